"""One AdamW step on a real model's parameters, per torch kernel: time and peak memory.

What `rlserve.core.training.adamw` picks on the CPU. The parameters have
SmolLM2-135M's shapes (random weights, random gradients: the step's cost depends on
the shapes only); each kernel runs in its own process, so that process's peak RSS is
the kernel's own. Kernels: `loop` (foreach=False, one tensor at a time), `foreach`
(multi-tensor) and `fused` (one pass per tensor in C++).

    .venv/bin/python benchmarks/bench_optimizer_step.py                 # 2 threads, 10 steps
    .venv/bin/python benchmarks/bench_optimizer_step.py --threads 1 --steps 20

Prints one row per kernel: median and min seconds per step, and the peak RSS its steps
added above the loop's own peak (parameters, gradients, moments and one tensor's
temporaries).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

KERNELS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def measure(kernel: str, threads: int, steps: int) -> dict:
    """Runs in the child: `steps` AdamW steps with `kernel`; seconds and peak memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    parameters = [p for p in model.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter) * 1e-3
    # The first step, by the loop, allocates the moments (state every kernel holds
    # alike) with one tensor's temporaries; then the kernel under test takes over.
    optimizer = torch.optim.AdamW(parameters, lr=1e-5, weight_decay=0.0, foreach=False)
    optimizer.step()
    optimizer.param_groups[0].update({"foreach": False, "fused": False, **KERNELS[kernel]})
    settled_mib = _rss_mib()
    peak_before_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "kernel": kernel,
        "parameters": sum(p.numel() for p in parameters),
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        # ru_maxrss never falls: growth past both the settled RSS and any earlier peak
        "peak_added_mib": max(0.0, peak_mib - max(settled_mib, peak_before_mib)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--child", choices=list(KERNELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.threads, args.steps)))
        return
    rows = []
    for kernel in args.kernels:
        child = [sys.executable, __file__, "--child", kernel]
        child += ["--threads", str(args.threads), "--steps", str(args.steps)]
        completed = subprocess.run(child, capture_output=True, text=True, check=True)
        rows.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    print(f"AdamW on {rows[0]['parameters'] / 1e6:.1f} M parameters, {args.threads} threads")
    print(f"{'kernel':<8} {'median s':>9} {'min s':>7} {'peak added MiB':>15}")
    for row in rows:
        print(
            f"{row['kernel']:<8} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{row['peak_added_mib']:>15.0f}"
        )


if __name__ == "__main__":
    main()
