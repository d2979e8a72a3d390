"""Data-parallel worker groups: N Ray actors forming one torch.distributed process group.

A service's Serve replica is its controller; it owns a WorkerGroup and dispatches each
request's batch across the ranks (split with padding, run, collect in order — VeRL's
DP_COMPUTE_PROTO), or calls every rank with the same arguments (checkpoint, load).

A worker is built by a factory — a class, or an import path "module:name" of a class or
function — called with `rank`, `world_size` plus its own keyword arguments; the worker has
`node_address()` and `init_distributed(address, port)` methods (rlserve.core.rank_worker
implements them with rlserve.core.process_group, which needs no Ray: this module is the
only one of the compute path's that imports it). Each Ray actor is a WorkerHost that
builds its worker inside its own process, so a controller that names its workers by
import path never imports what they do (transformers, DeepSpeed, peft, vLLM: ≈ 110 MB
of resident memory and seconds of start-up per Serve replica).

Tracing: a group created while its process traces (`tracing.current_setup()`, i.e. in a
Serve replica that called `setup_replica_tracing`) sets up the same tracing in every
worker, once, with sampling ratio 0 (a worker only continues traces, never starts one)
and `rlserve.rank` in its resource. Each call made inside a sampled trace then carries
the caller's trace context (`tracing.trace_carrier()`) and runs inside a span
`worker.<method>` (attributes rank, batch size), the parent of the spans the worker's
own code opens. Both go through Ray's `__ray_call__`, so worker classes need nothing
for it; with tracing off, or in an unsampled step, a call is the plain
`host.call.remote(method, ...)`.

Health: `dead_workers()` is the Serve health check's view of the group. Each worker has
one trivial ping outstanding at a time; a ping queued behind a long update simply waits
(a busy worker is alive), while the ping of a worker whose process died resolves with
Ray's actor-died error, which is what the check reports. Nothing blocks. A call that
finds its worker dead fails at once, without waiting for the other ranks (they may be
stuck in a collective with it), as UNAVAILABLE naming the rank, and the group reports
that worker dead from then on: the caller that asks GetInfo right after the failure
must not find the replica healthy just because the ping has not resolved yet.

Allocator: CPU worker processes run with jemalloc (the copy Ray's wheel ships,
preloaded) unless RLSERVE_WORKER_ALLOCATOR=system; a worker that reserves a GPU keeps
the system allocator (jemalloc under CUDA, NCCL and vLLM was never tried). glibc's
malloc keeps freed tensor memory in fragmented heaps: one SmolLM2-135M actor worker
(generate, log-probs, update, 3 steps) peaked at 3.62 GiB resident with glibc and 3.01
GiB with jemalloc. jemalloc's default purging hands freed pages back to the kernel
within seconds, and an update that frees and re-allocates its activations every
micro-batch then page-faults them in again: a LoRA update of 32 × ~96 tokens on 2
threads took 17-19 s that way, 12.8-13.3 s with purging off (MALLOC_CONF
dirty_decay_ms:-1,muzzy_decay_ms:-1; 14-15 s with glibc), at 3.17 GiB peak resident
instead of 2.98 (4.6 with glibc). So workers of a large model
(WorkerDeployment.keep_freed_pages, which the trainer sets from the model's size) keep
their freed pages for reuse, unless MALLOC_CONF is set in the environment. Small models
keep jemalloc's purging: a tiny-model critic that never purged grew 38 MiB over 150 PPO
steps (the sizes its variable-length batches ask for fragment the kept pages), against a
few MiB with purging.
"""

import asyncio
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlserve.core import tracing
from rlserve.core.batch import Batch
from rlserve.core.devices import worker_gpus
from rlserve.core.placement import actor_resource_options, ensure_placement_group
from rlserve.core.placement_config import WorkerPlacementConfig
from rlserve.core.service.methods import INIT_DISTRIBUTED, NODE_ADDRESS
from rlserve.core.service_config import WorkerDeployment
from rlserve.core.serving import unavailable

logger = logging.getLogger(__name__)
ALLOCATOR_ENV = "RLSERVE_WORKER_ALLOCATOR"


KEEP_FREED_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""jemalloc options of the workers: freed pages stay for reuse (see the module doc)."""


def worker_env_vars(gpus: float, keep_freed_pages: bool = False) -> dict[str, str]:
    """Environment for a worker process that reserves `gpus` GPUs (see the module doc).

    A worker that reserves none is hidden every GPU: Ray 2.60 no longer empties
    CUDA_VISIBLE_DEVICES for an actor with num_gpus=0, and such a worker set to 'auto'
    would otherwise compute on a cuda:0 that another worker reserved. It gets jemalloc
    preloaded, told to keep freed pages when `keep_freed_pages`. A worker with a GPU
    keeps the system allocator: jemalloc was measured on CPU workers only, and CUDA,
    NCCL and vLLM were never tried under it."""
    allocator = os.environ.get(ALLOCATOR_ENV, "jemalloc")
    if allocator not in ("jemalloc", "system"):
        raise ValueError(f"{ALLOCATOR_ENV}: expected 'jemalloc' or 'system', got {allocator!r}")
    if gpus > 0:
        return {}
    env = {"CUDA_VISIBLE_DEVICES": ""}
    if allocator == "system":
        return env
    library = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    if not library.is_file():
        logger.warning("no %s; worker processes use the system allocator", library)
        return env
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD", "")]))
    if keep_freed_pages and "MALLOC_CONF" not in os.environ:
        env["MALLOC_CONF"] = KEEP_FREED_PAGES
    return env


WorkerFactory = type | Callable[..., Any] | str
"""A worker class or function, or its import path "package.module:Name[.attribute]"."""


def resolve_factory(factory: WorkerFactory) -> Callable[..., Any]:
    """The callable an import path "module:Name.attr" names (a callable is returned as is)."""
    if not isinstance(factory, str):
        return factory
    module_name, _, attributes = factory.partition(":")
    if not module_name or not attributes:
        raise ValueError(f"worker factory: expected 'package.module:name', got {factory!r}")
    target = importlib.import_module(module_name)
    for attribute in attributes.split("."):
        target = getattr(target, attribute)
    return target


class WorkerHost:
    """The Ray actor around one worker: builds it in this process, calls its methods.

    WorkerGroup subclasses it per worker kind (named after the worker, so processes
    show as `ray::ActorWorker`, not as hosts).
    """

    def __init__(self, factory: WorkerFactory, **worker_kwargs: Any):
        self.worker = resolve_factory(factory)(**worker_kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


def _host_class(factory: WorkerFactory) -> type:
    """WorkerHost named after the worker; a malformed import path fails here, in the
    controller, rather than inside every actor."""
    if isinstance(factory, str):
        module_name, _, attributes = factory.partition(":")
        if not module_name or not attributes:
            raise ValueError(f"worker factory: expected 'package.module:name', got {factory!r}")
        name = attributes.split(".")[0]
    else:
        name = factory.__name__
    return type(name, (WorkerHost,), {"__module__": __name__})


def _get_fail_fast(refs: list[Any]) -> list[Any]:
    """ray.get of every ref, raising the first failure as soon as it happens: one rank
    that died must not leave the caller waiting on the others' rendezvous."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


def _setup_worker_tracing(worker: Any, setup: tracing.TracingSetup, rank: int) -> None:
    """Runs in a worker actor (via __ray_call__): its controller's tracing set-up."""
    tracing.setup_tracing(
        setup.service_name,
        setup.endpoint,
        0.0,  # never a root: a worker's spans belong to the call that reached it
        True,
        setup.file_path,
        resource_attributes={
            **setup.resource_attributes,
            "rlserve.rank": rank,
            "rlserve.node_id": ray.get_runtime_context().get_node_id(),
        },
    )


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200]


def _died_line(rank: int, error: Exception) -> str:
    return f"rank {rank} worker died: {_first_line(error)}"


def _ping(host: WorkerHost) -> None:
    """Runs in a worker actor (via __ray_call__): proves the process is alive."""


def _traced_call(
    host: WorkerHost, method: str, carrier: dict[str, str], args: tuple, kwargs: dict[str, Any]
) -> Any:
    """Runs in a worker actor (via __ray_call__): `method` inside the caller's trace."""
    batch_size = len(args[0]) if args and isinstance(args[0], Batch) else None
    rank = getattr(host.worker, "rank", None)
    with (
        tracing.attached(tracing.extract_context(carrier.items())),
        tracing.span(f"worker.{method}", rank=rank, batch_size=batch_size),
    ):
        return host.call(method, *args, **kwargs)


_SHORTFALL_FIXES = {
    "CPU": "lower num_cpus_per_worker or workers, or add nodes",
    "GPU": (
        "share GPUs (gpus_per_worker below 1, or a placement bundle such as "
        "{CPU: 1, GPU: 0.5}), set device: cpu, lower workers, or add GPUs"
    ),
}


def unscheduled_message(
    workers: str,
    need: dict[str, float],
    free: dict[str, float],
    total: dict[str, float],
    timeout_s: float,
) -> str:
    """Why `workers`, each asking for `need`, were not scheduled: the resources of which
    the cluster has less free than one worker asks for, with a fix for each (all of
    `need` when none is short now: other work held them until just before)."""
    asked = {name: amount for name, amount in need.items() if amount > 0}
    short = [name for name, amount in asked.items() if free.get(name, 0) + 1e-9 < amount] or list(
        asked
    )
    lines = [
        f"{name}: {asked[name]:g} each, {free.get(name, 0):g} free of {total.get(name, 0):g} "
        f"({_SHORTFALL_FIXES.get(name, 'free it or add nodes that have it')})"
        for name in short
    ]
    return f"{workers} were not scheduled within {timeout_s:.0f} s; short of " + "; ".join(lines)


class WorkerGroup:
    """`num_workers` workers built by `factory`, ranks 0..N-1, in one process group.

    With `placement`, worker i runs in bundle `bundle_offset + i` of that named placement
    group (created if missing) and asks for exactly that bundle's resources; without it,
    each worker asks for `num_cpus_per_worker` and `gpus_per_worker` (None: what its
    `device` setting calls for, devices.worker_gpus, a share of a GPU when the cluster
    has fewer GPUs than this group has workers) and Ray picks the node. Creation fails
    within schedule_timeout_s, naming the resources short, when the cluster cannot place
    the workers (Ray would otherwise leave them pending forever).
    """

    def __init__(
        self,
        factory: WorkerFactory,
        num_workers: int,
        worker_kwargs: dict[str, Any],
        num_cpus_per_worker: float = 1.0,
        placement: WorkerPlacementConfig | None = None,
        name_prefix: str | None = None,
        schedule_timeout_s: float = 120.0,
        device: str = "cpu",
        keep_freed_pages: bool = False,
        gpus_per_worker: float | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {num_workers}")
        group = None
        if placement is not None:
            placement.require_room_for(num_workers)
            group = ensure_placement_group(placement)
        if gpus_per_worker is None:
            gpus_per_worker = worker_gpus(
                device, ray.cluster_resources().get("GPU", 0), num_workers
            )
        host_cls = _host_class(factory)
        remote_cls = ray.remote(host_cls)
        self.workers = []
        self._pings: list[Any] = []
        self._died: dict[int, str] = {}  # rank -> why, as calls found it
        for rank in range(num_workers):
            options: dict[str, Any] = {
                "num_cpus": num_cpus_per_worker,
                "num_gpus": gpus_per_worker,
            }
            if group is not None:
                bundle_index = placement.bundle_offset + rank
                options = actor_resource_options(placement.bundles[bundle_index])
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle_index
                )
            if name_prefix:
                options["name"] = f"{name_prefix}-rank{rank}"
            options["runtime_env"] = {
                "env_vars": worker_env_vars(options["num_gpus"], keep_freed_pages)
            }
            if rank == 0:
                need = {"CPU": options["num_cpus"], "GPU": options["num_gpus"]}
            self.workers.append(
                remote_cls.options(**options).remote(
                    factory, rank=rank, world_size=num_workers, **worker_kwargs
                )
            )
        try:
            self._start(schedule_timeout_s, host_cls.__name__, need)
        except BaseException:
            # a worker that failed to build or join must not leave the others holding
            # their CPUs/GPUs (or waiting in the rendezvous)
            self.shutdown()
            raise

    @classmethod
    def for_service(
        cls, factory: WorkerFactory, config: WorkerDeployment, worker_kwargs: dict[str, Any]
    ) -> "WorkerGroup":
        """The workers a service's config describes: `config.workers` ranks, sized and
        placed by its num_cpus_per_worker, gpus_per_worker, placement and device."""
        return cls(
            factory,
            config.workers,
            worker_kwargs,
            num_cpus_per_worker=config.num_cpus_per_worker,
            placement=config.placement,
            device=config.device,
            keep_freed_pages=config.keep_freed_pages,
            gpus_per_worker=config.gpus_per_worker,
        )

    def _start(self, schedule_timeout_s: float, kind: str, need: dict[str, float]) -> None:
        try:
            address, port = ray.get(
                self.workers[0].call.remote(NODE_ADDRESS), timeout=schedule_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                unscheduled_message(
                    f"{len(self.workers)} {kind} workers",
                    need,
                    ray.available_resources(),
                    ray.cluster_resources(),
                    schedule_timeout_s,
                )
            ) from None
        _get_fail_fast(
            [worker.call.remote(INIT_DISTRIBUTED, address, port) for worker in self.workers]
        )
        self._tracing = tracing.current_setup()
        if self._tracing is not None:
            ray.get(
                [
                    worker.__ray_call__.remote(_setup_worker_tracing, self._tracing, rank)
                    for rank, worker in enumerate(self.workers)
                ]
            )

    def __len__(self) -> int:
        return len(self.workers)

    async def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Calls `method` on every rank with the same arguments; results by rank."""
        refs = [self._call(worker, method, args, kwargs) for worker in self.workers]
        return await self._gather(refs)

    async def run_split(self, method: str, batch: Batch, **kwargs: Any) -> Batch:
        """Splits `batch` across ranks (padding to equal shares), runs, collects in order.
        Each rank is sent its own rows only (a Batch pickles its views' own bytes)."""
        chunks, pad_count = batch.split(len(self.workers))
        results = await self.run_each(method, chunks, **kwargs)
        return Batch.collect(results, pad_count)

    async def run_each(self, method: str, per_rank: Sequence[Any], **kwargs: Any) -> list[Any]:
        """Calls `method` on rank i with per_rank[i]."""
        if len(per_rank) != len(self.workers):
            raise ValueError(f"got {len(per_rank)} inputs for {len(self.workers)} workers")
        refs = [
            self._call(worker, method, (item,), kwargs)
            for worker, item in zip(self.workers, per_rank, strict=True)
        ]
        return await self._gather(refs)

    async def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's result, in rank order. Raises as soon as one rank fails: its own
        exception (e.g. an RpcError naming a field) as itself, not wrapped; a dead
        worker as UNAVAILABLE naming its rank."""

        async def result(rank: int, ref: Any) -> Any:
            try:
                return await ref
            except RayTaskError as error:
                if isinstance(error.cause, Exception):
                    raise error.cause from None
                raise
            except ray.exceptions.ActorDiedError as error:
                self._died[rank] = _died_line(rank, error)
                raise unavailable(self._died[rank]) from None
            except ray.exceptions.RayActorError as error:  # unreachable, maybe not dead
                raise unavailable(f"rank {rank} worker: {_first_line(error)}") from None

        tasks = [asyncio.ensure_future(result(rank, ref)) for rank, ref in enumerate(refs)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # the others' results no longer matter
                task.cancel()

    def _call(self, worker: Any, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """One actor call; inside the caller's trace when that trace is sampled (an
        unsampled one would record nothing in the worker either: plain call)."""
        if self._tracing is not None and tracing.recording():
            carrier = tracing.trace_carrier()
            return worker.__ray_call__.remote(_traced_call, method, carrier, args, kwargs)
        return worker.call.remote(method, *args, **kwargs)

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Blocking call of `method` on rank 0 (set-up queries, e.g. the model's limits)."""
        return ray.get(self._call(self.workers[0], method, args, kwargs))

    def dead_workers(self) -> list[str]:
        """One line per worker whose process has died (empty when all are alive).

        Never waits: a worker's pending ping means it is busy, not dead. A dead worker's
        ping is kept, so every later check reports it too.
        """
        if not self._pings:
            self._pings = [worker.__ray_call__.remote(_ping) for worker in self.workers]
        dead = []
        for rank, ping in enumerate(self._pings):
            if rank in self._died:
                dead.append(self._died[rank])
                continue
            ready, _ = ray.wait([ping], timeout=0, fetch_local=False)
            if not ready:
                continue
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as error:
                dead.append(_died_line(rank, error))
                continue
            self._pings[rank] = self.workers[rank].__ray_call__.remote(_ping)
        return dead

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
