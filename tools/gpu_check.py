"""The checks tools/gpu_check.sh runs on a CUDA machine (see there): greedy vLLM tokens
against the hf engine's, then PPO steps through the stack with GPU memory per process.

    .venv/bin/python tools/gpu_check.py [--steps 3] [--model-dir runs/models/smollm2-135m]
"""

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def greedy_tokens_agree(model_dir: Path, prompts: int, new_tokens: int) -> None:
    """Greedy responses of vLLM (CUDA) and transformers on the same GPU, token by token."""
    from rlserve.core.modeling import load_tokenizer
    from rlserve.rollout.generation import SamplingSettings
    from rlserve.rollout.hf_engine import HFGenerationEngine
    from rlserve.rollout.vllm_engine import VLLMGenerationEngine

    tokenizer = load_tokenizer(model_dir)
    questions = [
        f"What is {a}+{a + 3}? Reply with the number after '#### '." for a in range(prompts)
    ]
    prompt_ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in questions
    ]
    sampling = SamplingSettings(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=new_tokens,
        responses_per_prompt=1,
        seed=0,
        ignore_eos=False,
        return_log_probs=False,
    )
    hf = HFGenerationEngine(str(model_dir), "float32", torch.device("cuda", 0))
    started = time.perf_counter()
    hf_out = hf.generate(prompt_ids, sampling).response_ids
    hf_s = time.perf_counter() - started
    del hf
    torch.cuda.empty_cache()
    vllm = VLLMGenerationEngine(str(model_dir), "float32", kv_cache_gib=4.0, enforce_eager=False)
    started = time.perf_counter()
    vllm_out = vllm.generate(prompt_ids, sampling).response_ids
    vllm_s = time.perf_counter() - started
    same = sum(a == b for a, b in zip(hf_out, vllm_out, strict=True))
    tokens = sum(map(len, vllm_out))
    print(
        f"greedy: {same}/{len(prompt_ids)} responses token-identical (vLLM CUDA vs hf, fp32); "
        f"vLLM {tokens / vllm_s:.0f} tokens/s, hf {sum(map(len, hf_out)) / hf_s:.0f} tokens/s"
    )
    print(f"  sample: {tokenizer.decode(vllm_out[0])!r}")


def gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory per process, from nvidia-smi."""
    output = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    usage = {}
    for line in output.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        usage[int(pid)] = int(mib)
    return usage


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[:60]
    except OSError:
        return "?"


def ppo_steps_with_gpu_memory(steps: int, model_dir: Path) -> None:
    peak: dict[int, int] = {}
    names: dict[int, str] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            for pid, mib in gpu_memory_by_pid().items():
                peak[pid] = max(peak.get(pid, 0), mib)
                names.setdefault(pid, process_name(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    command = [
        sys.executable,
        str(REPO / "benchmarks/bench_real_model.py"),
        f"--model-dir={model_dir}",
        "--device=cuda",
        "--engines",
        "vllm",
        "hf",
        "--algorithms",
        "ppo",
        "grpo",
        f"--steps={steps}",
        "--no-fixed-cost",
    ]
    try:
        subprocess.run(command, check=True)
    finally:
        stop.set()
        sampler.join()
    print("peak GPU memory per process (MiB):")
    for pid, mib in sorted(peak.items(), key=lambda item: -item[1]):
        print(f"  {mib:7d}  pid {pid}  {names[pid]}")
    print(f"  total of peaks: {sum(peak.values())} MiB on {torch.cuda.get_device_name(0)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "runs/models/smollm2-135m")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA device visible (torch {torch.__version__}); run on a GPU machine")
    print(f"torch {torch.__version__} CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}")
    if not (args.model_dir / "config.json").exists():
        from rlserve.core.gguf_import import import_gguf, smollm2_gguf_path

        print(import_gguf(smollm2_gguf_path(), args.model_dir).summary())
    greedy_tokens_agree(args.model_dir, prompts=16, new_tokens=32)
    ppo_steps_with_gpu_memory(args.steps, args.model_dir)


if __name__ == "__main__":
    main()
