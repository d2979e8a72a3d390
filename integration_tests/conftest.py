"""Fixtures for whole-stack tests: a warmed-up embedded model, a tool-using one, and
Phoenix (a real OTLP trace backend, integration_tests/phoenix.py) for the tracing tests."""

from pathlib import Path

import pytest

from integration_tests.agent_support import build_agent_model, write_agent_inputs
from integration_tests.phoenix import phoenix_backend  # noqa: F401
from rlserve.core.embedded.prepare import EmbeddedDefault, prepare_embedded_default
from rlserve.core.inputs_config import ArithmeticTaskConfig, TinyModelConfig


@pytest.fixture(scope="session")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedDefault:
    """A small warmed-up Llama on a+b with operands 0..19 (right sometimes, not always)."""
    return prepare_embedded_default(
        tmp_path_factory.mktemp("embedded"),
        tiny=TinyModelConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            intermediate_size=128,
            sft_max_steps=60,
            sft_target_accuracy=None,
            sft_batch_samples=64,
            sft_lr=3e-3,
        ),
        task=ArithmeticTaskConfig(operand_max=19, train_pairs=300, eval_pairs=64),
        seed=0,
        max_new_tokens=3,
        eval_prompts=64,
    )


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model taught one tool-using conversation (integration_tests/agent_support.py)."""
    return build_agent_model(tmp_path_factory.mktemp("agent_model"))


@pytest.fixture(scope="session")
def agent_inputs(agent_model_dir, tmp_path_factory):
    """Run inputs of agent_model_dir with its one prompt (integration_tests/agent_support.py)."""
    return write_agent_inputs(agent_model_dir, tmp_path_factory.mktemp("agent_data"))


@pytest.fixture(scope="module", autouse=True)
def module_apps_end_with_their_module(request: pytest.FixtureRequest):
    """Deletes the Serve apps a module deployed under its own names when it ends, also when
    its fixture failed halfway: an app left starting keeps its replicas and their CPUs and
    memory, and every later module then fails to deploy. The service roles stay, for
    `deployed_services` to reuse."""
    yield
    import ray

    if request.path.parent != Path(__file__).parent or not ray.is_initialized():
        return  # multinode/ and netns/ run their own clusters their own way
    from ray import serve

    from integration_tests.support import SERVICE_ROLES

    for name in set(serve.status().applications) - set(SERVICE_ROLES):
        serve.delete(name)
