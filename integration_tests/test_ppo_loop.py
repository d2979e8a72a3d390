"""A few PPO/GRPO steps through every service over the Serve gRPC port."""

import asyncio
import itertools
import math
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from integration_tests.support import (
    assert_same_step_metrics,
    deployed_services,
    run_inputs,
    session_runs_root,
    tiny_run_config,
)
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_to_proto
from rlserve.core.rpc import ServiceClient, open_channel
from rlserve.trainer.checkpoint import checkpoint_dir, read_trainer_state
from rlserve.trainer.deploy import service_args
from rlserve.trainer.metrics import read_metrics
from rlserve.trainer.run import train_on_services
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc


def _run(config, inputs, run_dir, address, resume_from=None):
    return asyncio.run(
        train_on_services(config, inputs, run_dir, address, resume_from, show_progress=False)
    )


def _deployed_run(config, embedded, run_dir, address):
    """Deploys `config`'s services (reusing same-settings apps) and runs it; its summary
    and per-step metric records."""
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, address)
    summary = _run(config, inputs, run_dir, address)
    return summary, [r for r in read_metrics(Path(summary.metrics_jsonl)) if "reward_mean" in r]


def _run_step_records(config, embedded, run_dir, address):
    """Deploys `config`'s services, runs it and returns its per-step metric records."""
    return _deployed_run(config, embedded, run_dir, address)[1]


def test_ppo_with_critic(serve_cluster, embedded, tmp_path):
    config = tiny_run_config(tmp_path, session_runs_root(tmp_path), trainer={"total_steps": 3})
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    summary = _run(config, inputs, tmp_path, serve_cluster.grpc_address)
    records = [r for r in read_metrics(Path(summary.metrics_jsonl)) if "reward_mean" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["weights_version"] for r in records] == [1.0, 2.0, 3.0]
    for record in records:
        for key in (
            "actor/pg_loss",
            "critic/vf_loss",
            "kl_mean",
            "entropy_mean",
            "time/generate_s",
            "time/values_s",
            "time/ref_log_prob_s",
        ):
            assert math.isfinite(record[key]), key
        assert record["staleness"] == 0
    assert summary.accuracy_before is not None and summary.accuracy_after is not None
    assert Path(summary.curves_png).stat().st_size > 0
    assert read_trainer_state(Path(summary.checkpoint))["step"] == 3


def test_batches_by_the_handle_route_train_exactly_as_by_grpc(serve_cluster, embedded, tmp_path):
    """Every batch of every step handed to the services through Ray's object store
    (handle_route_min_bytes=0) gives the metrics protobuf over gRPC gives (None: these
    small batches all go by gRPC), step for step."""
    by_route, routes = {}, {}
    for name, min_bytes in (("grpc", None), ("handle", 0)):
        config = tiny_run_config(
            tmp_path / name,
            session_runs_root(tmp_path),
            trainer={"total_steps": 2, "handle_route_min_bytes": min_bytes},
            actor={"use_kl_loss": True},
        )
        summary, by_route[name] = _deployed_run(
            config, embedded, tmp_path / name, serve_cluster.grpc_address
        )
        routes[name] = summary.calls_by_route
    assert [r["step"] for r in by_route["handle"]] == [1, 2]
    assert_same_step_metrics(by_route["grpc"], by_route["handle"])
    # every batch call went by its route: per step, generate, log-probs, reference,
    # values, reward and the two updates; then the evaluations' generations and rewards
    assert "handle" not in routes["grpc"]
    assert routes["handle"]["handle"] >= 2 * 7
    assert routes["handle"]["handle"] == routes["grpc"]["direct"] - routes["handle"]["direct"]


def test_adaptive_kl_coefficient_follows_the_measured_kl(serve_cluster, embedded, tmp_path):
    target_kl, horizon = 1e-3, 100
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={
            "kl_ctrl": {
                "kind": "adaptive",
                "kl_coef": 0.05,
                "target_kl": target_kl,
                "horizon": horizon,
            }
        },
        actor={"lr": 1e-2},  # move the policy so the KL leaves zero quickly
        trainer={"total_steps": 4},
    )
    records = _run_step_records(config, embedded, tmp_path, serve_cluster.grpc_address)
    assert records[0]["kl_coef"] == pytest.approx(0.05)
    samples = records[0]["samples"]
    for before, after in itertools.pairwise(records):
        error = min(max(before["kl_mean"] / target_kl - 1, -0.2), 0.2)
        expected = before["kl_coef"] * (1 + error * samples / horizon)
        assert after["kl_coef"] == pytest.approx(expected, rel=1e-6)
    assert records[-1]["kl_coef"] != pytest.approx(0.05, rel=1e-3)


def test_grpo_without_critic(serve_cluster, embedded, tmp_path):
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.0}},
        actor={"use_kl_loss": True, "kl_loss_coef": 0.04},
        rollout={"responses_per_prompt": 4},
        trainer={"total_steps": 2, "prompts_per_step": 8},
    )
    inputs = run_inputs(embedded)
    assert "critic" not in service_args(config, inputs.model_dir)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    summary = _run(config, inputs, tmp_path, serve_cluster.grpc_address)
    records = [r for r in read_metrics(Path(summary.metrics_jsonl)) if "reward_mean" in r]
    assert [r["samples"] for r in records] == [32.0, 32.0]
    assert not any(key.startswith("critic/") for key in records[-1])


def test_dapo_pieces_through_the_services(serve_cluster, embedded, tmp_path):
    """Dynamic sampling, overlong shaping and filtering, on a real run: every step trains
    on groups whose scores differ, and the metrics account for the rounds it took."""
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={
            "adv_estimator": "grpo",
            "kl_ctrl": {"kl_coef": 0.0},
            "dynamic_sampling": True,
            "dynamic_sampling_max_rounds": 3,
            "overlong_buffer_tokens": 2,
            "filter_overlong": True,
        },
        actor={"clip_ratio_high": 0.28, "ppo_mini_batch_prompts": 2},
        rollout={"responses_per_prompt": 4},
        trainer={"total_steps": 3, "prompts_per_step": 8},
    )
    records = _run_step_records(config, embedded, tmp_path, serve_cluster.grpc_address)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        rounds, groups = (
            record["generate/dynamic_sampling/rounds"],
            record["generate/dynamic_sampling/groups"],
        )
        assert 1 <= rounds <= 3 and groups in (2, 4, 6, 8)  # whole mini-batches of 2
        assert record["samples"] == 4 * groups  # whole groups, whole mini-batches
        assert 0 < record["generate/dynamic_sampling/kept_fraction"] <= 1
        assert record["reward_std"] > 0  # no all-equal group made it in
        assert -1.0 <= record["overlong/penalty_mean"] <= 0.0
        assert 0.0 <= record["overlong/truncated_fraction"] <= 1.0
        assert math.isfinite(record["actor/pg_loss"])


def test_remax_and_rollout_correction_through_the_services(serve_cluster, embedded, tmp_path):
    """ReMax's greedy baseline and truncated importance sampling against the engine's
    own log-probs, with the SAPO loss: each step records the baseline, the weights and
    the engine/trainer mismatch (near zero: hf generation and the trainer share weights
    and dtype)."""
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={"adv_estimator": "remax", "kl_ctrl": {"kl_coef": 0.0}, "rollout_is_cap": 2.0},
        actor={"policy_loss": "sapo", "loss_agg_mode": "seq-mean-token-mean"},
        trainer={"total_steps": 2},
    )
    records = _run_step_records(config, embedded, tmp_path, serve_cluster.grpc_address)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["remax/baseline_mean"] <= 1.0  # the rule scores 0 or 1
        assert record["time/greedy_baseline_s"] > 0
        assert record["rollout_is/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert abs(record["rollout_is/mismatch_kl"]) < 1e-3
        assert record["rollout_is/capped_fraction"] == 0.0
        assert math.isfinite(record["actor/pg_loss"])


def test_gdpo_and_dppo_through_the_services(serve_cluster, embedded, tmp_path):
    """GDPO reads each reward kind's score from the reward service (and its weights from
    GetInfo); the DPPO loss trains on it, normalised by each mini-batch's token count
    over 4 micro-batches."""
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={"adv_estimator": "gdpo", "kl_ctrl": {"kl_coef": 0.0}},
        actor={
            "policy_loss": "dppo_tv",
            "loss_normalizer": "mini_batch",
            "ppo_mini_batch_prompts": 4,
            "micro_batch_samples": 4,
        },
        rollout={"responses_per_prompt": 4},
        trainer={"total_steps": 2, "prompts_per_step": 8},
    )
    records = _run_step_records(config, embedded, tmp_path, serve_cluster.grpc_address)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # whitened over the step's response tokens
        assert abs(record["advantages_mean"]) < 1e-5
        assert 0.0 <= record["actor/pg_clipfrac"] <= 1.0
        assert math.isfinite(record["actor/pg_loss"])


def test_optimal_token_baseline_through_the_services(serve_cluster, embedded, tmp_path):
    """The optimal token baseline asks the rollout for Σπ² with the log-probs and reads
    the rollout-correction weights; DPPO-KL trains on its advantages."""
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={
            "adv_estimator": "optimal_token_baseline",
            "kl_ctrl": {"kl_coef": 0.0},
            "rollout_is_cap": 2.0,
        },
        actor={"policy_loss": "dppo_kl"},
        rollout={"responses_per_prompt": 4},
        trainer={"total_steps": 2, "prompts_per_step": 8},
    )
    records = _run_step_records(config, embedded, tmp_path, serve_cluster.grpc_address)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["rollout_is/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert math.isfinite(record["advantages_mean"])
        assert math.isfinite(record["actor/pg_loss"])


def test_grpo_passk_through_the_services(serve_cluster, embedded, tmp_path):
    """pass@k: per group only the best response carries an advantage, so at most one row
    in four is nonzero and the mean advantage is not negative."""
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        algorithm={"adv_estimator": "grpo_passk", "kl_ctrl": {"kl_coef": 0.0}},
        rollout={"responses_per_prompt": 4},
        trainer={"total_steps": 2, "prompts_per_step": 8},
    )
    records = _run_step_records(config, embedded, tmp_path, serve_cluster.grpc_address)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["advantages_mean"] >= 0.0
        assert math.isfinite(record["actor/pg_loss"])


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(
    serve_cluster, embedded, tmp_path, mode
):
    """one_step_off: step 3 trains on the generation step 2's checkpoint kept."""
    config = tiny_run_config(
        tmp_path,
        session_runs_root(tmp_path),
        trainer={"total_steps": 4, "checkpoint_every_steps": 2},
        rollout={"mode": mode},
    )
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    _run(config, inputs, uninterrupted, serve_cluster.grpc_address)

    # The "stopped after step 2" run: its directory as it was when step 2 was saved.
    resumed = tmp_path / "resumed"
    shutil.copytree(uninterrupted, resumed)
    shutil.rmtree(checkpoint_dir(resumed, 4))
    _run(
        config, inputs, resumed, serve_cluster.grpc_address, resume_from=checkpoint_dir(resumed, 2)
    )

    def steps_3_4(run_dir):
        return [
            r
            for r in read_metrics(run_dir / "metrics.jsonl")
            if r["step"] in (3, 4) and "reward_mean" in r
        ]

    expected, got = steps_3_4(uninterrupted), steps_3_4(resumed)
    assert len(expected) == len(got) == 2
    assert_same_step_metrics(expected, got)
    staleness = [
        r["staleness"] for r in read_metrics(uninterrupted / "metrics.jsonl") if "staleness" in r
    ]
    assert staleness == ([0.0] * 4 if mode == "sync" else [0.0, 1.0, 1.0, 1.0])


def test_a_retried_update_is_not_applied_twice(serve_cluster, embedded, tmp_path):
    """Over Serve gRPC: a retry of the step just applied, with its batch, is answered
    from the stored result; the run's applied step sent with another batch is refused."""
    config = tiny_run_config(tmp_path, session_runs_root(tmp_path), trainer={"total_steps": 1})
    inputs = run_inputs(embedded)
    deployed_services(config, inputs, serve_cluster.grpc_address)
    _run(config, inputs, tmp_path, serve_cluster.grpc_address)

    def update_batch(advantage: float) -> Batch:
        ids = torch.tensor([[1, 20, 21, 22]]).repeat(8, 1)  # one mini-batch of 8 rows
        return Batch(
            tensors={
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "responses": ids[:, 2:],
                "response_mask": torch.ones(8, 2, dtype=torch.int64),
                "old_log_probs": torch.zeros(8, 2),
                "advantages": torch.full((8, 2), advantage),
            }
        )

    async def updates():
        client = ServiceClient(
            open_channel(serve_cluster.grpc_address),
            rollout_pb2_grpc.RolloutServiceStub,
            "rollout",
            timeout_s=120,
        )

        def update(step, version, advantage):
            request = rollout_pb2.UpdateActorRequest(
                step=step, batch=batch_to_proto(update_batch(advantage)), weights_version=version
            )
            return client.call("UpdateActor", request)

        # the run applied step 0; step 0 again with this batch is someone else's
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await update(0, 0, 1.0)
        first = await update(1, 1, 1.0)
        again = await update(1, 1, 1.0)  # e.g. a retry after a lost reply
        after = await client.call("GetInfo", rollout_pb2.RolloutServiceGetInfoRequest())
        return refused.value, first, again, after.info

    refused, first, again, after = asyncio.run(updates())
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "step: 0 was already applied with another batch" in refused.details()
    assert (first.replayed, first.weights_version) == (False, 2)
    assert (again.replayed, again.weights_version) == (True, 2)
    assert dict(again.metrics) == dict(first.metrics)
    assert after.weights_version == 2 and after.last_applied_step == 1
