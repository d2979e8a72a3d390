"""What the per-service benchmarks share: a private local Ray with Serve, the embedded
default's tiny Llama on disk, a batch of random prompt ‖ response sequences and the
arguments that size it, the sampling they generate with, a timer."""

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlserve.core.batch import Batch


def start_cluster(work: Path, num_cpus: int = 8) -> int:
    """A private local Ray (its files under `work`) with Serve, the cluster token set as
    `rlserve train` sets it; returns Serve's gRPC port."""
    from rlserve.core import auth
    from rlserve.core.cluster import start_local_ray, start_serve_on_a_free_port

    os.environ.setdefault(auth.TOKEN_ENV, auth.generate_token())  # before Ray: replicas inherit it
    start_local_ray(num_cpus=num_cpus, temp_dir=work / "ray")
    return start_serve_on_a_free_port()


def build_model(directory: Path) -> Any:
    """Saves the embedded default's tiny Llama (hidden 128, 4 layers, head size 32, which
    vLLM's CPU attention supports) and its character tokenizer in `directory`; returns
    the tokenizer."""
    from rlserve.core.embedded.model import build_tiny_llama, save_model
    from rlserve.core.embedded.tokenizer import save_char_tokenizer

    tokenizer = save_char_tokenizer(directory)
    save_model(build_tiny_llama(tokenizer), directory)
    return tokenizer


def add_sequence_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of a benchmark over `make_batch` sequences on a deployed service."""
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)


def bench_sampling(max_new_tokens: int, responses_per_prompt: int) -> Any:
    """The rollout benchmarks' sampling: plain temperature 1, every response
    `max_new_tokens` long (EOS ignored), seed 0."""
    from rlserve.rollout.generation import SamplingSettings

    return SamplingSettings(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        responses_per_prompt=responses_per_prompt,
        seed=0,
        ignore_eos=True,
        return_log_probs=False,
    )


def make_batch(rows: int, prompt_len: int, response_len: int, vocab_size: int) -> Batch:
    """`rows` sequences of random tokens, every position real, with critic targets."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab_size, (rows, prompt_len + response_len), generator=generator)
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "responses": input_ids[:, prompt_len:].clone(),
            "response_mask": torch.ones(rows, response_len, dtype=torch.long),
            "values": torch.zeros(rows, response_len),
            "returns": torch.randn(rows, response_len, generator=generator),
        }
    )


def timed(call: Callable[[], object]) -> float:
    """Wall seconds of one `call()`."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start
