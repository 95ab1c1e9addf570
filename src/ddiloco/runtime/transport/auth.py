"""Shared-secret token and optional TLS for the syncer and its clients.

The token is read from the environment variable ``DDILOCO_TOKEN`` or from a file
(``--token-file``), never from the command line (it would show in ``ps``). Every call
carries it as gRPC metadata; the server compares in constant time.
"""

from __future__ import annotations

import hmac
import os
import secrets
import ssl
from pathlib import Path

import grpc

__all__ = [
    "TOKEN_ENV",
    "load_token",
    "new_token",
    "check_token",
    "server_credentials",
    "channel_credentials",
    "server_ssl_context",
    "client_ssl_context",
]

TOKEN_ENV = "DDILOCO_TOKEN"


def load_token(
    token_file: str | os.PathLike | None = None, *, how: str = "--token-file PATH"
) -> str:
    """The shared secret: from ``token_file`` if given, else from ``$DDILOCO_TOKEN``.
    ``how``: how the caller's user names a token file, for the error without one (a
    command's flag; ``token_file=PATH`` in Python)."""
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise ValueError(f"token file {path} does not exist")
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"no shared-secret token: set ${TOKEN_ENV} or pass {how} "
            f"(e.g. `export {TOKEN_ENV}=$(python -c 'import secrets; "
            f"print(secrets.token_hex(16))')` on every host)"
        )
    return token


def new_token() -> str:
    return secrets.token_hex(16)


def check_token(expected: str, got: str | None) -> bool:
    return got is not None and hmac.compare_digest(expected.encode(), got.encode())


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(Path(key_file).read_bytes(), Path(cert_file).read_bytes())]
    )


def channel_credentials(ca_file: str | None) -> grpc.ChannelCredentials:
    root = Path(ca_file).read_bytes() if ca_file else None
    return grpc.ssl_channel_credentials(root_certificates=root)


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """TLS for the syncer's data port (the same certificate as its gRPC port)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def client_ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """TLS for a learner's data connection: verifies the syncer against ``ca_file`` (or
    the system's roots)."""
    return ssl.create_default_context(cafile=ca_file)
