"""Does the default run learn on every seed? `rlserve train` on the embedded default, per seed.

For each seed, one whole `rlserve train trainer.seed=S` (its own local Ray cluster), then
one table:

- warm-up: steps the supervised warm-up took to reach model.tiny.sft_target_accuracy
  and the held-out accuracy it left (the run's own greedy evaluation of the warmed-up
  model, before Ray starts);
- before / after: held-out accuracy through the services at step 0 and after the last
  step, and the gain in points;
- RL s to +20: seconds of PPO steps and evaluations until an evaluation first reached
  before + 20 points (— if none did);
- whole s: the whole command, warm-up and cluster start included;
- independent: the warmed-up model and the final checkpoint's `rollout/model` loaded in
  plain transformers and scored by greedy exact match on all held-out pairs, not
  through the services, so the two scorings can be compared.

    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 3 4
    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 3 4 --algorithm grpo
    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 --algorithm dapo
    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 --algorithm agent
    .venv/bin/python benchmarks/bench_learning.py --seeds 0 1 2 --algorithm agent-baseline
    .venv/bin/python benchmarks/bench_learning.py --seeds 3 -- trainer.total_steps=30

Arguments after `--` are passed to every run as config overrides. GRPO runs the recipe
of `rlserve/core/configs/embedded_grpo.yaml` (no critic, 8 responses per prompt, KL loss),
DAPO that of `embedded_dapo.yaml` (the GRPO recipe with DAPO's four pieces). "agent" runs
the multi-turn task of `embedded_agent.yaml` ("a*b+c=" with a calculator the model calls;
its independent scoring plays episodes with a local calculator), "agent-baseline" the
same task answered in one turn without tools.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlserve.core.run_config import (
    EMBEDDED_AGENT_CONFIG_PATH,
    EMBEDDED_DAPO_CONFIG_PATH,
    EMBEDDED_GRPO_CONFIG_PATH,
)

GAIN_POINTS = 20.0
# The run config of each --algorithm (None: the embedded default, PPO).
ALGORITHM_CONFIGS = {
    "ppo": None,
    "grpo": EMBEDDED_GRPO_CONFIG_PATH,
    "dapo": EMBEDDED_DAPO_CONFIG_PATH,
    "agent": EMBEDDED_AGENT_CONFIG_PATH,
    "agent-baseline": EMBEDDED_AGENT_CONFIG_PATH,
}
# Overrides an --algorithm adds: the agent task's single-turn baseline calls no tool.
ALGORITHM_OVERRIDES = {"agent-baseline": ["rollout.agent=null"]}
# The agent task's episodes: the call, the tool's answer and the answer (its config's).
AGENT_MAX_NEW_TOKENS = 24


def run_seed(seed: int, algorithm: str, overrides: list[str], work: Path) -> dict:
    run_root = work / f"{algorithm}-seed{seed}"
    command = [
        sys.executable,
        "-m",
        "rlserve.trainer.cli",
        "train",
        *(["--config", str(ALGORITHM_CONFIGS[algorithm])] if ALGORITHM_CONFIGS[algorithm] else []),
        f"trainer.run_dir={run_root}",
        f"trainer.seed={seed}",
        *ALGORITHM_OVERRIDES.get(algorithm, []),
        *overrides,
    ]
    print(f"[seed {seed}] {' '.join(command[3:])}", flush=True)
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True)
    whole_s = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{completed.stderr[-3000:]}")
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    inputs = json.loads((run_dir / "inputs.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "seed": seed,
        "warmup_steps": inputs["warmup_steps"],
        "warmup_accuracy": inputs["warmup_accuracy"],
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "rl_s_to_gain": rl_seconds_to_gain(records, summary["accuracy_before"]),
        "curve": [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r],
        "whole_s": whole_s,
        "independent": independent_accuracy(
            run_dir, inputs, summary["checkpoint"], episodes=algorithm == "agent"
        ),
    }


def rl_seconds_to_gain(records: list[dict], before: float) -> float | None:
    """Seconds of steps and evaluations until an evaluation first reached before + 20."""
    elapsed = 0.0
    for record in records:
        if record.get("step", 0) == 0:
            continue
        elapsed += record.get("time/step_s", 0.0) + record.get("time/eval_s", 0.0)
        # in points rounded to a thousandth: accuracies arrive as float32 fractions, and
        # exactly +20 (e.g. 165 -> 265 of 500) must count as reached
        gain_points = round(100 * (record.get("eval_accuracy", -1.0) - before), 3)
        if gain_points >= GAIN_POINTS:
            return elapsed
    return None


def independent_accuracy(
    run_dir: Path, inputs: dict, checkpoint: str, episodes: bool = False
) -> tuple[float, float]:
    """(warmed-up, final) greedy accuracy on every held-out pair, in plain transformers;
    with `episodes`, tool-calling episodes with a local calculator in place of the
    environment service (rlserve.core.embedded.tool_task)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlserve.core.embedded.evaluate import greedy_accuracy
    from rlserve.core.embedded.task import read_jsonl
    from rlserve.core.embedded.tool_task import episode_accuracy

    rows = read_jsonl(Path(inputs["eval_path"]))
    scores = []
    for model_dir in (Path(inputs["model_dir"]), Path(checkpoint) / "rollout" / "model"):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        if episodes:
            scores.append(episode_accuracy(model, tokenizer, rows, AGENT_MAX_NEW_TOKENS))
        else:
            scores.append(greedy_accuracy(model, tokenizer, rows, max_new_tokens=4))
    return scores[0], scores[1]


def report(algorithm: str, results: list[dict]) -> None:
    pct = lambda value: "—" if value is None else f"{100 * value:.1f}%"  # noqa: E731
    print(f"\n{algorithm}: held-out accuracy per seed (services: 500 pairs; independent: all)")
    print(
        "| seed | warm-up steps | warm-up acc | before | after | gain | RL s to +20 | whole s "
        "| independent before → after (gain) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        gain = 100 * (r["after"] - r["before"])
        low, high = r["independent"]
        to_gain = "—" if r["rl_s_to_gain"] is None else f"{r['rl_s_to_gain']:.0f}"
        print(
            f"| {r['seed']} | {r['warmup_steps']} | {pct(r['warmup_accuracy'])} "
            f"| {pct(r['before'])} | {pct(r['after'])} | {gain:+.1f} | {to_gain} "
            f"| {r['whole_s']:.0f} | {pct(low)} → {pct(high)} ({100 * (high - low):+.1f}) |"
        )
    gains = [100 * (r["after"] - r["before"]) for r in results]
    print(f"gain: min {min(gains):+.1f}, median {statistics.median(gains):+.1f} points")
    for r in results:
        curve = " ".join(f"{step}:{100 * accuracy:.1f}" for step, accuracy in r["curve"])
        print(f"seed {r['seed']} held-out accuracy by step: {curve}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--algorithm", choices=sorted(ALGORITHM_CONFIGS), default="ppo")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_learning_"))
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, args.algorithm, args.overrides, work))
        report(args.algorithm, results)  # so far, in case a later seed fails


if __name__ == "__main__":
    main()
