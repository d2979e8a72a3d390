"""Checkpoint paths confined to a service's configured root: the one place that decides.

SaveCheckpoint / LoadCheckpoint name a checkpoint by a path *relative* to the service's
`checkpoint_root` (e.g. "step_000010/rollout"); a caller can never make a service read
or write anywhere else. `checkpoint_path(root, name)` refuses, with INVALID_ARGUMENT
naming the field and the fix: an empty name, a NUL byte, an absolute path, a `..`
component, the root itself, a name that resolves outside the root through a symlink,
and a name over the filesystem's limits (a component over NAME_MAX bytes, a whole path
over PATH_MAX), which the OS would otherwise refuse mid-save.
A service without a root refuses checkpoints altogether (FAILED_PRECONDITION).

Then, before any worker runs, `prepare_save_dir` creates the directory and
`require_load_dir` checks it exists; a path that is a file, lies under a file, or
cannot be created or written is FAILED_PRECONDITION naming the path and the reason, so
the service keeps serving what it had.

Limits: the checks run in the replica, on its node; workers on other nodes must see the
same filesystem at the same path (as before). A symlink swapped in between the check and
the workers' I/O is not caught (no openat-style confinement in DeepSpeed's writer).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath

from rlserve.core.serving import RpcError, failed_precondition, invalid_argument

FIELD = "location.path"
"""The request field naming a checkpoint in every Save/LoadCheckpoint request."""
_EXAMPLE = "'step_000010/rollout'"


def checkpoint_path(root: str | None, name: str, field: str = FIELD) -> Path:
    """The absolute directory `name` denotes under `root`, symlinks resolved.

    Raises:
        RpcError: FAILED_PRECONDITION when the service has no root; INVALID_ARGUMENT
            (naming `field`) for a name that is empty, holds a NUL byte, is absolute,
            has a '..' component, is the root itself, resolves outside the root, or is
            longer than the filesystem allows.
    """
    if not root:
        raise failed_precondition(
            "this service has no checkpoint_root configured, so it saves and loads no "
            "checkpoints: deploy it with checkpoint_root set to a directory its workers share"
        )
    fix = f"give a path relative to the service's checkpoint root, e.g. {_EXAMPLE}"
    if not name:
        raise invalid_argument(field, f"is empty; {fix}")
    if "\x00" in name:
        raise invalid_argument(field, f"contains a NUL byte; {fix}")
    relative = PurePosixPath(name)
    if relative.is_absolute():
        raise invalid_argument(field, f"{name!r} is absolute; {fix}")
    if ".." in relative.parts:
        raise invalid_argument(field, f"{name!r} climbs out with '..'; {fix}")
    base = Path(root).resolve()
    _require_within_name_limits(base, relative, name, field)
    resolved = (base / relative).resolve()
    if resolved == base:
        raise invalid_argument(field, f"{name!r} names the checkpoint root itself; {fix}")
    if base not in resolved.parents:
        raise invalid_argument(
            field, f"{name!r} leads outside the checkpoint root through a symlink; {fix}"
        )
    return resolved


def _require_within_name_limits(base: Path, relative: PurePosixPath, name: str, field: str) -> None:
    name_max = _path_limit(base, "PC_NAME_MAX", 255)
    path_max = _path_limit(base, "PC_PATH_MAX", 4096)
    shown = name if len(name) <= 60 else f"{name[:40]}...({len(name)} characters)"
    for part in relative.parts:
        if len(os.fsencode(part)) > name_max:
            raise invalid_argument(
                field,
                f"{shown!r} has a component of {len(os.fsencode(part))} bytes; this "
                f"filesystem allows {name_max} per name: use shorter names",
            )
    total = len(os.fsencode(str(base / relative)))
    if total >= path_max:
        raise invalid_argument(
            field,
            f"{shown!r} makes a path of {total} bytes under the checkpoint root; this "
            f"filesystem allows {path_max - 1}: use a shorter path",
        )


def _path_limit(directory: Path, limit: str, default: int) -> int:
    try:
        return os.pathconf(directory, limit)
    except (OSError, ValueError):  # the root not there yet, or no such limit here
        return default


def prepare_save_dir(directory: Path) -> None:
    """Creates `directory` (and its parents) and checks the service can write there.

    Raises:
        RpcError: FAILED_PRECONDITION naming the path and the reason.
    """
    for parent in reversed(directory.parents):
        if parent.exists() and not parent.is_dir():
            raise _unusable(directory, f"{parent} is a file, not a directory")
    if directory.exists() and not directory.is_dir():
        raise _unusable(directory, "it is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unusable(directory, f"cannot create it: {error.strerror or error}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise _unusable(directory, "the service's user cannot write there")


def require_load_dir(directory: Path, what: str) -> None:
    """Checks `directory` exists as a directory (`what`: e.g. "rollout checkpoint").

    Raises:
        RpcError: FAILED_PRECONDITION naming the path and the reason.
    """
    if not directory.exists():
        raise failed_precondition(f"{FIELD}: no {what} at {directory} (SaveCheckpoint writes one)")
    if not directory.is_dir():
        raise failed_precondition(f"{FIELD}: {directory} is a file, not a {what} directory")


def save_failed(directory: Path, error: BaseException, ranks: int = 1) -> RpcError:
    """FAILED_PRECONDITION for a save that a worker could not write (disk full...): the
    writers' own errors (torch's, safetensors') rarely say why, so the free space is named.
    With several `ranks` the message says the service was marked broken (see
    `ranks_left_waiting`)."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    reason = " ".join(reason.split())[:240]
    try:
        free = f"; {shutil.disk_usage(directory).free / 2**20:.1f} MiB free on its filesystem"
    except OSError:
        free = ""
    broken = (
        f"; the other of its {ranks} ranks may be waiting in the save's collectives, so the "
        "service is marked broken and Serve replaces it (restore the last checkpoint)"
        if ranks > 1
        else ""
    )
    return _unusable(directory, f"writing failed: {reason}{free}{broken}")


def ranks_left_waiting(ranks: int) -> bool:
    """Whether a save that failed on one rank can leave the others blocked: each rank
    enters DeepSpeed's save collectives on its own, so when one fails writing (rank 0
    writes the model files alone) the rest wait there for the process group's timeout
    (30 min), holding the worker. Only replacing the replica frees them."""
    return ranks > 1


def load_refused(directory: Path, what: str, error: BaseException) -> RpcError:
    """FAILED_PRECONDITION for a checkpoint the pre-load check refused (missing, corrupt or
    code-carrying file): nothing was loaded, so the service keeps its weights."""
    reason = " ".join(str(error).split())[:300]
    return failed_precondition(
        f"{FIELD}: no usable {what} at {directory}: {reason}; the service keeps its current weights"
    )


def _unusable(directory: Path, reason: str) -> RpcError:
    return failed_precondition(f"{FIELD}: cannot save a checkpoint at {directory}: {reason}")
