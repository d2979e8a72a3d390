"""Shared fixtures for every package's tests, and the sessions' collection rules.

One local Ray cluster and one Serve instance per test session (starting one costs
≈ 20 s); tiny models are built in the test, never downloaded. Authentication is on for
the session: the cluster's replicas inherit a token set before Ray starts, and tests send
it through rlserve.core.rpc.call_metadata like every client.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

if TYPE_CHECKING:  # torch is imported by the tests that use it, not by every session
    from rlserve.core.batch import Batch

# Enough logical CPUs for several services with two workers each; the work itself is
# tiny, so 2 physical cores carry it.
TEST_CLUSTER_CPUS = 16


_cluster_temp_dirs: list[Path] = []
"""The session cluster's Ray temp dir (its session_latest/logs), once it has started."""
LOG_TAIL_FILES, LOG_TAIL_LINES = 6, 25


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test on the session's cluster carries the ends of the Serve replica and
    Ray worker logs written last: a replica that hangs or dies while starting says why
    only there, and CI keeps nothing but the test output."""
    report = yield
    if report.failed and report.when in ("setup", "call") and _cluster_temp_dirs:
        logs = _cluster_temp_dirs[-1] / "session_latest" / "logs"
        modified = {}
        for path in [*logs.glob("serve/replica_*.log"), *logs.glob("worker-*.err")]:
            try:  # Ray rotates logs by renaming them: a listed file may be gone
                modified[path] = path.stat().st_mtime
            except FileNotFoundError:
                continue
        for path in sorted(modified, key=modified.get)[-LOG_TAIL_FILES:]:
            try:
                lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            except FileNotFoundError:
                continue
            report.sections.append((f"Ray log {path.name} (last lines)", "\n".join(lines)))
    return report


@dataclass(frozen=True)
class ServeCluster:
    grpc_address: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(
            self.grpc_address,
            options=[("grpc.max_receive_message_length", 256 * 2**20)],
        )


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve

    from rlserve.core import auth
    from rlserve.core.cluster import start_local_ray, start_serve_on_a_free_port

    # Before Ray starts: its processes, and so the replicas, inherit the environment.
    if auth.expected_token() is None:
        os.environ[auth.TOKEN_ENV] = auth.generate_token()
    # User tools the tests load by import path ("integration_tests.agent_tools:Hang")
    # must import in the replicas as a user's own package would.
    repo_root = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [repo_root, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # Short path: Ray's unix sockets live under it (108-byte limit).
    temp_dir = Path(tempfile.mkdtemp(prefix="rlray"))
    _cluster_temp_dirs.append(temp_dir)
    start_local_ray(num_cpus=TEST_CLUSTER_CPUS, temp_dir=temp_dir)
    grpc_port = start_serve_on_a_free_port()
    yield ServeCluster(grpc_address=f"127.0.0.1:{grpc_port}")
    serve.shutdown()
    ray.shutdown()


def padded_sequence_batch(
    rows: int,
    prompt_len: int = 6,
    response_len: int = 5,
    seed: int = 0,
    vocab_size: int = 99,
    targets: bool = False,
) -> Batch:
    """Random prompt ‖ response rows as the model services receive them: prompts
    left-padded, responses right-padded (some empty, the first full), pad id 0 where
    masked; with `targets`, a critic's old values and returns too."""
    import torch

    from rlserve.core.batch import Batch

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab_size, (rows, prompt_len + response_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    prompt_pad = torch.randint(0, prompt_len - 1, (rows,), generator=generator)
    response_lens = torch.randint(0, response_len + 1, (rows,), generator=generator)
    response_lens[0] = response_len
    for row in range(rows):
        attention_mask[row, : prompt_pad[row]] = 0
        attention_mask[row, prompt_len + response_lens[row] :] = 0
    input_ids[attention_mask == 0] = 0
    response_mask = attention_mask[:, prompt_len:].clone()
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": input_ids[:, prompt_len:].clone(),
        "response_mask": response_mask,
    }
    if targets:
        tensors["values"] = (
            torch.randn(rows, response_len, generator=generator) * 0.1 * response_mask
        )
        tensors["returns"] = torch.randn(rows, response_len, generator=generator) * response_mask
    return Batch(tensors=tensors)


@pytest.fixture(scope="session")
def sequence_batch():
    """padded_sequence_batch(rows, prompt_len=6, response_len=5, seed=0, vocab_size=99,
    targets=False) -> Batch."""
    return padded_sequence_batch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Llama + character tokenizer in HF format."""
    from rlserve.core.embedded.model import build_tiny_llama, save_model
    from rlserve.core.embedded.tokenizer import save_char_tokenizer

    directory = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = save_char_tokenizer(directory)
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0
    )
    save_model(model, directory)
    return directory


# The multi-node tests run their own simulated cluster, and a process holds one Ray: they
# are a second pytest session (`make test` runs both; see integration_tests/multinode).
# The two-node tests start a cluster in network namespaces (root only): a third session.
collect_ignore = [
    *([] if os.environ.get("RLSERVE_MULTINODE_TESTS") else ["integration_tests/multinode"]),
    *([] if os.environ.get("RLSERVE_NETNS_TESTS") else ["integration_tests/netns"]),
]


def pytest_collection_modifyitems(config, items):
    """Marks `cluster` every test that uses the session's Ray cluster (the serve_cluster
    fixture, directly or through another fixture): `make test-fast` leaves them out."""
    for item in items:
        if "serve_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


class InProcessGroup:
    """WorkerGroup's async interface over workers living in this process, already
    initialised: the real WorkerGroup needs Ray; this runs the same worker code
    directly, so a service's controller is testable without a cluster."""

    def __init__(self, workers: Sequence[Any], threaded: bool = False):
        self.workers = list(workers)
        # threaded: run each call in a thread, so the event loop stays free while the
        # workers compute (as with Ray actors) and deadlines can pass mid-call.
        self.threaded = threaded

    async def _call(self, worker: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        bound = getattr(worker, method)
        if self.threaded:
            return await asyncio.to_thread(bound, *args, **kwargs)
        return bound(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.workers)

    def dead_workers(self) -> list[str]:
        return []  # in this process: alive while the test is

    async def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [await self._call(worker, method, *args, **kwargs) for worker in self.workers]

    async def run_split(self, method: str, batch: Batch, **kwargs: Any) -> Batch:
        from rlserve.core.batch import Batch

        chunks, pad_count = batch.split(len(self.workers))
        return Batch.collect(await self.run_each(method, chunks, **kwargs), pad_count)

    async def run_each(self, method: str, per_rank: Sequence[Any], **kwargs: Any) -> list[Any]:
        return [
            await self._call(worker, method, item, **kwargs)
            for worker, item in zip(self.workers, per_rank, strict=True)
        ]


@pytest.fixture(scope="session")
def in_process_group() -> type[InProcessGroup]:
    """InProcessGroup(workers, threaded=False): WorkerGroup's interface without Ray."""
    return InProcessGroup
