"""The workers' compute path runs without Ray: a GPU machine with no Ray wheel can import
the actor, critic and reference workers, build an ActorWorker in-process, join its
process group and generate.

"Without Ray" is a subprocess whose import system refuses `ray` (ModuleNotFoundError,
as if it were not installed), so an import of it anywhere on that path fails the test.
"""

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoRay(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoRay())

    import torch
    import rlserve.critic.worker, rlserve.reference.worker
    from rlserve.core.batch import Batch
    from rlserve.rollout.config import RolloutServiceConfig
    from rlserve.rollout.generation import SamplingSettings
    from rlserve.rollout.worker import ActorWorker, actor_worker_kwargs

    config = RolloutServiceConfig(
        model_path=sys.argv[1], ppo_mini_batch_samples=2, micro_batch_samples=2, device="cpu"
    )
    worker = ActorWorker(rank=0, world_size=1, **actor_worker_kwargs(config))
    address, port = worker.node_address()
    worker.init_distributed(address, port)
    prompts = Batch(
        {"input_ids": torch.tensor([[1, 21, 15]] * 2), "attention_mask": torch.ones(2, 3).long()}
    )
    sampling = SamplingSettings(
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3, responses_per_prompt=1,
        seed=0, ignore_eos=True, return_log_probs=False,
    )
    batch = worker.generate(prompts, sampling)
    assert "ray" not in sys.modules
    print("generated", tuple(batch["responses"].shape), "at", address)
    """
)


def test_actor_worker_imports_joins_and_generates_without_ray(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "generated (2, 3) at 127.0.0.1" in run.stdout
