"""The stall watchdog: a process that is alive but stuck ends the run instead of hanging it.

JAX's heartbeats stop a run whose process died; a process whose main thread waits
forever (a read from a hung filesystem, a callback that deadlocked, a loader worker
that stopped, a collective it never reaches) keeps answering them, and every other
process then waits in the step's all-reduce. Here each process's training loop marks
where its main thread is (`Watch`: the phase and the last step it started), and a
thread of its own (`Watchdog`) publishes that mark (in the coordinator's key-value
store when there are several processes: no collective) and reads everyone's. When the
process holding the others up has made no progress for ``timeout`` seconds (four times
that while it evaluates or saves; never while it compiles), every process writes the
Python stacks of all its threads to ``DIR/stalls/process-N.txt``, process 0 names the
process that stalled, its phase and its stacks file in one line, and each process
ends with `EXIT_STALLED`, without waiting on the stuck collective: ``jdp.launch
--max-restarts`` then restarts the group from its last complete checkpoint, as after a
death, and a scheduler's retry resumes a single process the same way.

Only time the process ran counts: a process stopped (SIGSTOP, Ctrl-Z, a suspended
job) or a machine asleep is not stalled, and after a stop of the whole group each
process waits for the others' fresh marks before judging. An XLA compile in progress,
wherever it happens (the first step, an evaluation's first batch, a save's digests),
counts as compiling (`Compiles`, from JAX's monitoring events). Between processes, one
whose mark stopped moving (its watchdog thread did not run: stopped, or the
interpreter itself stuck) is the one holding the others up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable

from jdp.distributed.stall_lines import (
    EXIT_STALLED,
    RESUME_UNKNOWN,
    describe,
    resume_point,
    stacks_file,
    stacks_written,
    write_stacks,
)

STARTING, COMPILING = "starting (reading its first batch)", "compiling"
READING, STEPPING = "reading data", "in the step"
ACTIONS, CALLBACK = "in the loop's actions", "in a callback"
EVALUATING, SAVING = "evaluating", "saving"
FINISHED = "finished"  # its loop ended: the run is ending, nothing left to stall
# Times ``timeout`` a phase may go without progress; none: never a stall (a first
# compile's time has no bound a run could know, a large model's takes many minutes;
# nor has the first batch's: workers starting, a resumed stream skipping ahead).
_ALLOWANCE = {STARTING: None, COMPILING: None, EVALUATING: 4, SAVING: 4}
# Phases in which a process may only be waiting for the others (a step's all-reduce, or
# an action reading its result): between processes at the same step, the one elsewhere
# (reading data, in a callback, evaluating, saving) is holding them up.
_WAITING = (STEPPING, COMPILING, ACTIONS, STARTING)
_KEY = "jdp/watchdog"
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
        factor = None if self.compiling and not self.silent else _ALLOWANCE.get(self.phase, 1)
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


class Watchdog:
    """A daemon thread that ends the run when it stalls (see the module's docstring).

    ``directory`` holds the stacks files; ``client`` is JAX's distributed runtime client
    when there are several processes; ``on_stall(mark)`` runs in process 0 before it
    ends (the goodput ledger's last write); ``say`` prints process 0's line.
    """

    def __init__(self, watch: Watch, timeout: float, directory: str, *, process: int = 0,
                 processes: int = 1, client=None, on_stall: Callable[[Mark], None] | None = None,
                 say: Callable[[str], None] | None = None,
                 end: Callable[[int], None] | None = None, ckpt_dir: str | None = None
                 ):  # fmt: skip
        self.watch, self.timeout, self.directory = watch, timeout, directory
        self.process, self.processes, self.client = process, processes, client
        self.on_stall, self.say, self.ckpt_dir = on_stall, say or _stderr, ckpt_dir
        self.end = end or _end_process
        self.poll = min(max(timeout / 10, 0.1), 5.0)
        # A mark not published for this long: its process did not run (see `_run`).
        self.silence = 3 * self.poll + 2.0
        self._resumed = 0.0  # when (wall) this process last ran again after a stop
        self._compiles = Compiles(watch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jdp-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._compiles.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._compiles.__exit__(*exc_info)
        if self.processes > 1:  # the others stop watching: this one will not move again
            self.watch.at(FINISHED)
            mark = dataclasses.asdict(self.watch.mark(self.process))
            _quietly(lambda: self.client.key_value_set(
                f"{_KEY}/mark/{self.process}", json.dumps({**mark, "at": time.time()}),
                allow_overwrite=True))  # fmt: skip

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            late, last = now - last - self.poll, now
            if late > self.poll + 1.0:  # this thread did not run: the process was stopped
                self.watch.excuse(now - late, now)
                self._resumed = time.time()
            mark = self.watch.mark(self.process)
            single = self.processes == 1
            found = stalled([mark], self.timeout) if single else self._shared(mark)
            if found is not None and not self._stop.is_set():
                self._stalled(found)
                return

    def _shared(self, mark: Mark) -> Mark | None:
        """Publishes this process's mark; the stalled process, once one is declared or
        the marks show one (the first to see it declares it for every process)."""
        client, now = self.client, time.time()
        try:
            client.key_value_set(f"{_KEY}/mark/{self.process}",
                                 json.dumps({**dataclasses.asdict(mark), "at": now}),
                                 allow_overwrite=True)  # fmt: skip
            declared = client.key_value_try_get(f"{_KEY}/stalled")
        except Exception:
            declared = None
        if declared is not None:
            return Mark(**json.loads(declared))
        marks, stale = [], False
        try:
            for _, text in client.key_value_dir_get(f"{_KEY}/mark/"):
                record = json.loads(text)
                at = record.pop("at")
                record["idle"] += max(0.0, now - at)  # a frozen process's mark ages too
                record["silent"] = now - at > self.silence
                # Just after this process ran again, a mark from before its stop may be
                # one the whole group's stop held back: wait for it to move.
                stale |= at < self._resumed and now - self._resumed < self.silence
                marks.append(Mark(**record))
        except Exception:
            return None
        if stale or len(marks) < self.processes:
            return None
        if (found := stalled(marks, self.timeout)) is None:
            return None
        try:
            client.key_value_set(f"{_KEY}/stalled", json.dumps(dataclasses.asdict(found)))
        except Exception:  # another process declared first: its word holds
            try:
                return Mark(**json.loads(client.key_value_try_get(f"{_KEY}/stalled")))
            except Exception:
                return found
        return found

    def _stalled(self, mark: Mark) -> None:
        """Says which process stalled (process 0: first, so a hung filesystem cannot keep
        the line unsaid), writes this process's stacks (and process 0 the goodput
        ledger's last word) within `_RECORD_SECONDS`, and ends once every process has
        (at most 10 s more: none ends while another may still need the collectives)."""
        save_first = self.watch.save_first if mark.phase == READING else None
        if self.process == 0:
            resume = _quick(lambda: resume_point(self.ckpt_dir), RESUME_UNKNOWN)
            if save_first is not None:
                resume = f"the loop waits for data: saving step {mark.step} first"
            self.say(describe(mark, self.processes, self.timeout, self.directory, resume))
        recording = threading.Thread(target=self._record, args=(mark,), daemon=True)
        recording.start()
        recording.join(timeout=_RECORD_SECONDS)
        if save_first is not None and self._saved_first(save_first, mark):
            return  # the loop saved and ends the run stalled itself
        if self.processes > 1:
            _quietly(lambda: self.client.key_value_set(f"{_KEY}/ended/{self.process}", "1"))
            self._wait_for_the_others(mark.process)
        if self.process == 0 and (
            line := _quick(lambda: stacks_written(self.directory, self.processes), "")
        ):
            self.say(line)
        if self.processes > 1:
            # The stalled process ends first (a launcher names the first to fail), process
            # 0, which hosts the coordinator, last.
            time.sleep(0 if self.process == mark.process else 0.5 if self.process == 0 else 0.2)
        self.end(EXIT_STALLED)

    def _saved_first(self, save_first: Callable[[str], None], mark: Mark) -> bool:
        """Asks the loop (one process, waiting for data between steps) to save the last
        step's state and end stalled, as a signal would; whether it did. A loop that does
        not answer within `_ANSWER_SECONDS` (its main thread stuck outside the loader's
        wait), or whose save outlasts a save's allowance, is ended here all the same."""
        save_first(
            f"stalled {mark.phase} (no progress for {mark.idle:.0f} s, --stall-timeout "
            f"{self.timeout:g})"
        )
        answer_by = time.monotonic() + _ANSWER_SECONDS
        while self.watch.phase == READING:
            if self._stop.wait(0.05):
                return True
            if time.monotonic() > answer_by:
                return False
        return self._stop.wait(_ALLOWANCE[SAVING] * self.timeout)

    def _record(self, mark: Mark) -> None:
        path = stacks_file(self.directory, self.process)
        try:
            write_stacks(path, self.watch.mark(self.process))
        except OSError as error:
            sys.stderr.write(f"jdp: cannot write the stall's stacks to {path} ({error})\n")
        if self.process == 0 and self.on_stall is not None:
            _quietly(lambda: self.on_stall(mark))

    def _wait_for_the_others(self, stuck: int, seconds: float = 10.0) -> None:
        """Until every process has written its stacks (said so in the store), or ``seconds``;
        the stuck process, once the others have, 2 s more at most: stopped (SIGSTOP, a
        suspended job) it never will, and a live one writes its stacks at once."""
        deadline, shortened = time.monotonic() + seconds, False
        while time.monotonic() < deadline:
            try:
                keys = self.client.key_value_dir_get(f"{_KEY}/ended/")
            except Exception:  # the coordinator is gone: end now
                return
            ended = {key.rsplit("/", 1)[-1] for key, _ in keys}
            if len(ended) >= self.processes:
                return
            if not shortened and len(ended - {str(stuck)}) >= self.processes - 1:
                deadline, shortened = min(deadline, time.monotonic() + 2.0), True
            time.sleep(0.05)


# Seconds a stalled process gives its stacks file and the goodput ledger (a hung
# filesystem must not keep it from ending).
_RECORD_SECONDS = 10.0
# Seconds a loop waiting for data has to answer the ask to save: it asks every 0.25 s
# (`jdp.data.pipeline`), so twenty times that is an answer that is not coming.
_ANSWER_SECONDS = 5.0


def _end_process(code: int) -> None:
    """Ends this process now, its main thread stuck where it is: its loader workers
    killed first (a stopped one would outlive it), its output flushed."""
    for child in multiprocessing.active_children():
        _quietly(child.kill)
    _quietly(sys.stdout.flush)
    _quietly(sys.stderr.flush)
    os._exit(code)


def _quick(call: Callable[[], str], otherwise: str, seconds: float = 1.0) -> str:
    """``call()``'s answer, or ``otherwise`` when it fails or takes over ``seconds`` (a
    hung filesystem must not keep a stall's lines unsaid)."""
    answer = otherwise

    def ask():
        nonlocal answer
        with contextlib.suppress(Exception):
            answer = call()

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(seconds)
    return answer


def _stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # ending anyway: nothing here may stop that
        call()
