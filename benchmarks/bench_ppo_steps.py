"""PPO step throughput: episodes/s, tokens/s and where each step's time goes.

Runs `rlserve train` on the embedded default for N steps (or reads an existing run
directory) and prints the means over the steps after the first (warm-up excluded).

    .venv/bin/python benchmarks/bench_ppo_steps.py --steps 20          # new run
    .venv/bin/python benchmarks/bench_ppo_steps.py --run-dir runs/...  # existing run
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES = [
    "generate",
    "log_prob",
    "ref_log_prob",
    "values",
    "reward",
    "forward_wall",
    "advantages",
    "update_actor",
    "update_critic",
    "update_wall",
    "step",
]


def summarize(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [r for r in records if "reward_mean" in r][1:]
    if not steps:
        sys.exit(f"{run_dir}: fewer than two PPO steps recorded")

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steps if key in r)

    print(f"{run_dir}: {len(steps)} steps (first excluded), {mean('samples'):.0f} samples/step")
    print(f"  episodes/s {mean('episodes_per_s'):8.1f}")
    print(f"  tokens/s   {mean('tokens_per_s'):8.0f}  (prompt + response tokens)")
    step_s = mean("time/step_s")
    for stage in STAGES:
        key = f"time/{stage}_s"
        if any(key in r for r in steps):
            print(f"  {stage:<14}{mean(key):7.3f} s  ({100 * mean(key) / step_s:5.1f}% of step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--run-dir", type=Path, help="summarize this run instead")
    parser.add_argument("overrides", nargs="*", help="extra section.field=value")
    args = parser.parse_args()
    if args.run_dir:
        summarize(args.run_dir)
        return
    parent = Path(tempfile.mkdtemp(prefix="bench-ppo-"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlserve.trainer.cli",
            "train",
            f"trainer.total_steps={args.steps}",
            f"trainer.run_dir={parent}",
            "rollout.eval_every_steps=0",
            "trainer.checkpoint_every_steps=0",
            *args.overrides,
        ],
        check=True,
    )
    (run_dir,) = [p for p in parent.iterdir() if p.is_dir()]
    summarize(run_dir)


if __name__ == "__main__":
    main()
