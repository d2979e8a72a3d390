"""A discarding OTLP/gRPC trace receiver in its own process, for benchmarks.

It does what a collector's receiver does before storage (accept ExportTraceService
calls, decode them) and counts spans per `service.name`, so a benchmark measures what
the traced processes pay without a backend's storage competing for the same CPUs.

    sink = OtlpSink(Path("counts.json"))     # starts `python -m benchmarks.otlp_sink`
    setup_tracing(..., endpoint=sink.endpoint, ...)
    counts = sink.stop()                     # {"rlserve-trainer": 812, ...}
"""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

START_TIMEOUT_S = 30.0


def serve(port: int, counts_path: Path) -> None:
    """Receives on 127.0.0.1:`port` until SIGTERM, then writes the counts as JSON."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    counts: Counter[str] = Counter()
    lock = threading.Lock()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            with lock:
                for resource_spans in request.resource_spans:
                    service = next(
                        (
                            a.value.string_value
                            for a in resource_spans.resource.attributes
                            if a.key == "service.name"
                        ),
                        "unknown",
                    )
                    counts[service] += sum(len(s.spans) for s in resource_spans.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    )
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.stop(grace=2).wait()
    with lock:
        counts_path.write_text(json.dumps(dict(counts)))


class OtlpSink:
    """The receiver as a child process: `endpoint` while it runs, `stop()` the counts."""

    def __init__(self, counts_path: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.counts_path = counts_path
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.otlp_sink", str(self.port), str(counts_path)],
            cwd=Path(__file__).resolve().parents[1],
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.process.kill()
                    raise RuntimeError("the OTLP sink did not start") from None
                time.sleep(0.1)

    def stop(self) -> dict[str, int]:
        """Stops the receiver; spans received per service.name."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        return json.loads(self.counts_path.read_text()) if self.counts_path.exists() else {}


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
