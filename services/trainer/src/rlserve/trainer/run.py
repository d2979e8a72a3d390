"""A whole run: prepare model and data, bring up the cluster and services, train, report.

`train` is what `rlserve train` and `make demo` call. Everything that can be checked
without a cluster (config, model directory, datasets) is checked before Ray starts, so
a typo fails in a second, not after a deployment.

Tracing (`trainer.tracing`): the trainer process traces as `rlserve-trainer` for the
length of `train_on_services` and flushes its spans at the end; the services get the
same settings in their deploy args (see deploy.py). Before a local cluster is torn
down, the run waits for the services' last spans to be exported.

Authentication (rlserve.core.auth): a cluster started here gets a token generated for the
run unless RLSERVE_AUTH_TOKEN / RLSERVE_AUTH_TOKEN_FILE gives one; it is set in this
process's environment before Ray starts, so the replicas inherit it and the trainer's
clients send it. Joining a cluster, the trainer sends the token its environment gives.
"""

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlserve.core import auth, tracing
from rlserve.core.config import ConfigError, dump_config
from rlserve.core.message_limits import (
    MESSAGE_LIMIT_ENV,
    REWARD_LIMIT_BYTES,
    message_limit_bytes,
)
from rlserve.core.modeling import load_tokenizer
from rlserve.core.resources import resource_metrics
from rlserve.core.run_config import RunConfig
from rlserve.trainer.checkpoint import (
    latest_checkpoint,
    read_trainer_state,
    service_checkpoint_name,
)
from rlserve.trainer.clients import Clients
from rlserve.trainer.control import RunControl, serve_control
from rlserve.trainer.data import PromptRows, load_prompt_rows
from rlserve.trainer.deploy import (
    deploy_services,
    reserve_placement_groups,
    service_args,
    share_cluster_gpus,
    verify_placement,
)
from rlserve.trainer.lease_keeper import LeaseKeeper, run_id_of
from rlserve.trainer.loop import PPOTrainer
from rlserve.trainer.metrics import (
    MetricsLog,
    plot_curves,
    read_metrics,
    repair_torn_tail,
    truncate_after,
)
from rlserve.trainer.recovery import Recovery, RecoveryEvent
from rlserve.v1 import trainer_pb2

console = Console(stderr=True)
LOCAL_CLUSTER_MIN_CPUS = 16


@dataclass(frozen=True)
class RunInputs:
    """Where the policy and the prompts come from, resolved before any cluster starts."""

    model_dir: str
    train_path: str
    eval_path: str | None
    warmup_accuracy: float | None = None
    """Local greedy accuracy right after the embedded warm-up (None for user models)."""
    warmup_s: float | None = None
    warmup_steps: int | None = None
    warmup_reached_target: bool | None = None


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    seed: int
    """trainer.seed, the run's one seed."""
    warmup_steps: int | None
    """Supervised warm-up steps of the embedded default (None for user models)."""
    warmup_accuracy: float | None
    """Greedy accuracy on held-out training pairs right after that warm-up: where RL
    started (None for user models)."""
    warmup_reached_target: bool | None
    """Whether the warm-up stopped at its target accuracy rather than its step cap."""
    steps: int
    recoveries: list[RecoveryEvent]
    """Each time the run restored its services from a checkpoint after losing one."""
    phases_s: dict[str, float]
    """Seconds per phase of the command, in order: the process's start (interpreter,
    imports, config), prepare (the embedded default's warm-up), ray_start (a local
    Ray started, or the configured one joined), serve_start (Serve and its gRPC proxy),
    deploy (and deploy/<role>: each service's time to running), trainer set-up (with
    reset_services when an earlier run had trained them), the first evaluation and
    checkpoint, the PPO steps, the last evaluation and checkpoint, teardown."""
    accuracy_before: float | None
    accuracy_after: float | None
    train_s: float
    total_s: float
    checkpoint: str | None
    curves_png: str | None
    metrics_jsonl: str
    first_step_unix_s: float | None = None
    """Wall-clock time (Unix seconds) when this run's first PPO step began; None when
    it ran none."""
    startup_s: float | None = None
    """From the start of the command's process to its first PPO step: what a user
    waits (`train` fills it in; None for a run given already deployed services)."""
    calls_by_route: dict[str, int] = field(default_factory=dict)
    """The trainer's calls to the services, by the route that answered them: `handle`
    (a large batch through Ray's object store), `direct` (gRPC to the replica's own
    port) or `proxy` (Serve's gRPC proxy); see docs/architecture.md, "How calls reach a service"."""


def prepare_inputs(config: RunConfig, run_dir: Path) -> RunInputs:
    """Builds the embedded default when no model is given; checks user paths exist.

    Also checks that a prompt of data.max_prompt_tokens plus rollout.max_new_tokens fits
    the model's context, which only the model directory can tell.
    """
    if config.model.path is None:
        from rlserve.core.embedded.prepare import prepare_embedded_default

        console.print("building the embedded default (tiny Llama, char tokenizer, a+b task) ...")
        built = prepare_embedded_default(
            run_dir / "embedded",
            tiny=config.model.tiny,
            task=config.data.arithmetic,
            seed=config.trainer.seed,
            max_new_tokens=config.rollout.max_new_tokens,
            eval_prompts=config.rollout.eval_prompts,
            with_tools=config.rollout.agent is not None,
        )
        _check_context_fits(config, built.model_dir)
        return RunInputs(
            model_dir=str(built.model_dir.resolve()),
            train_path=config.data.train_path or str(built.train_path),
            eval_path=config.data.eval_path or str(built.eval_path),
            warmup_accuracy=built.warmup_accuracy,
            warmup_s=built.warmup_s,
            warmup_steps=built.warmup_steps,
            warmup_reached_target=built.warmup_reached_target,
        )
    model_dir = Path(config.model.path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {model_dir} is not a Hugging Face model directory")
    _check_context_fits(config, model_dir)
    if config.data.train_path is None:
        raise ValueError("data.train_path: required when model.path is set")
    for name in ("train_path", "eval_path"):
        path = getattr(config.data, name)
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"data.{name}: {path} does not exist")
    return RunInputs(str(model_dir.resolve()), config.data.train_path, config.data.eval_path)


def _check_context_fits(config: RunConfig, model_dir: Path) -> None:
    """ConfigError unless data.max_prompt_tokens + rollout.max_new_tokens fit the model.

    Otherwise the rollout service would refuse the first long prompt mid-run. Reads the
    config as the services will (AutoConfig; the text part of a multimodal model).
    """
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    context_tokens = getattr(text_config, "max_position_embeddings", None)
    if context_tokens is None:  # no fixed limit stated; the rollout service assumes none
        return
    prompt_tokens, new_tokens = config.data.max_prompt_tokens, config.rollout.max_new_tokens
    if prompt_tokens + new_tokens <= context_tokens:
        return
    if new_tokens < context_tokens:
        fix = f"lower data.max_prompt_tokens to {context_tokens - new_tokens}"
    else:
        fix = f"lower rollout.max_new_tokens below {context_tokens}"
    raise ConfigError(
        "data.max_prompt_tokens",
        f"{prompt_tokens} + rollout.max_new_tokens {new_tokens} = {prompt_tokens + new_tokens} "
        f"tokens exceed the model's context of {context_tokens} (max_position_embeddings in "
        f"{model_dir / 'config.json'}); {fix}, or lower both so they sum to at most "
        f"{context_tokens}",
    )


def setup_trainer_tracing(config: RunConfig) -> None:
    """This process's tracing, as `rlserve-trainer`, from `trainer.tracing`."""
    settings = config.trainer.tracing
    tracing.setup_tracing(
        "rlserve-trainer",
        settings.otlp_endpoint,
        settings.sampling_ratio,
        settings.enabled,
        settings.file_path,
    )


def make_trainer(
    config: RunConfig, inputs: RunInputs, run_dir: Path, serve_grpc_address: str
) -> PPOTrainer:
    """A PPOTrainer on the deployed services: tokenizer, prompts and clients loaded."""
    tokenizer = load_tokenizer(inputs.model_dir)
    data = config.data
    paths = {"train": inputs.train_path, "eval": inputs.eval_path}
    loaded: dict[str, PromptRows] = {}
    for name, path in paths.items():
        if path is None:
            continue
        loaded[name] = load_prompt_rows(
            path,
            tokenizer,
            data.prompt_key,
            data.ground_truth_key,
            data.max_prompt_tokens,
            data.long_prompts,
            data.tools_kwargs_key,
        )
        _print_prompt_counts(name, loaded[name], data.max_prompt_tokens, data.long_prompts)
    roles = set(service_args(config, inputs.model_dir))
    clients = Clients.connect(serve_grpc_address, config, roles, run_id_of(run_dir))
    eval_rows = loaded["eval"].rows if "eval" in loaded else []
    return PPOTrainer(config, clients, tokenizer, loaded["train"].rows, eval_rows, run_dir)


def _print_prompt_counts(
    name: str, loaded: PromptRows, max_prompt_tokens: int, long_prompts: str
) -> None:
    """One line per dataset, so rows lost to the length limit are never silent."""
    line = (
        f"{name}: {len(loaded.rows)} prompts, {loaded.dropped} dropped, "
        f"{loaded.truncated} truncated, longest {loaded.longest_tokens} tokens "
        f"(data.max_prompt_tokens={max_prompt_tokens}, data.long_prompts={long_prompts})"
    )
    if loaded.dropped:
        line = (
            f"[yellow]{line}; to keep them, raise data.max_prompt_tokens or set "
            "data.long_prompts=truncate_left[/yellow]"
        )
    console.print(line)


async def train_on_services(
    config: RunConfig,
    inputs: RunInputs,
    run_dir: Path,
    serve_grpc_address: str,
    resume_from: Path | None = None,
    show_progress: bool = True,
) -> RunSummary:
    """The PPO loop against services already deployed on serve_grpc_address."""
    started = time.perf_counter()
    setup_trainer_tracing(config)
    try:
        return await _train_on_services(
            config, inputs, run_dir, serve_grpc_address, resume_from, show_progress, started
        )
    finally:
        tracing.shutdown_tracing()  # exports the last steps' spans (bounded wait)


async def _train_on_services(
    config: RunConfig,
    inputs: RunInputs,
    run_dir: Path,
    serve_grpc_address: str,
    resume_from: Path | None,
    show_progress: bool,
    started: float,
) -> RunSummary:
    phases: dict[str, float] = {}
    mark = time.perf_counter()
    trainer = make_trainer(config, inputs, run_dir, serve_grpc_address)
    leases = LeaseKeeper(trainer.clients, run_id_of(run_dir), config.trainer.lease_ttl_s)
    try:
        await leases.take()  # before anything is reset or restored
    except BaseException:
        await trainer.clients.close()
        raise
    try:
        log = MetricsLog(run_dir)
        control = RunControl(total_steps=config.trainer.total_steps, run_dir=str(run_dir))
        server = None
        if config.trainer.control_port is not None:
            in_use = {
                role: client for role, client in vars(trainer.clients).items() if client is not None
            }
            server, port = await serve_control(control, config.trainer.control_port, in_use)
            (run_dir / "control_address").write_text(f"127.0.0.1:{port}\n")
            token = auth.expected_token()
            if token is not None:  # for `rlserve run status|stop|checkpoint RUN_DIR`
                write_private(run_dir / "control_token", token + "\n")

        if resume_from is not None:
            state = read_trainer_state(resume_from)
            await trainer.load_checkpoint(resume_from, state)
            truncate_after(log.path, trainer.state.step)
            console.print(f"resumed from {resume_from} at step {trainer.state.step}")
        else:
            reset_started = time.perf_counter()
            reset = await trainer.reset_used_services()
            if reset:
                phases["reset_services"] = time.perf_counter() - reset_started
                console.print(
                    f"reset {', '.join(reset)} to the deployed initial weights (an earlier run "
                    f"had trained them) in {phases['reset_services']:.1f} s"
                )

        every_eval = config.rollout.eval_every_steps
        every_ckpt = config.trainer.checkpoint_every_steps
        every_resources = config.trainer.resources_every_steps
        accuracy_before = None
        phases["trainer_setup"] = time.perf_counter() - mark
        if trainer.state.step == 0 and trainer.eval_rows:
            mark = time.perf_counter()
            before = await trainer.evaluate()
            accuracy_before = before["eval_accuracy"]
            log.write(0, before)
            phases["eval_before"] = time.perf_counter() - mark

        if config.trainer.max_recoveries and latest_checkpoint(run_dir) is None:
            mark = time.perf_counter()
            await trainer.save_checkpoint()  # the point a recovery before step 1 returns to
            phases["checkpoint_0"] = time.perf_counter() - mark
        recovery = Recovery(config.trainer.max_recoveries, config.trainer.recovery_timeout_s)

        control.state = trainer_pb2.RUN_STATE_RUNNING
        control.step = trainer.state.step
        checkpoint = None
        train_started = time.perf_counter()
        first_step_unix_s = time.time() if trainer.state.step < config.trainer.total_steps else None
        progress = Progress(
            TextColumn("PPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            disable=not show_progress,
        )
        try:
            with progress:
                task = progress.add_task(
                    "ppo",
                    total=config.trainer.total_steps,
                    completed=trainer.state.step,
                    status="",
                )
                # A step whose own calls completed but whose evaluation, metrics line or
                # checkpoint failed: a recovery that rolls nothing back repeats only those.
                done: dict[str, float] | None = None
                logged = False
                while done is not None or (
                    trainer.state.step < config.trainer.total_steps and not control.stop_requested
                ):
                    try:
                        if done is None:
                            done, logged = await trainer.run_step(), False
                        metrics, step = done, trainer.state.step
                        if every_eval and step % every_eval == 0 and "eval_accuracy" not in metrics:
                            metrics.update(await trainer.evaluate())
                        if every_resources and step % every_resources == 0:
                            # off the event loop: the control service keeps answering
                            metrics.update(await asyncio.to_thread(_resource_metrics))
                        if not logged:
                            log.write(step, metrics)
                            logged = True
                        if (every_ckpt and step % every_ckpt == 0) or control.checkpoint_requested:
                            checkpoint = await trainer.save_checkpoint()
                            control.checkpoint_requested = False
                        done = None
                    except grpc.aio.AioRpcError as error:
                        restored = await recovery.recover(trainer, error, log.path)
                        if restored is not None:
                            checkpoint, done = restored, None
                        control.step = trainer.state.step
                        progress.update(task, completed=trainer.state.step, status="recovered")
                        continue
                    control.step, control.last_metrics = step, metrics
                    status = f"reward {metrics['reward_mean']:.3f}  kl {metrics['kl_mean']:.4f}"
                    if "eval_accuracy" in metrics:
                        status += f"  held-out acc {100 * metrics['eval_accuracy']:.1f}%"
                    progress.update(task, completed=step, status=status)
            phases["ppo_steps"] = time.perf_counter() - train_started
            mark = time.perf_counter()
            final = {}
            if trainer.eval_rows and "eval_accuracy" not in trainer.state.last_metrics:
                final = await trainer.evaluate()
                log.write(trainer.state.step, final)
            if control.checkpoint_on_stop or not control.stop_requested or checkpoint is None:
                checkpoint = await trainer.save_checkpoint()
            control.state = trainer_pb2.RUN_STATE_FINISHED
        except BaseException as error:
            control.state = trainer_pb2.RUN_STATE_FAILED
            control.error = f"{type(error).__name__}: {error}"
            raise
        finally:
            trainer.discard_next_generation()  # a stopped or failed run's early generation
            await leases.release()
            await trainer.clients.close()
            log.close()
            if server is not None:
                await server.stop(grace=1.0)

        records = read_metrics(log.path)
        evaluated = [r for r in records if "eval_accuracy" in r]
        curves = run_dir / "curves.png"
        plot_curves(records, curves)
        phases["finish"] = time.perf_counter() - mark  # last evaluation, checkpoint, plot
        summary = RunSummary(
            run_dir=str(run_dir),
            seed=config.trainer.seed,
            warmup_steps=inputs.warmup_steps,
            warmup_accuracy=inputs.warmup_accuracy,
            warmup_reached_target=inputs.warmup_reached_target,
            steps=trainer.state.step,
            recoveries=recovery.events,
            phases_s=phases,
            accuracy_before=evaluated[0]["eval_accuracy"] if evaluated else accuracy_before,
            accuracy_after=evaluated[-1]["eval_accuracy"] if evaluated else None,
            train_s=time.perf_counter() - train_started,
            total_s=time.perf_counter() - started,
            checkpoint=str(checkpoint) if checkpoint else None,
            curves_png=str(curves),
            first_step_unix_s=first_step_unix_s,
            metrics_jsonl=str(log.path),
            calls_by_route=trainer.clients.calls_by_route(),
        )
        (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
        return summary
    finally:  # also when the run failed before its first step (both are idempotent)
        await leases.release()
        await trainer.clients.close()


def _resource_metrics() -> dict[str, float]:
    """resources/* metrics, or none this time: measuring must never stop a run (a node
    that just died fails the measurement, and recovery deals with the node)."""
    try:
        return resource_metrics()
    except Exception as error:
        console.print(f"[yellow]warning:[/] resources not measured this step: {error}")
        return {}


def proxy_message_limit_bytes(config: RunConfig) -> int:
    """The gRPC message bound of Serve's proxy for this run's services."""
    tokens = [config.rollout.max_request_tokens, config.critic.max_request_tokens]
    tokens.append(config.reference.max_request_tokens)
    return max(REWARD_LIMIT_BYTES, *(message_limit_bytes(count) for count in tokens))


def start_ray(config: RunConfig, run_dir: Path) -> bool:
    """Starts a private local Ray (no trainer.ray_address) or joins the configured one;
    returns whether it was started here."""
    from rlserve.core.cluster import connect_ray, start_local_ray

    if config.trainer.ray_address is None:
        if auth.expected_token() is None:
            # Before Ray starts: its processes, and so the replicas, inherit it.
            os.environ[auth.TOKEN_ENV] = auth.generate_token()
        close_local_ray_ports()
        # Serve's proxy holds messages up to this bound: the largest any service takes
        os.environ.setdefault(MESSAGE_LIMIT_ENV, str(proxy_message_limit_bytes(config)))
        temp_dir = Path("/tmp") / f"rlserve-{run_dir.name}"
        # Logical CPUs: four services with their workers need more scheduling slots than a
        # small machine has cores, and the embedded model is far too small to need them.
        start_local_ray(
            num_cpus=max(LOCAL_CLUSTER_MIN_CPUS, os.cpu_count() or 1),
            temp_dir=temp_dir,
            log_to_driver=False,
        )
        console.print(f"local Ray cluster started; logs under {temp_dir}/session_latest/logs")
        return True
    if auth.expected_token() is None:
        if config.trainer.service_auth == "token":
            raise auth.AuthConfigError(
                f"neither {auth.TOKEN_ENV} nor {auth.TOKEN_FILE_ENV} is set, and the services "
                f"require the cluster's token (trainer.service_auth=token): set one of them to "
                f"the token the cluster's nodes hold (deploy/ray/start-head.sh wrote it), or "
                f"run with trainer.service_auth=none on a cluster nobody else can reach"
            )
        console.print(
            f"[yellow]warning:[/] trainer.service_auth=none and no {auth.TOKEN_ENV}: the "
            f"services accept unauthenticated calls (anyone who reaches port "
            f"{config.trainer.serve_grpc_port} can call them); see deploy/README.md, "
            f"Authentication"
        )
    connect_ray(config.trainer.ray_address)
    return False


def close_local_ray_ports() -> None:
    """Turns Ray's token auth on, with a token of this run's own, for the local cluster
    about to start (unless the environment chose a mode). Ray's processes (GCS, raylet,
    workers, dashboard agent) listen on every interface whatever address they are given,
    and whoever reaches an open one runs code in the cluster, reading every worker's
    environment, the services' token included; with token auth they refuse callers
    without Ray's token."""
    from rlserve.core.cluster import RAY_AUTH_MODE_ENV, use_ray_token_auth

    if RAY_AUTH_MODE_ENV not in os.environ:
        use_ray_token_auth(auth.generate_token())


def start_serve_proxy(config: RunConfig, local: bool) -> str:
    """Starts Serve with its gRPC proxy (or finds it running); returns its address."""
    from rlserve.core.cluster import start_serve, start_serve_on_a_free_port

    if local:
        if config.trainer.serve_grpc_port:
            port = config.trainer.serve_grpc_port
            start_serve(port)
        else:
            port = start_serve_on_a_free_port()
        return f"127.0.0.1:{port}"
    start_serve(config.trainer.serve_grpc_port)
    host = config.trainer.ray_address.split("://")[-1].split(":")[0]
    host = "127.0.0.1" if host in ("auto", "localhost") else host
    return f"{host}:{config.trainer.serve_grpc_port}"


def new_run_dir(config: RunConfig) -> Path:
    run_dir = Path(config.trainer.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=False)
    write_private(run_dir / "config.yaml", dump_config(config))
    return run_dir


def write_private(path: Path, text: str) -> None:
    """Writes `text` to `path` readable by this user only (0600 whatever the umask): a
    run's config.yaml may hold reward HTTP headers, on storage every node shares."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(text)


class ResumeError(RuntimeError):
    """A run directory that cannot be resumed as it is (the message says why and the fix)."""


def train(config: RunConfig, run_dir: Path, resume: bool = False) -> RunSummary:
    """Prepare, start the cluster, deploy, train, tear down what was started here."""
    total_started = time.perf_counter()
    process_started_unix_s = psutil.Process().create_time()
    # interpreter start, imports, config: before anything below could time it
    phases: dict[str, float] = {"process_start": time.time() - process_started_unix_s}
    resume_from = latest_checkpoint(run_dir) if resume else None
    if resume and resume_from is None:
        raise ResumeError(f"{run_dir} holds no complete checkpoint to resume from")
    if resume:  # before any cluster starts or service is restored
        try:
            repaired = repair_torn_tail(run_dir / "metrics.jsonl")
        except ValueError as error:
            raise ResumeError(str(error)) from None
        if repaired is not None:
            console.print(f"[yellow]{repaired}[/yellow]")
    if resume_from is not None:
        try:  # before any cluster starts: the services could not load it from their root
            service_checkpoint_name(config.trainer.run_dir, resume_from, "rollout")
        except ValueError as error:
            raise ConfigError("trainer.run_dir", str(error)) from None
    inputs_file = run_dir / "inputs.json"
    if resume and inputs_file.exists():
        inputs = RunInputs(**json.loads(inputs_file.read_text()))
    else:
        mark = time.perf_counter()
        inputs = prepare_inputs(config, run_dir)
        inputs_file.write_text(json.dumps(asdict(inputs), indent=1))
        phases["prepare"] = time.perf_counter() - mark
    if inputs.warmup_accuracy is not None:
        tiny = config.model.tiny
        target = (
            ""
            if tiny.sft_target_accuracy is None
            else f"target {100 * tiny.sft_target_accuracy:.0f}% "
            + ("reached" if inputs.warmup_reached_target else "NOT reached")
            + "; "
        )
        console.print(
            f"warm-up (seed {config.trainer.seed}): {inputs.warmup_steps} steps in "
            f"{inputs.warmup_s:.1f} s; {target}held-out accuracy "
            f"{100 * inputs.warmup_accuracy:.1f}%"
        )
    mark = time.perf_counter()
    local = start_ray(config, run_dir)
    phases["ray_start"] = time.perf_counter() - mark
    mark = time.perf_counter()
    address = start_serve_proxy(config, local)
    phases["serve_start"] = time.perf_counter() - mark
    try:
        mark = time.perf_counter()
        apps = service_args(config, inputs.model_dir)
        share_cluster_gpus(apps)
        reserve_placement_groups(apps)
        console.print(f"deploying services on Serve (gRPC {address}) ...")
        ready_s = deploy_services(
            apps,
            config.trainer.deploy_timeout_s,
            config.trainer.replace_deployed_services,
            config.trainer.resource_shortfall_timeout_s,
        )
        phases["deploy"] = time.perf_counter() - mark
        phases.update((f"deploy/{role}", seconds) for role, seconds in ready_s.items())
        if config.placement.roles:
            for role, nodes in verify_placement(config, apps).items():
                console.print(f"placement: {role} on nodes {[node[:12] for node in nodes]}")
        summary = asyncio.run(train_on_services(config, inputs, run_dir, address, resume_from))
    finally:
        mark = time.perf_counter()
        if local:
            if config.trainer.tracing.enabled:
                # The services export every EXPORT_DELAY_MS; let their last batch leave.
                time.sleep(2 * tracing.EXPORT_DELAY_MS / 1000)
            _stop_local_cluster()
        teardown_s = time.perf_counter() - mark
    summary = replace(
        summary,
        total_s=time.perf_counter() - total_started + phases["process_start"],
        phases_s={**phases, **summary.phases_s, "teardown": teardown_s},
        startup_s=None
        if summary.first_step_unix_s is None
        else summary.first_step_unix_s - process_started_unix_s,
    )
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    return summary


def _stop_local_cluster() -> None:
    """Stops the cluster this run started, Serve with it. serve.shutdown() first would
    end with Ray's red `Task ServeController.graceful_shutdown failed ... killed by
    ray.kill` line on screen after the summary (Serve kills its controller while the
    call is in flight); the run's checkpoints and spans are written by then."""
    import ray

    ray.shutdown()


def print_summary(summary: RunSummary) -> None:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    gain = (
        f" ({100 * (summary.accuracy_after - summary.accuracy_before):+.1f} points)"
        if summary.accuracy_before is not None and summary.accuracy_after is not None
        else ""
    )
    warmup = "" if summary.warmup_steps is None else f", warm-up {summary.warmup_steps} steps"
    recoveries = "".join(
        f"\n  recovered at step {event.failed_step} ({', '.join(event.lost)} lost): services "
        f"back after {event.wait_s:.1f} s, "
        + (
            f"step {event.restored_step} restored in {event.restore_s:.1f} s"
            if event.rolled_back
            else "their state intact, nothing rolled back"
        )
        for event in summary.recoveries
    )
    phases = "  ".join(f"{name} {seconds:.1f}" for name, seconds in summary.phases_s.items())
    startup = (
        ""
        if summary.startup_s is None
        else f"\n  from the command's start to the first PPO step: {summary.startup_s:.1f} s"
    )
    routes = "  ".join(f"{route} {calls}" for route, calls in summary.calls_by_route.items())
    print(
        f"rlserve run finished: {summary.steps} PPO steps in {summary.train_s:.0f} s "
        f"(whole command {summary.total_s:.0f} s), seed {summary.seed}{warmup}\n"
        f"  held-out accuracy: before PPO {pct(summary.accuracy_before)}, "
        f"after {pct(summary.accuracy_after)}{gain}\n"
        f"  run directory: {summary.run_dir}\n"
        f"  metrics: {summary.metrics_jsonl} (TensorBoard: {summary.run_dir}/tensorboard)\n"
        f"  curves: {summary.curves_png}\n"
        f"  checkpoint: {summary.checkpoint}\n"
        f"  seconds: {phases}{startup}\n"
        f"  calls to the services by route: {routes or 'none'}{recoveries}"
    )
