"""The shared-secret token (rlserve.core.auth): where it is read from, what a client sends,
what a server refuses; then rpc_method and ServiceClient over a real gRPC (aio) server in
this process (no Ray): a call without the token or with another one is UNAUTHENTICATED,
never reaches the method, never sees the token echoed, and the server keeps serving."""

import asyncio

import grpc
import pytest
import torch

from rlserve.core import auth
from rlserve.core.batch import Batch
from rlserve.core.codec import batch_to_proto
from rlserve.core.rpc import RetryPolicy, ServiceClient, call_metadata
from rlserve.core.serving import deadline_metadata, rpc_method
from rlserve.v1 import reward_pb2, reward_pb2_grpc


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    auth._read_token_file.cache_clear()
    yield monkeypatch
    auth._read_token_file.cache_clear()


def test_generated_tokens_are_long_random_and_url_safe():
    tokens = {auth.generate_token() for _ in range(20)}
    assert len(tokens) == 20
    for token in tokens:
        assert len(token) == 43
        assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_no_token_configured_means_none_sent_and_every_call_accepted(no_token):
    assert auth.expected_token() is None
    assert auth.token_metadata() == []
    assert auth.rejection([]) is None
    assert auth.rejection([(auth.TOKEN_METADATA_KEY, "anything")]) is None
    no_token.setenv(auth.TOKEN_ENV, "   ")  # blank counts as unset
    assert auth.expected_token() is None


def test_token_from_the_environment(no_token):
    no_token.setenv(auth.TOKEN_ENV, " s3cret\n")
    assert auth.expected_token() == "s3cret"
    assert auth.token_metadata() == [("rlserve-token", "s3cret")]


def test_token_from_a_file_is_stripped_and_read_once(no_token, tmp_path):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    no_token.setenv(auth.TOKEN_FILE_ENV, str(path))
    assert auth.expected_token() == "from-file"
    path.write_text("changed")  # read once per process
    assert auth.expected_token() == "from-file"
    no_token.setenv(auth.TOKEN_ENV, "from-env")  # the variable wins over the file
    assert auth.expected_token() == "from-env"


@pytest.mark.parametrize("state", ["missing", "empty", "directory"])
def test_unusable_token_file_is_an_error_naming_the_variable(no_token, tmp_path, state):
    path = tmp_path / "token"
    if state == "empty":
        path.write_text(" \n")
    elif state == "directory":
        path.mkdir()
    no_token.setenv(auth.TOKEN_FILE_ENV, str(path))
    with pytest.raises(auth.AuthConfigError, match=f"^{auth.TOKEN_FILE_ENV}={path}: "):
        auth.expected_token()
    with pytest.raises(auth.AuthConfigError):
        auth.token_metadata()  # a client fails at once rather than send no token


def test_token_that_grpc_cannot_carry_is_refused(no_token):
    no_token.setenv(auth.TOKEN_ENV, "naïve")
    with pytest.raises(auth.AuthConfigError, match=f"^{auth.TOKEN_ENV}: .*printable ASCII"):
        auth.expected_token()


def test_rejection_names_the_key_and_the_fix_and_never_echoes_a_token(no_token):
    right = "tok-A1b2C3"
    no_token.setenv(auth.TOKEN_ENV, right)
    assert auth.rejection([("application", "x"), ("rlserve-token", right)]) is None
    assert auth.rejection([("rlserve-token", right.encode())]) is None
    missing = auth.rejection([("application", "x")])
    assert missing.startswith("missing metadata 'rlserve-token'")
    assert "set RLSERVE_AUTH_TOKEN" in missing and "tok-" not in missing
    for sent in ("tok-Z9y8X7", "", right + " ", right[:-1], right * 10):
        message = auth.rejection([("rlserve-token", sent)])
        assert message.startswith("wrong token in metadata 'rlserve-token'"), sent
        assert "set RLSERVE_AUTH_TOKEN" in message and "tok-" not in message


def test_call_metadata_routes_then_authenticates_then_adds_extras(no_token):
    assert call_metadata("reward") == [("application", "reward")]
    no_token.setenv(auth.TOKEN_ENV, "t")
    deadline = deadline_metadata(5.0)
    assert call_metadata("reward", deadline) == [
        ("application", "reward"),
        ("rlserve-token", "t"),
        deadline,
    ]
    assert call_metadata(None) == [("rlserve-token", "t")]  # the trainer's control service


# --- rpc_method over real gRPC -----------------------------------------------------------


class CountingReward(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self):
        self.calls = 0

    @rpc_method(reward_pb2.ComputeRewardResponse)
    async def ComputeReward(self, request, call):
        self.calls += 1
        return reward_pb2.ComputeRewardResponse(metrics={"rows": 2.0})


def _request() -> reward_pb2.ComputeRewardRequest:
    batch = Batch(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.int64)})
    return reward_pb2.ComputeRewardRequest(batch=batch_to_proto(batch))


async def _calls(servicer: CountingReward, metadatas: list[list[tuple[str, str]]]) -> list:
    """One direct ComputeReward per entry of `metadatas`, then one through ServiceClient;
    returns each outcome (response or AioRpcError)."""
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outcomes: list = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            for metadata in metadatas:
                try:
                    outcomes.append(await stub.ComputeReward(_request(), metadata=metadata))
                except grpc.aio.AioRpcError as error:
                    outcomes.append(error)
            client = ServiceClient(
                channel,
                reward_pb2_grpc.RewardServiceStub,
                "reward",
                timeout_s=10,
                policy=RetryPolicy(retries=0),
                direct=False,  # this server, never a Serve app of the session's cluster
            )
            outcomes.append(await client.call("ComputeReward", _request()))
    finally:
        await server.stop(None)
    return outcomes


def test_rpc_method_refuses_a_missing_or_wrong_token_and_keeps_serving(no_token):
    token = auth.generate_token()
    no_token.setenv(auth.TOKEN_ENV, token)
    servicer = CountingReward()
    missing, wrong, right, client = asyncio.run(
        _calls(
            servicer,
            [
                [("application", "reward")],
                [("application", "reward"), ("rlserve-token", "guess")],
                call_metadata("reward"),
            ],
        )
    )
    for error in (missing, wrong):
        assert isinstance(error, grpc.aio.AioRpcError)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "rlserve-token" in error.details() and "RLSERVE_AUTH_TOKEN" in error.details()
        assert token not in error.details() and "guess" not in error.details()
    assert missing.details().startswith("missing metadata")
    assert wrong.details().startswith("wrong token")
    assert right.metrics["rows"] == 2.0 and client.metrics["rows"] == 2.0
    assert servicer.calls == 2  # the refused calls never reached the method


def test_rpc_method_without_a_token_accepts_every_call(no_token):
    servicer = CountingReward()
    outcomes = asyncio.run(_calls(servicer, [[("application", "reward")]]))
    assert all(isinstance(o, reward_pb2.ComputeRewardResponse) for o in outcomes)
    assert servicer.calls == 2


def test_a_server_without_a_token_starts_only_when_told_auth_none(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    with pytest.raises(auth.AuthConfigError) as refused:
        auth.server_auth_mode("token", "critic")
    message = str(refused.value)
    assert "the critic service has no token" in message
    assert auth.TOKEN_ENV in message and "auth: none" in message
    assert auth.server_auth_mode("none", "critic") == "none"
    with pytest.raises(auth.AuthConfigError, match="not one of token, none"):
        auth.server_auth_mode("off", "critic")
    monkeypatch.setenv(auth.TOKEN_ENV, "tok-123")
    assert auth.server_auth_mode("token", "critic") == "token"
    assert auth.server_auth_mode("none", "critic") == "token"  # a token is always checked
