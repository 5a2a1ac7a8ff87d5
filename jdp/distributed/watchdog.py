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

from jdp.distributed.marks import (
    ALLOWANCE,
    FINISHED,
    NOT_ANSWERING,
    READING,
    SAVING,
    Compiles,
    Mark,
    Watch,
    stalled,
)
from jdp.distributed.stall_lines import (
    EXIT_STALLED,
    RESUME_UNKNOWN,
    describe,
    resume_point,
    stacks_file,
    stacks_written,
    write_stacks,
)

_KEY = "jdp/watchdog"


class Watchdog:
    """A daemon thread that ends the run when it stalls (see the module's docstring).

    ``directory`` holds the stacks files; ``client`` is JAX's distributed runtime client
    when there are several processes; ``on_stall(mark)`` runs in process 0 before it
    ends (the goodput ledger's last write); ``say`` prints process 0's line.
    """

    def __init__(
        self,
        watch: Watch,
        timeout: float,
        directory: str,
        *,
        process: int = 0,
        processes: int = 1,
        client=None,
        on_stall: Callable[[Mark], None] | None = None,
        say: Callable[[str], None] | None = None,
        end: Callable[[int], None] | None = None,
        ckpt_dir: str | None = None,
        heartbeat_timeout: float = 60.0,
    ):
        self.watch, self.timeout, self.directory = watch, timeout, directory
        self.process, self.processes, self.client = process, processes, client
        self.on_stall, self.say, self.ckpt_dir = on_stall, say or _stderr, ckpt_dir
        self.end = end or _end_process
        self.poll = min(max(timeout / 10, 0.1), 5.0)
        # A turn of `_run`'s loop longer than this: the process was stopped (it waits
        # `poll`, and `poll` at most for the store's answer).
        self.turn = 2 * self.poll + 1.0
        self._turned = time.monotonic()  # when `_run`'s loop last turned
        # A mark not published for this long: its process did not run (see `_run`).
        self.silence = 3 * self.poll + 2.0
        self._resumed = 0.0  # when (wall) this process last ran again after a stop
        # Process 0 holds the store: silent this long, it is stopped (JAX's heartbeats would
        # abort this process with a C++ stack at the heartbeat timeout).
        self.store_silence = min(timeout, heartbeat_timeout / 2)
        self._asking: threading.Thread | None = None
        self._answered, self._found = time.monotonic(), None
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
            _quietly(
                lambda: self.client.key_value_set(
                    f"{_KEY}/mark/{self.process}",
                    json.dumps({**mark, "at": time.time()}),
                    allow_overwrite=True,
                )
            )

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            if now - last > self.turn:  # this thread did not run: the process was stopped
                self.watch.excuse(last + self.poll, now)
                self._resumed, self._answered = time.time(), now
            last = self._turned = now
            mark = self.watch.mark(self.process)
            single = self.processes == 1
            found = stalled([mark], self.timeout) if single else self._exchange(mark)
            if found is not None and not self._stop.is_set():
                if found.phase == NOT_ANSWERING:
                    self._coordinator_gone(found)
                else:
                    self._stalled(found)
                return

    def _exchange(self, mark: Mark) -> Mark | None:
        """`_shared` in a thread of its own, so a store that does not answer (process 0
        stopped) cannot stop this watchdog: its answer, or, once the store has been silent
        for `store_silence`, a mark naming process 0 as not answering."""
        if self._asking is None or not self._asking.is_alive():
            found, self._found = self._found, None
            if found is not None:
                return found
            self._asking = threading.Thread(target=self._ask, args=(mark,), daemon=True)
            self._asking.start()
            self._asking.join(self.poll)
            found, self._found = self._found, None
            return found
        silent = time.monotonic() - self._answered
        if self.process != 0 and silent > self.store_silence and mark.phase != FINISHED:
            return Mark(0, mark.step, NOT_ANSWERING, silent, silent=True)
        return None

    def _ask(self, mark: Mark) -> None:
        found = self._shared(mark)
        self._answered, self._found = time.monotonic(), found

    def _coordinator_gone(self, mark: Mark) -> None:
        """Process 0, which holds the store, stopped answering: this process says so (no
        store, no process 0 to say it), writes its stacks and ends, before JAX's heartbeats
        abort it with a C++ stack."""
        resume = _quick(lambda: resume_point(self.ckpt_dir), RESUME_UNKNOWN)
        self.say(describe(mark, self.processes, self.timeout, self.directory, resume))
        recording = threading.Thread(target=self._record, args=(mark,), daemon=True)
        recording.start()
        recording.join(timeout=_RECORD_SECONDS)
        self.end(EXIT_STALLED)

    def _shared(self, mark: Mark) -> Mark | None:
        """Publishes this process's mark; the stalled process, once one is declared or
        the marks show one (the first to see it declares it for every process)."""
        client, now = self.client, time.time()
        try:
            client.key_value_set(
                f"{_KEY}/mark/{self.process}",
                json.dumps({**dataclasses.asdict(mark), "at": now}),
                allow_overwrite=True,
            )
            declared = client.key_value_try_get(f"{_KEY}/stalled")
        except Exception:
            declared = None
        if declared is not None:
            return Mark(**json.loads(declared))
        try:
            records = client.key_value_dir_get(f"{_KEY}/mark/")
        except Exception:
            return None
        # This thread may run before `_run` sees that the process was stopped (and sets
        # `_resumed`): until it has, the others' marks from before the stop are not judged.
        if time.monotonic() - self._turned > self.turn:
            return None
        marks, stale = [], False
        try:
            for _, text in records:
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
        return self._stop.wait(ALLOWANCE[SAVING] * self.timeout)

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
# (`jdp.data.loader.pipeline`), so twenty times that is an answer that is not coming.
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
