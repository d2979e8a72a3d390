"""The reward service through Serve's gRPC proxy, with a plain grpc client.

Two apps on the shared Serve instance:
- APP_FULL: rule + reward model + HTTP (a local server), with weights;
- APP_RULE: rule only, placed by a Ray node-label selector (the node's own id label, the
  one node of the test cluster), showing a label-placed replica starts and serves.
"""

from importlib.metadata import version

import grpc
import pytest
import ray
import torch
from ray import serve

from rlserve.core import auth
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.core.rpc import call_metadata
from rlserve.core.serving import deadline_metadata
from rlserve.reward.app import build_app
from rlserve.reward.reward_model import RewardModel
from rlserve.v1 import reward_pb2, reward_pb2_grpc

APP_FULL = "reward-test-full"
APP_RULE = "reward-test-rule"
WEIGHTS = {"rule": 1.0, "model": 0.5, "http": 0.25}
PROMPTS = ["1+2=", "10+20=", "7+5="]
RESPONSES = ["3", "31", "12"]
TRUTHS = ["3", "30", "12"]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def http_server(score_server):
    return score_server()


@pytest.fixture(scope="module")
def stub(serve_cluster, tiny_reward_model_dir, http_server):
    node_id = ray.get_runtime_context().get_node_id()
    serve.run(
        build_app(
            {
                "kinds": {
                    "rule": {"rule_name": "arithmetic_exact_match", "weight": WEIGHTS["rule"]},
                    "model": {"model_path": str(tiny_reward_model_dir), "weight": WEIGHTS["model"]},
                    "http": {"url": http_server.url, "weight": WEIGHTS["http"]},
                },
                "max_batch_samples": 8,
                "num_cpus_per_replica": 0.5,
            }
        ),
        name=APP_FULL,
        route_prefix=f"/{APP_FULL}",
    )
    serve.run(
        build_app(
            {
                "kinds": {"rule": {"rule_name": "gsm8k"}},
                "placement": {"label_selector": {"ray.io/node-id": node_id}},
                "num_cpus_per_replica": 0.5,
            }
        ),
        name=APP_RULE,
        route_prefix=f"/{APP_RULE}",
    )
    channel = serve_cluster.channel()
    yield reward_pb2_grpc.RewardServiceStub(channel)
    channel.close()
    serve.delete(APP_FULL)
    serve.delete(APP_RULE)


def _call(stub, batch: Batch, app: str = APP_FULL, timeout_s: float = TIMEOUT_S):
    request = reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch))
    return stub.ComputeReward(
        request,
        metadata=call_metadata(app, deadline_metadata(timeout_s)),
        timeout=timeout_s,
    )


def _full_batch(**non_tensors) -> Batch:
    input_ids, attention_mask = _encode()
    columns = {"response_text": RESPONSES, "ground_truth": TRUTHS, **non_tensors}
    return Batch(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask},
        non_tensors={k: v for k, v in columns.items() if v is not None},
        meta={"step": 7},
    )


def _encode():
    """Left-padded prompts then right-padded responses: [N, P+R] ids and mask."""
    tokenizer = build_char_tokenizer()
    prompts = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    tokenizer.padding_side = "right"
    responses = tokenizer(RESPONSES, padding=True, add_special_tokens=False, return_tensors="pt")
    return (
        torch.cat([prompts.input_ids, responses.input_ids], dim=1),
        torch.cat([prompts.attention_mask, responses.attention_mask], dim=1),
    )


def test_compute_reward_combines_all_kinds(stub, tiny_reward_model_dir, http_server):
    response = _call(stub, _full_batch(data_source=["arith"] * 3))
    out = batch_from_proto(response.batch)

    rule = torch.tensor([1.0, 0.0, 1.0])
    model = RewardModel(tiny_reward_model_dir, "float32", 16).score(*_encode())
    http = torch.tensor(
        [
            http_server.expected_score({"response_text": r, "ground_truth": t})
            for r, t in zip(RESPONSES, TRUTHS, strict=True)
        ]
    )
    assert out.tensors["scores_rule"].tolist() == rule.tolist()
    torch.testing.assert_close(out.tensors["scores_model"], model, atol=1e-5, rtol=1e-5)
    assert out.tensors["scores_http"].tolist() == http.tolist()
    torch.testing.assert_close(
        out.tensors["scores"],
        WEIGHTS["rule"] * rule + WEIGHTS["model"] * model + WEIGHTS["http"] * http,
        atol=1e-5,
        rtol=1e-5,
    )
    assert out.tensors["scores"].dtype == torch.float32
    assert out.meta["step"] == 7
    metrics = dict(response.metrics)
    assert metrics["samples"] == 3 and metrics["http_requests"] == 3
    assert metrics["http_failures"] == 0 and metrics["http_retries"] == 0
    assert {"rule_s", "model_s", "http_s"} <= set(metrics)
    # The HTTP API received every row with its columns.
    sent = [r for r in http_server.requests if r.get("data_source") == "arith"]
    assert sorted(r["response_text"] for r in sent) == sorted(RESPONSES)


def test_rule_only_app_placed_by_label_needs_no_tensors(stub):
    batch = Batch(
        non_tensors={
            "response_text": ["... #### 1,200", "#### 7", "no answer"],
            "ground_truth": ["1200", "8", "3"],
        }
    )
    out = batch_from_proto(_call(stub, batch, app=APP_RULE).batch)
    assert out.tensors["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out.tensors["scores_rule"].tolist() == [1.0, 0.0, 0.0]
    assert set(out.tensors) == {"scores", "scores_rule"}


def _mismatched_rows():
    # Batch itself refuses unequal columns, so cut a row from the wire form.
    message = batch_to_proto(_full_batch())
    del message.non_tensors["ground_truth"].values[-1]
    return message


@pytest.mark.parametrize(
    ("make_batch", "code", "details"),
    [
        (
            lambda: batch_to_proto(_full_batch(response_text=None)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch.non_tensors['response_text']: missing",
        ),
        (
            _mismatched_rows,
            grpc.StatusCode.INVALID_ARGUMENT,
            "non-tensor 'ground_truth' has batch size 2 but 'attention_mask' has 3",
        ),
        (lambda: batch_to_proto(Batch()), grpc.StatusCode.INVALID_ARGUMENT, "batch: empty batch"),
        (
            lambda: batch_to_proto(
                Batch(non_tensors={"response_text": ["1"] * 9, "ground_truth": ["1"] * 9})
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "batch: 9 rows exceed this service's limit of 8",
        ),
        (
            lambda: batch_to_proto(
                Batch(non_tensors={"response_text": RESPONSES, "ground_truth": TRUTHS})
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch.tensors['input_ids']: missing",
        ),
    ],
    ids=["missing_response_text", "row_count_mismatch", "empty", "oversized", "missing_ids"],
)
def test_invalid_requests_name_the_field_and_replica_keeps_serving(stub, make_batch, code, details):
    request = reward_pb2.ComputeRewardRequest(batch=make_batch())
    with pytest.raises(grpc.RpcError) as error:
        stub.ComputeReward(request, metadata=call_metadata(APP_FULL), timeout=TIMEOUT_S)
    assert error.value.code() == code
    assert details in error.value.details(), error.value.details()
    response = _call(stub, _full_batch())  # a valid call right after works
    assert len(batch_from_proto(response.batch)) == 3


def test_callers_passed_deadline_is_deadline_exceeded(stub):
    request = reward_pb2.ComputeRewardRequest(batch=batch_to_proto(_full_batch()))
    with pytest.raises(grpc.RpcError) as error:
        stub.ComputeReward(
            request,
            metadata=call_metadata(APP_FULL, deadline_metadata(-1.0)),
            timeout=TIMEOUT_S,
        )
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("sent", [None, "not-the-cluster-token"], ids=["no_token", "wrong_token"])
def test_call_without_the_clusters_token_is_unauthenticated(stub, sent):
    token = auth.expected_token()
    assert token is not None  # serve_cluster turns authentication on for the session
    metadata = [("application", APP_FULL), deadline_metadata(TIMEOUT_S)]
    if sent is not None:
        metadata.append((auth.TOKEN_METADATA_KEY, sent))
    requests = {
        "ComputeReward": reward_pb2.ComputeRewardRequest(batch=batch_to_proto(_full_batch())),
        "GetInfo": reward_pb2.RewardServiceGetInfoRequest(),
    }
    for rpc, request in requests.items():
        with pytest.raises(grpc.RpcError) as error:
            getattr(stub, rpc)(request, metadata=metadata, timeout=TIMEOUT_S)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, rpc
        details = error.value.details()
        assert auth.TOKEN_METADATA_KEY in details and auth.TOKEN_ENV in details, details
        assert token not in details and (sent is None or sent not in details)
    response = _call(stub, _full_batch())  # the replica keeps serving callers with the token
    assert len(batch_from_proto(response.batch)) == 3


def test_get_info(stub, tiny_reward_model_dir):
    node_id = ray.get_runtime_context().get_node_id()
    full = stub.GetInfo(
        reward_pb2.RewardServiceGetInfoRequest(),
        metadata=call_metadata(APP_FULL),
        timeout=TIMEOUT_S,
    )
    assert full.info.role == "reward"
    assert full.info.model == str(tiny_reward_model_dir) and full.info.engine == "hf"
    assert dict(full.kind_weights) == WEIGHTS
    assert full.info.rlserve_version == version("rlserve-reward")
    rule = stub.GetInfo(
        reward_pb2.RewardServiceGetInfoRequest(),
        metadata=call_metadata(APP_RULE),
        timeout=TIMEOUT_S,
    )
    assert dict(rule.kind_weights) == {"rule": 1.0} and rule.info.model == ""
    assert rule.info.workers[0].node_id == node_id  # the label-placed replica's node
    assert rule.info.workers[0].pid > 0
