"""Oversized requests without a token, on loopback: Serve's proxy and a replica's own
gRPC port refuse them from their length prefix (RESOURCE_EXHAUSTED) instead of buffering
up to 2 GiB each before the token is checked, so a flood neither fills the node's memory
nor gets a stateful replica replaced.

The flood speaks HTTP/2 itself (a few frames, no HPACK table, flow control obeyed): a
gRPC client would have to hold each 1 GiB message in memory to send it.
"""

import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest

from integration_tests.support import fresh_services, run_inputs, tiny_run_config
from rlserve.core.message_limits import DEFAULT_LIMIT_BYTES, message_limit_bytes
from rlserve.core.placement import serve_replicas
from rlserve.core.rpc import call_metadata, direct_grpc_target
from rlserve.v1 import critic_pb2, critic_pb2_grpc

pytestmark = pytest.mark.slow

CLAIMED_BYTES = 2**30  # each request says it is 1 GiB long, and would send all of it
FLOOD_STREAMS = 8
SEND_CAP_BYTES = 2**30
UPDATE_CRITIC = b"/rlserve.v1.CriticService/UpdateCritic"
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _hpack_int(value: int) -> bytes:
    if value < 127:
        return bytes([value])
    out, value = [127], value - 127
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    return bytes([*out, value])


def _header(name: bytes, value: bytes) -> bytes:
    # literal field, not indexed, new name, no Huffman coding
    return b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value


def _flood_one(address: str, application: str) -> tuple[bool, int]:
    """(refused, bytes of message sent) for one request that claims CLAIMED_BYTES."""
    host, port = address.rsplit(":", 1)
    headers = b"".join(
        _header(name, value)
        for name, value in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", UPDATE_CRITIC),
            (b":authority", address.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"application", application.encode()),
        )
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            _PREFACE + _frame(_SETTINGS, 0, 0) + _frame(_HEADERS, _END_HEADERS, 1, headers)
        )
        connection_window = stream_window = 65535
        message = b"\x00" + CLAIMED_BYTES.to_bytes(4, "big")  # gRPC's length prefix
        zeros = bytes(16384)
        sent, received = 0, b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0 if sent < SEND_CAP_BYTES else 0.5)
            if readable:
                data = sock.recv(1 << 16)
                if not data:
                    return True, sent  # the server closed the connection
                received += data
                while len(received) >= 9 and len(received) >= 9 + int.from_bytes(received[:3]):
                    length = int.from_bytes(received[:3])
                    kind, flags = received[3], received[4]
                    stream = int.from_bytes(received[5:9]) & 0x7FFFFFFF
                    payload, received = received[9 : 9 + length], received[9 + length :]
                    if kind == _WINDOW_UPDATE:
                        increment = int.from_bytes(payload) & 0x7FFFFFFF
                        if stream == 0:
                            connection_window += increment
                        else:
                            stream_window += increment
                    elif kind == _SETTINGS and not flags & _ACK:
                        for offset in range(0, len(payload), 6):
                            if int.from_bytes(payload[offset : offset + 2]) == 4:  # window
                                stream_window += (
                                    int.from_bytes(payload[offset + 2 : offset + 6]) - 65535
                                )
                        sock.sendall(_frame(_SETTINGS, _ACK, 0))
                    elif kind == _PING and not flags & _ACK:
                        sock.sendall(_frame(_PING, _ACK, 0, payload))
                    elif (kind == _RST_STREAM and stream == 1) or kind == _GOAWAY:
                        return True, sent
                    elif kind == _HEADERS and stream == 1 and flags & _END_STREAM:
                        return True, sent  # trailers: the call ended with a status
            room = min(connection_window, stream_window, 16384, SEND_CAP_BYTES - sent)
            if room > len(message):
                chunk = message + zeros[: room - len(message)]
                message = b""
                sock.sendall(_frame(_DATA, 0, 1, chunk))
                sent += len(chunk)
                connection_window -= len(chunk)
                stream_window -= len(chunk)
        return False, sent


class _PeakMemory:
    """The largest resident size each process reached while the flood ran."""

    def __init__(self, pids: dict[str, int]):
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.base = {name: p.memory_info().rss for name, p in self.processes.items()}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, process in self.processes.items():
                self.peak[name] = max(self.peak[name], process.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> "_PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def growth_mib(self) -> dict[str, float]:
        return {name: (self.peak[name] - self.base[name]) / 2**20 for name in self.peak}


def _proxy_pid() -> int:
    import os

    import ray

    (proxy,) = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_PROXY_ACTOR")
    ]
    handle = ray.get_actor(proxy["name"], namespace=proxy["namespace"])
    return ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)


def test_oversized_requests_without_a_token_are_refused_before_they_are_buffered(
    serve_cluster, embedded, tmp_path
):
    config = tiny_run_config(tmp_path)
    fresh_services(config, run_inputs(embedded))
    proxy = serve_cluster.grpc_address
    direct = direct_grpc_target("critic")
    assert direct is not None, "the critic replica has no direct-ingress port"
    (critic_replica,) = serve_replicas("critic")
    replicas = {
        role: [r["replica_id"] for r in serve_replicas(role)] for role in ("rollout", "critic")
    }

    # One real gRPC call over each bound, without a token: the size is refused first
    # (before: UNAUTHENTICATED, after the whole message was read).
    for address, limit in (
        (proxy, DEFAULT_LIMIT_BYTES),
        (direct, message_limit_bytes(config.critic.max_request_tokens)),
    ):
        with grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", -1)]
        ) as channel:
            call = channel.unary_unary(UPDATE_CRITIC.decode())
            with pytest.raises(grpc.RpcError) as refused:
                call(bytes(limit + 2**20), metadata=[("application", "critic")], timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, address

    targets = [proxy, direct] * (FLOOD_STREAMS // 2)
    pids = {"proxy": _proxy_pid(), "critic replica": critic_replica["pid"]}
    with _PeakMemory(pids) as memory, ThreadPoolExecutor(FLOOD_STREAMS) as pool:
        outcomes = list(pool.map(lambda address: _flood_one(address, "critic"), targets))
    print(f"flood: {outcomes}; peak growth MiB {memory.growth_mib()}")
    assert all(refused for refused, _ in outcomes), outcomes
    # refused from the prefix: each stream got no further than its first windows
    assert all(sent < 64 * 2**20 for _, sent in outcomes), outcomes
    assert all(growth < 256 for growth in memory.growth_mib().values()), memory.growth_mib()

    # the stateful replicas are the same ones, and serve callers with the token
    assert {role: [r["replica_id"] for r in serve_replicas(role)] for role in replicas} == replicas
    with serve_cluster.channel() as channel:
        info = critic_pb2_grpc.CriticServiceStub(channel).GetInfo(
            critic_pb2.CriticServiceGetInfoRequest(), metadata=call_metadata("critic"), timeout=10
        )
    assert info.info.role == "critic"
