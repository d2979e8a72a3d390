"""Which device a worker computes on, and the process-group backend that goes with it.

A worker role's `device` setting is "auto", "cpu" or "cuda". A CUDA worker sees exactly
the GPU of its bundle (Ray sets CUDA_VISIBLE_DEVICES for an actor that asks for
`GPU: 1`), so its device is always `cuda:0`; CUDA ranks talk over NCCL, CPU ranks over
gloo. Models and batches live on the worker's device; tensors cross to the CPU only at
the service boundary (requests in, results out), where the codec works on host memory.
"""

from __future__ import annotations

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


def worker_gpus(setting: str) -> float:
    """GPUs a worker asks Ray for when no placement bundle sets its resources: one for
    'cuda', one for 'auto' on a cluster that has GPUs, else none. (With a placement
    bundle the bundle decides: `{GPU: 1}`, or a fraction to share one GPU.)"""
    if setting == "cpu":
        return 0.0
    if setting == "cuda":
        return 1.0
    import ray

    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
