"""Real local HTTP scoring servers for the reward tests (stdlib, one thread per request).

`score_server(...)` starts a ThreadingHTTPServer on 127.0.0.1 at a free port; every
server stops when the test module ends. Behaviour knobs:
- delay_s: sleep before answering (slow API / concurrency measurement);
- fail_first: answer 500 to the first k requests of each sample (keyed by
  response_text), then answer normally; -1 = always 500;
- bad_body: answer 200 with a body that has no "score" (a broken API).
The normal answer is `expected_score(payload)` (also `server.expected_score`, as test
modules cannot import a conftest), computed from the request, so a test only passes when
the service really sent the sample and used the answer.
"""

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlserve.core.cluster import free_port


def expected_score(payload: dict) -> float:
    """What the normal server answers: half the response length, +10 when correct."""
    response, truth = payload["response_text"], payload.get("ground_truth")
    return 0.5 * len(response) + (10.0 if response.strip() == truth else 0.0)


@dataclass
class ScoreServer:
    url: str
    delay_s: float = 0.0
    fail_first: int = 0
    bad_body: bool = False
    redirect_location: str | None = None  # requests to /score answer 307 to it
    body_bytes: int = 0  # answer a body this long (padding after the score)
    send_length: bool = True  # False: no Content-Length, the body ends at close
    requests: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    attempts: Counter = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    expected_score = staticmethod(expected_score)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 would make a burst of 64 connections wait for SYN retries.
    request_queue_size = 256

    def handle_error(self, request, client_address) -> None:
        # A client that timed out hangs up mid-request: expected in the slow tests.
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(server_state: ScoreServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so the client's pool is exercised
        # Headers and body go out in two writes; without this, Nagle + delayed ACK add 40 ms.
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with server_state.lock:
                server_state.requests.append(payload)
                server_state.headers.append(dict(self.headers))
                server_state.attempts[payload["response_text"]] += 1
                attempt = server_state.attempts[payload["response_text"]]
                server_state.in_flight += 1
                server_state.max_in_flight = max(server_state.max_in_flight, server_state.in_flight)
            try:
                time.sleep(server_state.delay_s)
                failing = server_state.fail_first
                if server_state.redirect_location and self.path == "/score":
                    self._redirect(server_state.redirect_location)
                elif server_state.body_bytes:
                    self._send_padded(server_state.body_bytes, expected_score(payload))
                elif failing < 0 or attempt <= failing:
                    self._send(500, {"error": "scoring backend down"})
                elif server_state.bad_body:
                    self._send(200, {"result": "no score here"})
                else:
                    self._send(200, {"score": expected_score(payload)})
            finally:
                with server_state.lock:
                    server_state.in_flight -= 1

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and hung up: expected in the slow tests

        def _redirect(self, location: str) -> None:
            self.send_response(307)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _send_padded(self, size: int, score: float) -> None:
            head = json.dumps({"score": score}).encode()
            data = head + b" " * max(0, size - len(head))  # whitespace: still valid JSON
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if server_state.send_length:
                    self.send_header("Content-Length", str(len(data)))
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading at its cap

        def log_message(self, format: str, *args) -> None:  # quiet test output
            pass

    return Handler


@pytest.fixture(scope="module")
def score_server() -> Iterator[Callable[..., ScoreServer]]:
    """Starts servers on demand; all stop when the test module ends."""
    servers: list[ThreadingHTTPServer] = []

    def start(**behaviour) -> ScoreServer:
        port = free_port()
        state = ScoreServer(url=f"http://127.0.0.1:{port}/score", **behaviour)
        httpd = _Server(("127.0.0.1", port), _handler(state))
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(httpd)
        return state

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny LlamaForSequenceClassification (num_labels=1) + char
    tokenizer in HF format; the score head is scaled up so rows score clearly apart."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlserve.core.embedded.tokenizer import save_char_tokenizer

    directory = tmp_path_factory.mktemp("tiny_reward_model")
    tokenizer = save_char_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(50.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def encode_rows(tokenizer, prompts: list[str], responses: list[str]):
    """rlserve's layout: left-padded prompt (with BOS) then right-padded response + EOS.

    Returns input_ids, attention_mask [N, P+R] int64."""
    import torch

    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    response_ids = [
        tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for r in responses
    ]
    width_p = max(map(len, prompt_ids))
    width_r = max(map(len, response_ids))
    pad = tokenizer.pad_token_id
    ids, mask = [], []
    for p, r in zip(prompt_ids, response_ids, strict=True):
        left, right = width_p - len(p), width_r - len(r)
        ids.append([pad] * left + p + r + [pad] * right)
        mask.append([0] * left + [1] * (len(p) + len(r)) + [0] * right)
    return torch.tensor(ids), torch.tensor(mask)


@pytest.fixture(scope="session")
def encode():
    """`encode_rows` as a fixture (test modules cannot import a conftest)."""
    return encode_rows
