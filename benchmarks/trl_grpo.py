"""TRL's GRPOTrainer on one bench_vs_trl workload, one process: the single-process baseline.

Runs in .trl-venv (tools/setup_trl.sh), never in rlserve's venv: TRL is no dependency of
rlserve. bench_vs_trl.py starts it; by hand:

    .trl-venv/bin/python benchmarks/trl_grpo.py --model-dir runs/models/smollm2-135m \\
        --data train.jsonl --prompts 8 --responses 4 --new-tokens 48 --lora-rank 8 --steps 4

Prints one JSON line per optimizer step: {"step", "step_s", "generate_s", "forward_s",
"update_s", "intervals"}. generate_s is TRL's sampling call, forward_s its no-grad
log-prob passes (the reference, and old log-probs when TRL needs them), update_s the rest
of the step (the training forward, backward and optimizer step, with rewards and
bookkeeping); intervals the unix times each stage ran between. The
workload is the one rlserve runs: the same model in fp32, the same chat prompts, exactly
`--new-tokens` new tokens, temperature 1, one optimizer step per generation, KL loss 0.04
(k3) against the base; TRL's own defaults otherwise (gradient checkpointing on), as a
new user would run it.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ANSWER = re.compile(r"####\s*(-?\d+)")


def exact_answer(completions, ground_truth, **_) -> list[float]:
    """1 when the '#### N' answer equals the ground truth (rlserve's gsm8k rule)."""
    scores = []
    for completion, truth in zip(completions, ground_truth, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = ANSWER.findall(text)
        scores.append(1.0 if found and found[-1] == truth else 0.0)
    return scores


class StageClock(TrainerCallback):
    """Per-step wall time, the seconds spent in the wrapped stages during it, and the
    unix times each stage ran between (first start, last end)."""

    def __init__(self):
        self.stages = {"generate_s": 0.0, "forward_s": 0.0}
        self.spans: dict[str, list[float]] = {}
        self.started = 0.0

    def wrap(self, owner, name: str, stage: str, only_without_grad: bool = False) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if only_without_grad and torch.is_grad_enabled():
                return inner(*args, **kwargs)
            started, started_unix = time.perf_counter(), time.time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.stages[stage] += time.perf_counter() - started
                span = self.spans.setdefault(stage, [started_unix, 0.0])
                span[1] = time.time()

        setattr(owner, name, timed)

    def on_step_begin(self, args, state, control, **kwargs):
        self.stages = dict.fromkeys(self.stages, 0.0)
        self.spans = {}
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step_s = time.perf_counter() - self.started
        update_s = step_s - sum(self.stages.values())
        last = max(end for _, end in self.spans.values())
        intervals = {
            "generate": self.spans["generate_s"],
            "forward": self.spans["forward_s"],
            "update": [last, time.time()],  # the training forward and backward come last
        }
        record = {
            "step": state.global_step,
            "step_s": step_s,
            **self.stages,
            "update_s": update_s,
            "intervals": intervals,
        }
        print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--data", required=True, help="jsonl: prompt (chat messages), ground_truth")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--lora-rank", type=int, default=8, help="0 trains the full weights")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="/tmp/trl_grpo")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    samples = args.prompts * args.responses
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.responses,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0,
        beta=0.04,
        learning_rate=1e-4,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
    )
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_rank, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    clock = StageClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_answer,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[clock],
    )
    clock.wrap(trainer, "_generate_single_turn", "generate_s")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "forward_s", only_without_grad=True)
    trainer.train()


if __name__ == "__main__":
    main()
