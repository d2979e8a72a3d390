"""The shared-secret token every rlserve RPC carries.

Serve's gRPC proxy answers anyone who reaches its port (it binds every interface), and
an rlserve service takes weights updates, checkpoint loads and batches from whoever
calls. So every caller sends the cluster's token as the gRPC metadata entry
`rlserve-token`, and every server (each Serve replica through `serving.rpc_method`, the
trainer's control service) compares it with its own, in constant time, before any of
its own work; a missing or wrong token gets UNAUTHENTICATED and the token sent is never echoed.

Where the token comes from, on servers and clients alike:
- `RLSERVE_AUTH_TOKEN`: the token itself, or
- `RLSERVE_AUTH_TOKEN_FILE`: a file holding it, by absolute path (replicas run in
  another directory), read once per process, surrounding whitespace stripped. A
  missing, unreadable or empty file is an error naming the variable. When both are set,
  `RLSERVE_AUTH_TOKEN` wins.
- Neither (or an empty `RLSERVE_AUTH_TOKEN`): no token. A client without one sends none.
  A service without one refuses to start (`server_auth_mode`), unless its config says
  `auth: none`: then, and only then, it answers every caller. So a node that joined
  without the token file cannot serve unauthenticated by accident.

`rlserve train` generates a token per run (`generate_token`) for a cluster it starts
itself; Serve replicas inherit it from the process that starts Ray. deploy/ray/ scripts
generate one for a multi-node cluster.

What it protects: the services against callers that can reach the gRPC port but do not
hold the token. What it does not: the token and every request travel in plaintext
(insecure gRPC), so anyone who can watch the network can read the token and replay it.
This is not TLS. For encryption, put a TLS-terminating proxy in front of Serve's gRPC
port (Envoy, or nginx with `grpc_pass`) and keep the port itself unreachable from
outside. It covers neither Serve's own proxy endpoints (health, list of applications)
nor Ray's ports: those are Ray's token auth (`RAY_AUTH_MODE=token`), a separate secret.
"""

import functools
import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from rlserve.core.config import ConfigModel

TOKEN_ENV = "RLSERVE_AUTH_TOKEN"
TOKEN_FILE_ENV = "RLSERVE_AUTH_TOKEN_FILE"
TOKEN_METADATA_KEY = "rlserve-token"


AUTH_MODES = ("token", "none")


class AuthConfigError(RuntimeError):
    """The token settings cannot be used (unreadable file, a character gRPC refuses, no
    token for a service that requires one)."""


def server_auth_mode(configured: str, service: str) -> str:
    """The mode a service starting now checks its callers in: "token" whenever this
    process has a token, "none" only when it has none and its config says `auth: none`.

    Raises:
        AuthConfigError: no token and `configured` is "token" (the default).
    """
    if configured not in AUTH_MODES:
        raise AuthConfigError(f"auth: {configured!r} is not one of {', '.join(AUTH_MODES)}")
    if expected_token() is not None:
        return "token"
    if configured == "none":
        return "none"
    raise AuthConfigError(
        f"the {service} service has no token: neither {TOKEN_ENV} nor {TOKEN_FILE_ENV} is "
        f"set in its environment (on its node), so it would answer anyone who reaches its "
        f"port. Set one of them on every node (deploy/ray/start-*.sh write the token file), "
        f"or deploy the service with `auth: none` to accept unauthenticated calls on purpose"
    )


def generate_token() -> str:
    """A new random token: 32 bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def expected_token() -> str | None:
    """This process's token from RLSERVE_AUTH_TOKEN or RLSERVE_AUTH_TOKEN_FILE; None = none.

    The variables are looked up on each call (a test or `rlserve train` may set one after
    import); a file is read once per path.
    """
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return _checked(token, TOKEN_ENV)
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    return _read_token_file(path) if path else None


@functools.lru_cache(maxsize=8)
def _read_token_file(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise AuthConfigError(
            f"{TOKEN_FILE_ENV}={path}: cannot read the token file ({error}); point it at a "
            f"readable file holding the cluster's token, or unset it"
        ) from None
    if not token:
        raise AuthConfigError(
            f"{TOKEN_FILE_ENV}={path}: the token file is empty; write the cluster's token "
            f"into it, or unset {TOKEN_FILE_ENV}"
        )
    return _checked(token, f"the file named by {TOKEN_FILE_ENV}")


def _checked(token: str, source: str) -> str:
    # gRPC metadata values (keys without -bin) must be printable ASCII.
    if not all(" " <= char <= "~" for char in token):
        raise AuthConfigError(
            f"{source}: the token may hold printable ASCII only (rlserve.core.auth."
            f"generate_token() makes one)"
        )
    return token


def token_metadata() -> list[tuple[str, str]]:
    """The metadata entries a client adds to every call: the token, or none without one."""
    token = expected_token()
    return [] if token is None else [(TOKEN_METADATA_KEY, token)]


def rejection(metadata: Iterable[tuple[str, Any]]) -> str | None:
    """Why a call with this incoming metadata is refused (the UNAUTHENTICATED message);
    None when it may proceed: its token matches, or this server has none."""
    expected = expected_token()
    if expected is None:
        return None
    sent = next((value for key, value in metadata if key == TOKEN_METADATA_KEY), None)
    fix = (
        f"set {TOKEN_ENV} (or {TOKEN_FILE_ENV}) on the client to the cluster's token; "
        f"rlserve clients send it as metadata '{TOKEN_METADATA_KEY}'"
    )
    if sent is None:
        return f"missing metadata '{TOKEN_METADATA_KEY}': this service requires a token; {fix}"
    sent_bytes = sent if isinstance(sent, bytes) else str(sent).encode()
    if not hmac.compare_digest(sent_bytes, expected.encode()):
        return f"wrong token in metadata '{TOKEN_METADATA_KEY}'; {fix}"
    return None


class ServiceAuth(ConfigModel):
    """How a service checks its callers (every service's config has it)."""

    auth: Literal["token", "none"] = "token"
    """"token": every call must carry the cluster's token (rlserve.core.auth), and a
    service whose environment has none refuses to start. "none": a service without a
    token answers every caller who reaches its port (a token in its environment is
    still required of callers)."""
