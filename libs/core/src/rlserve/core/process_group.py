"""How a worker rank joins its service's torch.distributed group, without Ray.

Rank 0 hosts the rendezvous: `open_rendezvous` opens torch's TCPStore on a port the
kernel picks and keeps it open, and the other ranks connect to that port. Probing a free
port, closing the probe and handing its number to torch (as this did before) left a
window in which anything else on a busy node could take the port; a listening store
cannot lose it.

Nothing here imports Ray, so the compute path (the workers, their engines, training)
runs in a process without it; only WorkerGroup (rlserve.core.workers), which creates
the actors, imports Ray.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from rlserve.core.devices import deepspeed_accelerator, distributed_backend

SHM_ALL_REDUCE_OP = "deepspeed_shm_comm"
LOOPBACK = "127.0.0.1"


def node_ip() -> str:
    """The address other ranks reach this process at: Ray's node IP in a Ray worker
    process (Ray is imported there already; importing it here would tie the compute
    path to Ray), else loopback, since ranks built without Ray share one machine."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return LOOPBACK


def open_rendezvous() -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on a port the kernel picked (`.port`); the
    caller keeps it and passes it to init_process_group."""
    return dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)


def init_process_group(
    rank: int,
    world_size: int,
    address: str,
    port: int,
    device: torch.device | None = None,
    store: dist.TCPStore | None = None,
) -> None:
    """Joins the group (NCCL for CUDA workers, gloo on the CPU), then DeepSpeed's wrapper
    of it. `store`: rank 0's open_rendezvous(); without one, rank 0 listens on `port`
    (0 = the kernel picks, for a group of one) and the other ranks connect to
    address:port. A process already in a group keeps it (in-process tests build several
    workers in one process). A worker sees only its own GPU, so LOCAL_RANK is 0."""
    device = device or torch.device("cpu")
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=address,
        MASTER_PORT=str(store.port if store is not None else port),
        DS_ACCELERATOR=deepspeed_accelerator(device),
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = distributed_backend(device)
    if not dist.is_initialized():
        if store is None:
            store = dist.TCPStore(
                address, port, world_size, is_master=rank == 0, wait_for_workers=False
            )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    import deepspeed  # imported here, after DS_ACCELERATOR: only training workers need it
    import deepspeed.ops

    # DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce (used only by
    # inference_all_reduce, which nothing here calls) at every init: ≈ 40 s of gcc on a
    # fresh machine, under a lock file in ~/.cache/torch_extensions that every process
    # waits on. A worker killed while holding it (a replica torn down mid-start) left
    # every later worker on the machine waiting forever.
    deepspeed.ops.__compatible_ops__[SHM_ALL_REDUCE_OP] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
