"""``fit(config)``: a run as a loop of train steps and the periodic actions between them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence

import jax
import optax

from jdp.actions import Action, EarlyStopping, Progress
from jdp.checkpoint import Checkpointer, read_params, read_record, step_directory
from jdp.data.pipeline import train_batches
from jdp.data.sources import Split
from jdp.distributed.preemption import Preemption
from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS, parse_mesh_spec
from jdp.models import Model
from jdp.report.console import Console
from jdp.report.logger import MetricLogger
from jdp.report.throughput import Throughput
from jdp.report.writers import open_writers
from jdp.state import TrainState
from jdp.training.config import DILOCO_FIELDS, TOPOLOGY_FIELDS, TrainConfig
from jdp.training.run import Data, Run, Yours, build, config_optimizer, describe_run
from jdp.training.run_actions import (
    Checkpoint,
    CheckReplicas,
    Display,
    Evaluate,
    GuardFinite,
    LogMetrics,
    Profile,
    StopOnPreemption,
    Synchronize,
)

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
    preempted: str | None = None  # the line saying where a preempted run saved
    stopped: str | None = None  # why the run stopped before config.steps, when it did
    validation: dict[str, float] | None = None  # the last validation metrics, with a split
    # Every record logged (process 0): {"kind": "train" | "val" | "eval", "step", ...}.
    history: list[dict] = dataclasses.field(default_factory=list)
    evaluated_only: bool = False  # --eval-only: a checkpoint evaluated, nothing trained

    def summary_line(self) -> str:
        if self.preempted:
            return self.preempted
        validation = (
            f"val_accuracy={self.validation['accuracy']:.4f} "
            if self.validation and "accuracy" in self.validation
            else ""
        )
        if self.evaluated_only:
            return (
                f"jdp.train: evaluated step={self.steps} {validation}"
                f"test_loss={self.test_loss:.4f} test_accuracy={self.test_accuracy:.4f}"
            )
        return (
            f"jdp.train: steps={self.steps} train_loss={self.train_loss:.4f} {validation}"
            f"test_loss={self.test_loss:.4f} test_accuracy={self.test_accuracy:.4f} "
            f"examples/s={self.examples_per_sec:.0f} input_wait={self.input_wait:.1%} "
            f"wall={self.wall_seconds:.1f}s"
        )


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


def fit(
    config: TrainConfig,
    *,
    model: Model | None = None,
    train: Split | None = None,
    validation: Split | None = None,
    test: Split | None = None,
    optimizer: optax.GradientTransformation | None = None,
    lr_schedule: optax.Schedule | float | None = None,
    console: Console | None = None,
    callbacks: Sequence[Action] = (),
) -> FitResult:
    """Trains and evaluates the configured model; returns the final state and figures.

    ``model`` brings your own (`jdp.models.from_linen` / `jdp.models.from_nnx`) in
    place of the built-in ``config.model`` and ``config.model_size``; it takes the
    dataset's batches (``image`` and ``label``, or ``source`` and ``target``, or
    your own data's features). An NNX module gets its trained values back.

    ``train``, ``validation`` and ``test`` bring your own data (`jdp.data`) in
    place of ``config.dataset``. A validation split (given, or held out with
    ``config.validation_fraction``) is evaluated every ``eval_every`` steps and
    chooses the best checkpoint and early stopping; the test split is then only
    measured at the end and reported.

    ``optimizer`` is any Optax optimizer, used in place of the config's
    optimizer fields (which are then neither used nor recorded);
    ``lr_schedule`` (a schedule or a constant) is what the run logs as ``lr``.

    ``callbacks`` are your own actions (see `jdp.actions`), run after each call
    of the train step, after the evaluation and before the checkpoint: for
    example a `jdp.PeriodicAction` subclass, a `jdp.Callback`, or
    `jdp.EarlyStopping`. An action may stop the run (``progress.stop``).

    With ``config.ckpt_dir`` the run resumes from the latest checkpoint there,
    saves every ``config.ckpt_every`` steps and at the end, and on SIGTERM or
    SIGINT saves at the current step and returns early (``preempted``).

    Raises:
        UsageError: a mesh, batch size, dataset, model or checkpoint directory that
            cannot work here.

    Examples:
        >>> config = jdp.TrainConfig(mesh="data=2", steps=40, warmup_steps=5)
        >>> result = jdp.fit(config, console=jdp.Console(enabled=False))
        >>> result.steps, result.test_accuracy > 0.5
        (40, True)
    """
    started = time.perf_counter()
    console = console or Console()
    data = None
    if train is not None:
        data = Data(train, validation, test)
    elif validation is not None or test is not None:
        raise UsageError("fit: give train= with validation= or test= (your own data)")
    yours = Yours(model, data, optimizer, lr_schedule)
    if config.eval_only:
        return _evaluate_only(config, console, yours, started)
    run = build(config, console, yours)
    config = run.config  # resolved: --epochs as steps, a clamped warmup
    calls = config.steps_per_call  # steps per call of the train step
    with contextlib.ExitStack() as stack:
        state, start = run.state, 0
        checkpoints = Checkpointer(config.ckpt_dir, keep=config.keep) if config.ckpt_dir else None
        if checkpoints is not None:
            state, start = _resume(
                config, stack.enter_context(checkpoints), state, console, run.recorded
            )
            if start >= config.steps:
                console.line(
                    f"jdp: {checkpoints.directory} holds the finished run (step {start} of "
                    f"{config.steps}); evaluating it (raise --steps to train on)"
                )
                return _evaluated(run, state, start, console, started)
        batches = stack.enter_context(_train_loader(config, run, start))
        logger = stack.enter_context(_metric_logger(config))
        actions = _actions(config, run, stack, console, logger, batches, checkpoints, callbacks)
        progress = Progress(step=start, steps=config.steps, state=state)
        _call_each(actions, progress)  # before the first call: a profile may start there
        console.start_progress(config.steps - start)
        timer = _SteadyTimer(batches)
        for step in range(start + calls, config.steps + 1, calls):
            batch = next(batches)
            if step == start + calls and config.log_dir and jax.process_index() == 0:
                lowered = run.train_step.lower(progress.state, batch)
                describe_run(config, run, logger, lowered, console)
            progress.after_call(step, calls, *run.train_step(progress.state, batch))
            timer.after_call(progress.call_metrics)
            _call_each(actions, progress)
            if progress.stop_reason:
                break
        timer.stop()
        if run.model.update is not None:  # an NNX module gets its trained values back
            run.model.update(progress.state.params, progress.state.model_state)
        if not progress.finish:  # preempted, and saved if it could
            console.close_progress()
            return _stopped(progress, started)
        if progress.stop_reason:
            console.line(f"jdp: {progress.stop_reason}; stopping at step {progress.step}")
        progress.final = True
        _call_each(actions, progress)
        if run.sync_step is not None and run.model.update is not None:
            run.model.update(progress.state.params, progress.state.model_state)  # synced at end
    return _finished(config, progress, timer, started, start, logger.history)


def _call_each(actions: Sequence[Action], progress: Progress) -> None:
    for action in actions:
        action(progress)
        if not progress.finish:  # a stop that skips the end skips the rest of this pass too
            return


def _train_loader(config: TrainConfig, run: Run, start: int):
    return train_batches(
        run.train,
        run.mesh,
        batch_size=config.batch_size,
        seed=config.seed,
        start_step=start,
        workers=config.loader_workers,
        prefetch=config.prefetch,
        steps_per_call=config.steps_per_call,
    )


def _actions(config, run, stack, console, logger, batches, checkpoints, callbacks) -> list:
    """The run's actions in the order they are called after each call of the step."""
    actions: list[Action] = [Synchronize(run.sync_step)] if run.sync_step else []
    actions += [
        Display(console, logger, every=_DISPLAY_EVERY),
        LogMetrics(logger, every=config.log_every),
    ]
    if config.profile_window and jax.process_index() == 0:
        profile = Profile(*config.profile_window, os.path.join(config.log_dir, "profile"))
        stack.callback(profile.stop)
        actions.append(profile)
    actions.extend(_evaluations(run, console, logger, every=config.eval_every))
    if config.early_stop_patience:
        actions.append(
            EarlyStopping(
                config.early_stop_metric,
                patience=config.early_stop_patience,
                mode="max" if config.early_stop_metric == "accuracy" else "min",
            )
        )
    actions.extend(callbacks)
    skipping = config.nan_policy == "skip" or config.precision == "fp16"
    if config.nan_policy != "ignore":
        actions.append(
            GuardFinite(every=_DISPLAY_EVERY, skipping=skipping,
                        max_skipped_fraction=config.max_skipped_fraction, ckpt_dir=config.ckpt_dir)
        )  # fmt: skip
    checkpoint = None
    if checkpoints is not None:
        checkpoint = Checkpoint(
            checkpoints,
            batches,
            every=config.ckpt_every,
            config=run.recorded,
            skipping=skipping,
        )
        actions.append(checkpoint)
    actions.append(CheckReplicas(config.check_replicas_every))
    # Always asked: a signal ends the run at a step boundary (saving when it can),
    # never mid-step; several processes agree on the step through JAX's runtime.
    preemption = stack.enter_context(Preemption())
    actions.append(
        StopOnPreemption(preemption, steps_per_call=config.steps_per_call,
                         checkpoint=checkpoint, ckpt_dir=config.ckpt_dir)
    )  # fmt: skip
    return actions


def _evaluations(run: Run, console: Console, logger: MetricLogger, *, every: int) -> list:
    """With a validation split, it every ``every`` steps and the test split at the end only;
    without one, the test split every ``every`` steps. Both at the end."""
    kwargs = dict(batch_size=run.config.batch_size, console=console, logger=logger)
    evaluations = []
    if run.validation is not None:
        evaluations.append(
            Evaluate(run.eval_step, run.validation, run.mesh, every=every, prefix="val", **kwargs)
        )
    if run.test is not None:
        chooses = run.validation is None
        evaluations.append(
            Evaluate(run.eval_step, run.test, run.mesh, every=every if chooses else 0,
                     chooses=chooses, **kwargs)
        )  # fmt: skip
    return evaluations


class _SteadyTimer:
    """Wall time and input wait of the steady loop: from the end of the first call."""

    def __init__(self, loader):
        self.loader, self.calls = loader, 0
        self.started, self.waited_before, self.seconds, self.waited = 0.0, 0.0, 0.0, 0.0

    def after_call(self, metrics) -> None:
        self.calls += 1
        if self.calls == 1:
            jax.block_until_ready(metrics)  # compilation ends here; throughput counts from now
            self.started, self.waited_before = time.perf_counter(), self.loader.wait_seconds

    def stop(self) -> None:
        if self.calls > 1:
            self.seconds = time.perf_counter() - self.started
            self.waited = self.loader.wait_seconds - self.waited_before


def _finished(config: TrainConfig, progress: Progress, timer: _SteadyTimer, started: float,
              start: int, history: list) -> FitResult:  # fmt: skip
    last = progress.metrics
    tested = progress.tested or {}
    validated = progress.evaluated if progress.evaluated is not progress.tested else None
    timed = progress.step - start - config.steps_per_call  # the steps after the first call
    nan = float("nan")
    return FitResult(
        state=progress.state,
        steps=progress.step,
        train_loss=float(last["loss"]) if last is not None else nan,
        test_loss=tested.get("loss", nan),
        test_accuracy=tested.get("accuracy", nan),
        validation=validated,
        history=list(history),
        examples_per_sec=timed * config.batch_size / timer.seconds if timer.seconds else 0.0,
        input_wait=timer.waited / timer.seconds if timer.seconds else 0.0,
        wall_seconds=time.perf_counter() - started,
        stopped=progress.stop_reason,
    )


def _resume(config: TrainConfig, checkpoints: Checkpointer, state: TrainState, console: Console,
            recorded: dict | None = None) -> tuple[TrainState, int]:  # fmt: skip
    """The state and first step to continue from: a restored checkpoint's, or the fresh ones."""
    existing = checkpoints.steps()
    if existing and config.no_resume:
        raise UsageError(
            f"--no-resume: {checkpoints.directory} already holds checkpoints (latest step "
            f"{existing[-1]}); remove them, or choose an empty --ckpt-dir"
        )

    def same_run(meta: dict) -> None:
        _same_groups(state, meta, config.mesh, checkpoints.directory)
        conflicts = config.resume_conflicts(meta.get("config", {}), recorded)
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
    _say_how_steps_changed(config, meta.get("config", {}), start, checkpoints.directory, console)
    if start % config.steps_per_call:
        raise UsageError(
            f"{checkpoints.directory} holds step {start}, not a multiple of --steps-per-call "
            f"{config.steps_per_call}; resume with a --steps-per-call that divides {start}"
        )
    console.line(f"jdp: resuming from step {meta['step']} in {checkpoints.directory}")
    return state, start


def _same_groups(state: TrainState, meta: dict, mesh: str, directory: str) -> None:
    """A checkpoint holds one state per DiLoCo group: it resumes only with as many
    (counted from the arrays, whatever the specs wrote, -1 included)."""
    saved = next(
        (array["shape"][0] for name, array in meta.get("arrays", {}).items()
         if name.startswith("groups/")),
        0,
    )  # fmt: skip
    groups = jax.tree.leaves(state.groups)[0].shape[0] if state.groups is not None else 0
    if groups != saved:
        saved_mesh = meta.get("config", {}).get("mesh", "?")
        held = f"{saved} DiLoCo groups (--mesh {saved_mesh})" if saved else "no DiLoCo groups"
        wanted = f"{GROUP_AXIS}={saved}, any data size" if saved else f"no {GROUP_AXIS} axis"
        raise UsageError(
            f"{directory} holds a run of {held}, and --mesh {mesh} has "
            f"{groups or 'none'}; resume it on a mesh with {wanted}, or choose another --ckpt-dir"
        )


def _stopped(progress: Progress, started: float) -> FitResult:
    """The result of a run stopped without its end (preempted): no final figures."""
    nan = float("nan")
    return FitResult(
        state=progress.state,
        steps=progress.step,
        train_loss=nan,
        test_loss=nan,
        test_accuracy=nan,
        examples_per_sec=nan,
        input_wait=nan,
        wall_seconds=time.perf_counter() - started,
        preempted=progress.stop_reason,
        stopped=progress.stop_reason,
    )


def _say_how_steps_changed(config: TrainConfig, saved: dict, start: int, directory: str,
                           console: Console) -> None:  # fmt: skip
    """A resumed run may train longer than the run that saved; the schedule's horizon moves."""
    before = saved.get("steps", config.steps)
    if before == config.steps:
        return
    if config.steps <= start:
        raise UsageError(
            f"{directory} holds step {start}, and --steps is {config.steps}; raise --steps "
            f"above {start} to train on, or use --eval-only to evaluate it"
        )
    line = f"jdp: --steps {config.steps} (was {before})"
    if "lr" in saved:  # the built-in schedule, whose horizon is --steps
        was = dataclasses.replace(config, steps=before)
        now_lr, was_lr = (float(config_optimizer(c)[0](start)) for c in (config, was))
        line += (
            f": the {config.schedule} schedule now spans {config.steps} steps; at step {start} "
            f"its learning rate is {now_lr:.4g} (it was {was_lr:.4g})"
        )
    console.line(line)


def _evaluate_only(config: TrainConfig, console: Console, yours: Yours, started: float
                   ) -> FitResult:  # fmt: skip
    """``--eval-only``: the latest checkpoint of ``--ckpt-dir``, evaluated as its run would."""
    step_dir = step_directory(os.path.abspath(config.ckpt_dir))
    record = read_record(step_dir)
    saved = record.get("config", {})
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    if GROUP_AXIS not in dict(parse_mesh_spec(config.mesh)):
        fields -= set(DILOCO_FIELDS)  # a DiLoCo run's parameters evaluate on any mesh
    made_with = {
        name: value
        for name, value in saved.items()
        if name in fields and name not in TOPOLOGY_FIELDS and value != "yours"
        and not str(value).startswith("yours")
    }  # fmt: skip
    config = dataclasses.replace(config, **made_with, ckpt_dir=config.ckpt_dir)
    run = build(config, console, yours)
    params, model_state = read_params(step_dir, like=(run.state.params, run.state.model_state))
    state = run.state.replace(params=params, model_state=model_state)
    step = int(record.get("step", 0))
    return _evaluated(run, state, step, console, started)


def _evaluated(run: Run, state: TrainState, step: int, console: Console, started: float
               ) -> FitResult:  # fmt: skip
    """The result of evaluating ``state`` (a checkpoint) without training."""
    config = run.config
    if run.model.update is not None:  # an NNX module gets the checkpoint's values
        run.model.update(state.params, state.model_state)
    progress = Progress(step=step, steps=step, state=state)
    progress.final = True
    with _metric_logger(config) as logger:
        for evaluation in _evaluations(run, console, logger, every=0):
            evaluation(progress)
    tested, nan = progress.tested or {}, float("nan")
    validated = progress.evaluated if progress.evaluated is not progress.tested else None
    return FitResult(
        state=state,
        steps=progress.step,
        train_loss=nan,
        test_loss=tested.get("loss", nan),
        test_accuracy=tested.get("accuracy", nan),
        examples_per_sec=nan,
        input_wait=nan,
        wall_seconds=time.perf_counter() - started,
        validation=validated,
        history=list(logger.history),
        evaluated_only=True,
    )
