"""Rewards per second of each reward kind, measured through the engine (no Ray, no gRPC).

    .venv/bin/python -m benchmarks.bench_reward [--serve]

- rule: `arithmetic_exact_match` and `gsm8k` over 4096 samples.
- model: a tiny Llama reward model (hidden 128, 4 layers, the embedded default's size)
  on 256 sequences of ≈ 20 tokens, torch threads 1 (the replica default) and 2.
- http: a local stdlib HTTP server that answers after 50 ms, 256 samples, at several
  max_concurrency bounds; prints the sequential equivalent (256 × 50 ms) next to the
  measured time.
- --serve also starts a private local Ray + Serve and measures rule-kind calls through
  the gRPC proxy (the per-call cost a trainer sees), then shuts it down.

Each figure is the best of `--repeats` runs after one warm-up run: the machine is shared,
so the best run is the least disturbed one.
"""

import argparse
import asyncio
import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from rlserve.core.batch import Batch
from rlserve.core.cluster import free_port
from rlserve.core.config import validate_config
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.engine import build_engine

API_DELAY_S = 0.05


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


class _SlowScoreHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; without this, Nagle + delayed ACK add 40 ms.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(API_DELAY_S)
        body = json.dumps({"score": float(len(payload["response_text"]))}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        pass


def _best_rate(engine, batch: Batch, repeats: int) -> tuple[float, float]:
    """(best seconds per batch, rewards per second) over `repeats` runs after a warm-up."""

    async def run() -> list[float]:
        inputs = engine.parse(batch)
        times = []
        for _ in range(repeats + 1):
            start_s = time.perf_counter()
            await engine.score(inputs)
            times.append(time.perf_counter() - start_s)
        await engine.close()
        return times[1:]

    best_s = min(asyncio.run(run()))
    return best_s, len(batch) / best_s


def _engine(kinds: dict, **config):
    return build_engine(validate_config(RewardServiceConfig, {"kinds": kinds, **config}))


def bench_rules(repeats: int) -> None:
    n = 4096
    texts = [f"step {i}... #### {i * 7:,}" for i in range(n)]
    truths = [str(i * 7) for i in range(n)]
    for rule in ("arithmetic_exact_match", "gsm8k"):
        batch = Batch(non_tensors={"response_text": texts, "ground_truth": truths})
        best_s, rate = _best_rate(_engine({"rule": {"rule_name": rule}}), batch, repeats)
        print(f"rule {rule:<24} {n} samples  {best_s * 1e3:8.1f} ms  {rate:>10,.0f} rewards/s")


def _save_tiny_reward_model(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlserve.core.embedded.tokenizer import save_char_tokenizer

    tokenizer = save_char_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(directory)


def bench_model(repeats: int) -> None:
    n, prompt_len, response_len = 256, 12, 8
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 99, (n, prompt_len + response_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    # Ragged like real batches: left padding of 0..3, right padding of 0..3.
    for row in range(n):
        attention_mask[row, : row % 4] = 0
        attention_mask[row, prompt_len + response_len - (row // 4) % 4 :] = 0
    input_ids = input_ids * attention_mask
    batch = Batch(tensors={"input_ids": input_ids, "attention_mask": attention_mask})
    with tempfile.TemporaryDirectory() as directory:
        _save_tiny_reward_model(Path(directory))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            engine = _engine({"model": {"model_path": directory, "micro_batch_samples": 64}})
            best_s, rate = _best_rate(engine, batch, repeats)
            print(
                f"model tiny llama h128 l4, {threads} thread(s)  {n} x {input_ids.shape[1]} tokens"
                f"  {best_s * 1e3:8.1f} ms  {rate:>10,.0f} rewards/s"
            )


def bench_http(repeats: int) -> None:
    port = free_port()
    server = _Server(("127.0.0.1", port), _SlowScoreHandler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    n = 256
    batch = Batch(non_tensors={"response_text": [f"r{i}" for i in range(n)]})
    try:
        for concurrency in (1, 8, 32, 64, 128):
            if concurrency == 1:
                batch_1 = Batch(non_tensors={"response_text": [f"r{i}" for i in range(16)]})
                engine = _engine(
                    {"http": {"url": f"http://127.0.0.1:{port}/", "max_concurrency": 1}}
                )
                best_s, rate = _best_rate(engine, batch_1, 1)
                samples = 16
            else:
                engine = _engine(
                    {"http": {"url": f"http://127.0.0.1:{port}/", "max_concurrency": concurrency}}
                )
                best_s, rate = _best_rate(engine, batch, repeats)
                samples = n
            sequential_s = samples * API_DELAY_S
            print(
                f"http 50 ms API, max_concurrency {concurrency:>3}  {samples} samples"
                f"  {best_s * 1e3:8.1f} ms (sequential {sequential_s * 1e3:7.0f} ms,"
                f" x{sequential_s / best_s:5.1f})  {rate:>8,.0f} rewards/s"
            )
    finally:
        server.shutdown()
        server.server_close()


def bench_serve(repeats: int) -> None:
    """Rule kind through Serve's gRPC proxy on a private local Ray."""
    import ray
    from ray import serve

    from benchmarks.tiny_sequences import start_cluster
    from rlserve.core.codec import batch_to_proto
    from rlserve.core.rpc import call_metadata
    from rlserve.reward.app import build_app
    from rlserve.v1 import reward_pb2, reward_pb2_grpc

    grpc_port = start_cluster(Path(tempfile.mkdtemp(prefix="rlbench")), num_cpus=4)
    try:
        import grpc

        serve.run(
            build_app({"kinds": {"rule": {"rule_name": "gsm8k"}}}),
            name="reward-bench",
            route_prefix="/reward-bench",
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for n in (1, 256, 4096):
            batch = Batch(
                non_tensors={
                    "response_text": [f"#### {i}" for i in range(n)],
                    "ground_truth": [str(i) for i in range(n)],
                }
            )
            request = reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch))
            times = []
            for _ in range(repeats + 1):
                start_s = time.perf_counter()
                stub.ComputeReward(request, metadata=call_metadata("reward-bench"), timeout=60)
                times.append(time.perf_counter() - start_s)
            best_s = min(times[1:])
            print(
                f"serve gRPC, rule gsm8k  {n:>5} samples/call  {best_s * 1e3:8.1f} ms/call"
                f"  {n / best_s:>10,.0f} rewards/s"
            )
        channel.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", action="store_true", help="also measure through Serve")
    args = parser.parse_args()
    bench_rules(args.repeats)
    bench_model(args.repeats)
    bench_http(args.repeats)
    if args.serve:
        bench_serve(args.repeats)


if __name__ == "__main__":
    main()
