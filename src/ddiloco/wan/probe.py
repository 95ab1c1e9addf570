"""Bulk TCP transfer between two regions of a ``Topology``: the shaped rate as a TCP flow sees
it (receiver-side goodput) and as the link's counters see it."""

from __future__ import annotations

import subprocess
import sys
import time

from ddiloco.wan.topology import Topology

__all__ = ["bulk_transfer"]

_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(30)
buf = bytearray(1 << 16); n = 0; t0 = None; t1 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    now = time.monotonic()
    if t0 is None:
        t0 = now
    n += k; t1 = now
print(n, t1 - t0, flush=True)
"""

_SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
chunk = b"\0" * (1 << 16); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(chunk)
c.close()
"""


def bulk_transfer(
    topo: Topology, src: str | int, dst: str | int, seconds: float = 3.0, port: int = 5201
) -> dict:
    """Send as fast as TCP allows from region ``src`` to region ``dst`` for ``seconds``;
    return ``goodput_mbit`` (payload bytes the receiver got over the time it received them)
    and ``link_mbit`` (bytes the source's uplink carried over the same wall time)."""
    recv = subprocess.Popen(
        [*topo.exec_prefix(dst), sys.executable, "-c", _RECEIVER, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"receiver did not start: {recv.stderr.read()}")
        before = topo.counters()[str(src)]["up_bytes"]
        t0 = time.monotonic()
        subprocess.run(
            [
                *topo.exec_prefix(src),
                sys.executable,
                "-c",
                _SENDER,
                topo.ip(dst),
                str(port),
                str(seconds),
            ],
            check=True,
            capture_output=True,
            timeout=seconds + 60,
        )
        out, _ = recv.communicate(timeout=60)
        wall = time.monotonic() - t0
        after = topo.counters()[str(src)]["up_bytes"]
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    nbytes, recv_s = out.split()
    return {
        "bytes": int(nbytes),
        "receive_s": float(recv_s),
        "goodput_mbit": int(nbytes) * 8 / float(recv_s) / 1e6,
        "link_bytes": after - before,
        "link_mbit": (after - before) * 8 / wall / 1e6,
    }
