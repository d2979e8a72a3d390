"""The honest baseline: one process, plain PyTorch + transformers, PPO on one workload.

No RPC, no Ray, no DeepSpeed: the policy, a frozen reference, a value model (the
policy's backbone + a zero-initialised linear head, as rlserve's critic) and a frozen
reward model (AutoModelForSequenceClassification) in this process, and the garbage
collector frozen after set-up. Each step: sample `--new-tokens` tokens per prompt (EOS
ignored), score the sequences with all four models, token rewards = score at the last
token − kl_coef · (log π_old − log π_ref), GAE (γ 1, λ 0.95, whitened advantages), then
one PPO epoch of one mini-batch for the actor (clip 0.2, token-mean) and the critic
(clipped value loss 0.2), AdamW, gradient clip 1.0.

benchmarks/bench_vs_single_process.py runs it beside `rlserve train` on the same
models and prompts; alone:

    .venv/bin/python benchmarks/single_process_ppo.py --model DIR --reward-model DIR \
        --prompts-file train.jsonl --steps 20

Prints one JSON line: step_s per step, and episodes_per_s, the CPU seconds per step, the
cores kept busy and the mean of each stage (generate, forwards, advantages, updates) over
the steps after the first `--skip-steps`.
"""

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def token_log_probs(model, ids, mask, response_len):
    """log π(token) of the last `response_len` tokens of each row."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -response_len - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -response_len:, None])[..., 0]


class ValueModel(torch.nn.Module):
    def __init__(self, causal_lm):
        super().__init__()
        self.backbone = causal_lm.model
        self.head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, ids, mask, response_len):
        hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        # the value of response token t is read at the position before it
        return self.head(hidden[:, -response_len - 1 : -1]).squeeze(-1).float()


def gae(rewards, values, gamma=1.0, lam=0.95):
    advantages, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    returns = advantages + values
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8), returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--reward-model", required=True)
    parser.add_argument("--prompts-file", required=True, help="jsonl with a 'prompt' key")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-steps", type=int, default=2, help="warm-up steps not counted")
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--actor-lr", type=float, default=2e-4)
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    reference = AutoModelForCausalLM.from_pretrained(args.model).eval().requires_grad_(False)
    critic = ValueModel(AutoModelForCausalLM.from_pretrained(args.model))
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model)
    reward_model.eval().requires_grad_(False)
    actor_opt = torch.optim.AdamW(policy.parameters(), lr=args.actor_lr, foreach=False)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, foreach=False)
    with open(args.prompts_file) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    n, r = args.prompts_per_step, args.new_tokens
    gc.collect()
    gc.freeze()  # what TRL's users do: the collector's pauses otherwise dominate

    step_times, stage_times, cpu_times = [], [], []
    for step in range(args.steps):
        started = time.perf_counter()
        cpu_started = time.process_time()
        batch = prompts[step * n % len(prompts) :][:n]
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        policy.eval()
        with torch.no_grad():
            ids = policy.generate(
                **enc,
                do_sample=True,
                top_k=0,
                max_new_tokens=r,
                min_new_tokens=r,
                pad_token_id=tokenizer.pad_token_id,
            )
            generated = time.perf_counter()
            mask = torch.cat([enc.attention_mask, torch.ones(len(ids), r, dtype=torch.long)], 1)
            old_logp = token_log_probs(policy, ids, mask, r)
            ref_logp = token_log_probs(reference, ids, mask, r)
            critic.eval()
            old_values = critic(ids, mask, r)
            score = reward_model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        scored = time.perf_counter()
        rewards = -args.kl_coef * (old_logp - ref_logp)
        rewards[:, -1] += score
        advantages, returns = gae(rewards, old_values)

        estimated = time.perf_counter()
        policy.train()
        logp = token_log_probs(policy, ids, mask, r)
        ratio = torch.exp(logp - old_logp)
        clipped = torch.clamp(ratio, 0.8, 1.2)
        actor_loss = torch.max(-advantages * ratio, -advantages * clipped).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        actor_opt.step()

        critic.train()
        values = critic(ids, mask, r)
        values_clipped = old_values + torch.clamp(values - old_values, -0.2, 0.2)
        value_loss = (
            0.5
            * torch.max(
                F.mse_loss(values, returns, reduction="none"),
                F.mse_loss(values_clipped, returns, reduction="none"),
            ).mean()
        )
        critic_opt.zero_grad()
        value_loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        critic_opt.step()
        step_times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
        stage_times.append(
            {
                "generate": generated - started,
                "forwards": scored - generated,
                "advantages": estimated - scored,
                "updates": step_times[-1] - (estimated - started),
            }
        )

    counted = step_times[args.skip_steps :]
    print(
        json.dumps(
            {
                "step_s": [round(t, 4) for t in step_times],
                "mean_step_s": statistics.fmean(counted),
                "stages_s": {
                    stage: statistics.fmean(t[stage] for t in stage_times[args.skip_steps :])
                    for stage in stage_times[0]
                },
                "episodes_per_s": n / statistics.fmean(counted),
                "torch_threads": torch.get_num_threads(),
                "cpu_s_per_step": statistics.fmean(cpu_times[args.skip_steps :]),
                # CPU seconds of all its threads per wall second: the cores it keeps busy
                "busy_cores": sum(cpu_times[args.skip_steps :]) / sum(counted),
                "machine_cores": len(os.sched_getaffinity(0)),
            }
        )
    )


if __name__ == "__main__":
    main()
