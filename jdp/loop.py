"""``fit(config)``: the one place that wires mesh, data, model, optimizer and steps together."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jdp import distributed
from jdp.checkpoint import Checkpointer, Preemption
from jdp.config import TrainConfig
from jdp.data.pipeline import EvalReader, check_train_batch, eval_batches, train_batches
from jdp.data.sources import Split, load_split
from jdp.errors import UsageError
from jdp.mesh import (
    check_batch_size,
    data_size,
    make_mesh,
    replicated,
    requested_device_count,
    simulate_cpu_devices,
)
from jdp.metrics import (
    Console,
    MetricLogger,
    ProfileWindow,
    Throughput,
    open_writers,
    peak_flops,
    step_flops,
    write_run_info,
)
from jdp.models import Model, get_model
from jdp.precision import make_precision
from jdp.state import TrainState, create_train_state
from jdp.step import evaluate, make_eval_step, make_train_step

# How often the progress bar shows the loss: reading it waits for that step.
_DISPLAY_EVERY = 20


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What a run ends with: the final state and its summary figures."""

    state: TrainState
    steps: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    examples_per_sec: float
    input_wait: float  # fraction of the steady training loop spent waiting for a batch
    wall_seconds: float
    preempted: str | None = None  # the line saying where a stopped run saved, when it stopped

    def summary_line(self) -> str:
        if self.preempted:
            return self.preempted
        return (
            f"jdp.train: steps={self.steps} train_loss={self.train_loss:.4f} "
            f"test_loss={self.test_loss:.4f} test_accuracy={self.test_accuracy:.4f} "
            f"examples/s={self.examples_per_sec:.0f} input_wait={self.input_wait:.1%} "
            f"wall={self.wall_seconds:.1f}s"
        )


def _progress_fields(metrics, latest: dict | None) -> dict[str, str]:
    values = jax.device_get(metrics)
    fields = {"loss": f"{values['loss']:.4f}"}
    for name in ("lr", "grad_norm"):
        if name in values:
            fields[name] = f"{values[name]:.3g}"
    if "loss_scale" in values:
        fields["loss_scale"] = f"{values['loss_scale']:g}"
        fields["skipped"] = str(int(values["skipped_steps"]))
    if latest and "examples_per_sec" in latest:  # over the last logging interval
        fields["examples/s"] = f"{latest['examples_per_sec']:,.0f}"
    return fields


def _eval_order(result: dict) -> list[str]:
    """Loss and accuracy first, then any other metric; not the example count."""
    first = [name for name in ("loss", "accuracy") if name in result]
    return first + sorted(set(result) - set(first) - {"count"})


def _last_step(metrics, calls: int):
    """The metrics of a call's last step (a call of several steps returns one value each)."""
    return metrics if calls == 1 else jax.tree.map(lambda values: values[-1], metrics)


def _metric_logger(config: TrainConfig) -> MetricLogger:
    """Process 0's metric logger: writers in ``--log-dir`` when given, else just the display."""
    enabled = jax.process_index() == 0
    writers = open_writers(config.log_dir) if config.log_dir and enabled else []
    return MetricLogger(
        writers,
        every=1,  # the loop picks the steps: with several per call, the calls' last ones
        throughput=Throughput(config.batch_size),
        enabled=enabled,
    )


def _describe_run(
    config: TrainConfig,
    run: Run,
    logger: MetricLogger,
    lowered: jax.stages.Lowered,
    console: Console,
) -> None:
    """FLOPs per step and the peak they are measured against; the run directory's facts."""
    devices = run.mesh.devices.size
    kind = run.mesh.devices.flat[0].device_kind
    # XLA counts a loop's body once. With --steps-per-call the body is one step, so
    # the figure is per step as wanted; the micro-batch loop of --accumulate would
    # undercount: no figure rather than a wrong one.
    flops = step_flops(lowered, devices) if config.accumulate == 1 else None
    peak = peak_flops(kind)
    logger.throughput = Throughput(
        config.batch_size, flops_per_step=flops, peak_flops=peak * devices if peak else None
    )
    write_run_info(
        config.log_dir,
        dataclasses.asdict(config),
        {
            "mesh": dict(run.mesh.shape),
            "backend": config.backend,
            "flops_per_step": flops,
            "peak_flops_per_device": peak,
        },
    )
    if flops:
        against = f"MFU against {peak:.3g} FLOP/s per {kind}" if peak else f"no peak for {kind}"
        console.line(
            f"jdp: {flops:.3g} FLOPs per step (XLA cost analysis, {devices} devices); {against}"
        )


def setup_devices(mesh_spec: str, *, processes: int = 1) -> None:
    """Before JAX starts: on a CPU-only machine, simulate the devices the mesh asks of a process."""
    wanted = requested_device_count(mesh_spec)
    if wanted and wanted > processes and wanted % processes == 0:
        simulate_cpu_devices(wanted // processes)


@dataclasses.dataclass(frozen=True)
class Run:
    """A configured run before its first step: mesh, data, initial state and step functions."""

    config: TrainConfig
    mesh: Mesh
    train: Split
    test: Split
    model: Model
    state: TrainState
    train_step: Callable
    eval_step: Callable


def build(config: TrainConfig, console: Console, model: Model | None = None) -> Run:
    """Sets up devices, mesh, data, model, optimizer and steps; says what it built.

    ``model`` replaces the built-in ``config.model`` (see `fit`).

    Raises:
        UsageError: a mesh, batch size, dataset or model that cannot work here.
    """
    cluster = distributed.initialize(
        config.coordinator,
        config.num_processes,
        config.process_id,
        startup_timeout=config.startup_timeout,
        heartbeat_timeout=config.heartbeat_timeout,
    )
    setup_devices(config.mesh, processes=cluster.num_processes)
    mesh = make_mesh(config.mesh)
    replicas = data_size(mesh)
    check_batch_size(config.batch_size, mesh)
    per_replica = config.batch_size // replicas
    if per_replica % config.accumulate:
        raise UsageError(
            f"--accumulate {config.accumulate} does not divide the per-replica batch "
            f"{per_replica} (global {config.batch_size} / {replicas} replicas); use a global "
            f"batch that is a multiple of {config.accumulate * replicas}"
        )
    devices = mesh.devices.size
    if cluster.num_processes > 1:
        console.line(
            f"jdp: {cluster.num_processes} processes ({cluster.source}), coordinator "
            f"{cluster.coordinator}, {jax.local_device_count()} devices each"
        )
    if jax.default_backend() == "cpu" and devices > 1:
        console.line(
            f"jdp: no accelerator; mesh {config.mesh} runs on {devices} simulated CPU devices"
        )
    if "model" in mesh.shape:
        console.line(
            "jdp: parameters are replicated over the 'model' axis (no tensor sharding yet)"
        )

    train = load_split(config.dataset, "train", config.data_dir)
    test = load_split(config.dataset, "test", config.data_dir)
    check_train_batch(train, config.batch_size)
    name = f"{config.model} {config.model_size}"
    if model is None:
        model = get_model(config.model, train, config.model_size)
    else:
        name = "your model"
    init_rng, train_rng = jax.random.split(jax.random.key(config.seed))
    sample = EvalReader(train, batch_size=1, rows=slice(None))(0)
    params, model_state = jax.jit(
        lambda rng: model.init(rng, sample), out_shardings=replicated(mesh)
    )(init_rng)
    schedule = config.make_schedule()
    optimizer = config.make_optimizer(schedule)
    precision = make_precision(config.precision, reduce=config.reduce_dtype)
    state = create_train_state(
        params, optimizer, mesh, rng=train_rng, model_state=model_state, precision=precision
    )
    train_step = make_train_step(
        model.loss_fn,
        optimizer,
        mesh,
        backend=config.backend,
        has_model_state=True,
        precision=precision,
        accumulate=config.accumulate,
        lr_schedule=schedule,
        steps_per_call=config.steps_per_call,
    )
    eval_step = make_eval_step(model.metrics_fn, mesh, backend=config.backend, has_model_state=True)

    num_params = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    console.line(
        f"jdp: {name} ({num_params:,} params) on {config.dataset} "
        f"({len(train)} train / {len(test)} test), mesh {dict(mesh.shape)}, "
        f"backend {config.backend}, global batch {config.batch_size} "
        f"({per_replica} per replica"
        + (f", {config.accumulate} micro-batches" if config.accumulate > 1 else "")
        + f"), {config.steps} steps"
    )
    scaling = (
        f" x {config.batch_size}/{config.lr_reference_batch} ({config.lr_scaling} scaling)"
        if config.lr_scaling != "none"
        else ""
    )
    console.line(
        f"jdp: {config.optimizer}, lr {config.lr:g}{scaling} = {config.peak_lr:.4g} peak, "
        f"{config.schedule} schedule, {config.warmup_steps} warmup steps, "
        f"precision {config.precision} (all-reduce {config.reduce_dtype})"
    )
    return Run(config, mesh, train, test, model, state, train_step, eval_step)


def fit(
    config: TrainConfig, *, model: Model | None = None, console: Console | None = None
) -> FitResult:
    """Trains and evaluates the configured model; returns the final state and figures.

    ``model`` brings your own (`jdp.models.from_linen` / `jdp.models.from_nnx`) in
    place of the built-in ``config.model`` and ``config.model_size``; it takes the
    dataset's batches (``image`` and ``label``, or ``source`` and ``target``).

    With ``config.ckpt_dir`` the run resumes from the latest checkpoint there,
    saves every ``config.ckpt_every`` steps and at the end, and on SIGTERM or
    SIGINT saves at the current step and returns early (``preempted``).

    Raises:
        UsageError: a mesh, batch size, dataset, model or checkpoint directory that
            cannot work here.
    """
    started = time.perf_counter()
    console = console or Console()
    run = build(config, console, model)
    mesh, train, test, state = run.mesh, run.train, run.test, run.state
    train_step, eval_step = run.train_step, run.eval_step
    checkpoints = Checkpointer(config.ckpt_dir, keep=config.keep) if config.ckpt_dir else None
    with contextlib.ExitStack() as stack:
        start_step = 0
        if checkpoints is not None:
            stack.enter_context(checkpoints)
            state, start_step = _resume(config, checkpoints, state, console)

        def run_eval(step: int) -> dict[str, float]:
            batches = eval_batches(test, mesh, batch_size=config.batch_size)
            result = evaluate(eval_step, state, batches)
            console.line(
                f"step {step}: "
                + " ".join(f"test_{k}={result[k]:.4f}" for k in _eval_order(result))
            )
            logger.write("eval", step, result)
            return result

        def save(metrics: dict[str, float] | None = None) -> None:
            if checkpoints is not None:
                checkpoints.save(
                    state,
                    loader_step=batches.position,
                    config=dataclasses.asdict(config),
                    metrics=metrics,
                )

        batches = stack.enter_context(
            train_batches(
                train,
                mesh,
                batch_size=config.batch_size,
                seed=config.seed,
                start_step=start_step,
                workers=config.loader_workers,
                prefetch=config.prefetch,
                steps_per_call=config.steps_per_call,
            )
        )
        # Several processes: JAX's runtime takes SIGTERM over, so it is always asked.
        watch = checkpoints is not None or jax.process_count() > 1
        preemption = stack.enter_context(Preemption()) if watch else None
        logger = stack.enter_context(_metric_logger(config))
        profile = None
        if config.profile_window and jax.process_index() == 0:
            profile = ProfileWindow(*config.profile_window, os.path.join(config.log_dir, "profile"))
            stack.callback(profile.stop)
        console.start_progress(config.steps - start_step)
        metrics = None
        shown = start_step
        steady_start, waited_before = time.perf_counter(), 0.0  # reset after the first call
        # Each call runs `calls` steps; `step` is the last of them, where a run
        # evaluates, saves and logs (the config keeps those on call boundaries).
        calls = config.steps_per_call
        for step in range(start_step + calls, config.steps + 1, calls):
            batch = next(batches)
            first_call = step == start_step + calls
            if first_call and config.log_dir and jax.process_index() == 0:
                _describe_run(config, run, logger, train_step.lower(state, batch), console)
            if profile is not None:
                profile.before(step - calls + 1)
            state, metrics = train_step(state, batch)
            if step // config.log_every > (step - calls) // config.log_every:
                logger.record(step, _last_step(metrics, calls))  # a call's last step
            if profile is not None:
                profile.after(step, metrics)
            if first_call:
                jax.block_until_ready(metrics)  # compilation ends here; throughput counts from now
                steady_start, waited_before = time.perf_counter(), batches.wait_seconds
            if step // _DISPLAY_EVERY > shown // _DISPLAY_EVERY or step == config.steps:
                fields = _progress_fields(_last_step(metrics, calls), logger.latest)
                console.advance(step - shown, **fields)
                shown = step
            evaluated = None
            if config.eval_every and step % config.eval_every == 0 and step != config.steps:
                evaluated = run_eval(step)
            # JAX's multi-process sync point wants a counter that rises by one per call.
            if preemption is not None and preemption.reached(step // calls):
                if checkpoints is not None:
                    save(evaluated)
                    checkpoints.wait()
                console.close_progress()
                return _preempted(config, state, step, preemption, started)
            if config.ckpt_every and step % config.ckpt_every == 0 and step != config.steps:
                save(evaluated)
            if config.check_replicas_every and step % config.check_replicas_every == 0:
                distributed.check_replicas((state.params, state.model_state), step=step)
        ran = config.steps - start_step
        last = _last_step(metrics, calls) if metrics is not None else None
        train_loss = float(last["loss"]) if last is not None else float("nan")
        steady = time.perf_counter() - steady_start if ran > calls else 0.0
        waited = batches.wait_seconds - waited_before
        console.close_progress()
        final = run_eval(config.steps)
        save({"accuracy": final["accuracy"]})
    return FitResult(
        state=state,
        steps=config.steps,
        train_loss=train_loss,
        test_loss=final["loss"],
        test_accuracy=final["accuracy"],
        examples_per_sec=(ran - calls) * config.batch_size / steady if steady else 0.0,
        input_wait=waited / steady if steady else 0.0,
        wall_seconds=time.perf_counter() - started,
    )


def _resume(
    config: TrainConfig, checkpoints: Checkpointer, state: TrainState, console: Console
) -> tuple[TrainState, int]:
    """The state and first step to continue from: a restored checkpoint's, or the fresh ones."""
    existing = checkpoints.steps()
    if existing and config.no_resume:
        raise UsageError(
            f"--no-resume: {checkpoints.directory} already holds checkpoints (latest step "
            f"{existing[-1]}); remove them, or choose an empty --ckpt-dir"
        )

    def same_run(meta: dict) -> None:
        conflicts = config.resume_conflicts(meta.get("config", {}))
        if conflicts:
            raise UsageError(
                f"{checkpoints.directory} holds a run made with other settings: "
                f"{'; '.join(conflicts)}; rerun with its flags, or choose another --ckpt-dir"
            )

    restored = checkpoints.restore(state, check=same_run) if existing else None
    if restored is None:
        return state, 0
    state, meta = restored
    start = int(meta["loader_step"])
    if start % config.steps_per_call:
        raise UsageError(
            f"{checkpoints.directory} holds step {start}, not a multiple of --steps-per-call "
            f"{config.steps_per_call}; resume with a --steps-per-call that divides {start}"
        )
    console.line(f"jdp: resuming from step {meta['step']} in {checkpoints.directory}")
    return state, start


def _preempted(
    config: TrainConfig, state: TrainState, step: int, preemption: Preemption, started: float
) -> FitResult:
    nan = float("nan")
    return FitResult(
        state=state,
        steps=step,
        train_loss=nan,
        test_loss=nan,
        test_accuracy=nan,
        examples_per_sec=nan,
        input_wait=nan,
        wall_seconds=time.perf_counter() - started,
        preempted=(
            f"jdp.train: {preemption.signal_name} at step {step}; checkpoint saved in "
            f"{os.path.abspath(config.ckpt_dir)}; run the same command to resume"
            if config.ckpt_dir
            else f"jdp.train: {preemption.signal_name} at step {step}; stopped without saving "
            "(no --ckpt-dir)"
        ),
    )
