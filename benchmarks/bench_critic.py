"""Throughput of the critic service through Serve's gRPC port, on a private local Ray.

Builds the embedded default's tiny Llama (hidden 128, 4 layers, character tokenizer),
deploys the critic from it, and times ComputeValues and UpdateCritic on one batch of
`--rows` sequences (prompt `--prompt-len`, response `--response-len`, every response
token real). Prints the median of `--repeats` calls after one warm-up call:

    values/s       response tokens valued per second by ComputeValues (wall, client side)
    train tokens/s response tokens × ppo_epochs per second of UpdateCritic (wall)

Each line also gives sequence tokens/s (prompt + response positions the model runs over).

    .venv/bin/python -m benchmarks.bench_critic [--workers 2]
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.tiny_sequences import (
    add_sequence_args,
    build_model,
    make_batch,
    start_cluster,
    timed,
)
from rlserve.core.codec import batch_to_proto
from rlserve.core.rpc import call_metadata
from rlserve.core.serving import deadline_metadata
from rlserve.v1 import critic_pb2, critic_pb2_grpc

TIMEOUT_S = 600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sequence_args(parser)
    args = parser.parse_args()

    from ray import serve

    from rlserve.critic.app import build_app

    work = Path(tempfile.mkdtemp(prefix="rlbench"))
    vocab_size = len(build_model(work / "model"))
    grpc_port = start_cluster(work)
    config = {
        "model_path": str(work / "model"),
        "workers": args.workers,
        "num_cpus_per_worker": args.threads_per_worker,  # also each worker's torch threads
        "ppo_mini_batch_samples": 64,
        "micro_batch_samples": 64 // args.workers,
        "forward_micro_batch_samples": 64,
        "ppo_epochs": 2,
        "lr": 1e-3,
    }
    serve.run(build_app(config), name="critic", route_prefix="/critic")
    import grpc

    channel = grpc.insecure_channel(
        f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", 1 << 30)]
    )
    stub = critic_pb2_grpc.CriticServiceStub(channel)
    metadata = call_metadata("critic", deadline_metadata(TIMEOUT_S))
    batch = make_batch(args.rows, args.prompt_len, args.response_len, vocab_size)
    sequences = batch_to_proto(
        batch.select(["input_ids", "attention_mask", "responses", "response_mask"])
    )
    full = batch_to_proto(batch)
    tokens = args.rows * args.response_len
    sequence_tokens = args.rows * (args.prompt_len + args.response_len)

    def compute():
        stub.ComputeValues(
            critic_pb2.ComputeValuesRequest(batch=sequences), metadata=metadata, timeout=TIMEOUT_S
        )

    steps = iter(range(10**6))

    def update():
        stub.UpdateCritic(
            critic_pb2.UpdateCriticRequest(step=next(steps), batch=full),
            metadata=metadata,
            timeout=TIMEOUT_S,
        )

    compute()
    update()
    compute_s = statistics.median(timed(compute) for _ in range(args.repeats))
    update_s = statistics.median(timed(update) for _ in range(args.repeats))
    print(
        f"critic: tiny Llama (hidden 128, 4 layers), {args.workers} worker(s), "
        f"{args.threads_per_worker} torch thread(s) each, {args.rows} rows × "
        f"(prompt {args.prompt_len} + response {args.response_len}), mini-batch 64, "
        "2 epochs, fp32, ZeRO-0"
    )
    print(
        f"ComputeValues: {compute_s * 1000:.0f} ms/call, {tokens / compute_s:,.0f} values/s "
        f"({sequence_tokens / compute_s:,.0f} sequence tokens/s forward)"
    )
    print(
        f"UpdateCritic:  {update_s * 1000:.0f} ms/call, "
        f"{tokens * 2 / update_s:,.0f} train tokens/s (response tokens × epochs; "
        f"{sequence_tokens * 2 / update_s:,.0f} sequence tokens/s forward+backward)"
    )
    channel.close()
    serve.shutdown()
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
