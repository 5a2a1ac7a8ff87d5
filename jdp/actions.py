"""Periodic actions: what a run does between steps, each with one rule for when.

`jdp.fit` runs the train step and, after each call, every action in order
(`jdp.training.run_actions` holds the run's own):
display, metric logging, profiling, evaluation, your own actions (``callbacks=``),
checkpointing, the replica check, then the preemption check. After the last
step (or a stop) it calls them once more with ``progress.final`` set, for the
actions that also run at the end.

An action is any callable ``action(progress) -> bool`` (whether it ran). Most
are a `PeriodicAction`: one ``every``/``at_end`` rule and a ``run`` method.

Examples:
    >>> class RecordLoss(jdp.PeriodicAction):
    ...     losses = {}
    ...     def run(self, progress):
    ...         self.losses[progress.step] = float(progress.metrics["loss"])
    >>> record = RecordLoss(every=20)
    >>> config = jdp.TrainConfig(mesh="data=2", steps=60, warmup_steps=5)
    >>> result = jdp.fit(config, callbacks=[record], console=jdp.Console(enabled=False))
    >>> sorted(record.losses), record.losses[60] < record.losses[20]
    ([20, 40, 60], True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax

from jdp.errors import UsageError


@dataclasses.dataclass
class Progress:
    """What an action sees: the run after a call of the train step.

    Attributes:
        step: steps taken (the last step of the call just run).
        steps: the step the run ends at unless stopped.
        state: the `TrainState` after ``step``.
        ran: steps the last call ran (0 before the first call; ``--steps-per-call``
            runs several).
        call_metrics: the call's train metrics as the step returned them.
        metrics: the last step's train metrics, on the device: reading one waits
            for the step.
        evaluated: the metrics (``loss``, ``accuracy``, ...) that choose the best
            checkpoint and stop early, when an evaluation ran after this call, else
            None: the validation split's when there is one, else the test split's.
        tested: the test split's metrics, when they were measured after this call.
        final: set in the pass after the last step, or after a stop.
        stop_reason: why the run stops early, once an action asked (`stop`).
    """

    step: int
    steps: int
    state: Any
    ran: int = 0
    call_metrics: Any = None  # as the step returned them: (ran,) values when ran > 1
    evaluated: dict[str, float] | None = None
    tested: dict[str, float] | None = None
    final: bool = False
    stop_reason: str | None = None
    finish: bool = True  # whether the at-end actions run after the stop
    _last: Any = dataclasses.field(default=None, repr=False)
    # The learning rate of a step, where the step does not return it (`jdp.fit`'s:
    # an output of every call costs the host, and it is read only when logged).
    _lr_at: Callable[[int], Any] | None = dataclasses.field(default=None, repr=False)

    def after_call(self, step: int, ran: int, state: Any, call_metrics: Any) -> None:
        """Moves on to the state and metrics of a call that ran ``ran`` steps up to ``step``."""
        self.step, self.ran, self.state, self.call_metrics = step, ran, state, call_metrics
        self.evaluated, self.tested, self._last = None, None, None

    @property
    def metrics(self) -> Any:
        """The last step's train metrics (the call's last, with several steps per call)."""
        if self._last is None and self.call_metrics is not None:
            last = lambda values: values[-1]  # noqa: E731
            self._last = (
                self.call_metrics if self.ran <= 1 else jax.tree.map(last, self.call_metrics)
            )
            if self._lr_at is not None and "lr" not in self._last:
                self._last = {**self._last, "lr": self._lr_at(self.step)}
        return self._last

    def stop(self, reason: str, *, finish: bool = True) -> None:
        """Ends the run after this call's actions.

        ``finish=False`` skips the at-end actions (final evaluation and save), for
        a stop whose action has already saved, such as preemption.
        """
        if self.stop_reason is None:
            self.stop_reason, self.finish = reason, finish


class Action(Protocol):
    """Anything `jdp.fit` can call after each call of the train step."""

    def __call__(self, progress: Progress) -> bool: ...


class PeriodicAction:
    """Runs ``run(progress)`` every ``every`` steps and, with ``at_end``, at the end.

    It fires after the call during which a multiple of ``every`` was reached (a
    call of several steps fires once, at its last step), and at most once per
    step: an action that ran at the last step does not run again at the end.
    ``every=0`` never fires periodically.
    """

    def __init__(self, every: int = 0, *, at_end: bool = False):
        if every < 0:
            raise UsageError(f"{type(self).__name__}: every must be 0 (never) or more, not {every}")
        self.every, self.at_end = every, at_end
        self._ran_at: int | None = None

    def due(self, progress: Progress) -> bool:
        """Whether the action fires now (before the once-per-step rule)."""
        if progress.final:
            return self.at_end
        reached = progress.step // self.every if self.every else 0
        return bool(self.every) and reached > (progress.step - progress.ran) // self.every

    def __call__(self, progress: Progress) -> bool:
        if progress.step == self._ran_at or not self.due(progress):
            return False
        self._ran_at = progress.step
        self.run(progress)
        return True

    def run(self, progress: Progress) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define run(progress)")

    def quiet_through(self, progress: Progress) -> int:
        """The last step through which, called after ``progress``'s, it would do nothing:
        `jdp.fit` need not call it after a call that ends at or before that step (a
        fast step's loop then skips its actions between their steps). One whose
        ``due`` or ``__call__`` is its own has rules of its own, and is called after
        every call unless it says otherwise here."""
        kind = type(self)
        if kind.due is not PeriodicAction.due or kind.__call__ is not PeriodicAction.__call__:
            return progress.step
        return self._quiet_until_due(progress)

    def _quiet_until_due(self, progress: Progress) -> int:
        """The step before the next multiple of ``every`` (every step, with ``every=0``)."""
        if not self.every:
            return NEVER
        return (progress.step // self.every + 1) * self.every - 1


NEVER = 2**62  # a step no run reaches: an action with nothing periodic to do


class Callback(PeriodicAction):
    """A function as a periodic action: ``Callback(fn, every=100)`` calls ``fn(progress)``."""

    def __init__(self, fn: Callable[[Progress], Any], every: int = 0, *, at_end: bool = False):
        super().__init__(every, at_end=at_end)
        self.fn = fn

    def run(self, progress: Progress) -> None:
        self.fn(progress)


class EarlyStopping(PeriodicAction):
    """Stops the run when a test metric has not improved for ``patience`` evaluations.

    It looks at every evaluation the run makes (``--eval-every``): an
    evaluation improves when ``metric`` beats the best so far by more than
    ``min_delta`` (lower for ``mode="min"``, higher for ``"max"``). The run then
    ends as a full run does: a final evaluation and checkpoint at the step it
    stopped. The count restarts when a run resumes from a checkpoint.

    Args:
        metric: a test metric's name: ``loss``, ``accuracy``, or one of your
            model's ``metrics_fn``.
        patience: evaluations without improvement before stopping (at least 1).
        min_delta: how much better than the best counts as better.
        mode: ``"min"`` (default; a loss) or ``"max"`` (an accuracy).

    Examples:
        >>> config = jdp.TrainConfig(mesh="data=2", steps=400, warmup_steps=5, eval_every=20)
        >>> never_better = jdp.EarlyStopping("accuracy", patience=2, min_delta=1.0, mode="max")
        >>> result = jdp.fit(config, callbacks=[never_better], console=jdp.Console(enabled=False))
        >>> result.steps, result.stopped.startswith("early stopping: test accuracy")
        (60, True)
    """

    def __init__(
        self, metric: str = "loss", *, patience: int = 3, min_delta: float = 0.0, mode: str = "min"
    ):
        super().__init__()
        if patience < 1 or min_delta < 0 or mode not in ("min", "max"):
            raise UsageError(
                f"EarlyStopping needs patience >= 1, min_delta >= 0 and mode 'min' or "
                f"'max', got patience={patience}, min_delta={min_delta}, mode={mode!r}"
            )
        self.metric, self.patience, self.min_delta, self.mode = metric, patience, min_delta, mode
        self.best, self.best_step, self.waited = math.inf, None, 0

    def due(self, progress: Progress) -> bool:
        return progress.evaluated is not None and not progress.final

    def run(self, progress: Progress) -> None:
        if self.metric not in progress.evaluated:
            raise UsageError(
                f"EarlyStopping: no test metric {self.metric!r}; the evaluation gives "
                f"{', '.join(sorted(set(progress.evaluated) - {'count'}))}"
            )
        sign = 1.0 if self.mode == "min" else -1.0
        value = sign * progress.evaluated[self.metric]
        if value < self.best - self.min_delta:
            self.best, self.best_step, self.waited = value, progress.step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            progress.stop(
                f"early stopping: test {self.metric} has not improved on "
                f"{sign * self.best:.4f} (step {self.best_step}) for {self.waited} evaluations"
            )
