"""What tracing costs a PPO step: off, on at sampling 1.0, and on at 0.01, in one run.

    .venv/bin/python -m benchmarks.bench_tracing_cost              # default config
    .venv/bin/python -m benchmarks.bench_tracing_cost --rounds 10 --prompts-per-step 64

Method:
- One local Ray cluster, one deployment of the four services, one trainer: the modes
  differ only in the trainer's tracing set-up, switched between rounds. The services are
  deployed with tracing on and sampling ratio 0, so they trace exactly the steps the
  trainer samples (parent-based sampling) and start no trace of their own. In mode
  "off" the trainer has no tracer at all, sends no trace context, and each service call
  opens one non-recording span in the replica (no worker span, no export): the
  deployment a user runs with tracing off has not even that, a difference of a few
  microseconds per call (rlserve.core.tracing measures a span at ≈ 1 µs).
- Spans go over OTLP/gRPC to a receiver in its own process that counts and discards
  them, so the figure is what the traced processes pay (span creation, batching,
  protobuf encoding and sending on the exporter thread), not a collector's storage;
  `--otlp-endpoint` sends them to a real collector (Jaeger, Phoenix) instead.
- Warm-up steps first (untimed). Then `rounds` rounds; each runs every mode for
  `steps_per_round` steps, in an order rotated every round, so drift (the policy and
  its response lengths change as it trains; other load on the machine) spreads over
  all modes. The model, data and seed are the same for every mode.
- A step's time is the wall time of `PPOTrainer.run_step` as the trainer sees it.
  Overhead = mean step time of the mode / mean of "off" − 1; its ± is the standard
  error over rounds of the same ratio taken per round (paired, so slow rounds cancel).
- On a shared machine that ± can exceed the effect, so the benchmark also measures the
  CPU time one recorded span costs its process (created, ended, batched, encoded and
  sent to the receiver: `time.process_time` over all threads, export included) and
  estimates the overhead as spans per traced step × that cost / the "off" step time.
  It is an upper bound on what the spans add to a step's wall time: part of that CPU
  work runs on export threads concurrently with other processes' work.
"""

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.otlp_sink import OtlpSink
from rlserve.core import tracing
from rlserve.core.config import validate_config
from rlserve.core.run_config import RunConfig
from rlserve.trainer.deploy import deploy_services, service_args
from rlserve.trainer.run import RunInputs, make_trainer

MODES: list[tuple[str, float | None]] = [("off", None), ("on 1.0", 1.0), ("on 0.01", 0.01)]
"""(name, trainer sampling ratio; None = tracing off in the trainer)."""


@dataclass(frozen=True)
class StepTime:
    round: int
    mode: str
    step: int
    seconds: float


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    steps: int
    mean_s: float
    median_s: float
    overhead_pct: float
    """Mean step time relative to "off", in percent."""
    overhead_se_pct: float
    """Standard error over rounds of the per-round overhead (0 with one round)."""


# --- measuring --------------------------------------------------------------------------


def _trainer_tracing(endpoint: str, ratio: float | None) -> None:
    tracing.setup_tracing("rlserve-trainer", endpoint, ratio or 0.0, ratio is not None)


async def _timed_steps(trainer, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await trainer.run_step()
        times.append(time.perf_counter() - started)
    return times


async def _measure(
    config: RunConfig,
    inputs: RunInputs,
    run_dir: Path,
    address: str,
    endpoint: str,
    rounds: int,
    steps_per_round: int,
    warmup_steps: int,
    progress: bool,
) -> list[StepTime]:
    trainer = make_trainer(config, inputs, run_dir, address)
    _trainer_tracing(endpoint, None)
    await _timed_steps(trainer, warmup_steps)
    samples: list[StepTime] = []
    for round_index in range(rounds):
        shift = round_index % len(MODES)
        for mode, ratio in MODES[shift:] + MODES[:shift]:
            _trainer_tracing(endpoint, ratio)  # flushes the previous mode's spans first
            for seconds in await _timed_steps(trainer, steps_per_round):
                samples.append(StepTime(round_index, mode, trainer.state.step, seconds))
            if progress:
                recent = [s.seconds for s in samples[-steps_per_round:]]
                print(
                    f"  round {round_index + 1}/{rounds}  {mode:8s} "
                    + " ".join(f"{t:.3f}" for t in recent),
                    file=sys.stderr,
                )
    tracing.shutdown_tracing()
    return samples


def measure(
    config: RunConfig,
    inputs: RunInputs,
    run_dir: Path,
    address: str,
    endpoint: str,
    rounds: int,
    steps_per_round: int,
    warmup_steps: int = 2,
    progress: bool = False,
) -> list[StepTime]:
    """Deploys the services (tracing on, following the trainer) on the Serve cluster at
    `address` and times `run_step` per mode; see the module docstring."""
    services = config.model_copy(
        update={
            "trainer": config.trainer.model_copy(
                update={
                    "tracing": config.trainer.tracing.model_copy(
                        update={"enabled": True, "otlp_endpoint": endpoint, "sampling_ratio": 0.0}
                    )
                }
            )
        }
    )
    from ray import serve

    for role in ("rollout", "critic", "reference", "reward"):
        serve.delete(role)
    deploy_services(service_args(services, inputs.model_dir), config.trainer.deploy_timeout_s)
    try:
        return asyncio.run(
            _measure(
                config,
                inputs,
                run_dir,
                address,
                endpoint,
                rounds,
                steps_per_round,
                warmup_steps,
                progress,
            )
        )
    finally:
        tracing.shutdown_tracing()


def span_cpu_cost_s(endpoint: str, spans: int = 20_000) -> float:
    """CPU seconds one recorded span costs this process, export to `endpoint` included
    (spans shaped like a worker's: nested two deep, a few attributes)."""
    tracing.setup_tracing("rlserve-bench", endpoint, 1.0, True)
    started = time.process_time()
    for index in range(spans // 2):
        with (
            tracing.span("worker.update_actor", rank=0, batch_size=256),
            tracing.span("actor.forward", batch_size=64, index=index),
        ):
            pass
    tracing.shutdown_tracing()  # waits for the export: its CPU time counts
    return (time.process_time() - started) / (spans // 2 * 2)


def summarise(samples: list[StepTime]) -> list[ModeSummary]:
    """Per mode: mean and median step time, overhead vs "off" (see the docstring)."""
    by_mode = {mode: [s.seconds for s in samples if s.mode == mode] for mode, _ in MODES}
    rounds = sorted({s.round for s in samples})

    def round_mean(mode: str, index: int) -> float:
        return statistics.fmean(s.seconds for s in samples if s.mode == mode and s.round == index)

    base = statistics.fmean(by_mode["off"])
    summaries = []
    for mode, _ in MODES:
        ratios = [round_mean(mode, r) / round_mean("off", r) - 1 for r in rounds]
        se = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0
        summaries.append(
            ModeSummary(
                mode=mode,
                steps=len(by_mode[mode]),
                mean_s=statistics.fmean(by_mode[mode]),
                median_s=statistics.median(by_mode[mode]),
                overhead_pct=100 * (statistics.fmean(by_mode[mode]) / base - 1),
                overhead_se_pct=100 * se,
            )
        )
    return summaries


def format_table(summaries: list[ModeSummary]) -> str:
    lines = [
        "mode        steps   mean step s   median step s   overhead vs off",
        "----------  -----   -----------   -------------   ----------------",
    ]
    for s in summaries:
        overhead = "-" if s.mode == "off" else f"{s.overhead_pct:+.2f}% ± {s.overhead_se_pct:.2f}"
        lines.append(
            f"{s.mode:<10}  {s.steps:5d}   {s.mean_s:11.3f}   {s.median_s:13.3f}   {overhead}"
        )
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds of all three modes")
    parser.add_argument("--steps-per-round", type=int, default=2, help="steps per mode per round")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--prompts-per-step", type=int, default=None, help="default: the run config's (256)"
    )
    parser.add_argument(
        "--otlp-endpoint", default=None, help="a real collector; default: a discarding receiver"
    )
    parser.add_argument("--json", type=Path, help="also write samples and summary here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from rlserve.core.cluster import start_local_ray, start_serve_on_a_free_port
    from rlserve.core.embedded.prepare import prepare_embedded_default

    # One intra-op thread: on a busy machine two OpenMP threads wait on each other at
    # every op (the services' workers use one each, too).
    torch.set_num_threads(1)
    work_dir = Path(tempfile.mkdtemp(prefix="rltracecost"))
    overrides = {"trainer": {"run_dir": str(work_dir), "control_port": None}}
    if args.prompts_per_step:
        overrides["trainer"]["prompts_per_step"] = args.prompts_per_step
        mini = min(64, args.prompts_per_step)
        overrides["actor"] = {"ppo_mini_batch_prompts": mini, "micro_batch_samples": mini}
        overrides["critic"] = {"ppo_mini_batch_prompts": mini, "micro_batch_samples": mini}
    config = validate_config(RunConfig, overrides)
    print("building the embedded default model (warm-up) ...", file=sys.stderr)
    built = prepare_embedded_default(
        work_dir / "embedded",
        tiny=config.model.tiny,
        task=config.data.arithmetic,
        seed=config.trainer.seed,
        max_new_tokens=config.rollout.max_new_tokens,
        eval_prompts=config.rollout.eval_prompts,
    )
    inputs = RunInputs(str(built.model_dir), str(built.train_path), str(built.eval_path))
    sink = None if args.otlp_endpoint else OtlpSink(work_dir / "sink_counts.json")
    endpoint = args.otlp_endpoint or sink.endpoint
    start_local_ray(num_cpus=16, temp_dir=Path("/tmp") / work_dir.name, log_to_driver=False)
    port = start_serve_on_a_free_port()
    try:
        samples = measure(
            config,
            inputs,
            work_dir,
            f"127.0.0.1:{port}",
            endpoint,
            args.rounds,
            args.steps_per_round,
            args.warmup_steps,
            progress=True,
        )
        time.sleep(2 * tracing.EXPORT_DELAY_MS / 1000)  # the services' last spans
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        counts = sink.stop() if sink else {}
    summaries = summarise(samples)
    sink = None if args.otlp_endpoint else OtlpSink(work_dir / "sink_counts_micro.json")
    endpoint = args.otlp_endpoint or sink.endpoint
    samples_per_step = config.trainer.prompts_per_step * config.rollout.responses_per_prompt
    print(
        f"\ntracing cost per PPO step: {samples_per_step} samples/step, "
        f"{args.rounds} rounds × {args.steps_per_round} steps per mode, "
        f"spans to {'the discarding receiver' if sink else endpoint}"
    )
    print(format_table(summaries))
    span_cost_s = span_cpu_cost_s(endpoint)
    print(f"CPU time per recorded span (export included): {span_cost_s * 1e6:.1f} µs")
    if counts:
        traced = sum(1 for s in samples if s.mode == "on 1.0")
        per_step = sum(counts.values()) / max(traced, 1)
        off_s = summaries[0].mean_s
        print(
            f"spans received: {sum(counts.values())} (≈ {per_step:.0f} per traced step), "
            "by service: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )
        print(
            f"estimated from CPU cost: {per_step:.0f} spans × {span_cost_s * 1e6:.1f} µs "
            f"= {per_step * span_cost_s * 1e3:.1f} ms per traced step, "
            f"{100 * per_step * span_cost_s / off_s:.2f}% of the {off_s:.3f} s step"
        )
    if sink:
        sink.stop()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "samples": [asdict(s) for s in samples],
                    "summary": [asdict(s) for s in summaries],
                    "spans_received": counts,
                    "span_cpu_cost_s": span_cost_s,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
