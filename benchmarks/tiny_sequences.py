"""What the per-service benchmarks share: a private local Ray with Serve, the embedded
default's tiny Llama on disk, a batch of random prompt ‖ response sequences, a timer."""

import os
import time
from collections.abc import Callable
from pathlib import Path

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


def build_model(directory: Path) -> int:
    """Saves the embedded default's tiny Llama (hidden 128, 4 layers) and its character
    tokenizer in `directory`; returns the vocabulary size."""
    from rlserve.core.embedded.model import build_tiny_llama, save_model
    from rlserve.core.embedded.tokenizer import save_char_tokenizer

    tokenizer = save_char_tokenizer(directory)
    save_model(build_tiny_llama(tokenizer), directory)
    return len(tokenizer)


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
