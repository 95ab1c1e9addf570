"""``ddiloco export``: the global model out, as a plain ``state_dict`` in safetensors.

Two sources:

- a run directory, a checkpoint directory or a checkpoint manifest (``syncer.json``, or a
  ``syncer.pt`` file of the earlier format): the syncer's durable global model (fp32
  master values, exactly what the run's final evaluation used); a run of the in-process
  engine keeps its final global model in ``final_model.safetensors``;
- ``HOST:PORT`` of a live syncer: its published global model (what learners install; with a
  ``bf16`` or ``int8`` downlink the values carry that rounding).

The file loads with ``safetensors.torch.load_file`` into the model class the learners
trained (``model.load_state_dict(load_file(path))``); its metadata records the source, the
fragment versions, the model spec and, for a run of a built-in model, the model itself
(preset name and arguments: ``MODEL_FILE`` of the run directory), so that
``load_model(path)`` (``ddiloco.load_model``) builds and loads it in one call, from any
directory.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

from ddiloco.rundir import FINAL_MODEL, MODEL_FILE
from ddiloco.runtime.transport.spec import check_spec, fragmentation_from_spec

__all__ = [
    "ExportError",
    "assemble_state_dict",
    "load_model",
    "write_model_record",
    "state_dict_from_checkpoint",
    "state_dict_from_syncer",
    "global_state_dict",
    "save_state_dict",
    "add_export_parser",
    "cmd_export",
]

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


class ExportError(RuntimeError):
    """The source cannot give a model (missing or corrupt checkpoint, unreachable syncer,
    wrong token); the message says what to do."""


def assemble_state_dict(spec: dict, fragments: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-fragment flat tensors (fragment p's tensors in the order of the spec's
    fragmentation) -> name -> fp32 tensor in the spec's shapes and order. Raises
    ``ExportError`` when the fragments do not fit the spec."""
    frag = fragmentation_from_spec(spec)
    if len(fragments) != frag.P:
        raise ExportError(f"{len(fragments)} fragments for a spec with P = {frag.P}")
    shapes = dict(zip(spec["names"], (tuple(s) for s in spec["shapes"])))
    flat: dict[str, torch.Tensor] = {}
    for f, tensors in zip(frag.fragments, fragments):
        if len(tensors) != len(f.names):
            raise ExportError(f"fragment holds {len(tensors)} tensors, the spec {len(f.names)}")
        for n, t in zip(f.names, tensors):
            if t.numel() != math.prod(shapes[n]):
                raise ExportError(
                    f"tensor {n} has {t.numel()} values, the spec says shape {list(shapes[n])}"
                )
            flat[n] = t.detach().reshape(shapes[n]).to(torch.float32).contiguous().clone()
    return {n: flat[n] for n in spec["names"]}


def _checkpoint_path(source: str | Path) -> Path:
    p = Path(source)
    from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, LEGACY_NAME

    for d in (p, p / "checkpoint"):
        for cand in (d, d / CHECKPOINT_NAME, d / LEGACY_NAME):
            if cand.is_file():
                return cand
    if not p.exists():
        raise ExportError(
            f"{p} does not exist: give a run directory (holding "
            f"checkpoint/{CHECKPOINT_NAME}), a checkpoint directory, a "
            f"{CHECKPOINT_NAME} file or a live syncer's HOST:PORT"
        )
    raise ExportError(
        f"no syncer checkpoint in {p}: expected {p / 'checkpoint' / CHECKPOINT_NAME} "
        f"(a run of `ddiloco train`) or {p / CHECKPOINT_NAME} (a `ddiloco syncer "
        f"--checkpoint-dir`); a run without a checkpoint directory keeps no model"
    )


def state_dict_from_checkpoint(source: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state_dict, metadata) of the global model in a syncer checkpoint; ``source`` is a run
    directory (of either engine), a checkpoint directory or a checkpoint's manifest. Only
    theta is read, fragment by fragment, each fragment file verified (SHA-256, finite)."""
    from ddiloco.runtime.syncer.checkpoint import CheckpointError, load_checkpoint

    final = Path(source) / FINAL_MODEL
    if final.is_file() and not (Path(source) / "checkpoint").is_dir():
        return _state_dict_from_file(final)
    path = _checkpoint_path(source)

    def unreadable(e: Exception) -> ExportError:
        return ExportError(
            f"{path} is not a readable ddiloco syncer checkpoint ({type(e).__name__}: {e}); "
            f"it may be truncated, damaged or from another program"
        )

    try:
        ck = load_checkpoint(path, lazy=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise unreadable(e) from None
    try:
        spec, state = ck["spec"], ck["state"]
        check_spec(spec)
        sd = assemble_state_dict(spec, state["theta"])
        versions = [int(v) for v in state["versions"]]
    except CheckpointError as e:  # a damaged fragment file, met while reading theta
        raise unreadable(e) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{path} is not a ddiloco syncer checkpoint: {e}") from None
    return sd, {
        "source": str(path),
        "versions": versions,
        "merges": int(state.get("merges", 0)),
        "spec": spec,
        "model": _model_record_near(path),
    }


def write_model_record(cfg, out: str | Path) -> Path:
    """Write the run's model (``recipe.model_record``: preset name and arguments, the
    vocabulary read from its data) as ``MODEL_FILE`` in the run directory ``out``."""
    from ddiloco.recipe import model_record

    path = Path(out) / MODEL_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(model_record(cfg)) + "\n")
    tmp.replace(path)
    return path


def _model_record_near(path: Path) -> dict | None:
    """The model record of the run directory holding the checkpoint at ``path``
    (``MODEL_FILE``, written when the run starts); None outside a run directory."""
    for d in list(path.parents)[:3]:
        f = d / MODEL_FILE
        if f.is_file():
            try:
                rec = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise ExportError(f"{f} is not readable ({e})") from None
            _check_record(rec, f)
            return rec
    return None


def _check_record(rec, where) -> None:
    if not (
        isinstance(rec, dict)
        and isinstance(rec.get("name"), str)
        and isinstance(rec.get("args"), dict)
    ):
        raise ExportError(f"{where}: a model record must be {{'name': preset, 'args': {{...}}}}")


def _state_dict_from_file(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state_dict, metadata) of a model file this module wrote (an in-process run's
    ``final_model.safetensors``)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        return sd, {
            "source": str(path),
            "versions": json.loads(meta.get("ddiloco_versions", "[]")),
            "merges": int(meta.get("ddiloco_merges", 0)),
            "spec": json.loads(meta["ddiloco_spec"]),
            "model": json.loads(meta["ddiloco_model"]) if "ddiloco_model" in meta else None,
        }
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise ExportError(f"{path} is not a readable ddiloco model file ({e})") from None


def state_dict_from_syncer(
    address: str,
    *,
    token: str | None = None,
    token_file: str | None = None,
    tls_ca: str | None = None,
    timeout_s: float = 30.0,
) -> tuple[dict[str, torch.Tensor], dict]:
    """(state_dict, metadata) of the global model a live syncer publishes."""
    import grpc

    from ddiloco.runtime.learner.client import SyncerClient, rpc_code, rpc_details
    from ddiloco.runtime.transport.auth import load_token

    try:
        token = token or load_token(token_file)
    except ValueError as e:
        raise ExportError(str(e)) from None
    client = SyncerClient(address, token, tls_ca)
    try:
        st = client.unary("Status", {"spec": True}, timeout_s=min(timeout_s, 10.0), control=True)
        spec = st.get("spec")
        if not st.get("initialised") or spec is None:
            raise ExportError(
                f"the syncer at {address} holds no model yet (no learner has joined it)"
            )
        got = client.fetch(None, timeout_s=timeout_s, exact=True)
    except grpc.RpcError as e:
        code, msg = rpc_code(e), rpc_details(e)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise ExportError(f"the syncer at {address} refused the token ({msg})") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise ExportError(
                f"cannot reach a syncer at {address} ({code.name}: {msg}); check "
                f"the address, that it is running, and --tls-ca for a TLS "
                f"syncer"
            ) from None
        raise ExportError(f"the syncer at {address} answered {code.name}: {msg}") from None
    finally:
        client.close()
    P = len(got)  # noqa: N806
    sd = assemble_state_dict(spec, [got[p][1] for p in range(P)])
    return sd, {
        "source": address,
        "versions": [got[p][0] for p in range(P)],
        "merges": int(st.get("merges", 0)),
        "spec": spec,
    }


def global_state_dict(source: str, **kw) -> tuple[dict[str, torch.Tensor], dict]:
    """From a path if one exists at ``source``, else from a live syncer at ``HOST:PORT``."""
    if not Path(source).exists() and _ADDRESS.match(source):
        return state_dict_from_syncer(source, **kw)
    return state_dict_from_checkpoint(source)


def load_model(source: str | Path) -> torch.nn.Module:
    """The global model of a run, built and loaded, in eval mode: ``source`` is a run
    directory (of either engine), a checkpoint directory or manifest inside one, or a
    ``.safetensors`` file that ``ddiloco export`` wrote. The model comes from the record the
    export carries (``ddiloco_model`` in the file's metadata, ``MODEL_FILE`` in a run
    directory): preset name and arguments, vocabulary and block size included, so no data
    and no configuration are read and any working directory will do. A run directory
    written before the record existed is read through its ``config.toml`` (its data must
    then be where the run found it)."""
    from ddiloco.models import build_model

    p = Path(source)
    if p.is_file() and p.suffix == ".safetensors":
        sd, meta = _state_dict_from_file(p)
    else:
        sd, meta = state_dict_from_checkpoint(p)
    rec = meta.get("model") or _record_from_config(p)
    if rec is None:
        raise ExportError(
            f"{source} does not record which model it holds (a file exported from a live "
            f"syncer, or by an earlier version): export it from the run directory "
            f"(`ddiloco export RUN_DIR --out FILE`), or build the model yourself and "
            f"load it with model.load_state_dict(safetensors.torch.load_file(FILE))"
        )
    _check_record(rec, source)
    try:
        model = build_model(rec["name"], **rec["args"])
    except (ValueError, TypeError) as e:
        raise ExportError(f"{source} records a model this version cannot build: {e}") from None
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise ExportError(
            f"{source}: the tensors do not fit the recorded model {rec}: {e}"
        ) from None
    return model.eval()


def _record_from_config(source: Path) -> dict | None:
    """The model record of a run directory's ``config.toml`` (runs written before
    ``MODEL_FILE``); None without one. Its data must be readable: a text model's
    vocabulary comes from it."""
    from ddiloco.config import CONFIG_FILE, load_config

    start = source if source.is_dir() else source.parent
    for d in [start, *list(start.parents)[:2]]:
        if (d / CONFIG_FILE).is_file():
            from ddiloco.recipe import model_record

            try:
                return model_record(load_config(d / CONFIG_FILE))
            except (ValueError, OSError) as e:
                raise ExportError(
                    f"{d} records no model ({MODEL_FILE}) and its {CONFIG_FILE} does not "
                    f"give one: {e}"
                ) from None
    return None


def save_state_dict(sd: dict[str, torch.Tensor], out: str | Path, meta: dict) -> Path:
    """Write ``sd`` as safetensors, atomically (temp file, rename)."""
    from safetensors.torch import save_file

    out = Path(out)
    if not out.parent.is_dir():
        raise ExportError(
            f"the folder of --out {out} does not exist ({out.parent}): create it first or "
            f"choose another path"
        )
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(
        sd,
        str(tmp),
        metadata={
            "format": "pt",
            "ddiloco_source": str(meta["source"]),
            "ddiloco_versions": json.dumps(meta["versions"]),
            "ddiloco_merges": str(meta["merges"]),
            "ddiloco_spec": json.dumps(meta["spec"]),
            **(
                {"ddiloco_model": json.dumps(meta["model"])}
                if meta.get("model") is not None
                else {}
            ),
        },
    )
    tmp.replace(out)
    return out


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        help="write the global model as a safetensors state_dict",
        description="Write the global model as a plain state_dict (safetensors), loadable "
        "with safetensors.torch.load_file into the model class the learners trained. SOURCE "
        "is a run directory, a checkpoint directory, a checkpoint manifest (syncer.json), or "
        "HOST:PORT of a live syncer (token from $DDILOCO_TOKEN or --token-file).",
    )
    p.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT_OR_HOST:PORT")
    p.add_argument("--out", required=True, help="output file, e.g. model.safetensors")
    p.add_argument("--token-file", help="file holding the syncer's shared secret (live syncer)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) of a TLS syncer")
    p.add_argument("--timeout-s", type=float, default=30.0, help="live syncer: fetch timeout")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    try:
        if not Path(args.source).exists() and _ADDRESS.match(args.source):
            sd, meta = state_dict_from_syncer(
                args.source,
                token_file=args.token_file,
                tls_ca=args.tls_ca,
                timeout_s=args.timeout_s,
            )
        else:
            sd, meta = state_dict_from_checkpoint(args.source)
        out = save_state_dict(sd, args.out, meta)
    except ExportError as e:
        print(f"ddiloco export: error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in sd.values())
    versions = f", fragment versions {meta['versions']}" if meta["versions"] else ""
    print(
        f"wrote {out}: {len(sd)} tensors, {n:,} parameters{versions} "
        f"({meta['merges']} merges) from {meta['source']}"
    )
    return 0
