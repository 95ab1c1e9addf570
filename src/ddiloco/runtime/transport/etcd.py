"""A small client of etcd v3's JSON gateway, for the syncer's leader election.

etcd (3.4 and later) answers its gRPC API as JSON over HTTP at ``/v3/...``: keys and values
travel base64-coded, 64-bit integers as decimal strings, and a field at its zero value is
left out of a reply (a failed transaction has no ``succeeded``, an expired lease no
``TTL``). ``EtcdClient`` makes the few calls an election needs, each with its own
deadline, with the standard library only:

  grant(ttl_s)        POST /v3/lease/grant       a lease of ``ttl_s`` seconds
  keepalive(lease)    POST /v3/lease/keepalive   renew it; 0 once it has expired
  revoke(lease)       POST /v3/lease/revoke      end it (its keys go with it)
  create(key, value, lease)  POST /v3/kv/txn     put ``key`` only if it does not exist
  get(key)            POST /v3/kv/range          the key's value and revisions, or None
  put(key, value, lease)     POST /v3/kv/put     put ``key`` (a standby's registration)
  delete(key)         POST /v3/kv/deleterange    remove ``key``
  prefix(prefix)      POST /v3/kv/range          every key under ``prefix`` (the standbys)

Every failure (refused connection, timeout, an HTTP error, a reply that is not JSON) is an
``EtcdError``; callers treat it as "etcd unreachable now".

``parse_endpoint`` reads the ``etcd://HOST:PORT`` form the command line takes.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = [
    "EtcdClient",
    "EtcdError",
    "KeyValue",
    "leader_key",
    "standby_prefix",
    "parse_endpoint",
]


class EtcdError(RuntimeError):
    """etcd could not be reached or answered an error."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A key as etcd holds it."""

    value: bytes
    create_revision: int
    """The revision that created the key: unique to this creation, and larger for every
    later one (the election's epoch)."""
    mod_revision: int
    lease: int


def leader_key(name: str) -> str:
    """The key the syncers of run ``name`` campaign for (``ddiloco.runtime.syncer.ha``)."""
    return f"/ddiloco/{name}/leader"


def standby_prefix(name: str) -> str:
    """The keys under which the standbys of run ``name`` register (``.../ADDRESS``)."""
    return f"/ddiloco/{name}/standby/"


def parse_endpoint(url: str) -> str:
    """``etcd://HOST:PORT`` (or ``http://HOST:PORT``) as the gateway's base URL."""
    for scheme in ("etcd://", "http://"):
        if url.startswith(scheme):
            rest = url[len(scheme) :].rstrip("/")
            host, sep, port = rest.rpartition(":")
            if not sep or not host or not port.isdigit():
                break
            return f"http://{rest}"
    raise ValueError(f"etcd endpoint must be etcd://HOST:PORT, got {url!r}")


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


class EtcdClient:
    """etcd's JSON gateway at ``base_url`` (``http://HOST:PORT``)."""

    def __init__(self, base_url: str, timeout_s: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        req = urllib.request.Request(
            self.base_url + path,
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                out = json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError) as e:
            raise EtcdError(f"etcd {self.base_url}{path}: {e}") from None
        if not isinstance(out, dict):
            raise EtcdError(f"etcd {self.base_url}{path}: reply is not a JSON object")
        if "error" in out and "result" not in out:
            raise EtcdError(f"etcd {self.base_url}{path}: {out.get('error')}")
        return out

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds: its id."""
        return int(self._post("/v3/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def keepalive(self, lease: int, timeout_s: float | None = None) -> int:
        """Renew ``lease``: the TTL etcd granted again, 0 when the lease has expired."""
        out = self._post("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s)
        return int(out.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    def create(self, key: str, value: bytes, lease: int) -> tuple[bool, KeyValue | None]:
        """Put ``key`` under ``lease`` if no such key exists, in one transaction: (True,
        the new key) when created, else (False, the key that holds it, or None if it went
        meanwhile)."""
        k = _b64(key.encode())
        out = self._post(
            "/v3/kv/txn",
            {
                "compare": [{"key": k, "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if out.get("succeeded"):
            rev = int(out["header"]["revision"])
            return True, KeyValue(value, rev, rev, lease)
        kvs = (out.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return False, _kv(kvs[0]) if kvs else None

    def get(self, key: str) -> KeyValue | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key.encode())}).get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def put(self, key: str, value: bytes, lease: int) -> int:
        """Put ``key`` under ``lease``; the revision of the put."""
        out = self._post(
            "/v3/kv/put",
            {"key": _b64(key.encode()), "value": _b64(value), "lease": str(lease)},
        )
        return int(out["header"]["revision"])

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key.encode())})

    def prefix(self, prefix: str) -> dict[str, KeyValue]:
        """Every key that starts with ``prefix`` (not empty), by name."""
        end = bytearray(prefix.encode())
        end[-1] += 1
        kvs = (
            self._post(
                "/v3/kv/range", {"key": _b64(prefix.encode()), "range_end": _b64(bytes(end))}
            ).get("kvs")
            or []
        )
        return {base64.b64decode(d["key"]).decode(): _kv(d) for d in kvs}


def _kv(d: dict) -> KeyValue:
    return KeyValue(
        base64.b64decode(d.get("value", "")),
        int(d.get("create_revision", 0)),
        int(d.get("mod_revision", 0)),
        int(d.get("lease", 0)),
    )
