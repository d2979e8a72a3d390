"""What every worker rank of a service answers besides its own work.

A service's worker class (ActorWorker, CriticWorker, ReferenceWorker) subclasses
`RankWorker` and sets `rank`, `world_size` and `device` in its constructor; WorkerGroup
calls `node_address` on rank 0 and `init_distributed` on every rank, and the service's
controller asks `info` once for GetInfo. `TrainingRankWorker` adds the checkpoint check
the two training services share.
"""

import os
import socket
from pathlib import Path
from typing import Any

import torch

from rlserve.core.training import check_training_checkpoint
from rlserve.core.workers import distributed_address, init_process_group


class RankWorker:
    """One rank of a service's worker group."""

    rank: int
    world_size: int
    device: torch.device

    def node_address(self) -> tuple[str, int]:
        return distributed_address()

    def init_distributed(self, address: str, port: int) -> None:
        """Joins the service's process group (a training worker then builds its engine)."""
        init_process_group(self.rank, self.world_size, address, port, self.device)

    def info(self) -> dict[str, Any]:
        """rank, node_id, hostname, pid: where this rank runs, for GetInfo."""
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        except Exception:  # in-process, without Ray
            node_id = ""
        return {"rank": self.rank, "node_id": node_id, "hostname": socket.gethostname(),
                "pid": os.getpid()}  # fmt: skip


class TrainingRankWorker(RankWorker):
    """A rank that trains with DeepSpeed and keeps its engine's state under
    `<checkpoint>/<DEEPSPEED_SUBDIR>`."""

    DEEPSPEED_SUBDIR = "deepspeed"

    def check_checkpoint(self, directory: str, client_keys: list[str]) -> dict[str, Any]:
        """Reads this rank's state files weights-only, changing nothing (raises
        FileNotFoundError or UnsafeCheckpointError); every rank, before load_checkpoint.
        Returns the saved client_state's entries named `client_keys`."""
        return check_training_checkpoint(
            Path(directory) / self.DEEPSPEED_SUBDIR, self.rank, client_keys
        )
