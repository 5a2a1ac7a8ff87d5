"""``fit(config)``: a run as a loop of train steps and the periodic actions between them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

import jax
import optax

from jdp.actions import NEVER, Action, Progress
from jdp.checkpoint import Checkpointer
from jdp.data.loader import CallBounds, calls_from, places_ahead, train_batches
from jdp.data.splits import Split
from jdp.distributed.marks import (
    ACTIONS,
    COMPILING,
    READING,
    SAVING,
    STARTING,
    STEPPING,
    Watch,
)
from jdp.errors import LoaderError, UsageError
from jdp.models import Model
from jdp.report.console import Console
from jdp.report.goodput import Clock, Goodput
from jdp.report.run_info import record_goodput
from jdp.state import TrainState
from jdp.training.calls import call_bounds, choose_steps_per_call, say_gaps
from jdp.training.compile_cache import compile_cache
from jdp.training.config import TrainConfig
from jdp.training.messages import describe_run
from jdp.training.results import (
    FitResult,
    SteadyTimer,
    evaluate_only,
    evaluated,
    finished,
    stopped,
)
from jdp.training.resume import resume
from jdp.training.run import Data, Run, Yours, build
from jdp.training.steps import logged_lr, lr_in_step
from jdp.training.stops import Interrupted, StopOnPreemption
from jdp.training.wiring import (
    action_phases,
    actions_for,
    check_evaluates,
    checkpointer,
    data_ledger,
    log_dir_lock,
    metric_logger,
    stall_watch,
    tokens_per_example,
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

    Your own parts replace the config's: ``model`` (`jdp.models.from_linen`, `from_nnx`:
    an NNX module gets its trained values back); ``train``, ``validation`` and ``test``
    splits (`jdp.data`); ``optimizer``, any Optax one (``lr_schedule``, a schedule or
    a constant, is what the run logs as ``lr``). ``callbacks`` are your actions
    (`jdp.actions`), called after each call of the train step, after the evaluation
    and before the checkpoint; one may stop the run. A validation split (or
    ``config.validation_fraction``) chooses the best checkpoint and early stopping,
    and the test split is reported at the end. With ``config.ckpt_dir`` the run
    resumes from its latest checkpoint, saves every ``ckpt_every`` steps, every
    ``ckpt_every_minutes`` and at the end, and on SIGTERM or SIGINT saves and
    returns early (``preempted``). A run whose processes make no progress for
    ``config.stall_timeout`` seconds ends each of them with exit code 75 (the
    stall watchdog, `jdp.distributed.watchdog`).

    Raises:
        UsageError: a mesh, batch size, dataset, model or checkpoint directory that
            cannot work here.

    Examples:
        >>> config = jdp.TrainConfig(mesh="data=2", steps=40, warmup_steps=5)
        >>> result = jdp.fit(config, console=jdp.Console(enabled=False))
        >>> result.steps, result.test_accuracy > 0.5
        (40, True)
    """
    if not isinstance(config, TrainConfig):
        raise UsageError(f"fit takes a jdp.TrainConfig, got {type(config).__name__}")
    if uncallable := [each for each in callbacks if not callable(each)]:
        raise UsageError(f"callbacks are called after each step: {uncallable[0]!r} is not callable")
    started, clock, console = time.perf_counter(), Clock(), console or Console()
    yours = Yours(model, _your_data(train, validation, test), optimizer, lr_schedule)
    # --eval-only reads a checkpoint directory: it never makes one (for the cache).
    missing = config.eval_only and not os.path.isdir(config.ckpt_dir or "")
    with compile_cache(config.compile_cache, None if missing else config.ckpt_dir):
        return _fit(config, console, yours, callbacks, started, clock)


def _fit(
    config: TrainConfig,
    console: Console,
    yours: Yours,
    callbacks: Sequence[Action],
    started: float,
    clock: Clock,
) -> FitResult:
    if config.eval_only:
        return evaluate_only(config, console, yours, started)
    run = build(config, console, yours)
    check_evaluates(run, yours=yours.data is not None)
    config = run.config  # resolved: --epochs as steps, a clamped warmup
    goodput = Goodput(
        clock, config.log_dir, every=config.log_every, enabled=jax.process_index() == 0
    )
    with contextlib.ExitStack() as stack:
        state, start, checkpoints, ledger = run.state, 0, None, {}
        stack.enter_context(log_dir_lock(config))
        if config.ckpt_dir:
            checkpoints = stack.enter_context(checkpointer(config, run))
            state, start, ledger = resume(config, checkpoints, state, console, run.recorded)
            if start >= config.steps:
                console.line(
                    f"jdp: {checkpoints.directory} holds the finished run (step {start} of "
                    f"{config.steps}); evaluating it (raise --steps to train on)"
                )
                return evaluated(run, state, start, console, started)
        if config.steps_per_call == "auto":  # from the step it starts at
            before = clock.switch("compile")  # the one-step call's compile, the K-step's
            run = choose_steps_per_call(run, state, start, console, callbacks)
            config = run.config
            clock.switch(before)
        say_gaps(config, console, callbacks)
        goodput.start(start)
        progress, timer, history = _train(
            run, state, start, ledger, stack, console, checkpoints, callbacks, goodput
        )
        clock.switch("other")  # closing the loader, the metric files, the checkpointer
    accounting = goodput.finish("finished" if progress.finish else "preempted")
    if config.log_dir and jax.process_index() == 0:
        record_goodput(config.log_dir, accounting)
    if not progress.finish:  # preempted, and saved if it could
        return stopped(progress, started)
    return finished(run, progress, timer, started, start, history, accounting)


def _your_data(train: Split | None, validation: Split | None, test: Split | None) -> Data | None:
    given = {"train": train, "validation": validation, "test": test}
    for name, split in given.items():
        if split is not None and not hasattr(split, "kind"):  # every jdp.data split says its kind
            raise UsageError(
                f"fit: {name}= takes a split of jdp.data (from_arrays(x, y); from_indexable "
                f"for a Hugging Face or Grain dataset; from_batches, ...), got "
                f"{type(split).__name__}"
            )
    if train is not None:
        return Data(train, validation, test)
    if validation is not None or test is not None:
        raise UsageError("fit: give train= with validation= or test= (your own data)")
    return None


def _train(
    run: Run,
    state: TrainState,
    start: int,
    ledger: dict,
    stack: contextlib.ExitStack,
    console: Console,
    checkpoints: Checkpointer | None,
    callbacks: Sequence[Action],
    goodput: Goodput,
) -> tuple[Progress, SteadyTimer, list]:
    """The loop from step ``start``: a call of the train step, then the actions, until
    the last step or a stop; then the actions once more, at the end, unless the stop
    skips it (preemption). ``ledger``: the data ledger through ``start``, as its
    checkpoint kept it; ``goodput`` is given each moment's part. Returns the progress,
    the steady loop's timer and the records logged."""
    config, calls = run.config, run.config.steps_per_call  # steps per call of the step
    bounds = call_bounds(config, callbacks)  # a shorter call closes a gap to one (forced K)
    steps: dict = {}  # the step's call by the steps it runs (K, and 1 closing a gap), as met
    batches = stack.enter_context(_train_loader(config, run, start, bounds))
    logger = stack.enter_context(metric_logger(config, tokens_per_example(run)))
    ledger = data_ledger(config, run, batches, start, ledger)
    actions = actions_for(
        config, run, stack, console, logger, batches, checkpoints, callbacks, ledger
    )
    progress = Progress(step=start, steps=config.steps, state=state)
    if run.schedule is not None and not lr_in_step(config):
        progress._lr_at = logged_lr(run.schedule, int(state.loss_scale.skipped))
    clock, quiet = goodput.clock, start  # no action is due through step `quiet`
    watch = stack.enter_context(stall_watch(config, start, goodput))
    phases = action_phases(actions, callbacks)
    preemption = next(action for action in actions if isinstance(action, StopOnPreemption))
    batches.interrupt = preemption.interrupted if jax.process_count() == 1 else None
    watch.save_first = preemption.stall if jax.process_count() == 1 else None
    always = [action for action in actions if not hasattr(action, "quiet_through")]
    # A profile may start before the first call, and the finiteness guard compiles its
    # read of the state: compiling, as the first call does, which is never a stall.
    _call_each(actions, progress, clock, watch, phases, starting=True)
    console.start_progress(config.steps, start)
    timer = SteadyTimer(batches, console)
    for step, ran in calls_from(start, config.steps, calls, bounds):
        step, first, fresh = step + ran, step == start, ran not in steps
        clock.switch("input")
        watch.at(STARTING if first else READING)
        if (batch := _next_batch(batches, progress, preemption, watch, first=first)) is None:
            break
        if fresh:  # a call that compiles: the first, and each new length a gap asks
            steps[ran] = run.train_step if ran == calls else run.step_for(ran)
            timer.compiling()
        watch.started(step, COMPILING if first or fresh else STEPPING)
        redone = step <= goodput.redo_until
        clock.switch("compile" if first or fresh else "recomputed" if redone else "step")
        if first and config.log_dir and jax.process_index() == 0:
            lowered = steps[ran].lower(progress.state, batch)
            describe_run(config, run, logger, lowered, console, scanned=ran > 1)
        progress.after_call(step, ran, *steps[ran](progress.state, batch))
        timer.after_call(progress.call_metrics, ran)
        if step > quiet:
            _call_each(actions, progress, clock, watch, phases)
            quiet = _quiet_through(actions, progress)
        else:  # only the actions asked after every call
            _call_each(always, progress, clock, watch, phases)
        goodput.progress(step)
        if progress.stop_reason:
            break
    timer.stop()
    if run.model.update is not None:  # an NNX module gets its trained values back
        run.model.update(progress.state.params, progress.state.model_state)
    if not progress.finish:
        console.close_progress()
        return progress, timer, logger.history
    if progress.stop_reason:
        console.line(f"jdp: {progress.stop_reason}; stopping at step {progress.step}")
    progress.final = True
    _call_each(actions, progress, clock, watch, phases)
    if checkpoints is not None:
        _tag_last_checkpoint(checkpoints, clock, watch, logger)
    if run.sync_step is not None and run.model.update is not None:
        run.model.update(progress.state.params, progress.state.model_state)  # synced at end
    return progress, timer, logger.history


def _next_batch(batches, progress: Progress, preemption: StopOnPreemption, watch, *, first: bool):
    """The call's batch, or None where reading it stopped the run (a signal, a loader that
    cannot go on, bad data: the last step's state is whole, and saved first); bad data
    before the ``first`` call raises, its line alone."""
    try:
        return next(batches)
    except (Interrupted, LoaderError, UsageError) as stop:
        if isinstance(stop, UsageError) and first:
            raise
        watch.at(SAVING)
        preemption.now(progress, stop)
        return None


def _tag_last_checkpoint(checkpoints: Checkpointer, clock, watch, logger) -> None:
    """Waits for the last save and tags the run with its path, for the trackers."""
    clock.switch("checkpoint")
    watch.at(SAVING)
    checkpoints.wait()
    clock.switch("other")
    if saved := checkpoints.steps():
        path = os.path.join(os.path.abspath(checkpoints.directory), str(saved[-1]))
        logger.tag("jdp.checkpoint", path)


def _call_each(
    actions: Sequence[Action],
    progress: Progress,
    clock: Clock,
    watch: Watch,
    phases: dict[int, tuple[str, str]],
    *,
    starting: bool = False,
) -> None:
    """Each action in turn, its time given to its part of the goodput ledger (``part``:
    a checkpoint's, an evaluation's) or to the step's, and its phase to the watch
    (``starting``: before the first call, the loop's own actions' is compiling)."""
    for action in actions:
        phase = phases[id(action)]
        watch.at(*((COMPILING, "") if starting and phase[0] == ACTIONS else phase))
        part = getattr(action, "part", None)
        previous = clock.switch(part) if part else None
        action(progress)
        if previous:
            clock.switch(previous)
        if not progress.finish:  # a stop that skips the end skips the rest of this pass too
            return


def _quiet_through(actions: Sequence[Action], progress: Progress) -> int:
    """The last step through which none of the actions that say when they are quiet
    (`jdp.actions.PeriodicAction.quiet_through`) needs a call: a fast step's loop pays
    for its actions only at the steps they run."""
    return min(
        (action.quiet_through(progress) for action in actions if hasattr(action, "quiet_through")),
        default=NEVER,
    )


def _train_loader(config: TrainConfig, run: Run, start: int, bounds: CallBounds):
    return train_batches(
        run.train,
        run.mesh,
        batch_size=config.batch_size,
        seed=config.seed,
        start_step=start,
        workers=config.loader_workers,
        prefetch=config.prefetch,
        steps_per_call=config.steps_per_call,
        place=places_ahead(run.mesh),
        ledger=config.data_ledger,
        steps=config.steps - start,
        bounds=bounds,
    )
