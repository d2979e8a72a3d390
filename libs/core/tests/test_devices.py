"""Device selection per worker role: auto/cpu/cuda, and the backends that follow."""

import pytest
import torch

from rlserve.core.devices import (
    deepspeed_accelerator,
    distributed_backend,
    resolve_device,
    worker_gpus,
)


@pytest.mark.parametrize(
    ("setting", "cuda_available", "expected"),
    [
        ("auto", True, torch.device("cuda", 0)),
        ("auto", False, torch.device("cpu")),
        ("cpu", True, torch.device("cpu")),
        ("cpu", False, torch.device("cpu")),
        ("cuda", True, torch.device("cuda", 0)),
    ],
)
def test_resolve_device(setting, cuda_available, expected):
    assert resolve_device(setting, cuda_available=cuda_available) == expected


def test_cuda_without_a_gpu_says_how_to_get_one(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match=r"device: 'cuda'.*GPU: 1.*setup.sh --gpu.*device: cpu"):
        resolve_device("cuda", cuda_available=False)


def test_unknown_setting_names_the_field():
    with pytest.raises(ValueError, match=r"device: 'tpu' is not one of \['auto', 'cpu', 'cuda'\]"):
        resolve_device("tpu")


def test_auto_on_this_machine_matches_torch():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize(
    ("device", "backend", "accelerator"),
    [(torch.device("cuda", 0), "nccl", "cuda"), (torch.device("cpu"), "gloo", "cpu")],
)
def test_backend_and_accelerator_follow_the_device(device, backend, accelerator):
    assert distributed_backend(device) == backend
    assert deepspeed_accelerator(device) == accelerator


@pytest.mark.parametrize(
    ("setting", "cluster_gpus", "gpu_workers", "expected"),
    [
        ("cpu", 8, 3, 0.0),
        ("auto", 0, 3, 0.0),
        ("auto", 4, 3, 1.0),
        ("cuda", 3, 3, 1.0),
        # one GPU, rollout + critic + reference: a third each, not one each in turn
        ("auto", 1, 3, 0.3333),
        ("cuda", 2, 3, 0.5),
    ],
)
def test_worker_gpus_without_a_placement_bundle(setting, cluster_gpus, gpu_workers, expected):
    assert worker_gpus(setting, cluster_gpus, gpu_workers) == expected


@pytest.mark.parametrize(("cluster_gpus", "gpu_workers"), [(1, 2), (1, 3), (2, 3), (3, 7)])
def test_shared_gpus_hold_every_worker(cluster_gpus, gpu_workers):
    share = worker_gpus("cuda", cluster_gpus, gpu_workers)
    per_gpu = int(1 / share + 1e-9)
    assert per_gpu * share <= 1  # Ray fits that many shares on one GPU
    assert per_gpu * cluster_gpus >= gpu_workers


def test_cuda_on_a_cluster_without_gpus_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"device: 'cuda' but the cluster has no GPU.*auto or cpu"):
        worker_gpus("cuda", 0, 1)
