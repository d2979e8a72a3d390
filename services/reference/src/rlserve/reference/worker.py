"""One data-parallel rank of the reference: a frozen causal LM scoring responses.

The model is loaded once, put in eval mode with every parameter frozen, and only ever
runs under `torch.no_grad()`: no optimizer, no gradients, no state that changes. Log-probs
come from rlserve.core.response_scoring (`score_responses`), the same function the
rollout service uses for ComputeLogProb, so before any actor update the two
agree by construction (an integration test checks it through both services).

Used as a Ray actor by WorkerGroup, and in-process by unit tests. Its ranks join no
process group and never start DeepSpeed: a forward needs no collective, each rank scores
its own rows, and a group would only cost an NCCL communicator (GPU memory) per rank.
"""

from typing import Any

import torch

from rlserve.core import tracing
from rlserve.core.batch import Batch
from rlserve.core.modeling import load_causal_lm
from rlserve.core.process_group import node_ip
from rlserve.core.rank_worker import RankSetup, RankWorker
from rlserve.core.response_scoring import forward_micro_batches, score_responses
from rlserve.core.serving import until_deadline


class ReferenceWorker(RankWorker):
    """Frozen policy copy of one rank."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        setup: RankSetup,
        forward_micro_batch_samples: int,
        logits_chunk_tokens: int | None = None,
    ):
        super().__init__(rank, world_size, setup)
        self.forward_micro_batch_samples = forward_micro_batch_samples
        self.logits_chunk_tokens = logits_chunk_tokens
        self.model = load_causal_lm(setup.model_path, self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)

    def node_address(self) -> tuple[str, int]:
        """No rendezvous to host: the ranks join no group (port 0)."""
        return node_ip(), 0

    def init_distributed(self, address: str, port: int) -> None:
        """Nothing to join: scoring is rank-local (see the module doc)."""

    def info(self) -> dict[str, Any]:
        """Rank, placement and model facts for GetInfo and request validation."""
        return {**super().info(), "vocab_size": self.model.config.get_text_config().vocab_size}

    @torch.no_grad()
    def compute_ref_log_prob(
        self, batch: Batch, temperature: float = 1.0, deadline: float | None = None
    ) -> Batch:
        """ref_log_probs [n, R] float32 (0 outside response_mask), in micro-batches.

        Log-probs are taken under softmax(logits / temperature), as the rollout sampled.
        Raises DEADLINE_EXCEEDED between micro-batches once `deadline` (Unix seconds) has
        passed.
        """
        self.use_threads("forward")
        response_len = batch.tensors["responses"].shape[1]
        chunks = []
        micro_batches = forward_micro_batches(
            batch, self.forward_micro_batch_samples, self.forward_max_tokens
        )
        for micro in until_deadline(micro_batches, deadline, "ComputeRefLogProb"):
            micro = micro.to(self.device)
            with tracing.span("reference.forward", batch_size=len(micro)):
                scores = score_responses(
                    self.model,
                    micro.tensors["input_ids"],
                    micro.tensors["attention_mask"],
                    micro.tensors["responses"],
                    micro.tensors["response_mask"],
                    temperature,
                    chunk_tokens=self.logits_chunk_tokens,
                )
                chunks.append(scores.log_probs.cpu())
        log_probs = torch.cat(chunks) if chunks else torch.zeros(0, response_len)
        return Batch(tensors={"ref_log_probs": log_probs})
