"""The configured policy loss is the one the actor trains with.

An in-process ActorWorker (DeepSpeed world size 1, gloo, no Ray, no gRPC) built from a
RolloutServiceConfig, as the service builds it. The batch is made deliberately stale
(old log-probs one nat below the current ones, so every ratio is e ≈ 2.7, far outside a
0.2 clip) with positive advantages: PPO's clip then silences every token, while CISPO,
whose clip only bounds a stop-gradient weight, still trains on all of them.
"""

import math

import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.cluster import free_port
from rlserve.core.process_group import init_process_group
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.generation import SamplingSettings
from rlserve.rollout.worker import ActorWorker, actor_worker_kwargs

SAMPLING = SamplingSettings(
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    max_new_tokens=3,
    responses_per_prompt=1,
    seed=5,
    ignore_eos=True,
    return_log_probs=False,
)


@pytest.fixture(scope="module")
def process_group():
    init_process_group(0, 1, "127.0.0.1", free_port())


def make_worker(model_dir, policy_loss: str, **settings) -> ActorWorker:
    config = RolloutServiceConfig(
        model_path=str(model_dir),
        ppo_mini_batch_samples=4,
        lr=1e-2,
        policy_loss=policy_loss,
        **({"micro_batch_samples": 2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2} | settings),
    )
    worker = ActorWorker(rank=0, world_size=1, **actor_worker_kwargs(config))
    worker.init_distributed("127.0.0.1", free_port())
    return worker


def stale_batch(worker: ActorWorker) -> Batch:
    """Four sampled responses, advantage 1 on every token, old log-probs 1 nat lower."""
    rows = [[1, 21, 15], [1, 23, 24], [1, 40, 41], [1, 50, 51]]
    prompts = Batch(
        {"input_ids": torch.tensor(rows), "attention_mask": torch.ones(4, 3, dtype=torch.long)}
    )
    batch = worker.generate(prompts, SAMPLING)
    log_probs = worker.compute_log_prob(batch)["log_probs"]
    mask = batch["response_mask"]
    keys = ("input_ids", "attention_mask", "responses", "response_mask")
    tensors = {key: batch[key] for key in keys}
    tensors["old_log_probs"] = torch.where(
        mask.bool(), log_probs - 1.0, torch.zeros_like(log_probs)
    )
    tensors["advantages"] = mask.float()
    return Batch(tensors)


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[key], after[key]) for key in before)


def test_ppo_clip_silences_stale_tokens_but_cispo_trains_on_them(process_group, tiny_model_dir):
    vanilla = make_worker(tiny_model_dir, "vanilla")
    batch = stale_batch(vanilla)
    before = vanilla.policy_weights()
    metrics = vanilla.update_actor(batch)
    # every ratio is e > 1.2 with A > 0: the clipped branch, no gradient, no step
    assert metrics["pg_clipfrac"] == pytest.approx(1.0)
    assert not moved(before, vanilla.policy_weights())

    cispo = make_worker(tiny_model_dir, "cispo")
    before = cispo.policy_weights()
    metrics = cispo.update_actor(batch)
    # the same tokens are clipped, yet each keeps the gradient -1.2·A·∇log π
    assert metrics["pg_clipfrac"] == pytest.approx(1.0)
    assert metrics["pg_loss"] == pytest.approx(-1.2)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert moved(before, cispo.policy_weights())


def test_sapo_and_dppo_settings_reach_the_loss(process_group, tiny_model_dir):
    sapo = make_worker(tiny_model_dir, "sapo", sapo_tau_pos=2.0)
    batch = stale_batch(sapo)
    before = sapo.policy_weights()
    metrics = sapo.update_actor(batch)
    # ratio e, A = 1, τ_pos 2: gate (4/2)·σ(2(e - 1)); the soft gate still trains
    gate = 2.0 / (1.0 + math.exp(-2.0 * (math.e - 1.0)))
    assert metrics["pg_loss"] == pytest.approx(-gate, rel=1e-4)
    assert moved(before, sapo.policy_weights())

    # DPPO-TV with no room to rise: every positive-advantage token is outside
    frozen = make_worker(tiny_model_dir, "dppo_tv", clip_ratio_high=0.0)
    before = frozen.policy_weights()
    metrics = frozen.update_actor(batch)
    assert metrics["pg_clipfrac"] == pytest.approx(1.0)
    assert not moved(before, frozen.policy_weights())

    # room for any rise, weights capped at 2 (< e): every token trains with weight 2
    free = make_worker(tiny_model_dir, "dppo_tv", clip_ratio_high=1.0, dppo_max_ratio=2.0)
    metrics = free.update_actor(batch)
    assert metrics["pg_clipfrac"] == pytest.approx(0.0)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1.0)
    assert metrics["pg_loss"] == pytest.approx(-2.0)


def test_mini_batch_normalisation_makes_the_gradient_independent_of_micro_batches(
    process_group, tiny_model_dir
):
    """One mini-batch of 4 rows whose first two responses keep 1 of 3 tokens: a token
    mean per micro-batch of 2 weighs those tokens 3× more than the mean over all 10
    tokens does; normalised by the mini-batch's count, 2 micro-batches give the gradient
    of 1."""
    probe = make_worker(tiny_model_dir, "reinforce")
    batch = stale_batch(probe)
    mask = batch["response_mask"].clone()
    mask[:2, 1:] = 0
    batch = Batch({**batch.tensors, "response_mask": mask})
    counts = {
        "mini_batch_tokens": torch.full((4,), float(mask.sum())),
        "mini_batch_sequences": torch.full((4,), 4.0),
    }
    norms = {}
    for micro in (2, 4):
        for normaliser, tensors in (("micro_batch", {}), ("mini_batch", counts)):
            worker = make_worker(tiny_model_dir, "reinforce", micro_batch_samples=micro)
            metrics = worker.update_actor(Batch({**batch.tensors, **tensors}))
            norms[micro, normaliser] = metrics["grad_norm"]
    assert norms[2, "mini_batch"] == pytest.approx(norms[4, "mini_batch"], rel=1e-4)
    # one micro-batch of the whole mini-batch: both normalisers are the same loss
    assert norms[4, "micro_batch"] == pytest.approx(norms[4, "mini_batch"], rel=1e-4)
    assert norms[2, "micro_batch"] != pytest.approx(norms[4, "micro_batch"], rel=1e-2)
