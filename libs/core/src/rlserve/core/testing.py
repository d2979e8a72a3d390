"""pytest fixtures shared by every package's tests (loaded by the root conftest.py).

One local Ray cluster and one Serve instance per test session (starting one costs
≈ 20 s); tiny models are built in the test, never downloaded. Authentication is on for
the session: the cluster's replicas inherit a token set before Ray starts, and tests send
it through rlserve.core.rpc.call_metadata like every client.
"""

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

# Enough logical CPUs for several services with two workers each; the work itself is
# tiny, so 2 physical cores carry it.
TEST_CLUSTER_CPUS = 16


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
    # Short path: Ray's unix sockets live under it (108-byte limit).
    temp_dir = Path(tempfile.mkdtemp(prefix="rlray"))
    start_local_ray(num_cpus=TEST_CLUSTER_CPUS, temp_dir=temp_dir)
    grpc_port = start_serve_on_a_free_port()
    yield ServeCluster(grpc_address=f"127.0.0.1:{grpc_port}")
    serve.shutdown()
    ray.shutdown()


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
