"""The `rlserve` command.

  rlserve train [--config FILE] [section.field=value ...]   new run (default: embedded)
  rlserve resume RUN_DIR [section.field=value ...]          continue from the last checkpoint
  rlserve config [--config FILE] [--describe] [overrides]   print the resolved config / fields
  rlserve trace report FILE... [--step N] [--timeline PNG]  where each PPO step's time went
  rlserve service deploy|scale|remove|status|release-placement ...
                                        one service on a running cluster (service_ops.py)
  rlserve run status|stop|checkpoint RUN_DIR  a running trainer, from another shell (run_ops.py)
  rlserve doctor [--address A] [--target HOST:PORT]
                                        every service's health, weights, memory (doctor.py)
  rlserve model import-gguf GGUF_FILE OUT_DIR [--dtype D]
                                        a GGUF file -> plain HF model folder (no hub access)

Config errors exit with status 2 before anything starts, naming the field.
"""

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from rlserve.core.config import ConfigError, describe_config, dump_config, load_config
from rlserve.core.run_config import RunConfig
from rlserve.trainer import doctor, run_ops, service_ops


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlserve", description="PPO over rlserve services")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="start a new run")
    train.add_argument("--config", type=Path, help="YAML run config (default: embedded)")
    train.add_argument("overrides", nargs="*", help="section.field=value")
    resume = commands.add_parser("resume", help="continue a run from its last checkpoint")
    resume.add_argument("run_dir", type=Path)
    resume.add_argument("overrides", nargs="*", help="section.field=value, e.g. more steps")
    show = commands.add_parser("config", help="print the resolved config")
    show.add_argument("--config", type=Path)
    show.add_argument("--describe", action="store_true", help="list every field with its doc")
    show.add_argument("overrides", nargs="*")
    trace = commands.add_parser("trace", help="analyse traces of PPO steps")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    # Listed for --help; main() hands everything after "trace report" to trace_report.
    trace_commands.add_parser(
        "report", help="critical path, time per service and stage, RPC overhead, timeline PNG"
    )
    service_ops.add_parser(commands)
    run_ops.add_parser(commands)
    doctor.add_parser(commands)
    model = commands.add_parser("model", help="bring a model in")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    import_gguf = model_commands.add_parser(
        "import-gguf",
        help="write a plain HF model folder (safetensors, tokenizer, chat template) from GGUF",
    )
    import_gguf.add_argument("gguf_file", type=Path, help="the model's .gguf file")
    import_gguf.add_argument("out_dir", type=Path, help="new (or empty) folder to write")
    import_gguf.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default), bfloat16 or float16: dtype of the saved, de-quantised weights",
    )
    return parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ray").setLevel(logging.WARNING)


def _import_gguf(args: argparse.Namespace) -> int:
    from rlserve.core.gguf_import import check_import_arguments, import_gguf

    try:
        check_import_arguments(args.gguf_file, args.out_dir, args.dtype)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    _quiet_libraries()
    started = time.perf_counter()
    imported = import_gguf(args.gguf_file, args.out_dir, args.dtype)
    print(f"{imported.summary()} ({time.perf_counter() - started:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["trace", "report"]:
        from rlserve.trainer import trace_report

        return trace_report.main(argv[2:])
    args = _parser().parse_args(argv)
    if args.command == "service":
        try:
            return service_ops.run(args)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except (KeyError, RuntimeError, TimeoutError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    if args.command == "run":
        return run_ops.run(args)
    if args.command == "doctor":
        try:
            return doctor.run(args)
        except (ConnectionError, RuntimeError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if args.command == "model":
        return _import_gguf(args)
    try:
        if args.command == "resume":
            config = load_config(RunConfig, args.run_dir / "config.yaml", args.overrides)
        else:
            config = load_config(RunConfig, args.config, args.overrides)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(
            describe_config(RunConfig) if args.describe else dump_config(config, redact=True),
            end="",
        )
        return 0

    from rlserve.core.auth import AuthConfigError
    from rlserve.core.placement import PlacementError
    from rlserve.trainer.deploy import ResourceShortfallError, ServiceSettingsConflict
    from rlserve.trainer.dynamic_sampling import NoInformativeGroups
    from rlserve.trainer.lease_keeper import LeaseRefused
    from rlserve.trainer.run import ResumeError, new_run_dir, print_summary, train

    _quiet_libraries()
    try:
        if args.command == "train":
            summary = train(config, new_run_dir(config))
        else:
            summary = train(config, args.run_dir, resume=True)
    except ConfigError as error:  # checks that need the model or data (e.g. its context)
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except (
        ServiceSettingsConflict,
        LeaseRefused,
        ResumeError,
        AuthConfigError,
        ResourceShortfallError,
        PlacementError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except NoInformativeGroups as error:  # the run stopped; its checkpoints resume it
        print(f"error: {error}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
