"""What a run ends with (`FitResult`) and how each way of ending makes it: trained to
the end, stopped early (preempted), or a checkpoint evaluated without training."""

from __future__ import annotations

import dataclasses
import time

import jax

from jdp.actions import Progress
from jdp.checkpoint import latest_record, read_checkpoint
from jdp.checkpoint.record import RunSettings
from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS
from jdp.report.console import Console
from jdp.state import TrainState
from jdp.training.compile_cache import reads
from jdp.training.config import DILOCO_FIELDS, TOPOLOGY_FIELDS, TrainConfig
from jdp.training.run import Run, Yours, build
from jdp.training.stops import signal_of, stalled
from jdp.training.wiring import evaluations, metric_logger, tokens_per_example

# A curve's split as `History` names it -> the kind of record it is logged as.
_SPLIT_KINDS = {"train": "train", "val": "val", "test": "eval"}


class History(list):
    """The records a run logged, in order, each ``{"kind", "step", metric: value, ...}``
    (``kind`` is ``train``, ``val`` or ``eval``, the test split), and each metric's
    curve by name, as Keras users read ``history.history["val_loss"]``:
    ``history["val/loss"]`` (or ``"val_loss"``) is the list of the validation loss
    at each evaluation, ``history["test/accuracy"]`` the test split's, and
    ``history["loss"]`` (``"train/loss"``) the logged train loss; ``steps(name)``
    says at which steps, ``curves()`` gives every curve.

    Examples:
        >>> history = History([{"kind": "train", "step": 20, "loss": 0.5},
        ...                    {"kind": "val", "step": 20, "loss": 0.7}])
        >>> history["val_loss"], history["loss"], history.steps("val/loss"), len(history)
        ([0.7], [0.5], [20], 2)
    """

    def __getitem__(self, key):
        if not isinstance(key, str):
            return super().__getitem__(key)
        kind, name = self._parse(key)
        values = [record[name] for record in self if record["kind"] == kind and name in record]
        if not values:
            raise KeyError(f"no curve {key!r}; the run logged: {', '.join(self.curves())}")
        return values

    def steps(self, key: str) -> list[int]:
        """The steps of ``key``'s values."""
        kind, name = self._parse(key)
        return [record["step"] for record in self if record["kind"] == kind and name in record]

    def curves(self) -> dict[str, list]:
        """Every curve: ``{"train/loss": [...], "val/loss": [...], ...}``."""
        names = {kind: split for split, kind in _SPLIT_KINDS.items()}
        keys = dict.fromkeys(
            f"{names[record['kind']]}/{name}"
            for record in self
            if record["kind"] in names
            for name, value in record.items()
            if name not in ("kind", "step", "time", "count") and not isinstance(value, str)
        )
        return {key: self[key] for key in keys}

    def _parse(self, key: str) -> tuple[str, str]:
        for split, kind in _SPLIT_KINDS.items():
            for separator in ("/", "_"):
                if key.startswith(split + separator):
                    return kind, key[len(split) + 1 :]
        return "train", key


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What a run ends with: the final state and its summary figures."""

    state: TrainState
    steps: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    examples_per_sec: float  # the steps of calls that compiled nothing; NaN if none was
    input_wait: float  # fraction of the steady training loop spent waiting for a batch
    wall_seconds: float
    preempted: str | None = None  # the line saying where a preempted run saved
    signal: int | None = None  # the signal that stopped it (SIGTERM's or SIGINT's number)
    stalled: bool = False  # the stall watchdog stopped it, its last step's state saved first
    stopped: str | None = None  # why the run stopped before config.steps, when it did
    validation: dict[str, float] | None = None  # the last validation metrics, with a split
    # Every record logged (process 0): {"kind": "train" | "val" | "eval", "step", ...},
    # and each metric's curve by name: history["val/loss"] (see `History`).
    history: History = dataclasses.field(default_factory=History)
    evaluated_only: bool = False  # --eval-only: a checkpoint evaluated, nothing trained
    test: dict[str, float] | None = None  # the last test metrics, when the run has a test split
    tokens_per_sec: float | None = None  # a language model's, from examples/s and its window
    # Where the run's wall time went, over its restarts (`jdp.report.goodput.summarize`).
    goodput: dict | None = None

    def summary_line(self) -> str:
        if self.preempted:
            return self.preempted
        figures = self._figures()
        if self.evaluated_only:
            return f"jdp.train: evaluated step={self.steps} {figures}".rstrip()
        tokens = f"tokens/s={self.tokens_per_sec:.0f} " if self.tokens_per_sec is not None else ""
        goodput = f"goodput={self.goodput['goodput']:.1%} " if self.goodput else ""
        return (
            f"jdp.train: steps={self.steps} train_loss={self.train_loss:.4f} {figures}"
            f"examples/s={self.examples_per_sec:.0f} {tokens}input_wait={self.input_wait:.1%} "
            f"{goodput}wall={self.wall_seconds:.1f}s"
        )

    def _figures(self) -> str:
        """The evaluations' headline figures: a classifier's accuracy, a language model's
        loss and bits per byte (or perplexity); the test split's when there is one. None
        where nothing was evaluated (no held-out split, a stop before the end)."""
        parts = []
        if self.validation:
            headline = _headline(self.validation)
            names = ["accuracy"] if headline == "accuracy" else ["loss", headline]
            parts += [f"val_{name}={self.validation[name]:.4f}" for name in names if name]
        if self.test is not None:
            headline = _headline(self.test or {}) or "accuracy"
            parts += [f"test_loss={self.test_loss:.4f}"]
            parts += [f"test_{headline}={(self.test or {}).get(headline, float('nan')):.4f}"]
        return "".join(f"{part} " for part in parts)


def _headline(metrics: dict[str, float]) -> str | None:
    """An evaluation's main figure besides its loss."""
    return next(
        (name for name in ("accuracy", "bits_per_byte", "perplexity") if name in metrics), None
    )


class SteadyTimer:
    """Wall time and input wait of the steady loop: from the end of the first call to the
    end of the last, both waited for (so examples/s counts steps done, not dispatched),
    less any later call that compiled (`compiling`). It says when the first call starts
    compiling, and how long compiling and the call took."""

    def __init__(self, loader, console: Console):
        self.loader, self.calls, self.console = loader, 0, console
        self.started, self.waited_before, self.seconds, self.waited = 0.0, 0.0, 0.0, 0.0
        self.untimed_steps, self._untimed, self._compiling = 0, 0.0, None
        console.line("jdp: compiling the train step")
        self._created = time.perf_counter()
        self._last = None  # the last call's metrics

    def compiling(self) -> None:
        """Before a call that compiles a program (a shorter call, closing a gap): untimed."""
        if self.calls:
            jax.block_until_ready(self._last)
            self._compiling = time.perf_counter()

    def after_call(self, metrics, steps: int) -> None:
        """After each call, its ``metrics`` and the ``steps`` it ran."""
        self.calls, self._last = self.calls + 1, metrics
        if self._compiling is not None:
            jax.block_until_ready(metrics)
            self._untimed += time.perf_counter() - self._compiling
            self.untimed_steps, self._compiling = self.untimed_steps + steps, None
        if self.calls == 1:
            self.untimed_steps = steps
            jax.block_until_ready(metrics)  # compilation ends here; throughput counts from now
            self.started, self.waited_before = time.perf_counter(), self.loader.wait_seconds
            programs, saved = reads()  # since the run began: its set-up's programs too
            cached = (
                f" ({programs} program{'s' * (programs > 1)} read from the compilation "
                f"cache, {saved:.1f}s of compiling saved)"
                if programs
                else ""
            )
            self.console.line(
                f"jdp: compiled and ran the first call in "
                f"{self.started - self._created:.1f}s{cached}"
            )

    def stop(self) -> None:
        if self.calls > 1:
            jax.block_until_ready(self._last)  # the calls still in flight (two at most)
            self.seconds = time.perf_counter() - self.started - self._untimed
            self.waited = self.loader.wait_seconds - self.waited_before


def finished(
    run: Run,
    progress: Progress,
    timer: SteadyTimer,
    started: float,
    start: int,
    history: list,
    goodput: dict | None = None,
) -> FitResult:
    config, last = run.config, progress.metrics
    tested = progress.tested or {}
    validated = progress.evaluated if progress.evaluated is not progress.tested else None
    timed = progress.step - start - timer.untimed_steps  # the steps after the first call
    nan = float("nan")
    # NaN where no step was timed (every call compiled: one step, or one call): no figure.
    rate = timed * config.batch_size / timer.seconds if timed > 0 and timer.seconds else nan
    window = tokens_per_example(run)
    return FitResult(
        state=progress.state,
        steps=progress.step,
        train_loss=float(last["loss"]) if last is not None else nan,
        test_loss=tested.get("loss", nan),
        test_accuracy=tested.get("accuracy", nan),
        validation=validated,
        test=progress.tested,
        tokens_per_sec=rate * window if window else None,
        history=History(history),
        examples_per_sec=rate,
        input_wait=timer.waited / timer.seconds if timer.seconds else 0.0,
        wall_seconds=time.perf_counter() - started,
        stopped=progress.stop_reason,
        goodput=goodput,
    )


def stopped(progress: Progress, started: float) -> FitResult:
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
        stalled=stalled(progress.stop_reason),
        signal=None if stalled(progress.stop_reason) else signal_of(progress.stop_reason),
    )


def evaluate_only(config: TrainConfig, console: Console, yours: Yours, started: float) -> FitResult:
    """``--eval-only``: the latest checkpoint of ``--ckpt-dir``, evaluated as its run would."""
    saved = latest_record(config.ckpt_dir).config
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    if not config.mesh_spec.has(GROUP_AXIS):
        fields -= set(DILOCO_FIELDS)  # a DiLoCo run's parameters evaluate on any mesh
    made_with = {
        name: value
        for name, value in saved.items()
        if name in fields
        and name not in TOPOLOGY_FIELDS
        and value != "yours"
        and not str(value).startswith("yours")
        and name != "init_from"
    }
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    differ = [  # a flag given that the checkpoint's run set otherwise: never dropped in silence
        f"--{name.replace('_', '-')} {getattr(config, name)} (it ran {value})"
        for name, value in made_with.items()
        if name != "eval_only" and getattr(config, name) not in (defaults[name], value)
    ]
    if differ:
        raise UsageError(
            f"--eval-only evaluates {config.ckpt_dir} as its run made it, which "
            f"{', '.join(differ)} contradict{'s' * (len(differ) == 1)}; leave them out"
        )
    config = dataclasses.replace(config, **made_with, ckpt_dir=config.ckpt_dir)
    run = build(config, console, yours, architecture=RunSettings(saved).architecture or None)
    like = (run.state.params, run.state.model_state)
    _, record, params, model_state = read_checkpoint(config.ckpt_dir, like=like)
    state = run.state.replace(params=params, model_state=model_state)
    return evaluated(run, state, record.step, console, started)


def evaluated(
    run: Run, state: TrainState, step: int, console: Console, started: float
) -> FitResult:
    """The result of evaluating ``state`` (a checkpoint) without training."""
    config = run.config
    if run.model.update is not None:  # an NNX module gets the checkpoint's values
        run.model.update(state.params, state.model_state)
    progress = Progress(step=step, steps=step, state=state)
    progress.final = True
    with metric_logger(config, tokens_per_example(run)) as logger:
        for evaluation in evaluations(run, console, logger, every=0):
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
        test=progress.tested,
        history=History(logger.history),
        evaluated_only=True,
    )
