"""StatefulController: the one kernel of a service whose workers hold training state.

The rollout's and the critic's controllers subclass it and keep only their own work
(versions checks, sampling and generation; values); everything about state is here once:

- **Exclusive access** (rlserve.core.exclusive.ExclusiveAccess): one call at a time, each
  within the caller's deadline and `call_timeout_s`; updates, saves, loads and resets
  are atomic (detached: they run to completion even when the caller goes away).
- **Applied steps** (rlserve.core.steps.StepLedger) and the weights version: 0 for the
  deployed weights, +1 per applied update.
- **Known or broken**: work that fails after it reached the workers marks the state
  broken; every call but LoadCheckpoint and Reset is then FAILED_PRECONDITION, and the
  health check fails (Serve replaces the replica), until a load or reset succeeds.
- **The update rule**, one order for every service (`update`):

  1. *checks* — the request alone (step >= 0, the batch, its mini-batch plan), before
     the lock: a malformed request is INVALID_ARGUMENT naming its field whatever the
     state, and never waits behind a long update;
  2. *broken?* — FAILED_PRECONDITION, for a retried step too: once the state is unknown
     the ledger no longer describes the weights (a load that failed part-way left some
     ranks on other weights), GetInfo already fails (the health check), and the
     trainer's recovery reloads a checkpoint, which it does sooner when the update says
     so than after a "replayed" that the next call contradicts;
  3. *replay* — a kept applied step sent with the batch it applied returns its stored
     result (replayed=True) and trains nothing; no precondition on the current state is
     checked, since a retry carries the version its own update consumed;
  4. *apply* — the service's preconditions on the current state (the rollout's weights
     version), then the work the checks returned (UpdateWork: one worker method on
     every rank); a failure marks the state broken, success bumps the version and
     records the result.

- **Checkpoints**, under the service's checkpoint root (rlserve.core.checkpoint_paths),
  with one client-state format beside DeepSpeed's state (CLIENT_STATE_KEYS): a load has
  every rank read its files weights-only and parses the client state first, changing
  nothing, so a missing, corrupt or code-carrying checkpoint leaves the service as it
  was; only a failure inside the load itself marks it broken.
- **Reset**: the deployed state (initial weights, fresh optimizer, version 0, an empty
  ledger) in the same worker processes; like a load, a way back from a broken state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rlserve.core.batch import Batch
from rlserve.core.checkpoint_paths import (
    checkpoint_path,
    load_refused,
    prepare_save_dir,
    ranks_left_waiting,
    require_load_dir,
    save_failed,
)
from rlserve.core.exclusive import ExclusiveAccess
from rlserve.core.service.methods import CHECK_CHECKPOINT, LOAD_CHECKPOINT, RESET, SAVE_CHECKPOINT
from rlserve.core.serving import Deadline, RpcError, failed_precondition, invalid_argument
from rlserve.core.steps import StepLedger, batch_fingerprint
from rlserve.core.training import DEEPSPEED_SUBDIR, DS_CHECKPOINT_TAG, UnsafeCheckpointError
from rlserve.core.worker_controller import RequestBounds, WorkerController

logger = logging.getLogger(__name__)
T = TypeVar("T")
NO_DEADLINE = Deadline()


@dataclass(frozen=True)
class AppliedStep:
    """What an applied update answered, kept in the ledger for its retries."""

    weights_version: int
    """The version after the step."""
    metrics: dict[str, float]
    scores: Batch | None = None
    """Per-row results of the update's own forward (the rollout's single-pass update);
    not kept in checkpoints."""


@dataclass(frozen=True)
class UpdateWork:
    """What an update asks of the workers, decided from the request alone: one call of
    `method` on every rank, each with its share, and how the ranks' answers become the
    step's result."""

    method: str
    """The workers' update method (rlserve.<service>.methods)."""
    shares: list[Any]
    """Each rank's share of the update, by rank."""
    summarise: Callable[[list[Any], float], tuple[dict[str, float], Batch | None]]
    """(the ranks' answers, seconds they took) -> (metrics, per-row scores or None)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of every rank's call."""


CLIENT_STATE_KEYS = ("weights_version", "last_applied_step", "updates")
"""What SaveCheckpoint stores beside the weights (DeepSpeed's client_state); "updates"
holds [step, weights_version, metrics, batch fingerprint] per kept step, oldest first."""
LEGACY_LEDGER_KEY = "applied"
"""The critic's ledger in checkpoints from before the one format: [step, metrics,
weights_version(, fingerprint)] per kept step; read, never written."""


@dataclass(frozen=True)
class ClientState:
    weights_version: int
    last_applied_step: int
    updates: list[tuple[int, str, AppliedStep]]


def parse_client_state(state: dict[str, Any]) -> ClientState:
    """The versions and ledger a checkpoint stores, read before anything loads
    (ValueError naming what is wrong: a checkpoint that cannot restore them is refused
    while the service still holds its own weights)."""
    missing = [key for key in ("weights_version", "last_applied_step") if key not in state]
    if "updates" not in state and LEGACY_LEDGER_KEY not in state:
        missing.append("updates")
    if missing:
        raise ValueError(f"its client state lacks {missing}")
    try:
        if "updates" in state:
            updates = [
                (int(step), str(fpr), AppliedStep(int(version), dict(metrics)))
                for step, version, metrics, fpr in state["updates"]
            ]
        else:  # entries without a fingerprint are never replayed (no batch matches "")
            updates = [
                (
                    int(entry[0]),
                    str(entry[3]) if len(entry) > 3 else "",
                    AppliedStep(int(entry[2]), dict(entry[1])),
                )
                for entry in state[LEGACY_LEDGER_KEY]
            ]
        return ClientState(int(state["weights_version"]), int(state["last_applied_step"]), updates)
    except (TypeError, ValueError) as error:
        raise ValueError(f"its client state is malformed ({error})") from None


class StatefulController(WorkerController):
    """Exclusive access, applied steps, versions, the broken state, checkpoints and
    Reset of one service over `group` (WorkerGroup's async interface).

    Args:
        role: the service in messages ("rollout service", "critic").
        checkpoint_kind: its checkpoints in messages ("rollout checkpoint").
        keep: applied steps whose results stay replayable (and go into checkpoints).
        call_timeout_s: the most one call may hold the workers.
    """

    def __init__(
        self,
        group: Any,
        role: str,
        checkpoint_kind: str,
        keep: int,
        call_timeout_s: float = math.inf,
        bounds: RequestBounds | None = None,
    ):
        super().__init__(group, bounds)
        self.checkpoint_kind = checkpoint_kind
        self.keep = keep
        self.access = ExclusiveAccess(role, call_timeout_s)
        self.steps: StepLedger[AppliedStep] = StepLedger(keep)
        self.weights_version = 0

    @property
    def checkpoint_root(self) -> str | None:
        """The directory checkpoints are confined to (None: the service keeps none)."""
        raise NotImplementedError

    @property
    def last_applied_step(self) -> int:
        return self.steps.last_applied_step

    def health_problems(self) -> list[str]:
        """Why this service cannot serve: dead workers, a state left inconsistent."""
        return super().health_problems() + self.access.problems()

    # ---- calls ----------------------------------------------------------------------------

    async def read(
        self,
        stage: str,
        work: Callable[[], Awaitable[T]],
        deadline: Deadline,
        precondition: Callable[[], None] | None = None,
    ) -> T:
        """`work()` on the current weights, holding the lock: refused while broken, then
        `precondition()`, then the deadline; cancelled when the deadline passes."""

        async def locked() -> T:
            self.access.check_usable()
            if precondition is not None:
                precondition()
            deadline.check(stage)
            return await work()

        return await self.access.run(stage, locked, deadline, atomic=False)

    async def update(
        self,
        rpc: str,
        step: int,
        batch: Batch,
        deadline: Deadline,
        check: Callable[[], Awaitable[UpdateWork]],
        precondition: Callable[[], None] | None = None,
    ) -> tuple[AppliedStep, bool]:
        """One update step by the update rule (module doc); (its result, replayed).

        `check()` checks the request (before the lock) and returns the work it asks of
        the workers; `precondition()` checks the request against the current state, for
        a new step only.
        """
        if step < 0:
            raise invalid_argument("step", f"must be >= 0, got {step}")
        stage = f"{rpc} step {step}"
        deadline.check(stage)
        update_work = await check()
        fingerprint = batch_fingerprint(batch)

        async def work() -> tuple[AppliedStep, bool]:
            self.access.check_usable()
            stored = self.steps.replay_or_require_next(step, fingerprint)
            if stored is not None:
                logger.info("%s replayed (the same batch, applied before)", stage)
                return stored, True
            if precondition is not None:
                precondition()
            try:
                started = time.perf_counter()
                answers = await self.group.run_each(
                    update_work.method, update_work.shares, **update_work.options
                )
                metrics, scores = update_work.summarise(answers, time.perf_counter() - started)
            except BaseException as error:
                # Some ranks may have stepped their optimizer and others not.
                self.access.mark_broken(stage, error)
                raise
            self.weights_version += 1
            record = AppliedStep(self.weights_version, metrics, scores)
            self.steps.record(step, fingerprint, record)
            return record, False

        return await self.access.run(stage, work, deadline, atomic=True)

    # ---- checkpoints and Reset ------------------------------------------------------------

    async def save_checkpoint(self, path: str, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """(weights_version, last_applied_step) written to `path`, a name relative to the
        checkpoint root (a directory that cannot be written is FAILED_PRECONDITION)."""
        directory = checkpoint_path(self.checkpoint_root, path)
        prepare_save_dir(directory)
        deadline.check("SaveCheckpoint")
        return await self.access.run(
            "SaveCheckpoint", lambda: self._save(directory), deadline, atomic=True
        )

    async def _save(self, directory: Path) -> tuple[int, int]:
        self.access.check_usable()
        try:
            await self.group.run_all(SAVE_CHECKPOINT, str(directory), self.client_state())
        except RpcError:  # a lost worker (UNAVAILABLE): not a write failure
            raise
        except Exception as error:  # disk full, permissions: the weights are untouched
            ranks = len(self.group)
            if ranks_left_waiting(ranks):
                self.access.mark_broken("SaveCheckpoint", error)
            raise save_failed(directory, error, ranks) from None
        return self.weights_version, self.last_applied_step

    async def load_checkpoint(self, path: str, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """(weights_version, last_applied_step) restored from `path` (relative to the
        checkpoint root); works on a broken state too (the way back to a known one)."""
        directory = checkpoint_path(self.checkpoint_root, path)
        require_load_dir(directory, self.checkpoint_kind)
        if not (directory / DEEPSPEED_SUBDIR / DS_CHECKPOINT_TAG).is_dir():
            raise failed_precondition(
                f"location.path: no {self.checkpoint_kind} at {directory} "
                "(SaveCheckpoint writes one)"
            )
        deadline.check("LoadCheckpoint")
        return await self.access.run(
            "LoadCheckpoint", lambda: self._load(directory, path), deadline, atomic=True
        )

    async def _load(self, directory: Path, path: str) -> tuple[int, int]:
        try:
            states = await self.group.run_all(
                CHECK_CHECKPOINT, str(directory), [*CLIENT_STATE_KEYS, LEGACY_LEDGER_KEY]
            )
            restored = parse_client_state(states[0])
        except (FileNotFoundError, UnsafeCheckpointError, ValueError) as error:
            raise load_refused(directory, self.checkpoint_kind, error) from None
        try:
            await self.group.run_all(LOAD_CHECKPOINT, str(directory))
            self.steps.restore(restored.last_applied_step, restored.updates)
        except FileNotFoundError as error:
            if ranks_left_waiting(len(self.group)):  # other ranks may have loaded
                self.access.mark_broken(f"LoadCheckpoint of {path!r}", error)
                raise
            raise failed_precondition(  # the only rank loaded nothing: the state is intact
                f"location.path: no {self.checkpoint_kind} under {str(directory)!r} ({error})"
            ) from None
        except BaseException as error:
            self.access.mark_broken(f"LoadCheckpoint of {path!r}", error)
            raise
        self.weights_version = restored.weights_version
        self.access.mark_known()
        return self.weights_version, self.last_applied_step

    async def reset(self, deadline: Deadline = NO_DEADLINE) -> tuple[int, int]:
        """Back to the deployed state (initial weights, fresh optimizer, version 0, no
        applied step); (weights_version, last_applied_step). Works on a broken state."""

        async def work() -> tuple[int, int]:
            try:
                await self.group.run_all(RESET)
            except BaseException as error:
                self.access.mark_broken("Reset", error)
                raise
            self.steps = StepLedger(self.keep)
            self.weights_version = 0
            self.access.mark_known()
            return self.weights_version, self.last_applied_step

        return await self.access.run("Reset", work, deadline, atomic=True)

    def client_state(self) -> dict[str, Any]:
        """What a checkpoint stores beside the weights (CLIENT_STATE_KEYS)."""
        return {
            "weights_version": self.weights_version,
            "last_applied_step": self.last_applied_step,
            "updates": [
                [step, record.weights_version, dict(record.metrics), fingerprint]
                for step, fingerprint, record in self.steps.entries()
            ],
        }
