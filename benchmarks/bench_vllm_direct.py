"""vLLM called directly: the baseline for "vLLM inside the rollout service".

`bench_direct(model_path, prompts, sampling)` builds the vllm engine's `LLM` (same
settings as the service: in-process, eager, explicit KV cache) and times
`LLM.generate` on token-id prompts with the SamplingParams the engine would use: no
engine wrapper, no Ray, no Serve. bench_rollout.py is meant to call it next to the
service, so both numbers come from one run. Run alone, it prints, for a stated tiny
config, vLLM direct, the vllm engine wrapper (generate -> Generated) and the 'hf' engine:

    .venv/bin/python -m benchmarks.bench_vllm_direct [--prompts 64]

tokens/s counts generated tokens (ignore_eos, so each response is max_new_tokens
long) over the median wall time of `repeats` calls after one warm-up call; tokens per
CPU-second (this process, all threads) is printed too, because wall time on a shared
machine moves with other people's jobs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.tiny_sequences import bench_sampling, build_model
from rlserve.core.embedded.task import addition_rows
from rlserve.rollout.generation import SamplingSettings


@dataclass(frozen=True)
class Timing:
    tokens: int
    """Generated tokens per call."""
    wall_s: float
    """Median wall seconds per call."""
    cpu_s: float
    """Median CPU seconds per call (all threads of this process): less sensitive than
    wall time to other jobs on a shared machine."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


def timed(call: Callable[[], int], repeats: int) -> Timing:
    """Medians of `repeats` calls after one warm-up call; `call` returns its token count."""
    tokens = call()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return Timing(tokens, statistics.median(walls), statistics.median(cpus))


def time_direct(
    model_path: str | Path,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    repeats: int = 3,
    dtype: str = "float32",
) -> Timing:
    """vLLM's `LLM.generate` called directly on token-id prompts, built and sampled with
    the vllm engine's settings (so only the engine's wrapper is left out)."""
    from vllm.inputs import TokensPrompt

    from rlserve.rollout.vllm_engine import VLLMGenerationEngine, vllm_sampling_params

    llm = VLLMGenerationEngine(str(model_path), dtype, seed=0).llm
    requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
    params = [vllm_sampling_params(sampling, row) for row in range(len(prompts))]

    def call() -> int:
        outputs = llm.generate(requests, params, use_tqdm=False)
        return sum(len(c.token_ids) for output in outputs for c in output.outputs)

    return timed(call, repeats)


def bench_direct(
    model_path: str | Path,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    repeats: int = 3,
    dtype: str = "float32",
) -> float:
    """Generated tokens/s (wall) of vLLM's `LLM.generate` called directly on `prompts`."""
    return time_direct(model_path, prompts, sampling, repeats, dtype).tokens_per_s


def time_engine(
    engine_name: str,
    model_path: str | Path,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    repeats: int = 3,
) -> Timing:
    """A rollout generation engine's `generate`, in this process."""
    from rlserve.rollout.worker import make_generation_engine

    engine = make_generation_engine(engine_name, str(model_path), "float32", 0)
    return timed(lambda: sum(map(len, engine.generate(prompts, sampling).response_ids)), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--responses-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    # 1 = the service's default (torch_threads_per_worker). On the 2 shared cores here, 2
    # threads made both engines erratic (spinning OpenMP workers fight other jobs).
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="vllm_bench") as directory:
        model_dir = Path(directory)
        tokenizer = build_model(model_dir)
        rows, _ = addition_rows(operand_max=99, train_pairs=args.prompts, eval_pairs=0, seed=0)
        prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
        sampling = bench_sampling(args.max_new_tokens, args.responses_per_prompt)
        samples = args.prompts * args.responses_per_prompt
        print(
            f"tiny Llama (hidden 128, 4 layers, 4 heads, fp32), {args.prompts} prompts × "
            f"{args.responses_per_prompt} samples × {args.max_new_tokens} new tokens "
            f"= {samples * args.max_new_tokens} tokens per call, temperature 1"
        )
        results = {
            "vllm direct (LLM.generate)": time_direct(model_dir, prompts, sampling, args.repeats),
            "vllm engine (generate)": time_engine(
                "vllm", model_dir, prompts, sampling, args.repeats
            ),
            "hf engine (generate)": time_engine("hf", model_dir, prompts, sampling, args.repeats),
        }
    for name, timing in results.items():
        print(
            f"  {name:28s} {timing.tokens_per_s:>10,.0f} tokens/s   "
            f"{timing.tokens_per_cpu_s:>10,.0f} tokens/CPU-s   ({timing.wall_s:.3f} s)"
        )


if __name__ == "__main__":
    main()
