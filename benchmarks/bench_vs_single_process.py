"""rlserve against a single-process PPO on one small workload, interleaved in one run.

The workload: the embedded tiny Llama (hidden 128, 4 layers) with random weights, 64
prompts "a+b=" per step, 1 response each of exactly 8 new tokens, 1 PPO epoch of one
mini-batch for actor and critic, GAE, a fixed KL penalty 0.05 in the reward, a frozen
random reward model of the policy's shape, 20 steps, no warm-up, evaluation or
checkpoints. The baseline is benchmarks/single_process_ppo.py (plain PyTorch +
transformers, collector frozen). Each round runs the baseline, then `rlserve train`
once per rollout mode (`--modes`, default both: sync and one_step_off), on the same
model, reward model and prompts; steady state = the steps after the first
`--skip-steps`.

    .venv/bin/python benchmarks/bench_vs_single_process.py --rounds 2
    .venv/bin/python benchmarks/bench_vs_single_process.py --modes sync -- actor.workers=2
    .venv/bin/python benchmarks/bench_vs_single_process.py --cluster deployed --rounds 10 \
        --modes sync

`--cluster new` (default): each rlserve run starts its own local cluster, as `make demo`
does, so a round lasts ≈ 1.5 min. `--cluster deployed`: one Ray head for the whole
benchmark (deploy/ray/start-head.sh, with the environment `rlserve train` gives its own
local cluster), services deployed by a first run that is not counted, each later run
resetting and reusing them (≈ 7 s to its first step), so a round lasts ≈ 30 s and the
baseline and rlserve run seconds apart. The baseline then shares the machine with the idle
services and Ray's processes (it kept 1.80-1.85 of 2 cores busy, against 1.97-1.98
alone), which raises its CPU seconds per step and flatters rlserve's ratio: use
`deployed` to follow rlserve's own split by process quickly, `new` for the ratio.

Prints per round: episodes/s of each, rlserve's step split (generate = waiting for the
step's batch, forwards, updates), its start-up (the command's process start to its first
step, with the phases) and the whole command's time; the cores each kept busy; CPU
seconds per step: the baseline's own process's, rlserve's processes' (each worker, each
service's replica, the trainer, Ray and Serve's own processes, from /proc/PID/stat over
its counted steps, split by process; the whole machine's from /proc/stat beside it) and
their ratio in that round; then the medians, rlserve / baseline per mode, CPU seconds per
step against the baseline's (the ratio of the medians and the median of the rounds'
ratios), one_step_off / sync, and the ceiling: the baseline's work run again with one
torch thread measures its CPU seconds per step without intra-op threading; that work
spread over every core without overhead is the fastest any split of it (services,
pipelining) could run here. That one-thread figure is a floor no parallel run reaches on
these machines: a process's CPU seconds for the same work grow by a third while another
process keeps the other core busy (the same ActorWorker steps, in-process: 0.067 CPU s
per generate alone, 0.092 with a second copy running; the baseline itself spends ≈ 1.25x
its one-thread CPU seconds on 2 threads).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from ray_head import start_head, stop_head
from sampling import MachineCpuSampler, ProcessCpuSampler
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlserve.core import auth
from rlserve.core.cluster import apply_ray_env_defaults, free_port
from rlserve.core.embedded.prepare import prepare_embedded_default
from rlserve.core.inputs_config import ArithmeticTaskConfig, TinyModelConfig

HERE = Path(__file__).resolve().parent
STAGES = ("generate", "forward_wall", "advantages", "update_actor_waits_generation", "update_wall")


def prepare_workload(root: Path, seed: int) -> tuple[Path, Path]:
    """The policy (random tiny Llama + its tokenizer and prompts) and a random reward model."""
    built = prepare_embedded_default(
        root / "embedded",
        tiny=TinyModelConfig(sft_max_steps=0, sft_target_accuracy=None),
        task=ArithmeticTaskConfig(),
        seed=seed,
        max_new_tokens=8,
        eval_prompts=500,
    )
    config = AutoConfig.from_pretrained(built.model_dir)
    config.num_labels = 1
    torch.manual_seed(seed + 1)
    reward_model = AutoModelForSequenceClassification.from_config(config)
    reward_dir = root / "reward_model"
    reward_model.save_pretrained(reward_dir)
    AutoTokenizer.from_pretrained(built.model_dir).save_pretrained(reward_dir)
    return built.model_dir, reward_dir


def run_baseline(
    model_dir: Path, reward_dir: Path, prompts: Path, args, threads: int | None = None
) -> dict:
    command = [
        sys.executable,
        str(HERE / "single_process_ppo.py"),
        f"--model={model_dir}",
        f"--reward-model={reward_dir}",
        f"--prompts-file={prompts}",
        f"--steps={args.steps}",
        f"--skip-steps={args.skip_steps}",
        *([f"--threads={threads}"] if threads else []),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def workload_overrides(model_dir: Path, reward_dir: Path, prompts: Path, steps: int) -> list[str]:
    """`rlserve train` overrides for the workload above (run_dir and mode not included)."""
    return [
        f"model.path={model_dir}",
        f"data.train_path={prompts}",
        "reward.kinds.rule=null",
        f"reward.kinds.model.model_path={reward_dir}",
        "trainer.prompts_per_step=64",
        "rollout.responses_per_prompt=1",
        "rollout.max_new_tokens=8",
        "rollout.ignore_eos=true",
        "rollout.eval_every_steps=0",
        "actor.ppo_epochs=1",
        "actor.ppo_mini_batch_prompts=64",
        "critic.ppo_epochs=1",
        "critic.ppo_mini_batch_prompts=64",
        "algorithm.kl_ctrl.kl_coef=0.05",
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_every_steps=0",
    ]


def train_once(
    overrides: list[str], run_parent: Path, env: dict[str, str] | None = None
) -> tuple[Path, float]:
    """One `rlserve train` under `run_parent`: its run directory (the newest there: runs
    on deployed services share the parent they were deployed with) and the command's
    seconds; its stderr in the error when it fails."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "rlserve.trainer.cli", "train", *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,  # on a running cluster: every replica's log lines too
        text=True,
        env=env,
    )
    command_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"rlserve train failed ({done.returncode}):\n{done.stderr[-5000:]}")
    run_dir = max((p for p in run_parent.iterdir() if p.is_dir()), key=lambda p: p.name)
    return run_dir, command_s


def run_rlserve(
    model_dir: Path,
    reward_dir: Path,
    prompts: Path,
    run_parent: Path,
    mode: str,
    args,
    cpu: MachineCpuSampler,
    processes: ProcessCpuSampler,
    cluster: list[str],
    env: dict[str, str] | None = None,
) -> dict:
    overrides = [
        *workload_overrides(model_dir, reward_dir, prompts, args.steps),
        f"trainer.run_dir={run_parent}",
        f"rollout.mode={mode}",
        *cluster,
        *args.overrides,
    ]
    run_dir, command_s = train_once(overrides, run_parent, env)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [r for r in records if "time/step_s" in r]
    counted = steps[args.skip_steps :]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in counted if key in r)

    step_s = mean("time/step_s")
    summary = json.loads((run_dir / "summary.json").read_text())
    # the steps ran back to back from first_step_unix_s (no evaluation or checkpoint)
    step_times = [r["time/step_s"] for r in steps]
    counted_start = summary["first_step_unix_s"] + sum(step_times[: args.skip_steps])
    counted_end = summary["first_step_unix_s"] + sum(step_times)
    phases = summary["phases_s"]
    before_steps = list(phases)[: list(phases).index("ppo_steps")]
    busy_cores = cpu.busy_cores(counted_start, counted_end)
    by_role = {
        role: per_s * step_s
        for role, per_s in processes.cpu_s_by_role(counted_start, counted_end).items()
    }
    return {
        "episodes_per_s": 64 / step_s,
        "mean_step_s": step_s,
        "busy_cores": busy_cores,
        "machine_cpu_s_per_step": busy_cores * step_s,
        # rlserve's own processes, as the baseline's figure is its own process's
        "cpu_s_per_step": sum(by_role.values()),
        "cpu_s_per_step_by_role": by_role,
        "stages_s": {stage: mean(f"time/{stage}_s") for stage in STAGES},
        "command_s": command_s,
        "startup_s": summary["startup_s"],
        "startup_phases_s": {name: phases[name] for name in before_steps},
    }


@contextmanager
def rlserve_cluster(args, env: dict[str, str]) -> Iterator[list[str]]:
    """The `rlserve train` overrides that put each run on the cluster `--cluster` asks
    for: none for `new` (each run starts and stops its own); for `deployed`, a Ray head
    started here (deploy/ray/start-head.sh) that outlives the runs, whose first run
    deploys the services and the later ones reset and reuse them."""
    if args.cluster == "new":
        yield []
        return
    head, ray_port = start_head(Path(tempfile.mkdtemp(prefix="rlb", dir="/tmp")), env)
    try:
        yield [
            f"trainer.ray_address=127.0.0.1:{ray_port}",
            f"trainer.serve_grpc_port={free_port()}",
        ]
    finally:
        stop_head(head)


def describe_run(mode: str, mine: dict) -> str:
    stages = "  ".join(f"{k} {v:.3f}" for k, v in mine["stages_s"].items())
    startup = mine["startup_phases_s"]
    phases = "  ".join(f"{k} {v:.1f}" for k, v in startup.items() if "/" not in k)
    by_role = "  ".join(
        f"{role} {cpu_s:.3f}" for role, cpu_s in mine["cpu_s_per_step_by_role"].items()
    )
    return (
        f"  rlserve {mode} {mine['episodes_per_s']:6.1f} eps/s "
        f"({mine['mean_step_s']:.3f} s/step: {stages}); "
        f"{mine['cpu_s_per_step']:.3f} CPU s/step in its processes (the machine: "
        f"{mine['busy_cores']:.2f} cores busy = {mine['machine_cpu_s_per_step']:.3f})\n"
        f"    command start to first step {mine['startup_s']:.1f} s ({phases}); "
        f"whole command {mine['command_s']:.1f} s\n"
        f"    CPU s/step by process: {by_role}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes", nargs="+", choices=["sync", "one_step_off"], default=["sync", "one_step_off"]
    )
    parser.add_argument(
        "--cluster",
        choices=["new", "deployed"],
        default="new",
        help="new: each rlserve run starts its own cluster; deployed: one Ray head for the "
        "whole benchmark, services deployed by a first run (not counted) and reused",
    )
    parser.add_argument("overrides", nargs="*", help="extra section.field=value for rlserve")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-vs-single-"))
    model_dir, reward_dir = prepare_workload(root, args.seed)
    prompts = model_dir.parent / "data" / "train.jsonl"
    apply_ray_env_defaults(local=True)  # a deployed head runs as `rlserve train`'s own
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.setdefault(auth.TOKEN_ENV, auth.generate_token())
    baseline: list[dict] = []
    one_thread: list[dict] = []  # the same work, each operation on one core
    ours: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    cpu = MachineCpuSampler()
    processes = ProcessCpuSampler(period_s=0.5)
    with cpu.sampling(), processes.sampling(), rlserve_cluster(args, env) as cluster:
        if cluster:
            deploying = run_rlserve(
                model_dir,
                reward_dir,
                prompts,
                root / "runs",
                args.modes[0],
                args,
                cpu,
                processes,
                cluster,
                env,
            )
            print(f"services deployed (run not counted)\n{describe_run(args.modes[0], deploying)}")
        for round_index in range(args.rounds):
            baseline.append(run_baseline(model_dir, reward_dir, prompts, args))
            base = baseline[-1]
            base_stages = "  ".join(f"{k} {v:.3f}" for k, v in base["stages_s"].items())
            print(
                f"round {round_index}: single process {base['episodes_per_s']:6.1f} eps/s "
                f"({base['mean_step_s']:.3f} s/step: {base_stages}); "
                f"{base['cpu_s_per_step']:.3f} CPU s/step, "
                f"{base['busy_cores']:.2f} of {base['machine_cores']} cores busy",
                flush=True,
            )
            one_thread.append(run_baseline(model_dir, reward_dir, prompts, args, threads=1))
            print(
                f"  single process, 1 thread {one_thread[-1]['episodes_per_s']:6.1f} eps/s, "
                f"{one_thread[-1]['cpu_s_per_step']:.3f} CPU s/step",
                flush=True,
            )
            for mode in args.modes:
                run_parent = root / ("runs" if cluster else f"runs{round_index}_{mode}")
                mine = run_rlserve(
                    model_dir,
                    reward_dir,
                    prompts,
                    run_parent,
                    mode,
                    args,
                    cpu,
                    processes,
                    cluster,
                    env,
                )
                ours[mode].append(mine)
                print(
                    f"{describe_run(mode, mine)}\n    CPU s/step = "
                    f"{mine['cpu_s_per_step'] / base['cpu_s_per_step']:.2f}x this round's "
                    "single process",
                    flush=True,
                )
    base_eps = statistics.median(b["episodes_per_s"] for b in baseline)
    cores = baseline[0]["machine_cores"]
    work_cpu_s = statistics.median(b["cpu_s_per_step"] for b in one_thread)
    ceiling_eps = 64 / (work_cpu_s / cores)
    print(
        f"median of {args.rounds} rounds: single process {base_eps:.1f} eps/s "
        f"({statistics.median(b['busy_cores'] for b in baseline):.2f} of {cores} cores busy); "
        f"its work at one thread {work_cpu_s:.3f} CPU s/step, which spread over {cores} "
        f"cores with no idle core and no overhead would run {ceiling_eps:.1f} eps/s = "
        f"{ceiling_eps / base_eps:.2f}x the single process: the most any split of this "
        "work can gain on this machine"
    )
    medians = {
        mode: statistics.median(o["episodes_per_s"] for o in runs) for mode, runs in ours.items()
    }
    base_cpu_s = statistics.median(b["cpu_s_per_step"] for b in baseline)
    for mode, eps in medians.items():
        cpu_s = statistics.median(o["cpu_s_per_step"] for o in ours[mode])
        per_round = [
            o["cpu_s_per_step"] / b["cpu_s_per_step"]
            for o, b in zip(ours[mode], baseline, strict=True)
        ]
        print(
            f"  rlserve {mode} {eps:.1f} eps/s, rlserve / single process = {eps / base_eps:.2f}; "
            f"CPU s per step {cpu_s:.3f} = {cpu_s / base_cpu_s:.2f}x the single process's "
            f"{base_cpu_s:.3f} ({cpu_s / work_cpu_s:.2f}x its work at one thread); per round "
            f"{', '.join(f'{r:.2f}' for r in per_round)}x, median "
            f"{statistics.median(per_round):.2f}x"
        )
    if {"sync", "one_step_off"} <= set(medians):
        gain = medians["one_step_off"] / medians["sync"]
        print(f"  one_step_off / sync = {gain:.2f}")


if __name__ == "__main__":
    main()
