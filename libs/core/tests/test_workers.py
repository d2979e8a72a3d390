"""WorkerGroup on the session's Ray cluster: rendezvous, split/pad/collect, per-rank calls."""

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.process_group import init_process_group, node_ip, open_rendezvous
from rlserve.core.workers import (
    ALLOCATOR_ENV,
    KEEP_FREED_PAGES,
    WorkerGroup,
    _host_class,
    resolve_factory,
    unscheduled_message,
    worker_env_vars,
)


class RankWorker:
    """Tags each row with its rank; all_reduce proves one process group."""

    def __init__(self, rank: int, world_size: int, offset: int):
        self.rank, self.world_size, self.offset = rank, world_size, offset
        self.rendezvous = None

    def node_address(self):
        self.rendezvous = open_rendezvous()
        return node_ip(), self.rendezvous.port

    def init_distributed(self, address, port):
        init_process_group(self.rank, self.world_size, address, port, store=self.rendezvous)

    def tag(self, batch: Batch) -> Batch:
        rows = batch["x"] + self.offset
        ranks = torch.full_like(rows, self.rank)
        return Batch(tensors={"x": rows, "rank": ranks})

    def rank_sum(self) -> int:
        import torch.distributed as dist

        total = torch.tensor([self.rank])
        dist.all_reduce(total)
        return int(total)

    def echo(self, item):
        return (self.rank, item)

    def received_bytes(self, batch: Batch) -> Batch:
        """The bytes of storage behind the batch this rank was sent."""
        held = torch.tensor([batch["x"].untyped_storage().nbytes()])
        return Batch(tensors={"held": held.expand(len(batch)).contiguous()})

    def process_facts(self) -> dict:
        import os

        maps = Path("/proc/self/maps").read_text()
        return {
            "jemalloc": "libjemalloc" in maps,
            "auth_mode": os.environ.get("RAY_AUTH_MODE"),
        }

    def pid(self) -> int:
        import os

        return os.getpid()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def fail(self):
        from rlserve.core.serving import invalid_argument

        raise invalid_argument("x", "bad")


@pytest.fixture(scope="module")
def group(serve_cluster):
    workers = WorkerGroup(RankWorker, 3, {"offset": 100}, num_cpus_per_worker=0.5)
    yield workers
    workers.shutdown()


def test_ranks_form_one_process_group(group):
    assert asyncio.run(group.run_all("rank_sum")) == [3, 3, 3]


def test_each_rank_is_sent_its_own_rows_only(group):
    """A chunk of a split is a view; pickled as one, it would carry the whole batch."""
    batch = Batch(tensors={"x": torch.zeros(300, 1000)})
    held = asyncio.run(group.run_split("received_bytes", batch))["held"]
    assert held.tolist() == [100 * 1000 * 4] * 300


@pytest.mark.parametrize("rows", [1, 3, 7, 9])
def test_run_split_collects_in_order_without_padding(group, rows):
    batch = Batch(tensors={"x": torch.arange(rows)})
    result = asyncio.run(group.run_split("tag", batch))
    assert result["x"].tolist() == [r + 100 for r in range(rows)]
    share = -(-rows // 3)  # ceil: padded so each rank gets an equal share
    assert result["rank"].tolist() == [r // share for r in range(rows)]


def test_run_each_sends_rank_i_its_item(group):
    assert asyncio.run(group.run_each("echo", ["a", "b", "c"])) == [(0, "a"), (1, "b"), (2, "c")]
    with pytest.raises(ValueError, match="got 2 inputs for 3 workers"):
        asyncio.run(group.run_each("echo", ["a", "b"]))


def test_rejects_empty_group():
    with pytest.raises(ValueError, match="num_workers: must be >= 1"):
        WorkerGroup(RankWorker, 0, {"offset": 0})


def test_worker_exceptions_arrive_unwrapped(group):
    import grpc

    from rlserve.core.serving import RpcError

    with pytest.raises(RpcError, match=r"^x: bad$") as error:
        asyncio.run(group.run_all("fail"))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_call_whose_worker_dies_fails_at_once_unavailable_and_the_group_reports_it(
    serve_cluster,
):
    """Rank 1 killed while both ranks work: the call fails without waiting for rank 0,
    and the health check reports the death without waiting for a ping."""
    import grpc

    from rlserve.core.serving import RpcError

    group = WorkerGroup(RankWorker, 2, {"offset": 0}, num_cpus_per_worker=0.25)
    try:
        pids = asyncio.run(group.run_all("pid"))

        async def call_and_kill() -> tuple[RpcError, float]:
            call = asyncio.ensure_future(group.run_all("sleep", 60.0))
            await asyncio.sleep(1.0)
            killed_at = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(RpcError) as error:
                await call
            return error.value, time.monotonic() - killed_at

        error, failed_after_s = asyncio.run(call_and_kill())
        assert error.code == grpc.StatusCode.UNAVAILABLE
        assert error.message.startswith("rank 1 worker died"), error.message
        assert failed_after_s < 30, failed_after_s  # rank 0 sleeps on for 59 s
        assert group.dead_workers() == [error.message]
    finally:
        group.shutdown()


def test_unschedulable_workers_fail_fast_naming_the_shortfall(serve_cluster):
    with pytest.raises(RuntimeError, match=r"were not scheduled within 2 s; short of CPU: 1000"):
        WorkerGroup(RankWorker, 1, {"offset": 0}, num_cpus_per_worker=1000, schedule_timeout_s=2)


def test_workers_short_of_a_gpu_are_told_about_gpus_not_cpus():
    message = unscheduled_message(
        "1 CriticWorker workers",
        {"CPU": 1, "GPU": 1},
        free={"CPU": 3, "GPU": 0},
        total={"CPU": 4, "GPU": 1},
        timeout_s=120,
    )
    assert "short of GPU: 1 each, 0 free of 1 (share GPUs" in message
    assert "CPU" not in message.split("short of")[1].split("{")[0]


def test_worker_processes_run_with_jemalloc_and_the_job_environment(group):
    facts = asyncio.run(group.run_all("process_facts"))
    assert [fact["jemalloc"] for fact in facts] == [True] * 3
    # the actor's runtime_env adds to the job's environment, it does not replace it
    assert {fact["auth_mode"] for fact in facts} == {"disabled"}


def test_cpu_workers_get_jemalloc_and_no_gpu_gpu_workers_the_system_allocator(monkeypatch):
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    cpu = worker_env_vars(gpus=0)
    # Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for num_gpus=0: the worker must hide it
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert "libjemalloc.so" in cpu["LD_PRELOAD"]
    for share in (1.0, 0.5):
        assert worker_env_vars(gpus=share, keep_freed_pages=True) == {}


def test_only_workers_asked_to_keep_freed_pages_turn_purging_off(monkeypatch):
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    assert "MALLOC_CONF" not in worker_env_vars(gpus=0)
    assert worker_env_vars(gpus=0, keep_freed_pages=True)["MALLOC_CONF"] == KEEP_FREED_PAGES
    # the job's own jemalloc options win (the runtime_env adds to the job's environment)
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    assert "MALLOC_CONF" not in worker_env_vars(gpus=0, keep_freed_pages=True)


def test_system_allocator_on_request(monkeypatch):
    monkeypatch.setenv(ALLOCATOR_ENV, "system")
    assert worker_env_vars(gpus=0) == {"CUDA_VISIBLE_DEVICES": ""}
    monkeypatch.setenv(ALLOCATOR_ENV, "tcmalloc")
    with pytest.raises(ValueError, match="RLSERVE_WORKER_ALLOCATOR"):
        worker_env_vars(gpus=1)


def test_import_paths_name_a_module_and_attribute():
    assert resolve_factory("rlserve.core.workers:WorkerGroup.run_all") is WorkerGroup.run_all
    with pytest.raises(ValueError, match=r"package\.module:name"):
        resolve_factory("rlserve.core.workers.WorkerGroup")


class RankOneFails(RankWorker):
    def __init__(self, rank: int, world_size: int, offset: int):
        if rank == 1:
            raise RuntimeError("rank 1 cannot load its model")
        super().__init__(rank, world_size, offset)


def test_a_worker_that_fails_to_build_fails_the_group_and_frees_the_others(serve_cluster):
    """Rank 0 would otherwise wait in the rendezvous for rank 1 and keep its resources."""
    import ray

    with pytest.raises(Exception, match="rank 1 cannot load its model"):
        WorkerGroup(RankOneFails, 2, {"offset": 0}, num_cpus_per_worker=0.5, name_prefix="fails")
    for _ in range(100):  # ray.kill takes effect asynchronously
        try:
            ray.get_actor("fails-rank0")
        except ValueError:
            return
        time.sleep(0.1)
    raise AssertionError("rank 0 of the failed group is still alive")


def test_hosts_are_named_after_their_workers():
    class Outer:
        class Inner:
            pass

    assert _host_class(Outer.Inner).__name__ == "Inner"
    assert _host_class("rlserve.rollout.worker:ActorWorker.from_service_config").__name__ == (
        "ActorWorker"
    )
    with pytest.raises(ValueError, match=r"package\.module:name"):
        _host_class("rlserve.rollout.worker.ActorWorker")
