"""Target 3: codec throughput per core. Encode and decode of a 16 MiB fp32 tensor on one
torch thread, best of several runs; throughput counts fp32 bytes. The target is on the
round trip: fp32 bytes / (encode time + decode time) >= 1 GB/s for int8 and int4.
A plain fp32 copy (``clone``) in the same run gives the machine's memory speed."""

from __future__ import annotations

import torch
from perf_common import best_time, row

from ddiloco.algorithm.codecs import CODECS

THRESHOLD_GBPS = 1.0


def main(quick: bool = False) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        numel = (1 << 20) if quick else (4 << 20)
        repeat = 3 if quick else 7
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02
        fp32_bytes = numel * 4
        copy_gbps = fp32_bytes / best_time(lambda: x.clone(), repeat) / 1e9
        codecs = {}
        for name, c in CODECS.items():
            buf = c.encode(x)
            t_enc = best_time(lambda: c.encode(x), repeat)  # noqa: B023
            t_dec = best_time(lambda: c.decode(buf, numel), repeat)  # noqa: B023
            codecs[name] = {
                "encode_gbps": fp32_bytes / t_enc / 1e9,
                "decode_gbps": fp32_bytes / t_dec / 1e9,
                "roundtrip_gbps": fp32_bytes / (t_enc + t_dec) / 1e9,
                "bytes": len(buf),
                "bytes_vs_fp32": len(buf) / fp32_bytes,
                "compression": fp32_bytes / len(buf),
            }
    finally:
        torch.set_num_threads(threads)
    rt = {n: codecs[n]["roundtrip_gbps"] for n in ("int8", "int4")}
    met = all(v >= THRESHOLD_GBPS for v in rt.values())
    notes = "; ".join(
        f"{n}: enc {v['encode_gbps']:.2f} / dec {v['decode_gbps']:.2f} GB/s, "
        f"{v['bytes_vs_fp32']:.3f} x fp32 bytes"
        for n, v in codecs.items()
    )
    return {
        "rows": [
            row(
                "3. codecs: int8/int4 encode+decode per core",
                f"int8 {rt['int8']:.2f} GB/s, int4 {rt['int4']:.2f} GB/s "
                f"(fp32 clone {copy_gbps:.2f} GB/s)",
                f">= {THRESHOLD_GBPS} GB/s round trip",
                met,
                notes,
                **{f"{n}_roundtrip_gbps": v for n, v in rt.items()},
            )
        ],
        "details": {"numel": numel, "threads": 1, "clone_gbps": copy_gbps, "codecs": codecs},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
