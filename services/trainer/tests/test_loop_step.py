"""One PPOTrainer step against in-process fake services: the loop's wiring, without Ray.

The fakes answer each RPC with fixed, easily computed tensors (every response token has
log-prob -0.5 under the policy, the engine reported -0.6, the reward is 1 for even rows
and 0 for odd ones), and record every request. The tests check what the step asks for
and what it sends to the updates; the services' own behaviour is tested through Serve in
integration_tests/test_ppo_loop.py.
"""

import asyncio
import logging
import math

import pytest
import torch

from rlserve.core.algos.advantages import grpo_advantages
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.config import validate_config
from rlserve.core.modeling import load_tokenizer
from rlserve.core.run_config import RunConfig
from rlserve.trainer.checkpoint import checkpoint_dir, latest_checkpoint, read_trainer_state
from rlserve.trainer.clients import Clients
from rlserve.trainer.data import PromptRow
from rlserve.trainer.loop import PPOTrainer
from rlserve.trainer.rewards import Rewards
from rlserve.v1 import critic_pb2, reference_pb2, reward_pb2, rollout_pb2

POLICY_LOG_PROB = -0.5
ENGINE_LOG_PROB = -0.6
RESPONSE_TOKEN = 7


class FakeService:
    """Answers `call(rpc, request)` and `call_api(request)` like a service client, from
    `handlers` (which see the request as gRPC carries it: the batch encoded in it)."""

    def __init__(self, **handlers):
        self.handlers = handlers
        self.requests: list[tuple[str, object]] = []

    async def call(self, rpc, request, timeout_s=None):
        self.requests.append((rpc, request))
        return self.handlers[rpc](request)

    async def call_api(self, request, timeout_s=None):
        response = await self.call(request.RPC, request.to_proto(), timeout_s)
        return type(request).Response.from_proto(response)

    def sent(self, rpc):
        return [request for name, request in self.requests if name == rpc]


def _generate(request):
    prompts = batch_from_proto(request.prompts)
    sampling = request.sampling
    n, width = sampling.responses_per_prompt, sampling.max_new_tokens
    rows = len(prompts) * n
    repeated = prompts.index(torch.arange(len(prompts)).repeat_interleave(n))
    responses = torch.full((rows, width), RESPONSE_TOKEN, dtype=torch.long)
    mask = torch.ones(rows, width, dtype=torch.long)
    tensors = {
        "prompts": repeated["input_ids"],
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([repeated["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([repeated["attention_mask"], mask], dim=1),
    }
    if request.return_log_probs:
        tensors["rollout_log_probs"] = torch.full((rows, width), ENGINE_LOG_PROB)
    if request.HasField("agent"):  # a multi-turn answer: row 0's call failed, row 1's rewarded
        tensors["tool_errors"] = torch.tensor([int(i == 0) for i in range(rows)])
        tensors["tool_rewards"] = torch.tensor([float(i == 1) for i in range(rows)])
    non_tensors = {
        **repeated.non_tensors,
        "uid": [i // n for i in range(rows)],
        "response_text": ["x"] * rows,
    }
    batch = Batch(tensors, non_tensors, {"weights_version": request.expected_weights_version})
    return rollout_pb2.GenerateSequencesResponse(batch=batch_to_proto(batch))


def _log_prob(request):
    mask = batch_from_proto(request.batch)["response_mask"].float()
    tensors = {"log_probs": POLICY_LOG_PROB * mask, "entropy": mask}
    if request.return_sum_pi_squared:
        tensors["sum_pi_squared"] = 0.3 * mask
    return rollout_pb2.ComputeLogProbResponse(batch=batch_to_proto(Batch(tensors)))


def _update_actor(request):
    response = rollout_pb2.UpdateActorResponse(
        weights_version=request.weights_version + 1, metrics={"pg_loss": 0.0}
    )
    batch = batch_from_proto(request.batch)
    if "old_log_probs" not in batch.tensors:  # a single-pass update scores the rows itself
        mask = batch["response_mask"].float()
        scores = Batch({"log_probs": POLICY_LOG_PROB * mask, "entropy": 0.25 * mask})
        response.batch.CopyFrom(batch_to_proto(scores))
    return response


def _reward(request):
    rows = len(batch_from_proto(request.batch))
    scores = torch.tensor([float(i % 2 == 0) for i in range(rows)])
    tensors = {"scores": scores, "scores_rule": scores}
    # as an HTTP kind with on_failure fallback reports one failed sample of the call's
    figures = {"http_s": 0.25, "http_requests": float(rows), "http_failures": 1.0}
    return reward_pb2.ComputeRewardResponse(batch=batch_to_proto(Batch(tensors)), metrics=figures)


def fake_clients(critic: bool, reference: bool) -> Clients:
    rollout = FakeService(
        GenerateSequences=_generate, ComputeLogProb=_log_prob, UpdateActor=_update_actor
    )
    reward = FakeService(
        ComputeReward=_reward,
        GetInfo=lambda _: reward_pb2.RewardServiceGetInfoResponse(kind_weights={"rule": 1.0}),
    )

    def ref_log_prob(request):
        mask = batch_from_proto(request.batch)["response_mask"].float()
        ref = Batch({"ref_log_probs": (POLICY_LOG_PROB - 0.1) * mask})
        return reference_pb2.ComputeRefLogProbResponse(batch=batch_to_proto(ref))

    def values(request):
        mask = batch_from_proto(request.batch)["response_mask"].float()
        return critic_pb2.ComputeValuesResponse(batch=batch_to_proto(Batch({"values": 0 * mask})))

    return Clients(
        rollout=rollout,
        reward=reward,
        reference=FakeService(ComputeRefLogProb=ref_log_prob) if reference else None,
        critic=(
            FakeService(
                ComputeValues=values,
                UpdateCritic=lambda _: critic_pb2.UpdateCriticResponse(metrics={"vf_loss": 0.0}),
            )
            if critic
            else None
        ),
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def one_step(tokenizer, tmp_path, **sections) -> tuple[dict[str, float], Clients]:
    data = {
        "rollout": {"max_new_tokens": 3},
        "actor": {"ppo_mini_batch_prompts": 2, "micro_batch_samples": 2},
        "critic": {"ppo_mini_batch_prompts": 2, "micro_batch_samples": 2},
        "trainer": {"prompts_per_step": 2, "run_dir": str(tmp_path)},
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    config = validate_config(RunConfig, data)
    clients = fake_clients(config.needs_critic, config.needs_reference)
    rows = [PromptRow(f"{a}+{a}=", str(2 * a)) for a in range(1, 9)]
    trainer = PPOTrainer(config, clients, tokenizer, rows, rows[:2], tmp_path)
    metrics = asyncio.run(trainer.run_step())
    return metrics, clients


def actor_batch(clients: Clients) -> Batch:
    (update,) = clients.rollout.sent("UpdateActor")
    return batch_from_proto(update.batch)


def test_ppo_step_asks_every_service_once_and_updates_both_models(tokenizer, tmp_path):
    metrics, clients = one_step(tokenizer, tmp_path)
    assert len(clients.rollout.sent("GenerateSequences")) == 1
    assert len(clients.reference.sent("ComputeRefLogProb")) == 1
    assert len(clients.critic.sent("UpdateCritic")) == 1
    (update,) = clients.rollout.sent("UpdateActor")
    assert (update.step, update.weights_version) == (0, 0)
    assert metrics["weights_version"] == 1.0 and metrics["samples"] == 2.0
    # the reward is 1 for row 0 and 0 for row 1: a mean of 0.5
    assert metrics["reward_mean"] == pytest.approx(0.5)
    # k1 in the reward: old - ref = 0.1 nat per token
    assert metrics["kl_token_mean"] == pytest.approx(0.1)
    assert "ref_log_probs" not in actor_batch(clients).tensors  # the KL is in the reward


def test_a_single_pass_step_takes_the_old_log_probs_from_the_update(tokenizer, tmp_path):
    """One on-policy optimizer step: no ComputeLogProb, the actor gets no old_log_probs,
    and the entropy and the drift from the reference come from the update's forward."""
    metrics, clients = one_step(
        tokenizer,
        tmp_path,
        algorithm={"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.0}},
        actor={"ppo_epochs": 1, "use_kl_loss": True},
        rollout={"max_new_tokens": 3, "responses_per_prompt": 2},
    )
    assert clients.rollout.sent("ComputeLogProb") == []
    assert len(clients.reference.sent("ComputeRefLogProb")) == 1
    sent = actor_batch(clients)
    assert "old_log_probs" not in sent.tensors and "ref_log_probs" in sent.tensors
    assert metrics["entropy_mean"] == pytest.approx(0.25)
    assert metrics["kl_token_mean"] == pytest.approx(0.1)  # update's -0.5 vs the ref's -0.6
    # a second epoch makes the update take several steps: old log-probs computed first
    _, clients = one_step(
        tokenizer,
        tmp_path / "two",
        algorithm={"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.0}},
        actor={"ppo_epochs": 2, "use_kl_loss": True},
        rollout={"max_new_tokens": 3, "responses_per_prompt": 2},
    )
    assert len(clients.rollout.sent("ComputeLogProb")) == 1
    assert "old_log_probs" in actor_batch(clients).tensors


def test_rollout_correction_asks_the_engine_and_weights_the_advantages(tokenizer, tmp_path):
    metrics, clients = one_step(
        tokenizer,
        tmp_path,
        algorithm={"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.0}, "rollout_is_cap": 2.0},
        rollout={"max_new_tokens": 3, "responses_per_prompt": 2},
    )
    (generate,) = clients.rollout.sent("GenerateSequences")
    assert generate.return_log_probs
    sent = actor_batch(clients)
    mask = sent["response_mask"]
    # π_old/π_rollout = e^(−0.5 + 0.6) on every token, below the cap
    weight = math.exp(POLICY_LOG_PROB - ENGINE_LOG_PROB)
    # each response's score on its first token (GRPO scores a row by its token rewards' sum)
    token_rewards = torch.zeros(mask.shape)
    token_rewards[:, 0] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    advantages, _ = grpo_advantages(token_rewards, mask, group_ids=torch.tensor([0, 0, 1, 1]))
    expected = advantages * weight
    torch.testing.assert_close(sent["advantages"], expected)
    assert metrics["rollout_is/is_weight_mean"] == pytest.approx(weight)
    assert metrics["rollout_is/mismatch_kl"] == pytest.approx(-0.1)


def test_remax_generates_a_greedy_baseline_per_prompt(tokenizer, tmp_path):
    metrics, clients = one_step(
        tokenizer, tmp_path, algorithm={"adv_estimator": "remax", "kl_ctrl": {"kl_coef": 0.0}}
    )
    sampled, greedy = clients.rollout.sent("GenerateSequences")
    assert sampled.sampling.temperature > 0
    assert (greedy.sampling.temperature, greedy.sampling.responses_per_prompt) == (0.0, 1)
    assert len(clients.reward.sent("ComputeReward")) == 2
    # the greedy responses score 1 (prompt 0) and 0 (prompt 1), as the samples do
    assert metrics["remax/baseline_mean"] == pytest.approx(0.5)
    torch.testing.assert_close(actor_batch(clients)["advantages"], torch.zeros(2, 3))


def test_the_reward_services_figures_are_summed_per_step_and_failures_warned(
    tokenizer, tmp_path, caplog
):
    # ReMax calls the reward twice a step: the sampled responses and the greedy ones
    with caplog.at_level(logging.WARNING, logger="rlserve.trainer.rewards"):
        metrics, clients = one_step(tokenizer, tmp_path, algorithm={"adv_estimator": "remax"})
    assert len(clients.reward.sent("ComputeReward")) == 2
    assert metrics["reward/http_failures"] == 2.0 and metrics["reward/http_s"] == 0.5
    assert metrics["reward/http_requests"] == 2.0 + 2.0  # 2 sampled + 2 greedy responses
    (warning,) = [r.getMessage() for r in caplog.records if "reward HTTP" in r.getMessage()]
    assert warning.startswith("step 1: 2 reward HTTP samples failed (4 requests sent)")


def test_optimal_token_baseline_asks_for_sum_pi_squared(tokenizer, tmp_path):
    _, clients = one_step(
        tokenizer,
        tmp_path,
        algorithm={"adv_estimator": "optimal_token_baseline", "kl_ctrl": {"kl_coef": 0.0}},
        rollout={"max_new_tokens": 3, "responses_per_prompt": 2},
    )
    (log_prob,) = clients.rollout.sent("ComputeLogProb")
    assert log_prob.return_sum_pi_squared
    # group 0 holds returns 1 and 0 with equal path weights: the baseline is 0.5
    advantages = actor_batch(clients)["advantages"]
    torch.testing.assert_close(advantages[0], torch.full((3,), 0.5))
    torch.testing.assert_close(advantages[1], torch.full((3,), -0.5))


def test_gdpo_asks_the_reward_kinds_once(tokenizer, tmp_path):
    _, clients = one_step(
        tokenizer,
        tmp_path,
        algorithm={"adv_estimator": "gdpo", "kl_ctrl": {"kl_coef": 0.0}},
        rollout={"max_new_tokens": 3, "responses_per_prompt": 2},
    )
    assert len(clients.reward.sent("GetInfo")) == 1
    advantages = actor_batch(clients)["advantages"]
    # one kind: GRPO's ±0.707 per group, then whitened over the 12 tokens -> ±1 (× n/(n-1))
    assert advantages[0, 0] > 0 > advantages[1, 0]
    assert float(advantages.mean()) == pytest.approx(0.0, abs=1e-6)


def _one_step_off_trainer(tokenizer, tmp_path, total_steps: int, **sections) -> PPOTrainer:
    data = {
        "rollout": {"max_new_tokens": 3, "mode": "one_step_off"},
        "actor": {"ppo_mini_batch_prompts": 2, "micro_batch_samples": 2},
        "critic": {"ppo_mini_batch_prompts": 2, "micro_batch_samples": 2},
        "trainer": {"prompts_per_step": 2, "total_steps": total_steps, "run_dir": str(tmp_path)},
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    config = validate_config(RunConfig, data)
    clients = fake_clients(critic=True, reference=True)
    clients.rollout.handlers.update(
        SaveCheckpoint=lambda _: rollout_pb2.RolloutServiceSaveCheckpointResponse(),
        LoadCheckpoint=lambda _: rollout_pb2.RolloutServiceLoadCheckpointResponse(
            weights_version=1
        ),
    )
    clients.critic.handlers.update(
        SaveCheckpoint=lambda _: critic_pb2.CriticServiceSaveCheckpointResponse(),
        LoadCheckpoint=lambda _: critic_pb2.CriticServiceLoadCheckpointResponse(),
    )
    rows = [PromptRow(f"{a}+{a}=", str(2 * a)) for a in range(1, 9)]
    return PPOTrainer(config, clients, tokenizer, rows, rows[:2], tmp_path)


def test_one_step_off_generates_the_next_batch_before_the_update(tokenizer, tmp_path):
    trainer = _one_step_off_trainer(tokenizer, tmp_path, total_steps=2)

    async def two_steps():
        return [await trainer.run_step() for _ in range(2)]

    first, second = asyncio.run(two_steps())
    rollout = trainer.clients.rollout
    # step 2's generation is asked for after step 1's log-probs, before its update, and
    # not again in step 2; the last step asks for none
    assert [rpc for rpc, _ in rollout.requests] == [
        "GenerateSequences",
        "ComputeLogProb",
        "GenerateSequences",
        "UpdateActor",
        "ComputeLogProb",
        "UpdateActor",
    ]
    generations = rollout.sent("GenerateSequences")
    assert [g.expected_weights_version for g in generations] == [0, 0]
    assert all(g.return_log_probs for g in generations)  # for the correction
    assert generations[1].sampling.seed == generations[0].sampling.seed + 1
    assert [u.weights_version for u in rollout.sent("UpdateActor")] == [0, 1]
    assert (first["staleness"], second["staleness"]) == (0.0, 1.0)
    # the correction is on without algorithm.rollout_is_cap: π_old/π_rollout = e^0.1
    weight = math.exp(POLICY_LOG_PROB - ENGINE_LOG_PROB)
    assert second["rollout_is/is_weight_mean"] == pytest.approx(weight)


def test_one_step_off_checkpoint_keeps_the_next_generation(tokenizer, tmp_path):
    original = _one_step_off_trainer(tokenizer, tmp_path, total_steps=3)

    async def step_and_save():
        await original.run_step()
        return await original.save_checkpoint()

    directory = asyncio.run(step_and_save())
    (generated_early,) = original.clients.rollout.sent("GenerateSequences")[1:]
    restored = _one_step_off_trainer(tokenizer, tmp_path, total_steps=3)

    async def load_and_step():
        await restored.load_checkpoint(directory, read_trainer_state(directory))
        return await restored.run_step()

    metrics = asyncio.run(load_and_step())
    # step 2 trains on the saved generation (version 0, staleness 1) and asks only for
    # step 3's, from the prompts after it
    (asked,) = restored.clients.rollout.sent("GenerateSequences")
    assert metrics["staleness"] == 1.0
    assert asked.sampling.seed == generated_early.sampling.seed + 1
    assert (
        batch_from_proto(asked.prompts)["input_ids"].tolist()
        != batch_from_proto(generated_early.prompts)["input_ids"].tolist()
    )
    (update,) = restored.clients.rollout.sent("UpdateActor")
    assert (update.step, update.weights_version) == (1, 1)


@pytest.mark.parametrize(
    "sections",
    [
        {"algorithm": {"adv_estimator": "remax", "kl_ctrl": {"kl_coef": 0.0}}},
        {
            "algorithm": {
                "adv_estimator": "grpo",
                "kl_ctrl": {"kl_coef": 0.0},
                "dynamic_sampling": True,
            },
            "rollout": {"max_new_tokens": 3, "mode": "one_step_off", "responses_per_prompt": 2},
        },
    ],
    ids=["remax", "dynamic_sampling"],
)
def test_one_step_off_with_a_greedy_baseline_or_dynamic_sampling(tokenizer, tmp_path, sections):
    trainer = _one_step_off_trainer(tokenizer, tmp_path, total_steps=2, **sections)

    async def two_steps():
        return [await trainer.run_step() for _ in range(2)]

    first, second = asyncio.run(two_steps())
    assert (first["staleness"], second["staleness"]) == (0.0, 1.0)
    sampled = [
        g for g in trainer.clients.rollout.sent("GenerateSequences") if g.sampling.temperature > 0
    ]
    assert [g.expected_weights_version for g in sampled] == [0, 0]
    updates = trainer.clients.rollout.sent("UpdateActor")
    assert [u.weights_version for u in updates] == [0, 1]
    if "dynamic_sampling" in sections["algorithm"]:
        # scored while generating: no reward call among the forwards
        assert len(trainer.clients.reward.sent("ComputeReward")) == len(sampled)
        assert second["generate/dynamic_sampling/groups"] == 2.0
    else:
        # one greedy baseline per step, from the weights that step trains
        greedy = [
            g
            for g in trainer.clients.rollout.sent("GenerateSequences")
            if g.sampling.temperature == 0
        ]
        assert [g.expected_weights_version for g in greedy] == [0, 1]


def test_a_saved_step_is_kept_as_it_is_not_written_again(tokenizer, tmp_path):
    """The end of a run asks for the checkpoint of a step the last periodic save wrote:
    the services are not asked again and the complete checkpoint is left untouched."""
    trainer = _one_step_off_trainer(tokenizer, tmp_path, total_steps=1, rollout={"mode": "sync"})

    async def step_and_save_twice():
        await trainer.run_step()
        first = await trainer.save_checkpoint()
        written = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
        second = await trainer.save_checkpoint()
        return first, second, written

    first, second, written = asyncio.run(step_and_save_twice())
    assert first == second == checkpoint_dir(tmp_path, 1)
    assert len(trainer.clients.rollout.sent("SaveCheckpoint")) == 1
    assert len(trainer.clients.critic.sent("SaveCheckpoint")) == 1
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == written


def test_a_save_failing_part_way_leaves_the_last_complete_checkpoint(tokenizer, tmp_path):
    trainer = _one_step_off_trainer(
        tokenizer,
        tmp_path,
        total_steps=3,
        rollout={"mode": "sync"},
        trainer={"keep_checkpoints": 1},
    )
    saves = []

    def rollout_save(request):  # the service writes its files where it is told
        directory = tmp_path / request.location.path
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"weights")
        return rollout_pb2.RolloutServiceSaveCheckpointResponse()

    def critic_save(request):
        saves.append(request.location.path)
        if len(saves) == 2:
            (tmp_path / request.location.path).mkdir(parents=True)
            (tmp_path / request.location.path / "half").write_bytes(b"half")
            raise OSError(28, "No space left on device")
        return critic_pb2.CriticServiceSaveCheckpointResponse()

    trainer.clients.rollout.handlers["SaveCheckpoint"] = rollout_save
    trainer.clients.critic.handlers["SaveCheckpoint"] = critic_save

    async def run():
        await trainer.run_step()
        await trainer.save_checkpoint()
        await trainer.run_step()
        with pytest.raises(OSError, match="No space"):
            await trainer.save_checkpoint()
        assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
        assert not checkpoint_dir(tmp_path, 2).exists()
        return await trainer.save_checkpoint()  # the retry clears what the failure left

    saved = asyncio.run(run())
    assert saved == latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    assert read_trainer_state(saved)["step"] == 2
    assert not (saved / "critic" / "half").exists()
    assert (saved / "rollout" / "model.safetensors").read_bytes() == b"weights"
    # keep_checkpoints=1: step 1 went once step 2 was complete; no staging is left
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


def _trainer_with_actor_update(tokenizer, tmp_path, update_actor) -> PPOTrainer:
    trainer = _one_step_off_trainer(tokenizer, tmp_path, total_steps=2, rollout={"mode": "sync"})
    trainer.clients.rollout.handlers["UpdateActor"] = update_actor
    return trainer


def test_a_replayed_update_at_the_weights_the_step_makes_is_counted(tokenizer, tmp_path):
    def replayed(request):
        response = _update_actor(request)
        response.replayed = True
        return response

    trainer = _trainer_with_actor_update(tokenizer, tmp_path, replayed)
    metrics = asyncio.run(trainer.run_step())
    assert metrics["replayed_updates"] == 1.0 and trainer.state.weights_version == 1


def test_a_replay_reporting_other_weights_stops_the_run(tokenizer, tmp_path):
    """Something else moved the actor on since: training on is training from its batch."""

    def replayed_elsewhere(request):
        response = _update_actor(request)
        response.replayed, response.weights_version = True, request.weights_version + 3
        return response

    trainer = _trainer_with_actor_update(tokenizer, tmp_path, replayed_elsewhere)
    with pytest.raises(RuntimeError, match="another trainer is updating the service"):
        asyncio.run(trainer.run_step())
    assert trainer.state.weights_version == 0


def test_a_rewound_step_sends_the_same_batches_and_asks_for_the_next_generation_again(
    tokenizer, tmp_path
):
    """A failure after the forwards (here the actor's update) and a rewind run the step
    again with its first attempt's generation and forwards: the update gets the same
    batch, and one_step_off asks again for the next step's generation it discarded."""
    trainer = _one_step_off_trainer(tokenizer, tmp_path, total_steps=2)
    attempts = []

    def failing_once(request):
        attempts.append(batch_from_proto(request.batch))
        if len(attempts) == 1:
            raise ConnectionError("the update's answer was lost")
        return _update_actor(request)

    trainer.clients.rollout.handlers["UpdateActor"] = failing_once

    async def fail_rewind_and_run_again():
        with pytest.raises(ConnectionError):
            await trainer.run_step()
        assert trainer.schedule.holds_generation_for(1)  # asked for during the attempt
        trainer.rewind()
        assert not trainer.schedule.holds_generation_for(1)  # discarded with it
        return await trainer.run_step()

    metrics = asyncio.run(fail_rewind_and_run_again())
    rollout = trainer.clients.rollout
    assert [rpc for rpc, _ in rollout.requests] == [
        "GenerateSequences",
        "ComputeLogProb",
        "GenerateSequences",
        "UpdateActor",
        "GenerateSequences",
        "UpdateActor",
    ]
    first, second = attempts
    assert first.tensors.keys() == second.tensors.keys()
    for key in first.tensors:
        torch.testing.assert_close(first[key], second[key])
    asked = rollout.sent("GenerateSequences")
    assert asked[1].sampling.seed == asked[2].sampling.seed  # the same prompts and seed
    assert asked[1].prompts == asked[2].prompts
    assert trainer.state.step == 1 and metrics["weights_version"] == 1.0
    assert trainer.schedule.holds_generation_for(1)


@pytest.mark.parametrize(
    ("kinds", "tensors"),
    [({"rule": 1.0}, []), ({"model": 0.5, "rule": 1.0}, ["attention_mask", "input_ids"])],
)
def test_token_ids_go_only_to_a_reward_service_with_a_model(kinds, tensors):
    """A rule or HTTP reward reads text alone (and may run where torch is not installed):
    it gets no tensors, so no call of it takes the handle route."""
    reward = FakeService(
        ComputeReward=_reward,
        GetInfo=lambda _: reward_pb2.RewardServiceGetInfoResponse(kind_weights=kinds),
    )
    rewards = Rewards(reward, validate_config(RunConfig, {}))
    ids = torch.ones(2, 4, dtype=torch.long)
    batch = Batch(
        {"input_ids": ids, "attention_mask": ids, "response_mask": ids},
        {"response_text": ["1", "2"], "ground_truth": ["1", "3"], "prompt_text": ["0+1", "1+1"]},
    )
    asyncio.run(rewards.score(batch))
    asyncio.run(rewards.score(batch))
    for request in reward.sent("ComputeReward"):
        assert sorted(request.batch.tensors) == tensors
        assert sorted(request.batch.non_tensors) == ["ground_truth", "prompt_text", "response_text"]
    assert len(reward.sent("GetInfo")) == 1


@pytest.mark.parametrize(
    ("on_tool_error", "reward_mean"), [("continue", 0.75), ("zero_reward", 0.25)]
)
def test_an_agent_run_asks_for_tools_and_scores_their_outcomes(
    tokenizer, tmp_path, on_tool_error, reward_mean
):
    """Row 0: reward 1, but its call failed; row 1: reward 0 + 0.5 × its tool's reward 1."""
    agent = {
        "tool_call_format": "bracket",
        "max_turns": 3,
        "tool_reward_weight": 0.5,
        "on_tool_error": on_tool_error,
    }
    metrics, clients = one_step(tokenizer, tmp_path, rollout={"max_new_tokens": 3, "agent": agent})
    (generate,) = clients.rollout.sent("GenerateSequences")
    assert generate.agent.environment_app == "environment"
    assert (generate.agent.tool_call_format, generate.agent.max_turns) == ("bracket", 3)
    assert metrics["reward_mean"] == pytest.approx(reward_mean)


@pytest.mark.parametrize("on_tool_error", ["continue", "drop_sample"])
def test_drop_sample_takes_the_signal_of_a_response_with_a_failed_call(
    tokenizer, tmp_path, on_tool_error
):
    """GRPO, two responses per prompt: row 0's call failed. Dropped, its advantage is 0
    and its row stays; its group partner's advantage is the same either way."""
    metrics, clients = one_step(
        tokenizer,
        tmp_path,
        algorithm={"adv_estimator": "grpo"},
        rollout={
            "max_new_tokens": 3,
            "responses_per_prompt": 2,
            "agent": {"tool_call_format": "bracket", "on_tool_error": on_tool_error},
        },
    )
    advantages = actor_batch(clients)["advantages"]
    assert advantages.shape[0] == 4
    assert advantages[1:].abs().sum() > 0
    if on_tool_error == "drop_sample":
        assert torch.equal(advantages[0], torch.zeros_like(advantages[0]))
        assert metrics["agent/dropped_samples"] == 1.0
    else:
        assert advantages[0].abs().sum() > 0
        assert "agent/dropped_samples" not in metrics


def test_a_generation_answering_fewer_samples_than_asked_fails_the_step(tokenizer, tmp_path):
    """A batch is never silently short: the step stops, naming what it asked for and got."""
    config = validate_config(
        RunConfig,
        {"trainer": {"prompts_per_step": 2, "run_dir": str(tmp_path)}, "actor": {}},
    )
    clients = fake_clients(config.needs_critic, config.needs_reference)

    def short(request):
        answer = batch_from_proto(_generate(request).batch)
        return rollout_pb2.GenerateSequencesResponse(batch=batch_to_proto(answer.index([0])))

    clients.rollout.handlers["GenerateSequences"] = short
    rows = [PromptRow(f"{a}+{a}=", str(2 * a)) for a in range(1, 9)]
    trainer = PPOTrainer(config, clients, tokenizer, rows, rows[:2], tmp_path)
    with pytest.raises(RuntimeError, match=r"answered 1 samples for 2 prompts x 1 responses = 2"):
        asyncio.run(trainer.run_step())
