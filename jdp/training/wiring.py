"""What a run calls between its train steps: its actions, in order, and its metric logger."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence

import jax
from jax._src import distributed as jax_distributed  # the runtime's client: no public handle

from jdp.actions import Action, EarlyStopping
from jdp.checkpoint import Checkpointer
from jdp.checkpoint.params import best_recorded
from jdp.checkpoint.record import BEST
from jdp.data.loader import BatchStream, EvalReader, Loader, TrainReader
from jdp.data.splits import Ledger
from jdp.distributed.lock import held
from jdp.distributed.marks import ACTIONS, CALLBACK, Watch
from jdp.distributed.preemption import Preemption
from jdp.distributed.watchdog import Watchdog
from jdp.errors import UsageError
from jdp.mesh import process_rows
from jdp.report.console import Console
from jdp.report.goodput import Goodput
from jdp.report.logger import MetricLogger
from jdp.report.throughput import Throughput
from jdp.report.trackers import open_writers, tracker_names
from jdp.training.config import TrainConfig
from jdp.training.finite import GuardFinite
from jdp.training.run import Run
from jdp.training.run_actions import (
    Checkpoint,
    CheckReplicas,
    Display,
    Evaluate,
    LogMetrics,
    Profile,
    Synchronize,
)
from jdp.training.stops import StopOnPreemption

# How often the progress bar shows the loss: reading it waits for that step.
DISPLAY_EVERY = 20


def metric_logger(config: TrainConfig, tokens_per_example: int | None = None) -> MetricLogger:
    """Process 0's metric logger: writers in ``--log-dir`` when given, else just the display;
    ``tokens_per_example`` (a language model's window) adds tokens/s and tokens seen."""
    enabled = jax.process_index() == 0
    trackers = tracker_names(config.tracker)
    writers = open_writers(config.log_dir, trackers) if config.log_dir and enabled else []
    return MetricLogger(
        writers,
        every=1,  # the loop picks the steps: with several per call, the calls' last ones
        throughput=Throughput(config.batch_size, tokens_per_example=tokens_per_example),
        enabled=enabled,
    )


def tokens_per_example(run: Run) -> int | None:
    """The tokens a training example feeds the model (a corpus's window), or None."""
    return getattr(run.train, "seq_len", None)


# Metrics where lower is better, for --best-mode auto.
_LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte", "error")


@contextlib.contextmanager
def log_dir_lock(config: TrainConfig) -> Iterator[None]:
    """``--log-dir`` held for the run's life (by process 0, which writes its metrics), so
    that a second live run is refused it in one line, not interleaved with it; a
    ``--ckpt-dir`` of the same directory is held by its `Checkpointer` already."""
    real = os.path.realpath  # one directory by two names is one directory
    if not config.log_dir or (config.ckpt_dir and real(config.ckpt_dir) == real(config.log_dir)):
        yield
        return
    with held(config.log_dir, "--log-dir"):
        yield


def checkpointer(config: TrainConfig, run: Run) -> Checkpointer:
    """The run's `Checkpointer`, keeping the best checkpoint by ``--best-metric``."""
    name, mode = best_metric(config, run)
    # Recorded with each save, for `jdp.load_model(dir, "best")` to choose as Orbax keeps.
    run.recorded[BEST] = {"metric": name, "mode": mode}
    return Checkpointer(config.ckpt_dir, keep=config.keep, best_metric=name, best_mode=mode)


def best_metric(config: TrainConfig, run: Run) -> tuple[str, str]:
    """``(metric, "max" or "min")`` that picks the best checkpoint: ``--best-metric``
    (``NAME`` or ``SPLIT/NAME``) or the model's own, checked before the first step
    against what the choosing split's evaluation gives."""
    objective = run.model.objective
    chooser = "val" if run.validation is not None else "test"
    split, _, name = (config.best_metric or objective.best[0]).rpartition("/")
    if split and split != chooser:
        raise UsageError(
            f"--best-metric {config.best_metric}: in this run the {chooser} split picks the "
            f"best checkpoint; name {chooser}/{name}"
        )
    given = eval_metric_names(run)
    if not config.best_metric and given is not None and name not in given:
        return "loss", "min"  # your objective without the default's metric: its loss
    if given is not None and name not in given:
        raise UsageError(
            f"--best-metric {config.best_metric or name}: the evaluation gives "
            f"{', '.join(sorted(given))}; choose one of them"
        )
    if config.best_mode != "auto":
        return name, config.best_mode
    if not config.best_metric:
        return name, objective.best[1]
    return name, "min" if any(word in name for word in _LOWER_IS_BETTER) else "max"


def eval_metric_names(run: Run) -> set[str] | None:
    """The names an evaluation of the run reports (traced, nothing computed); None when
    the run evaluates nothing."""
    if run.validation is None and run.test is None:
        return None
    sample = EvalReader(run.train, batch_size=1, rows=slice(None))(0)
    params, model_state = jax.eval_shape(run.model.init, jax.random.key(0), sample)
    means = jax.eval_shape(run.model.metrics_fn, params, model_state, sample)
    names = set(means)
    derived = run.model.objective.derived
    if derived is not None:
        names |= set(derived(dict.fromkeys(names, 0.0)))
    return names


def data_ledger(
    config: TrainConfig, run: Run, batches: Loader, start: int, base: dict
) -> Ledger | None:
    """The run's data ledger (`jdp.data.splits.ledger`), continuing ``base`` (a checkpoint's);
    None with ``--data-ledger off`` or your own stream of batches (no indices)."""
    if config.data_ledger == "off" or isinstance(run.train, BatchStream):
        return None
    return Ledger(
        batches,
        rows=process_rows(run.mesh, config.batch_size),
        start=start,
        base=base,
        with_bytes=config.data_ledger == "bytes",
        timeout=config.heartbeat_timeout,
    )


def actions_for(
    config: TrainConfig,
    run: Run,
    stack: contextlib.ExitStack,
    console: Console,
    logger: MetricLogger,
    batches: Loader,
    checkpoints: Checkpointer | None,
    callbacks: Sequence[Action],
    ledger: Ledger | None = None,
) -> list[Action]:
    """The run's actions in the order they are called after each call of the step."""
    actions: list[Action] = [Synchronize(run.sync_step)] if run.sync_step else []
    actions += [
        Display(console, logger, every=DISPLAY_EVERY),
        LogMetrics(logger, every=config.log_every, ledger=ledger),
    ]
    if config.profile_window and jax.process_index() == 0:
        profile = Profile(*config.profile_window, os.path.join(config.log_dir, "profile"))
        stack.callback(profile.stop)
        actions.append(profile)
    skipping = config.nan_policy == "skip" or config.precision == "fp16"
    checkpoint = None
    if checkpoints is not None:
        chosen = run.recorded.get("best_checkpoint")
        best = (chosen["metric"], chosen["mode"]) if chosen else None
        checkpoint = Checkpoint(
            checkpoints,
            batches,
            every=config.ckpt_every,
            config=run.recorded,
            skipping=skipping,
            minutes=config.ckpt_every_minutes,
            ledger=ledger,
            best=best,
            best_so_far=best and best_recorded(checkpoints.directory, *best),
        )
    keep = checkpoint.keep if checkpoint is not None else None
    actions.extend(evaluations(run, console, logger, every=config.eval_every, keep=keep))
    if config.early_stop_patience:
        actions.append(
            EarlyStopping(
                config.early_stop_metric,
                patience=config.early_stop_patience,
                mode="max" if config.early_stop_metric == "accuracy" else "min",
            )
        )
    actions.extend(callbacks)
    if config.nan_policy != "ignore":
        # The batches again, read on the host, for the guard to name bad inputs with.
        inputs = TrainReader(
            run.train,
            batch_size=config.batch_size,
            seed=config.seed,
            rows=process_rows(run.mesh, config.batch_size),
        )
        actions.append(
            GuardFinite(
                every=DISPLAY_EVERY,
                skipping=skipping,
                max_skipped_fraction=config.max_skipped_fraction,
                ckpt_dir=config.ckpt_dir,
                inputs=inputs,
            )
        )
    if checkpoint is not None:
        actions.append(checkpoint)
    actions.append(CheckReplicas(config.check_replicas_every))
    # Always asked: a signal ends the run at a step boundary (saving when it can),
    # never mid-step; several processes agree on the step through JAX's runtime.
    preemption = stack.enter_context(Preemption())
    actions.append(StopOnPreemption(preemption, checkpoint=checkpoint, ckpt_dir=config.ckpt_dir))
    return actions


def check_evaluates(run: Run, *, yours: bool) -> None:
    """``--eval-every`` where the data (``yours``: `jdp.fit`'s splits) holds no validation
    or test split would evaluate nothing in silence: refused in one line, before any work."""
    config = run.config
    if config.eval_every and run.validation is None and run.test is None:
        data = "your data" if yours else f"--dataset {config.dataset}"
        raise UsageError(
            f"--eval-every {config.eval_every}: {data} has no validation or test split to "
            "evaluate; hold one out with --validation-fraction F, or drop --eval-every"
        )


def evaluations(run: Run, console: Console, logger: MetricLogger, *, every: int, keep=None) -> list:
    """With a validation split, it every ``every`` steps and the test split at the end only;
    without one, the test split every ``every`` steps. Both at the end. ``keep`` saves the
    state when an evaluation fails (`Checkpoint.keep`)."""
    kwargs = dict(
        batch_size=run.config.batch_size,
        console=console,
        logger=logger,
        derived=run.model.objective.derived,
        keep=keep,
        stop_nonfinite=run.config.nan_policy != "ignore",
        batches=run.config.eval_batches,
    )
    evaluations = []
    if run.validation is not None:
        evaluations.append(
            Evaluate(run.eval_step, run.validation, run.mesh, every=every, prefix="val", **kwargs)
        )
    if run.test is not None:
        chooses = run.validation is None
        evaluations.append(
            Evaluate(
                run.eval_step,
                run.test,
                run.mesh,
                every=every if chooses else 0,
                chooses=chooses,
                **kwargs,
            )
        )
    return evaluations


@contextlib.contextmanager
def stall_watch(config: TrainConfig, start: int, goodput: Goodput):
    """The loop's `Watch`, and with ``--stall-timeout`` the watchdog that ends a stalled
    run (`jdp.distributed.watchdog`): its stacks files go to the log directory, else the
    checkpoint directory, else ``jdp-run`` in the system's temporary one (not ``jdp``: a
    folder of that name where Python starts would stand in for the package)."""
    watch = Watch(start)
    if not config.stall_timeout:
        yield watch
        return
    directory = config.log_dir or config.ckpt_dir or os.path.join(tempfile.gettempdir(), "jdp-run")
    processes = jax.process_count()
    client = jax_distributed.global_state.client if processes > 1 else None
    watchdog = Watchdog(
        watch,
        config.stall_timeout,
        os.path.abspath(directory),
        process=jax.process_index(),
        processes=processes,
        client=client,
        on_stall=goodput.stalled,
        ckpt_dir=config.ckpt_dir,
        heartbeat_timeout=config.heartbeat_timeout,
    )
    with watchdog:
        yield watch


def action_phases(
    actions: Sequence[Action], callbacks: Sequence[Action]
) -> dict[int, tuple[str, str]]:
    """Each action's phase for the stall watchdog (by ``id``): the one it names (``phase``:
    an evaluation's, a save's), a callback's with its name, else the loop's actions'."""
    yours = {id(callback) for callback in callbacks}
    phases = {}
    for action in actions:
        if id(action) in yours:
            name = getattr(action, "__qualname__", None) or type(action).__qualname__
            phases[id(action)] = (CALLBACK, name)
        else:
            phases[id(action)] = (getattr(action, "phase", ACTIONS), "")
    return phases
