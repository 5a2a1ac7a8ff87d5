"""Where each process's main thread is, and which process holds the others up: the
stall watchdog's judgement (`jdp.distributed.watchdog` runs it). The training loop sets
its `Watch` at a few points a step; `Compiles` counts XLA compiles in progress from JAX's
monitoring events; `stalled` reads every process's `Mark`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

STARTING, COMPILING = "starting (reading its first batch)", "compiling"
READING, STEPPING = "reading data", "in the step"
ACTIONS, CALLBACK = "in the loop's actions", "in a callback"
EVALUATING, SAVING = "evaluating", "saving"
FINISHED = "finished"  # its loop ended: the run is ending, nothing left to stall
# Process 0 as another process sees it when the store it holds stops answering.
NOT_ANSWERING = "not answering (the store it holds for the run is silent: it is stopped)"
# Times ``timeout`` a phase may go without progress; none: never a stall (a first
# compile's time has no bound a run could know, a large model's takes many minutes;
# nor has the first batch's: workers starting, a resumed stream skipping ahead).
ALLOWANCE = {STARTING: None, COMPILING: None, EVALUATING: 4, SAVING: 4}
# Phases in which a process may only be waiting for the others (a step's all-reduce, or
# an action reading its result): between processes at the same step, the one elsewhere
# (reading data, in a callback, evaluating, saving) is holding them up.
_WAITING = (STEPPING, COMPILING, ACTIONS, STARTING)
# JAX's monitoring event around each XLA compile (or read from the compilation cache): a
# scalar as it begins, a duration as it ends.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class Mark:
    """Where one process's main thread is: ``phase`` since ``idle`` seconds, the last
    call of the step it started ending at ``step``; ``where`` names a callback."""

    process: int
    step: int
    phase: str
    idle: float
    where: str = ""
    compiling: bool = False  # an XLA compile is in progress, whatever the phase
    silent: bool = False  # its mark stopped moving: its process did not run (set by a reader)

    def limit(self, timeout: float) -> float | None:
        # A silent process's compile would have let its watchdog run: it is stopped.
        factor = None if self.compiling and not self.silent else ALLOWANCE.get(self.phase, 1)
        return None if factor is None else factor * timeout


class Watch:
    """The main thread's progress, set from the training loop at a few points a step:
    each change of phase or step (and each `tick`) is progress."""

    def __init__(self, step: int = 0):
        self.step, self.phase, self.where = step, STARTING, ""
        self.since = time.monotonic()
        self.compiles = 0  # in progress (`Compiles`)
        # One process's loop, waiting for data: asks it to save the last step's state and
        # end stalled, as a signal would (`jdp.training.stops.StopOnPreemption.stall`).
        self.save_first: Callable[[str], None] | None = None

    def at(self, phase: str, where: str = "") -> None:
        self.phase, self.where, self.since = phase, where, time.monotonic()

    def started(self, step: int, phase: str) -> None:
        """A call of the step that ends at ``step`` begins (compiling, the first)."""
        self.step, self.phase, self.where, self.since = step, phase, "", time.monotonic()

    def tick(self) -> None:
        self.since = time.monotonic()

    def excuse(self, start: float, end: float) -> None:
        """``start`` to ``end`` (monotonic) the process did not run (stopped, or the
        machine asleep): no time without progress."""
        if self.since < end:
            self.since += end - max(self.since, start)

    def mark(self, process: int) -> Mark:
        idle = time.monotonic() - self.since
        return Mark(process, self.step, self.phase, idle, self.where, self.compiles > 0)


class Compiles:
    """Counts the XLA compiles in progress in this process into ``watch.compiles``, from
    JAX's monitoring events (registered while the context is open); a compile's end is
    progress. Lowering and tracing, which come first, count as the phase they are in."""

    def __init__(self, watch: Watch):
        self.watch = watch

    def begun(self, event: str, value: float, **_) -> None:
        if event == COMPILE_EVENT:
            self.watch.compiles += 1

    def ended(self, event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            self.watch.compiles = max(0, self.watch.compiles - 1)
            self.watch.tick()

    def __enter__(self) -> Compiles:
        from jax import monitoring

        monitoring.register_scalar_listener(self.begun)
        monitoring.register_event_duration_secs_listener(self.ended)
        return self

    def __exit__(self, *exc_info) -> None:
        from jax import monitoring

        with contextlib.suppress(Exception):  # a JAX without one: nothing to undo
            monitoring.unregister_scalar_listener(self.begun)
            monitoring.unregister_event_duration_listener(self.ended)


def stalled(marks: list[Mark], timeout: float) -> Mark | None:
    """The process that stalled the run, if one has. The one holding the others up is
    furthest behind, and between processes at that step one outside the step (the
    others wait for it in the all-reduce), else the one idle longest; a run whose
    processes furthest behind include one compiling is not stalled (the others wait for
    its compiler)."""
    if any(mark.phase == FINISHED for mark in marks):
        return None
    behind = min(mark.step for mark in marks)
    marks = [mark for mark in marks if mark.step == behind]
    silent = [mark for mark in marks if mark.silent]
    if any(mark.limit(timeout) is None for mark in silent or marks):
        return None
    # One whose mark stopped moving holds up the others, whatever its phase says.
    mark = min(silent or marks, key=lambda mark: (mark.phase in _WAITING, -mark.idle))
    return mark if mark.idle > mark.limit(timeout) else None
