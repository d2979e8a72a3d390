"""Which device a worker computes on, and the process-group backend that goes with it.

A worker role's `device` setting is "auto", "cpu" or "cuda". A CUDA worker sees exactly
the GPU of its bundle (Ray sets CUDA_VISIBLE_DEVICES for an actor that asks for a GPU or
a fraction of one), so its device is always `cuda:0`; CUDA ranks talk over NCCL, CPU
ranks over gloo. A worker that reserves no GPU sees none either: since Ray 2.60 an actor
with num_gpus=0 keeps the node's CUDA_VISIBLE_DEVICES, so WorkerGroup empties it in such
a worker's environment (rlserve.core.workers.worker_env_vars), and "auto" there is the
CPU rather than a GPU that another worker reserved. Models and batches live on the
worker's device; tensors cross to the CPU only at the service boundary (requests in,
results out), where the codec works on host memory.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import torch

DeviceSetting = Literal["auto", "cpu", "cuda"]
DEVICE_SETTINGS: tuple[str, ...] = ("auto", "cpu", "cuda")


def resolve_device(setting: str, cuda_available: bool | None = None) -> torch.device:
    """The torch device for a worker whose role asks for `setting`.

    "auto" is CUDA when this process sees a GPU, else the CPU. "cuda" without a visible
    GPU is an error that says how to give the worker one, rather than a slow CPU run.
    `cuda_available` overrides the probe (tests).
    """
    if setting not in DEVICE_SETTINGS:
        raise ValueError(f"device: {setting!r} is not one of {list(DEVICE_SETTINGS)}")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if setting == "cpu" or (setting == "auto" and not cuda_available):
        return torch.device("cpu")
    if not cuda_available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise RuntimeError(
            "device: 'cuda' but this worker sees no GPU (torch CUDA build: "
            f"{torch.version.cuda or 'no'}, CUDA_VISIBLE_DEVICES={visible}); give the role's "
            "placement bundle a GPU (worker_resources: {GPU: 1}), install the GPU profile "
            "(tools/setup.sh --gpu), or set device: cpu"
        )
    return torch.device("cuda", 0)


def distributed_backend(device: torch.device) -> str:
    """torch.distributed backend for ranks on `device`: NCCL between GPUs, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


def deepspeed_accelerator(device: torch.device) -> str:
    """DeepSpeed's accelerator name (DS_ACCELERATOR) for `device`.

    Set before deepspeed is imported: left to itself, DeepSpeed picks CUDA whenever a GPU
    is visible, even for a worker told to run on the CPU.
    """
    return "cuda" if device.type == "cuda" else "cpu"


RAY_UNITS_PER_RESOURCE = 10_000
"""Ray counts a resource in fixed-point units of 1/10,000."""


def worker_gpus(setting: str, cluster_gpus: float, gpu_workers: int) -> float:
    """GPUs one worker reserves when no placement bundle sets its resources.

    `cluster_gpus`: the GPUs of the cluster; `gpu_workers`: the workers that reserve
    GPUs this way (every unplaced non-CPU worker of the run, all services together).
    None for 'cpu', nor for 'auto' on a cluster without GPUs; a whole GPU each when
    there are enough; else an equal share, 1/k of a GPU with k = ceil(gpu_workers /
    cluster_gpus) workers to a GPU (rounded down to Ray's unit, so k shares fit in one).
    """
    if setting == "cpu" or (setting == "auto" and cluster_gpus < 1):
        return 0.0
    if cluster_gpus < 1:
        raise ValueError(
            "device: 'cuda' but the cluster has no GPU; start Ray on a node with one "
            "(ray start --num-gpus=N) or set the role's device to auto or cpu"
        )
    if gpu_workers <= cluster_gpus:
        return 1.0
    workers_per_gpu = math.ceil(gpu_workers / math.floor(cluster_gpus))
    return (RAY_UNITS_PER_RESOURCE // workers_per_gpu) / RAY_UNITS_PER_RESOURCE
