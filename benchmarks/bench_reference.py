"""Throughput of the reference service through Serve's gRPC port, on a private local Ray.

Builds the embedded default's tiny Llama (hidden 128, 4 layers, character tokenizer),
deploys the reference from it, and times ComputeRefLogProb on one batch of `--rows`
sequences (prompt `--prompt-len`, response `--response-len`, every response token real).
Prints the median of `--repeats` calls after one warm-up call, as log-prob tokens/s
(response tokens scored per second, wall, client side) and sequence tokens/s (positions
the model runs over).

    .venv/bin/python -m benchmarks.bench_reference [--workers 2]
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
from rlserve.v1 import reference_pb2, reference_pb2_grpc

TIMEOUT_S = 600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sequence_args(parser)
    args = parser.parse_args()

    import grpc
    import ray
    from ray import serve

    from rlserve.reference.app import build_app

    work = Path(tempfile.mkdtemp(prefix="rlbench"))
    vocab_size = len(build_model(work / "model"))
    grpc_port = start_cluster(work)
    config = {
        "model_path": str(work / "model"),
        "workers": args.workers,
        "num_cpus_per_worker": args.threads_per_worker,  # also each worker's torch threads
        "forward_micro_batch_samples": 64,
    }
    serve.run(build_app(config), name="reference", route_prefix="/reference")
    channel = grpc.insecure_channel(
        f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", 1 << 30)]
    )
    stub = reference_pb2_grpc.ReferenceServiceStub(channel)
    batch = make_batch(args.rows, args.prompt_len, args.response_len, vocab_size)
    sequences = batch.select(["input_ids", "attention_mask", "responses", "response_mask"])
    request = reference_pb2.ComputeRefLogProbRequest(batch=batch_to_proto(sequences))

    def call() -> None:
        stub.ComputeRefLogProb(
            request,
            metadata=call_metadata("reference", deadline_metadata(TIMEOUT_S)),
            timeout=TIMEOUT_S,
        )

    call()
    seconds = statistics.median(timed(call) for _ in range(args.repeats))
    tokens = args.rows * args.response_len
    sequence_tokens = args.rows * (args.prompt_len + args.response_len)
    print(
        f"reference: tiny Llama (hidden 128, 4 layers), {args.workers} worker(s), "
        f"{args.threads_per_worker} torch thread(s) each, {args.rows} rows × "
        f"(prompt {args.prompt_len} + response {args.response_len}), micro-batch 64, fp32"
    )
    print(
        f"ComputeRefLogProb: {seconds * 1000:.0f} ms/call, {tokens / seconds:,.0f} log-prob "
        f"tokens/s ({sequence_tokens / seconds:,.0f} sequence tokens/s forward)"
    )
    channel.close()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
