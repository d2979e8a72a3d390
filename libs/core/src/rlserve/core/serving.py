"""How every rlserve service answers gRPC inside a Ray Serve deployment.

One place decides: the status a failure becomes, the message a caller sees, and the
caller's deadline.

- `RpcError` carries a gRPC status and a message naming the field; `invalid_argument`,
  `failed_precondition` and friends build them. A `CodecError` (malformed tensor) is an
  INVALID_ARGUMENT too.
- `@rpc_method(ResponseType)` wraps a deployment method: an RpcError becomes that status
  and message; any other exception becomes INTERNAL with a one-line message (Serve's
  default would send the whole traceback, leaking internals and, with non-ASCII text,
  overflowing a default client's metadata limit), and the traceback goes to the log.
  The replica keeps serving either way.
- Deadlines: gRPC does not hand the caller's deadline through Serve's proxy, so rlserve
  clients also send it as metadata (`DEADLINE_METADATA_KEY`, absolute Unix time in
  seconds); `Deadline.check(stage)` raises DEADLINE_EXCEEDED between units of work once
  it has passed.
"""

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from rlserve.core.codec import CodecError

logger = logging.getLogger(__name__)

DEADLINE_METADATA_KEY = "rlserve-deadline-unix-s"
# Status details travel percent-encoded in HTTP/2 trailers (a non-ASCII byte costs 3);
# gRPC clients warn past 8 KiB of metadata and fail the call past their limit.
_MAX_DETAILS_WIRE_BYTES = 4096

Response = TypeVar("Response")


class RpcError(Exception):
    """A failure with the gRPC status the caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str):
        # Both in args, so the error survives pickling (raised inside a Ray worker).
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def invalid_argument(field: str, problem: str) -> RpcError:
    """INVALID_ARGUMENT whose message starts with the offending field."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def failed_precondition(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.FAILED_PRECONDITION, message)


def resource_exhausted(field: str, problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{field}: {problem}")


@dataclass(frozen=True)
class Deadline:
    """The caller's deadline as absolute Unix time; None = the caller set none."""

    unix_s: float | None = None

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, Any]]) -> "Deadline":
        for key, value in metadata:
            if key == DEADLINE_METADATA_KEY:
                try:
                    return cls(float(value))
                except ValueError:
                    raise invalid_argument(
                        f"metadata {DEADLINE_METADATA_KEY}", f"not a number: {value!r}"
                    ) from None
        return cls(None)

    def remaining_s(self) -> float:
        return float("inf") if self.unix_s is None else self.unix_s - time.time()

    def check(self, stage: str) -> None:
        """Raises DEADLINE_EXCEEDED when the caller's deadline has passed."""
        if self.remaining_s() <= 0:
            raise RpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"caller's deadline passed during {stage}",
            )


def deadline_metadata(timeout_s: float) -> tuple[str, str]:
    """The metadata entry a client sends so the service can honour its deadline."""
    return (DEADLINE_METADATA_KEY, f"{time.time() + timeout_s:.6f}")


def _wire_bytes(char: str) -> int:
    return sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in char.encode())


def _clip(text: str) -> str:
    """Cuts `text` so its percent-encoded form stays under _MAX_DETAILS_WIRE_BYTES."""
    budget = _MAX_DETAILS_WIRE_BYTES - 3
    for index, char in enumerate(text):
        budget -= _wire_bytes(char)
        if budget < 0:
            return text[:index] + "..."
    return text


def rpc_method(
    response_type: Callable[[], Response],
) -> Callable[[Callable[..., Awaitable[Response]]], Callable[..., Awaitable[Response]]]:
    """Wraps `async def Rpc(self, request, grpc_context)` of a Serve gRPC deployment."""

    def decorate(method: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, grpc_context: Any) -> Response:
            try:
                return await method(self, request, grpc_context)
            except RpcError as error:
                code, message = error.code, error.message
            except CodecError as error:
                code, message = grpc.StatusCode.INVALID_ARGUMENT, str(error)
            except Exception as error:
                logger.exception("%s failed", method.__name__)
                code = grpc.StatusCode.INTERNAL
                message = f"{method.__name__} failed: {type(error).__name__}: {error}"
            grpc_context.set_code(code)
            grpc_context.set_details(_clip(message))
            return response_type()

        return wrapper

    return decorate
