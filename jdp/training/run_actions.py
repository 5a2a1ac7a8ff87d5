"""The actions `jdp.fit` builds from its config: display, metric logging, profiling,
evaluation, checkpointing, the replica check and preemption (see `jdp.actions`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jdp import checkpoint
from jdp.actions import PeriodicAction, Progress
from jdp.checkpoint import Checkpointer
from jdp.data.loader import eval_batches
from jdp.data.splits import Ledger, Split
from jdp.diloco import has_groups
from jdp.distributed.marks import EVALUATING, SAVING
from jdp.distributed.replica_check import check_replicas
from jdp.errors import NonFiniteError, UsageError
from jdp.report.console import Console
from jdp.report.logger import MetricLogger
from jdp.step import evaluate
from jdp.training.finite import groups_finite, host_values, metrics_finite, state_finite


def _progress_fields(metrics: Mapping[str, Any], latest: Mapping | None) -> dict[str, str]:
    values = host_values(metrics)
    fields = {"loss": f"{values['loss']:.4f}"}
    for name in ("lr", "grad_norm"):
        if name in values:
            fields[name] = f"{values[name]:.3g}"
    if "loss_scale" in values:
        fields["loss_scale"] = f"{values['loss_scale']:g}"
        fields["skipped"] = str(int(values["skipped_steps"]))
    if latest and "tokens_per_sec" in latest:  # a language model's, over the last interval
        fields["tokens/s"] = f"{latest['tokens_per_sec']:,.0f}"
    elif latest and "examples_per_sec" in latest:  # over the last logging interval
        fields["examples/s"] = f"{latest['examples_per_sec']:,.0f}"
    return fields


class Display(PeriodicAction):
    """The progress bar: steps done and the loss.

    A due step's loss is shown after the next call of the step, which waited for it
    (`jdp.step.contract.bounded`), and at the end at once. Read at once, it made
    the host wait for the step just dispatched, with none queued behind it: the
    device then idled while the host went on to the next call (3% of the 38k
    MLP's steps on one CPU device, reading every 20 steps).
    """

    def __init__(self, console: Console, logger: MetricLogger, *, every: int):
        super().__init__(every, at_end=True)
        self.console, self.logger = console, logger
        self._shown: int | None = None  # the step the bar shows
        self._due: tuple[int, Any] | None = None  # (step, metrics) to show

    def __call__(self, progress: Progress) -> bool:
        if self._shown is None:  # the first pass, before the first call
            self._shown = progress.step
        self._show_due()
        return super().__call__(progress)

    def quiet_through(self, progress: Progress) -> int:
        # A line due is drawn in the pass after the next call.
        return progress.step if self._due is not None else self._quiet_until_due(progress)

    def run(self, progress: Progress) -> None:
        if progress.metrics is not None:
            self._due = (progress.step, progress.metrics)
        if progress.final:
            self._show_due()
            self.console.close_progress()

    def _show_due(self) -> None:
        if self._due is not None:
            (step, metrics), self._due = self._due, None
            steps = step - self._shown
            shows = self.console.shows(steps)
            fields = _progress_fields(metrics, self.logger.latest) if shows else {}
            self.console.advance(steps, **fields)
            self._shown = step


class LogMetrics(PeriodicAction):
    """Queues the last step's train metrics to the metric logger (never waits), with the
    data ledger's digests of the step when the run keeps one (`jdp.data.splits.ledger`)."""

    def __init__(self, logger: MetricLogger, *, every: int, ledger: Ledger | None = None):
        super().__init__(every)
        self.logger, self.ledger = logger, ledger

    def run(self, progress: Progress) -> None:
        metrics = progress.metrics
        if self.ledger is not None:
            metrics = {**metrics, **self.ledger.at(progress.step)}
        self.logger.record(progress.step, metrics)


class Profile:
    """A profiler trace of steps ``first..last`` (inclusive) into ``directory``.

    The trace starts after the call before ``first`` (before the first call, for
    step 1) and stops after ``last``'s call, once its device work is done.
    """

    def __init__(self, first: int, last: int, directory: str):
        self.first, self.last, self.directory = first, last, directory
        self._tracing = False

    def __call__(self, progress: Progress) -> bool:
        if progress.final:
            self.stop()
            return False
        if self._tracing and progress.ran and progress.step >= self.last:
            jax.block_until_ready(progress.call_metrics)  # the trace holds the steps' work
            self.stop()
            return True
        if progress.step + 1 == self.first:
            jax.profiler.start_trace(self.directory)
            self._tracing = True
            return True
        return False

    def stop(self) -> None:
        if self._tracing:
            self._tracing = False
            jax.profiler.stop_trace()


def _eval_order(result: Mapping[str, float]) -> list[str]:
    """Loss and accuracy first, then any other metric; not the example count."""
    first = [name for name in ("loss", "accuracy") if name in result]
    return first + sorted(set(result) - set(first) - {"count"})


class Evaluate(PeriodicAction):
    """Exact metrics over a whole split (or its first ``batches``), logged as
    ``{prefix}_{name}``.

    ``prefix="test"`` sets ``progress.tested``; ``chooses`` sets
    ``progress.evaluated``, the metrics that choose the best checkpoint and stop
    early (the validation split's when the run has one, else the test split's).

    An evaluation never costs the training before it: when one fails, or gives
    a metric that is not finite (never taken for the best checkpoint or an early
    stop), ``keep(progress)`` saves the state first (`Checkpoint.keep`) and the
    run stops with one line naming what was kept. With ``stop_nonfinite=False``
    (``--nan-policy ignore``) one that is not finite is logged, and still chooses
    nothing.
    """

    part = "evaluate"  # of the goodput ledger (`jdp.report.goodput`)
    phase = EVALUATING  # for the stall watchdog (`jdp.distributed.watchdog`)

    def __init__(
        self,
        eval_step,
        split: Split,
        mesh,
        *,
        batch_size: int,
        every: int,
        console: Console,
        logger: MetricLogger,
        prefix: str = "test",
        chooses: bool = True,
        derived=None,
        keep: Callable[[Progress], str] | None = None,
        stop_nonfinite: bool = True,
        batches: int = 0,
    ):
        super().__init__(every, at_end=True)
        self.batches = batches  # the first that many of the split (0: all)
        self.eval_step, self.split, self.mesh, self.batch_size = eval_step, split, mesh, batch_size
        self.console, self.logger, self.prefix, self.chooses = console, logger, prefix, chooses
        self.derived = derived  # the objective's figures from the means (perplexity)
        self.keep, self.stop_nonfinite = keep, stop_nonfinite

    @property
    def _name(self) -> str:
        return {"val": "validation"}.get(self.prefix, self.prefix)

    def run(self, progress: Progress) -> None:
        try:
            batches = eval_batches(
                self.split, self.mesh, batch_size=self.batch_size, batches=self.batches
            )
            result = evaluate(self.eval_step, progress.state, batches)
        except Exception as error:
            kept = self._kept(progress)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise UsageError(
                f"evaluating the {self._name} split at step {progress.step} failed "
                f"({type(error).__name__}: {reason}); {kept}"
            ) from error
        if self.derived is not None:
            result |= self.derived(result)
        bad = [name for name, value in result.items() if not math.isfinite(value)]
        if bad and self.stop_nonfinite:
            where = f"the {self._name} split's {bad[0]} is {result[bad[0]]} at step {progress.step}"
            state = progress.state  # checked, not inferred: every output is NaN from them
            if not (groups_finite(state) if has_groups(state) else state_finite(state)):
                raise NonFiniteError(
                    f"{where}: the parameters themselves are not finite (the initial or "
                    f"imported weights, or a step that diverged before the loss was read); "
                    f"{self._kept(progress)}"
                )
            raise NonFiniteError(
                f"{where}, though its inputs are finite and the parameters are: look at the "
                f"{self._name} labels against the loss, or at a model that overflows; it "
                f"chooses no checkpoint and stops nothing; {self._kept(progress)}"
            )
        self.console.line(
            f"step {progress.step}: "
            + " ".join(f"{self.prefix}_{name}={result[name]:.4f}" for name in _eval_order(result))
        )
        self.logger.write("eval" if self.prefix == "test" else self.prefix, progress.step, result)
        if self.chooses and not bad:  # with --nan-policy ignore: logged, never chosen
            progress.evaluated = result
        if self.prefix == "test":
            progress.tested = result

    def _kept(self, progress: Progress) -> str:
        if self.keep is None:
            return "nothing was saved (no --ckpt-dir)"
        return self.keep(progress)


class Checkpoint(PeriodicAction):
    """Saves the state, where the loader stands and this step's test metrics: every
    ``every`` steps, at the end, and once ``minutes`` have passed since the last save.

    The clock is read after each call; with several processes, process 0's reading
    decides, sent to all every `AGREE_EVERY` steps (a collective as small as one
    flag), so that every process saves the same step.

    With ``best`` (a metric and ``max`` or ``min``), also at every evaluation better
    than each before it in the run (``best_so_far``: a resumed run's), as Keras'
    ``ModelCheckpoint(save_best_only=True)`` saves: the best checkpoint is the best
    evaluation's step, not the best of the steps that happened to be saved.

    Never a state that is not finite: without skipping, one whose call's loss
    was not, or whose parameters, optimizer or model state are not (a last
    gradient that was not finite leaves its loss finite and the state not); the
    save waits for the step anyway, and the check reads the state once.
    """

    part = "checkpoint"  # of the goodput ledger (`jdp.report.goodput`)
    phase = SAVING  # for the stall watchdog (`jdp.distributed.watchdog`)

    def __init__(
        self,
        checkpointer: Checkpointer,
        loader,
        *,
        every: int,
        config: Mapping,
        skipping: bool,
        minutes: float = 0.0,
        ledger: Ledger | None = None,
        best: tuple[str, str] | None = None,
        best_so_far: float | None = None,
    ):
        super().__init__(every, at_end=True)
        self.best, self._best_value, self._seen = best, best_so_far, None
        self.checkpointer, self.loader, self.config = checkpointer, loader, dict(config)
        self.ledger = ledger
        self.skipping = skipping  # updates with a non-finite gradient are skipped: all finite
        self.seconds = 60.0 * minutes
        self._saved_at = time.monotonic()

    def due(self, progress: Progress) -> bool:
        improved = self._improved(progress)  # read every call: it notes each evaluation
        if not progress.final and progress.step >= progress.steps:
            return False  # the end saves this step, after the end's evaluation, with it
        return super().due(progress) or self._time_is_up(progress) or improved

    def _improved(self, progress: Progress) -> bool:
        """Whether this call brought an evaluation better than every earlier one."""
        evaluated = progress.evaluated
        if self.best is None or evaluated is None or evaluated is self._seen:
            return False
        self._seen = evaluated
        metric, mode = self.best
        value = evaluated.get(metric)
        if not isinstance(value, float) or not math.isfinite(value):
            return False
        previous = self._best_value
        better = previous is None or (value > previous if mode == "max" else value < previous)
        if better:
            self._best_value = value
        return better and not progress.final  # the end saves anyway

    def quiet_through(self, progress: Progress) -> int:
        # A save on the clock reads it after every call.
        return progress.step if self.seconds else self._quiet_until_due(progress)

    def _time_is_up(self, progress: Progress) -> bool:
        if not self.seconds or progress.final or not progress.ran:
            return False
        up = time.monotonic() - self._saved_at >= self.seconds
        if jax.process_count() == 1:
            return up
        if progress.step // AGREE_EVERY == (progress.step - progress.ran) // AGREE_EVERY:
            return False  # processes agree only at these steps, all at once
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.asarray(up)))

    def run(self, progress: Progress) -> None:
        self._saved_at = time.monotonic()
        grouped = has_groups(progress.state)
        if grouped and not groups_finite(progress.state):  # every process alike
            why = "a DiLoCo group's parameters are not finite"
        elif not grouped and not self.skipping and not metrics_finite(progress.call_metrics):
            why = "its loss is not finite, so its parameters may not be"
        elif not grouped and not self.skipping and not state_finite(progress.state):
            why = "its parameters or optimizer state are not finite"
        else:
            why = None
        if why:
            checkpoint.warn(
                f"not saving step {progress.step}: {why}; the checkpoints already saved are kept"
            )
            return
        self.checkpointer.save(
            progress.state,
            loader_step=self.loader.position,
            config=self.config,
            metrics=progress.evaluated,
            ledger=self.ledger.record(progress.step) if self.ledger is not None else None,
        )

    def save_now(self, progress: Progress) -> None:
        """Saves at this step unless saved there already, and waits until it is on disk."""
        if self._ran_at != progress.step:
            self._ran_at = progress.step
            self.run(progress)
        self.checkpointer.wait()

    def keep(self, progress: Progress) -> str:
        """Saves this step now (`save_now`), without test metrics; says what is kept."""
        self.save_now(progress)
        steps = self.checkpointer.steps()
        if not steps:
            return f"no checkpoint could be kept in {self.checkpointer.directory}"
        return f"the trained state is kept in {self.checkpointer.directory} (step {steps[-1]})"


# With several processes, a time-based save is agreed on every this many steps.
AGREE_EVERY = 20


class Synchronize(PeriodicAction):
    """DiLoCo's synchronisation of the groups, every ``sync_every`` steps and at the end
    (before evaluation and checkpointing, which then see the synchronised state)."""

    def __init__(self, sync_step):
        super().__init__(sync_step.every, at_end=True)
        self.sync_step = sync_step

    def run(self, progress: Progress) -> None:
        progress.state = self.sync_step(progress.state)


class CheckReplicas(PeriodicAction):
    """Raises `jdp.distributed.ReplicaMismatchError` when devices hold different parameters
    (with DiLoCo groups: the synchronised ones, and each group's among its devices)."""

    def run(self, progress: Progress) -> None:
        state = progress.state
        check_replicas((state.params, state.model_state), step=progress.step)
        if has_groups(state):  # each group's replicas, among themselves
            leaf = jax.tree.leaves(state.groups.params)[0]
            mesh = leaf.sharding.mesh
            group_of = {device.id: g for g, row in enumerate(mesh.devices) for device in row.flat}
            trained = (state.groups.params, state.groups.model_state)
            check_replicas(trained, step=progress.step, groups=group_of)
