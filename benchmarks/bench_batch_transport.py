"""How fast a large batch moves on each hop, next to Ray's own object transfer.

One 64 MiB float32 batch (`--mib`), in one run on a private local Ray:

- wire codec (trainer -> service): batch_to_proto + SerializeToString on the sending
  side, FromString + batch_from_proto on the receiving side (what the gRPC hop adds
  besides the socket), in process;
- service -> workers: `WorkerGroup.run_split` to 1 and to 2 worker processes that
  answer with their row count (each rank is sent its rows only);
- trainer -> service -> workers, the whole way: a `ServiceClient.call_api` to a
  replica (the services' own `batch_rpc` wrapper: auth, tracing, errors) that takes the
  batch and `run_split`s it to 2 workers, as a service's ComputeRefLogProb does before
  its forward (here the workers only count rows); three routes: protobuf through Serve's
  gRPC proxy, protobuf direct to the replica's own port (Serve's direct ingress), and
  the handle route (rlserve.core.serving.ServiceEndpoint: the request dataclass and its
  Batch through Ray's object store, the trainer's route for batches);
- a small call the same three ways (64 rows x 24 int64 ids, the embedded default's
  size): per-call latency, what each of a PPO step's RPCs pays; and 1 and 4 MiB calls,
  between which the handle route overtakes direct gRPC;
- the reference: `ray.put` of the same bytes and a worker process `ray.get`-ing them,
  timed first and last; the faster of the two is the yardstick.

Each figure is GB/s of the batch's bytes over the median of `--repeats` timed calls
after one warm-up; the Ray figures are printed with their ratio to `ray.put/get`.

    .venv/bin/python benchmarks/bench_batch_transport.py [--mib 64] [--repeats 5]
"""

import argparse
import asyncio
import statistics
import time

import ray
import torch
from ray import serve

from rlserve.core import api
from rlserve.core.batch import Batch
from rlserve.core.cluster import start_local_ray, start_serve_on_a_free_port
from rlserve.core.codec import batch_from_proto, batch_to_proto
from rlserve.core.rpc import ServiceClient, direct_grpc_target, open_channel
from rlserve.core.serving import ServiceEndpoint, batch_rpc
from rlserve.core.workers import WorkerGroup
from rlserve.v1 import common_pb2, reference_pb2_grpc

SMALL_ROWS = 64
# Where the handle route overtakes a direct gRPC call (rlserve.core.rpc.HANDLE_ROUTE_MIN_BYTES).
MID_SIZES_MIB = (1, 4)


class RowCounter:
    """A rank that only looks at what it was sent."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank

    def node_address(self):
        return ("127.0.0.1", 0)

    def init_distributed(self, address, port):
        pass

    def rows(self, batch: Batch) -> Batch:
        return Batch(tensors={"rows": torch.full((len(batch),), len(batch))})


@serve.deployment(ray_actor_options={"num_cpus": 0})
class BatchSink(ServiceEndpoint):
    """A service replica without a model: takes the request's batch and splits it over
    its worker ranks, then answers with the rows the ranks counted."""

    def __init__(self, workers: int):
        self.group = WorkerGroup(RowCounter, workers, {}, num_cpus_per_worker=0.5)

    @batch_rpc(api.ComputeRefLogProbRequest)
    async def ComputeRefLogProb(self, request, call):
        return api.BatchAnswer(await self.group.run_split("rows", request.batch))


def through_serve(batches: dict[str, Batch], workers: int, repeats: int) -> dict[str, float]:
    """Median seconds of one call trainer -> replica -> `workers` ranks, for each batch
    and route: protobuf through Serve's gRPC proxy or direct to the replica's own gRPC
    port (Serve's direct ingress), or the Batch by the handle route (rlserve.core.rpc)."""
    port = start_serve_on_a_free_port()
    serve.run(BatchSink.bind(workers), name="reference", route_prefix="/reference")

    async def timed_calls(batch: Batch, route: str) -> list[float]:
        # the channel belongs to this event loop
        channel = open_channel(f"127.0.0.1:{port}")
        client = ServiceClient(
            channel,
            reference_pb2_grpc.ReferenceServiceStub,
            "reference",
            600,
            direct=route == "direct",
            handle=route == "handle",
            handle_min_bytes=0,
        )
        times = []
        for _ in range(repeats + 1):  # the first warms up
            started = time.perf_counter()
            counted = (await client.call_api(api.ComputeRefLogProbRequest(batch))).batch
            times.append(time.perf_counter() - started)
            assert int(counted["rows"].sum()) == len(batch) ** 2 // workers
            assert client.last_route == route, f"asked for {route}, went {client.last_route}"
        await client.close()
        await channel.close()
        return times[1:]

    assert direct_grpc_target("reference") is not None, "Serve's direct ingress is off"
    try:
        return {
            f"{name}, {route}": statistics.median(asyncio.run(timed_calls(batch, route)))
            for name, batch in batches.items()
            for route in ("proxy", "direct", "handle")
        }
    finally:
        serve.shutdown()


@ray.remote(num_cpus=0)
class Getter:
    def nbytes(self, wrapped: list) -> int:
        return len(memoryview(ray.get(wrapped[0])).cast("B"))


def median_s(work, repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = args.mib * 2**20 // (4 * 4096)
    batch = Batch(tensors={"x": torch.randn(rows, 4096)})
    gigabytes = rows * 4096 * 4 / 1e9
    results: dict[str, float] = {}

    def encode() -> bytes:
        return batch_to_proto(batch).SerializeToString()

    wire = encode()
    results["codec encode (send side)"] = median_s(encode, args.repeats)
    results["codec decode (receive side)"] = median_s(
        lambda: batch_from_proto(common_pb2.Batch.FromString(wire)), args.repeats
    )

    start_local_ray(num_cpus=2, log_to_driver=False)  # with Serve's direct ingress on
    try:
        getter = Getter.remote()
        ray.get(getter.nbytes.remote([ray.put(b"")]))
        array = batch.tensors["x"].numpy()

        def ray_put_get() -> float:
            return median_s(lambda: ray.get(getter.nbytes.remote([ray.put(array)])), args.repeats)

        ray_reference_s = [ray_put_get()]
        for workers in (1, 2):
            group = WorkerGroup(RowCounter, workers, {}, num_cpus_per_worker=0.5)
            try:
                results[f"run_split to {workers} worker(s)"] = median_s(
                    lambda group=group: asyncio.run(group.run_split("rows", batch)), args.repeats
                )
            finally:
                group.shutdown()
        small = Batch(tensors={"input_ids": torch.ones(SMALL_ROWS, 24, dtype=torch.int64)})
        mid_sized = {
            f"{mib} MiB call": Batch(tensors={"x": torch.randn(mib * 2**20 // (4 * 4096), 4096)})
            for mib in MID_SIZES_MIB
        }
        whole_way = through_serve(
            {"trainer -> service -> 2 workers": batch, "small call": small, **mid_sized},
            2,
            args.repeats,
        )
        # Again at the end: a fresh cluster's first puts can be several times slower, and
        # the faster of the two is the stricter yardstick.
        ray_reference_s.append(ray_put_get())
    finally:
        ray.shutdown()

    reference = results["ray.put + ray.get"] = min(ray_reference_s)
    print(f"{args.mib} MiB batch ({rows} rows x 4096 float32), median of {args.repeats}")
    first, last = (f"{seconds * 1e3:.1f}" for seconds in ray_reference_s)
    print(f"  (ray.put + ray.get: {first} ms first, {last} ms last; the faster is the yardstick)")
    for name, seconds in results.items():
        ratio = f"  ({reference / seconds:.2f}x ray.put/get)" if "worker" in name else ""
        print(f"  {name:<40}{gigabytes / seconds:6.2f} GB/s  ({seconds * 1e3:7.1f} ms){ratio}")
    for name, seconds in whole_way.items():
        if name.startswith("small call"):
            print(f"  {name:<40}{'':>11}  ({seconds * 1e3:7.1f} ms)  ({SMALL_ROWS} x 24 int64)")
        elif " MiB call" in name:
            print(f"  {name:<40}{'':>11}  ({seconds * 1e3:7.1f} ms)")
        else:
            ratio = f"  ({reference / seconds:.2f}x ray.put/get)"
            print(f"  {name:<40}{gigabytes / seconds:6.2f} GB/s  ({seconds * 1e3:7.1f} ms){ratio}")


if __name__ == "__main__":
    main()
