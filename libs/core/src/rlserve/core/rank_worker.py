"""What every worker rank of a service answers besides its own work.

A service's worker class (ActorWorker, CriticWorker, ReferenceWorker) subclasses
`RankWorker`, whose constructor takes the rank, the world size and a `RankSetup` (the
model, where it computes, its threads: `RankSetup.of(service config)`) before the
worker's own plain arguments. WorkerGroup calls `node_address` on rank 0 and
`init_distributed` on every rank, and the service's controller asks `info` once for
GetInfo. `TrainingRankWorker` adds what the two training services share: the DeepSpeed
engine built from `OptimizerSettings` once the process group exists, the engine's
part of every checkpoint (check, save, load) under `<checkpoint>/deepspeed`, and
`reset`: a new engine from the initial weights, in the same process (no imports, no
new process group), so a deployed service can start another run.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlserve.core.devices import resolve_device
from rlserve.core.modeling import resolve_dtype
from rlserve.core.process_group import init_process_group, node_ip, open_rendezvous
from rlserve.core.service_config import WorkerDeployment
from rlserve.core.training import (
    DEEPSPEED_SUBDIR,
    OptimizerSettings,
    build_training_engine,
    check_training_checkpoint,
    full_state_dict,
    load_training_checkpoint,
    save_training_checkpoint,
)


@dataclass(frozen=True)
class RankSetup:
    """What every rank starts from, whichever service it serves."""

    model_path: str
    """Hugging Face model directory the rank loads."""
    dtype: str = "auto"
    """'auto' or a name in rlserve.core.modeling.DTYPES (resolve_dtype, for the rank's
    device)."""
    device: str = "auto"
    """'cuda', 'cpu' or 'auto' (rlserve.core.devices.resolve_device)."""
    num_threads: int = 1
    """torch intra-op threads of the rank's process."""
    forward_max_tokens: int | None = None
    """Most tokens per forward micro-batch; None = by sample count only."""
    stage_threads: dict[str, int] | None = None
    """torch threads of each stage's calls ("generate", "forward", "update"), set as
    each call starts (rlserve.core.service_config.StageThreads); None = num_threads."""

    @classmethod
    def of(cls, config: WorkerDeployment, num_threads: int | None = None) -> RankSetup:
        """A service config's: threads follow the worker's CPUs unless given."""
        stages = config.stage_threads
        return cls(
            model_path=config.model_path,
            dtype=config.dtype,
            device=config.device,
            num_threads=num_threads or max(1, int(config.num_cpus_per_worker)),
            forward_max_tokens=config.forward_max_tokens,
            stage_threads=stages.model_dump() if stages is not None else None,
        )


class RankWorker:
    """One rank of a service's worker group."""

    def __init__(self, rank: int, world_size: int, setup: RankSetup):
        torch.set_num_threads(setup.num_threads)
        self.stage_threads = setup.stage_threads
        self.rank, self.world_size = rank, world_size
        self.model_path = setup.model_path
        self.device = resolve_device(setup.device)
        self.dtype = resolve_dtype(setup.dtype, self.device)
        if self.device.type == "cuda" and self.dtype == "float32":
            # TF32 tensor cores: float32 matmuls ≈ 8x faster on Ampere and later, inputs
            # rounded to a 10-bit mantissa, sums kept in float32 (no effect on older GPUs).
            torch.set_float32_matmul_precision("high")
        self.forward_max_tokens = setup.forward_max_tokens
        self._rendezvous: Any = None  # rank 0's store, from node_address to init_distributed

    def use_threads(self, stage: str) -> None:
        """The torch threads planned for `stage` ("generate", "forward", "update"): the
        stage on the critical path takes the cores that others leave idle meanwhile."""
        if self.stage_threads is not None:
            torch.set_num_threads(self.stage_threads[stage])

    def node_address(self) -> tuple[str, int]:
        """Rank 0: where the others meet it, this node's address and the port of the
        rendezvous it now holds open (rlserve.core.process_group)."""
        self._rendezvous = open_rendezvous()
        return node_ip(), self._rendezvous.port

    def init_distributed(self, address: str, port: int) -> None:
        """Joins the service's process group (a training worker then builds its engine)."""
        init_process_group(self.rank, self.world_size, address, port, self.device, self._rendezvous)

    def info(self) -> dict[str, Any]:
        """rank, node_id, hostname, pid: where this rank runs, for GetInfo."""
        # Ray is imported in a Ray actor's process already; a rank built without it has
        # no node id.
        ray = sys.modules.get("ray")
        node_id = ray.get_runtime_context().get_node_id() if ray and ray.is_initialized() else ""
        return {
            "rank": self.rank,
            "node_id": node_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }


class TrainingRankWorker(RankWorker):
    """A rank that trains `self.engine` (DeepSpeed) and keeps the engine's state under
    `<checkpoint>/<training.DEEPSPEED_SUBDIR>`; a subclass builds its module in
    init_distributed, then calls `_build_engine`, and defines `reset`."""

    def __init__(self, rank: int, world_size: int, setup: RankSetup, optimizer: OptimizerSettings):
        super().__init__(rank, world_size, setup)
        self.optimizer_settings = optimizer
        # Built in init_distributed: DeepSpeed needs the process group.
        self.engine: Any = None

    def _build_engine(self, module: torch.nn.Module) -> None:
        self.engine = build_training_engine(module, self.optimizer_settings, self.dtype)

    def _drop_engine(self) -> None:
        """Frees the engine (weights, optimizer state, gradients) before a new one is
        built in this process: two at once would double the rank's memory."""
        import gc

        self.engine.destroy()
        self.engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """The trained module's full state dict; call on every rank (a collective under
        ZeRO-3)."""
        return full_state_dict(self.engine)

    def check_checkpoint(self, directory: str, client_keys: list[str]) -> dict[str, Any]:
        """Reads this rank's state files weights-only, changing nothing (raises
        FileNotFoundError or UnsafeCheckpointError); every rank, before load_checkpoint.
        Returns the saved client_state's entries named `client_keys`."""
        return check_training_checkpoint(Path(directory) / DEEPSPEED_SUBDIR, self.rank, client_keys)

    def _save_engine_state(self, directory: str, client_state: dict[str, Any]) -> None:
        save_training_checkpoint(self.engine, Path(directory) / DEEPSPEED_SUBDIR, client_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restores weights + optimizer state from the checkpoint; its client_state."""
        return load_training_checkpoint(self.engine, Path(directory) / DEEPSPEED_SUBDIR)
