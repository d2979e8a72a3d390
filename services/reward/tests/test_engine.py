"""The engine without Ray: request checks, weighted combination of kinds, rule errors."""

import asyncio
import time

import grpc
import pytest
import torch

from rlserve.core.batch import Batch
from rlserve.core.config import ConfigError, validate_config
from rlserve.core.embedded.tokenizer import build_char_tokenizer
from rlserve.core.serving import Deadline, RpcError
from rlserve.reward.config import RewardServiceConfig
from rlserve.reward.engine import RewardEngine, RewardError, build_engine
from rlserve.reward.reward_model import RewardModel

PROMPTS = ["1+2=", "10+20=", "7+5=", "99+1="]
RESPONSES = ["3", "31", "12", "100 "]
TRUTHS = ["3", "30", "12", "100"]


def _engine(kinds: dict, **config) -> RewardEngine:
    return build_engine(validate_config(RewardServiceConfig, {"kinds": kinds, **config}))


def _score(engine: RewardEngine, batch: Batch, deadline: Deadline | None = None):
    async def go():
        try:
            return await engine.score(engine.parse(batch), deadline)
        finally:
            await engine.close()

    return asyncio.run(go())


def _text_batch(**extra_columns) -> Batch:
    return Batch(non_tensors={"response_text": RESPONSES, "ground_truth": TRUTHS, **extra_columns})


def test_weighted_combination_of_rule_model_and_http(tiny_reward_model_dir, encode, score_server):
    server = score_server()
    input_ids, attention_mask = encode(build_char_tokenizer(), PROMPTS, RESPONSES)
    batch = Batch(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask},
        non_tensors={"response_text": RESPONSES, "ground_truth": TRUTHS},
    )
    engine = _engine(
        {
            "rule": {"rule_name": "arithmetic_exact_match", "weight": 2.0},
            "model": {"model_path": str(tiny_reward_model_dir), "weight": 0.5},
            "http": {"url": server.url, "weight": -0.25},
        }
    )
    result = _score(engine, batch)

    rule = torch.tensor([1.0, 0.0, 1.0, 1.0])
    model = RewardModel(tiny_reward_model_dir, "float32", 16).score(input_ids, attention_mask)
    http = torch.tensor(
        [
            server.expected_score({"response_text": r, "ground_truth": t})
            for r, t in zip(RESPONSES, TRUTHS, strict=True)
        ]
    )
    assert result.kind_scores["rule"].tolist() == rule.tolist()
    torch.testing.assert_close(torch.from_numpy(result.kind_scores["model"]), model)
    assert result.kind_scores["http"].tolist() == http.tolist()
    scores = torch.from_numpy(result.scores)
    torch.testing.assert_close(scores, 2.0 * rule + 0.5 * model - 0.25 * http)
    assert scores.dtype == torch.float32
    assert {"rule_s", "model_s", "http_s", "http_requests", "http_retries", "http_failures"} <= set(
        result.metrics
    )
    assert result.metrics["samples"] == 4
    assert engine.kind_weights == {"rule": 2.0, "model": 0.5, "http": -0.25}


def test_user_rule_by_import_path_gets_extra_columns(tmp_path, monkeypatch):
    (tmp_path / "engine_user_rules.py").write_text(
        "def by_source(response_text, ground_truth, *, data_source, **extra):\n"
        "    return len(response_text) * (10.0 if data_source == 'gsm8k' else 1.0)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = _engine({"rule": {"rule_name": "engine_user_rules:by_source"}})
    result = _score(engine, _text_batch(data_source=["gsm8k", "x", "x", "gsm8k"]))
    assert result.scores.tolist() == [10.0, 2.0, 2.0, 40.0]


def test_kinds_run_concurrently(tmp_path, monkeypatch, score_server):
    (tmp_path / "slow_rules.py").write_text(
        "import time\n"
        "def slow(response_text, ground_truth):\n"
        "    time.sleep(0.125)\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    server = score_server(delay_s=0.5)
    engine = _engine({"rule": {"rule_name": "slow_rules:slow"}, "http": {"url": server.url}})
    start_s = time.perf_counter()
    result = _score(engine, _text_batch())
    elapsed_s = time.perf_counter() - start_s
    assert result.metrics["rule_s"] >= 0.5 and result.metrics["http_s"] >= 0.5
    assert elapsed_s < 0.85  # one after the other would take ≥ 1.0 s


def test_rule_that_raises_names_rule_and_row(tmp_path, monkeypatch):
    (tmp_path / "bad_rules.py").write_text(
        "def picky(response_text, ground_truth):\n"
        "    if response_text == '12':\n"
        "        raise KeyError('no')\n"
        "    return 0.0\n"
        "def nan(response_text, ground_truth):\n"
        "    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"rule 'bad_rules:picky' failed on row 2: KeyError"):
        _score(_engine({"rule": {"rule_name": "bad_rules:picky"}}), _text_batch())
    with pytest.raises(RewardError, match=r"rule 'bad_rules:nan' returned nan for row 0"):
        _score(_engine({"rule": {"rule_name": "bad_rules:nan"}}), _text_batch())


def test_passed_deadline_is_deadline_exceeded():
    with pytest.raises(RpcError) as error:
        _score(_engine({"rule": {"rule_name": "gsm8k"}}), _text_batch(), Deadline(time.time() - 1))
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("batch", "code", "message"),
    [
        (Batch(), "INVALID_ARGUMENT", "batch: empty batch"),
        (
            Batch(non_tensors={"response_text": ["a"] * 9, "ground_truth": ["a"] * 9}),
            "RESOURCE_EXHAUSTED",
            "batch: 9 rows exceed this service's limit of 8",
        ),
        (
            Batch(non_tensors={"ground_truth": ["a"]}),
            "INVALID_ARGUMENT",
            "batch.non_tensors['response_text']: missing",
        ),
        (
            Batch(non_tensors={"response_text": ["a"]}),
            "INVALID_ARGUMENT",
            "batch.non_tensors['ground_truth']: missing",
        ),
        (
            Batch(non_tensors={"response_text": ["a", None], "ground_truth": ["a", "b"]}),
            "INVALID_ARGUMENT",
            "batch.non_tensors['response_text'][1]: must be a string, got NoneType",
        ),
        (
            Batch(non_tensors={"response_text": ["a"], "ground_truth": [3.0]}),
            "INVALID_ARGUMENT",
            "batch.non_tensors['ground_truth'][0]: must be a string, got float",
        ),
    ],
)
def test_parse_rejects_bad_text_batches(batch, code, message):
    engine = _engine({"rule": {"rule_name": "gsm8k"}}, max_batch_samples=8)
    with pytest.raises(RpcError) as error:
        engine.parse(batch)
    assert error.value.code == getattr(grpc.StatusCode, code)
    assert error.value.message.startswith(message), error.value.message


def test_http_only_needs_no_ground_truth(score_server):
    server = score_server()
    engine = _engine({"http": {"url": server.url}})
    result = _score(engine, Batch(non_tensors={"response_text": ["abcd"]}))
    assert result.scores.tolist() == [2.0]
    assert server.requests == [{"response_text": "abcd"}]


def test_parse_checks_model_inputs(tiny_reward_model_dir, encode):
    engine = _engine({"model": {"model_path": str(tiny_reward_model_dir)}})
    ids, mask = encode(build_char_tokenizer(), PROMPTS, RESPONSES)
    text = {"response_text": RESPONSES}
    cases = [
        (Batch(non_tensors=text), "batch.tensors['input_ids']: missing"),
        (Batch(tensors={"input_ids": ids}), "batch.tensors['attention_mask']: missing"),
        (
            Batch(tensors={"input_ids": ids + 1000, "attention_mask": mask}),
            "batch.tensors['input_ids']: token ids must lie in 0..",
        ),
        (
            Batch(tensors={"input_ids": ids, "attention_mask": mask[:, :-1]}),
            "batch.tensors['attention_mask']: shape",
        ),
        (
            Batch(
                tensors={
                    "input_ids": ids,
                    "attention_mask": mask * torch.tensor([[1], [0], [1], [1]]),
                }
            ),
            "batch.tensors['attention_mask']: row 1 has no real token",
        ),
    ]
    for batch, message in cases:
        with pytest.raises(RpcError) as error:
            engine.parse(batch)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.message.startswith(message), error.value.message
    # A model-only service needs no text columns.
    result = _score(engine, Batch(tensors={"input_ids": ids, "attention_mask": mask}))
    assert result.scores.shape == (4,)


def test_rule_reads_at_most_max_text_chars():
    engine = _engine({"rule": {"rule_name": "gsm8k", "max_text_chars": 10}})
    long_row = Batch(
        non_tensors={"response_text": ["#### 1", "#" * 11], "ground_truth": ["1", "1"]}
    )
    with pytest.raises(RpcError) as error:
        engine.parse(long_row)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch.non_tensors['response_text'][1]: has 11 characters" in str(error.value)
    assert "kinds.rule.max_text_chars" in str(error.value)
    long_truth = Batch(non_tensors={"response_text": ["#### 1"], "ground_truth": ["1" * 11]})
    with pytest.raises(RpcError, match=r"\['ground_truth'\]\[0\]: has 11 characters"):
        engine.parse(long_truth)
    exact = Batch(non_tensors={"response_text": ["#### 1" + " " * 4], "ground_truth": ["1"]})
    assert _score(engine, exact).scores.tolist() == [1.0]


def test_rule_time_budget_stops_the_call(tmp_path, monkeypatch):
    (tmp_path / "budget_rules.py").write_text(
        "import time\n"
        "calls = []\n"
        "def slow(response_text, ground_truth):\n"
        "    calls.append(1)\n"
        "    time.sleep(0.5)\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = _engine({"rule": {"rule_name": "budget_rules:slow", "time_budget_s": 0.7}})
    with pytest.raises(RpcError) as error:
        _score(engine, _text_batch())
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "kinds.rule.time_budget_s" in str(error.value)
    assert "after 2 of 4 rows" in str(error.value)
    import budget_rules

    assert len(budget_rules.calls) == 2  # stopped between rows, not after all of them


def test_header_values_are_read_from_the_replicas_environment_or_a_file(
    score_server, tmp_path, monkeypatch
):
    server = score_server()
    monkeypatch.setenv("VERIFIER_KEY", "Bearer from-env")
    (tmp_path / "token").write_text("from-file\n")
    headers = {"Authorization": "env:VERIFIER_KEY", "X-Token": f"file:{tmp_path / 'token'}"}
    engine = _engine({"http": {"url": server.url, "headers": {**headers, "X-Plain": "as-is"}}})
    _score(engine, _text_batch())
    sent = server.headers[-1]
    assert (sent["Authorization"], sent["X-Token"], sent["X-Plain"]) == (
        "Bearer from-env", "from-file", "as-is")  # fmt: skip


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("env:RLSERVE_TEST_UNSET_VARIABLE", "environment variable 'RLSERVE_TEST_UNSET_VARIABLE'"),
        ("file:/nonexistent/token", "file '/nonexistent/token', which the reward replica cannot"),
    ],
)
def test_a_header_reference_that_resolves_to_nothing_names_the_header(value, problem):
    with pytest.raises(ConfigError) as error:
        _engine({"http": {"url": "http://127.0.0.1:9/", "headers": {"Authorization": value}}})
    assert str(error.value).startswith("kinds.http.headers.Authorization: refers to ")
    assert problem in str(error.value)
