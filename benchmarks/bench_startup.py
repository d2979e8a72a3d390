"""From `rlserve train` to the first PPO step, three ways, with each phase.

1. new cluster: `rlserve train` alone (it starts a private Ray + Serve, deploys the four
   services, trains, tears everything down), the way `make demo` runs;
2. running cluster, first run: a Ray head started beforehand with
   deploy/ray/start-head.sh, the run deploys the services (they stay after it);
3. running cluster, services deployed: `--reuse-runs` more runs with the same settings;
   each finds the services an earlier run trained and resets them (Reset RPC) instead
   of deploying.

The workload is bench_vs_single_process's (tiny Llama with random weights, a random
reward model, 64 prompts per step), `--steps` steps each. A run's start-up is its
summary's `startup_s`: from the start of the command's process (interpreter, imports)
to the moment its first PPO step begins; the phases are the summary's.

    .venv/bin/python benchmarks/bench_startup.py
    .venv/bin/python benchmarks/bench_startup.py --reuse-runs 3 -- actor.workers=2

The head runs under a new process group and is stopped by signalling that group, so
another Ray on the machine is left alone; its ports are picked free.
"""

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_vs_single_process import prepare_workload, train_once, workload_overrides
from ray_head import start_head, stop_head
from sampling import MachineCpuSampler

from rlserve.core import auth
from rlserve.core.cluster import free_port


def run_train(
    overrides: list[str], run_parent: Path, env: dict[str, str], cpu: MachineCpuSampler
) -> dict:
    """One `rlserve train` under `run_parent`; its summary (the newest run there) and
    the CPU seconds the machine spent on its start-up."""
    run_dir, command_s = train_once(overrides, run_parent, env)
    summary = json.loads((run_dir / "summary.json").read_text())
    first_step = summary["first_step_unix_s"]
    startup_cpu_s = cpu.cpu_s(first_step - summary["startup_s"], first_step)
    return {**summary, "command_s": command_s, "startup_cpu_s": startup_cpu_s}


def describe(label: str, summary: dict) -> str:
    phases = summary["phases_s"]
    before_steps = list(phases)[: list(phases).index("ppo_steps")]
    split = "  ".join(f"{name} {phases[name]:.1f}" for name in before_steps if "/" not in name)
    cpu_s, cores = summary["startup_cpu_s"], os.cpu_count()
    return (
        f"{label}: command start to first step {summary['startup_s']:.1f} s ({split}); "
        f"whole command {summary['command_s']:.1f} s\n"
        f"  the machine's CPU time to the first step {cpu_s:.1f} s: at least "
        f"{cpu_s / cores:.1f} s on {cores} cores"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reuse-runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="extra section.field=value for rlserve")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    model_dir, reward_dir = prepare_workload(root, args.seed)
    prompts = model_dir.parent / "data" / "train.jsonl"
    base = [*workload_overrides(model_dir, reward_dir, prompts, args.steps), *args.overrides]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.setdefault(auth.TOKEN_ENV, auth.generate_token())

    cpu = MachineCpuSampler()
    with cpu.sampling():
        new_cluster = run_train([*base, f"trainer.run_dir={root / 'new'}"], root / "new", env, cpu)
        print(describe("new cluster", new_cluster), flush=True)

        # a short path: Ray's unix sockets live under it
        head, ray_port = start_head(Path(tempfile.mkdtemp(prefix="rlb", dir="/tmp")), env)
        try:
            on_cluster = [
                *base,
                f"trainer.run_dir={root / 'cluster'}",
                f"trainer.ray_address=127.0.0.1:{ray_port}",
                f"trainer.serve_grpc_port={free_port()}",
            ]
            first = run_train(on_cluster, root / "cluster", env, cpu)
            print(describe("running cluster, first run (deploys)", first), flush=True)
            reused = []
            for index in range(args.reuse_runs):
                reused.append(run_train(on_cluster, root / "cluster", env, cpu))
                print(describe(f"running cluster, run {index + 2} (reset)", reused[-1]), flush=True)
        finally:
            stop_head(head)
    if reused:
        median = statistics.median(r["startup_s"] for r in reused)
        print(
            f"median start-up on deployed services: {median:.1f} s "
            f"(new cluster {new_cluster['startup_s']:.1f} s, "
            f"{new_cluster['startup_s'] / median:.1f}x longer)"
        )


if __name__ == "__main__":
    main()
