"""How a run outlives a service that died: notice, wait for Serve, restore, replay.

A failed call alone says little: a bad request fails too, and replaying would only fail
again. So when a step (or its evaluation or checkpoint) fails with a gRPC error, the
trainer asks every service for GetInfo. A service lost its state when it does not
answer (its replica is down, or it reports a dead worker: rlserve.core.serving's health
check) or when a stateful one answers with other state than the trainer expects (the
rollout's weights version or last applied step, the critic's last applied step): Serve
replaced its replica, which starts from the initial weights. Only then, or when the call
itself found no replica (UNAVAILABLE), does the run recover. It waits until every
service answers GetInfo (Serve brings replaced replicas up) and asks again:

- Every stateful service still holds the run's state (a restarted Serve proxy, a
  replaced reward replica, a network blip that outlived the call's retries): nothing
  is rolled back. The trainer runs the failed step again from where it stood, with the
  results it already had, so an update the service applied before the failure is
  answered as a replay of the same batch; a failure after the step completed repeats
  only what followed it (evaluation, metrics, checkpoint).
- Otherwise it loads the last complete checkpoint into the rollout and critic services
  and the trainer (step, weights version, prompt stream, KL controller, RNG), drops the
  metrics of the steps after it and runs them again.

Either way the steps run see the same prompts, sampling seeds, weights and optimizer
state as the first time, so they produce the same metrics an uninterrupted run would
(the recovery tests check that equality). Every step is applied once in the final
weights: the services' step ledgers are restored with their checkpoints. A run with
recovery on writes a checkpoint before its first step, so there is always one to
return to.
"""

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from rlserve.trainer.checkpoint import latest_checkpoint, read_trainer_state
from rlserve.trainer.control import failure_detail, service_info
from rlserve.trainer.metrics import truncate_after

console = Console(stderr=True)
PROBE_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 1.0


@dataclass
class RecoveryEvent:
    """One recovery, as the run summary reports it."""

    failed_step: int
    """The step (0-based) that was running when the failure surfaced."""
    lost: dict[str, str]
    """role -> why it counted as lost."""
    restored_step: int
    """Steps completed when the run went on: the checkpoint's, after a rollback."""
    wait_s: float
    """From the failure to every service answering again."""
    restore_s: float
    """Loading the checkpoint into the services and the trainer (0 without rollback)."""
    rolled_back: bool = True
    """Whether a checkpoint was restored; False when every service kept its state."""


@dataclass
class Recovery:
    """The run's recovery budget and what it was spent on."""

    max_recoveries: int
    timeout_s: float
    events: list[RecoveryEvent] = field(default_factory=list)

    async def recover(
        self, trainer: Any, error: grpc.aio.AioRpcError, log_path: Path
    ) -> Path | None:
        """Waits for the services, then restores `trainer` and its services from the last
        checkpoint (returned) unless every stateful service kept its state (None: the
        trainer is rewound to the start of the step in progress, see the module
        docstring).

        Raises `error` itself when every service answers with its state and the call
        was not UNAVAILABLE (the failure was the request's, not a service's), and
        RuntimeError when the budget is spent, no service came back within timeout_s,
        or there is no checkpoint to return to.
        """
        failed_at = time.perf_counter()
        failed_step = trainer.state.step
        lost = await lost_services(trainer)
        if not lost and error.code() != grpc.StatusCode.UNAVAILABLE:
            raise error
        if not lost:
            lost = {"(call)": f"UNAVAILABLE: {error.details()}"}
        if len(self.events) >= self.max_recoveries:
            raise RuntimeError(
                f"step {failed_step}: services lost again ({_describe(lost)}) after "
                f"{len(self.events)} recoveries (trainer.max_recoveries="
                f"{self.max_recoveries}); resume with `rlserve train --resume` once the "
                "cluster is sound"
            ) from error
        checkpoint = latest_checkpoint(trainer.run_dir)
        if checkpoint is None:
            raise RuntimeError(
                f"step {failed_step}: services lost ({_describe(lost)}) and the run has no "
                "checkpoint to return to"
            ) from error
        console.print(
            f"[yellow]step {failed_step} failed ({error.code().name}): {_describe(lost)}; "
            "waiting for the services[/yellow]"
        )
        deadline = time.monotonic() + self.timeout_s
        await wait_until_answering(trainer.clients, deadline, self.timeout_s)
        answered_at = time.perf_counter()
        if not await lost_services(trainer):
            trainer.rewind()
            event = RecoveryEvent(
                failed_step=failed_step,
                lost=lost,
                restored_step=trainer.state.step,
                wait_s=answered_at - failed_at,
                restore_s=0.0,
                rolled_back=False,
            )
            self.events.append(event)
            console.print(
                f"[yellow]recovered: services answering after {event.wait_s:.1f} s with "
                f"the run's state; nothing rolled back, running step "
                f"{event.restored_step + 1} again[/yellow]"
            )
            return None
        console.print(f"[yellow]state lost: restoring {checkpoint.name}[/yellow]")
        while True:
            try:
                await trainer.load_checkpoint(checkpoint, read_trainer_state(checkpoint))
                break
            except grpc.aio.AioRpcError as again:
                # A replica that answered GetInfo can still be on its way out (its
                # worker died a moment ago): wait for its replacement, restore again.
                if again.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                console.print(
                    f"[yellow]restoring {checkpoint.name} failed ({again.details()}); "
                    "waiting for the services again[/yellow]"
                )
                await wait_until_answering(trainer.clients, deadline, self.timeout_s)
                answered_at = time.perf_counter()
        truncate_after(log_path, trainer.state.step)
        event = RecoveryEvent(
            failed_step=failed_step,
            lost=lost,
            restored_step=trainer.state.step,
            wait_s=answered_at - failed_at,
            restore_s=time.perf_counter() - answered_at,
        )
        self.events.append(event)
        console.print(
            f"[yellow]recovered: services answering after {event.wait_s:.1f} s, "
            f"{checkpoint.name} restored in {event.restore_s:.1f} s; replaying from step "
            f"{event.restored_step + 1}[/yellow]"
        )
        return checkpoint


def _describe(lost: dict[str, str]) -> str:
    return "; ".join(f"{role}: {why}" for role, why in lost.items())


def _in_use(clients: Any) -> dict[str, Any]:
    return {role: client for role, client in vars(clients).items() if client is not None}


async def lost_services(trainer: Any) -> dict[str, str]:
    """role -> why, for each service that does not answer or lost its state."""
    roles = _in_use(trainer.clients)
    # The merged reference is the rollout app itself: one probe of it is enough.
    if "reference" in roles and roles["reference"].application == roles["rollout"].application:
        del roles["reference"]
    answers = await asyncio.gather(
        *(service_info(role, client, PROBE_TIMEOUT_S) for role, client in roles.items()),
        return_exceptions=True,
    )
    rollout_states, critic_steps = trainer.intact_service_states()
    lost = {}
    for (role, _), answer in zip(roles.items(), answers, strict=True):
        if isinstance(answer, grpc.aio.AioRpcError | TimeoutError):
            lost[role] = failure_detail(answer, PROBE_TIMEOUT_S)
        elif isinstance(answer, BaseException):
            raise answer
        elif (
            role == "rollout"
            and (answer.weights_version, answer.last_applied_step) not in rollout_states
        ):
            lost[role] = (
                f"weights version {answer.weights_version}, last step {answer.last_applied_step}"
                f" (the run can go on from {_either(sorted(rollout_states))})"
            )
        elif role == "critic" and answer.last_applied_step not in critic_steps:
            lost[role] = (
                f"last step {answer.last_applied_step} (the run can go on from "
                f"{_either(sorted(critic_steps))})"
            )
    return lost


def _either(states: list) -> str:
    return " or ".join(str(state) for state in states) if states else "none: rewind impossible"


async def wait_until_answering(clients: Any, deadline: float, timeout_s: float) -> None:
    """Returns once every service in use answers GetInfo; RuntimeError past `deadline`
    (time.monotonic()), the end of the recovery's `timeout_s`."""
    roles = _in_use(clients)
    waiting: dict[str, str] = {}
    while True:
        answers = await asyncio.gather(
            *(service_info(role, client, PROBE_TIMEOUT_S) for role, client in roles.items()),
            return_exceptions=True,
        )
        waiting = {
            role: failure_detail(answer, PROBE_TIMEOUT_S)
            for (role, _), answer in zip(roles.items(), answers, strict=True)
            if isinstance(answer, BaseException)
        }
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"services did not come back within trainer.recovery_timeout_s={timeout_s:g}"
                f" s: {_describe(waiting)}"
            )
        await asyncio.sleep(POLL_INTERVAL_S)
