"""The goodput ledger: where a run's wall time went, across its restarts.

Each start of a run (an attempt) runs a `Clock` that gives every moment of the
attempt to one part: ``startup`` (building the run, restoring a checkpoint, and for
``python -m jdp.train`` everything from its process's start: Python, the imports),
``compile`` (the first call of the step, and ``--steps-per-call auto``'s choice: its timed
calls on a copy of the state, `jdp.training.calls`), ``step`` (train steps, and what runs
between them), ``recomputed`` (train steps that an attempt before this one had
already computed, lost to its failure), ``input`` (waiting for a batch),
``checkpoint`` (blocked on a save), ``evaluate``, ``other`` (closing the loader,
the metric files and the checkpointer at the end) and ``stalled`` (the time without
progress before the stall watchdog ended the attempt, `jdp.distributed.watchdog`).
Process 0 writes the attempt's parts to ``goodput.json`` in the run's directory
every few seconds and at the end; a killed attempt's time after its last write, and
the wait until the next attempt's process started, count as ``restart``. The gap
after an attempt that finished (a run resumed later with more steps) is not the
run's time.

Goodput is the share of the wall time spent in train steps that were kept:
``step / wall``. The parts add up to the wall time: the test holds them to 2%.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from jdp.report.bookkeeping import read_or_set_aside

PARTS = (
    "startup",
    "compile",
    "step",
    "recomputed",
    "input",
    "checkpoint",
    "evaluate",
    "other",
    "stalled",
    "restart",
)
FILE = "goodput.json"
# Seconds between the writes of a live attempt's parts (each a small file renamed into place).
WRITE_EVERY = 2.0


def process_started() -> float:
    """When this process started (seconds since the epoch): from ``/proc`` where there is
    one, else when this module was imported."""
    try:  # its age: the time since boot less its start's, both to 10 ms (boot's own is to 1 s)
        with open("/proc/self/stat") as file:
            ticks = int(file.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as file:
            uptime = float(file.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def _claim_start() -> float:
    """When this attempt began: the process's start for the first run of a jdp command
    (``python -m jdp.train``: its imports are the run's start-up), else now (a run of
    your program or notebook starts when you call it)."""
    global _CLAIMED
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    command = spec is not None and (spec.name or "").startswith("jdp.")
    first, _CLAIMED = not _CLAIMED, True
    return process_started() if first and command else time.time()


_CLAIMED = False


class Clock:
    """An attempt's wall time, each moment given to the part ``switch`` last named.

    The clock starts in ``startup``, which also holds the time from a jdp command's
    process start to the clock's.
    """

    def __init__(self):
        now, self.started = time.perf_counter(), _claim_start()
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.seconds["startup"] = max(0.0, time.time() - self.started)
        self.part, self._since = "startup", now

    def switch(self, part: str) -> str:
        """From now on the time is ``part``'s; returns the part it was."""
        now = time.perf_counter()
        self.seconds[self.part] += now - self._since
        previous, self.part, self._since = self.part, part, now
        return previous

    def parts(self) -> dict[str, float]:
        """Each part's seconds so far, the running one's included."""
        parts = dict(self.seconds)
        parts[self.part] += time.perf_counter() - self._since
        return parts


class Goodput:
    """Process 0's ledger of a run's attempts in ``directory`` (None: this attempt only).

    ``start(step)`` begins the attempt at the step it resumes from (reading the
    attempts before it); ``redo_until`` is the furthest step an attempt before it
    computed, whose steps this one computes again; ``progress(step)`` writes the
    parts every `WRITE_EVERY` seconds and at each ``every``-th step (the logged ones: a
    restart knows how far a killed attempt got at least as well as its metrics do);
    ``finish(how)`` writes them and returns the run's accounting (`summarize`).
    """

    def __init__(
        self, clock: Clock, directory: str | None, *, every: int = 0, enabled: bool = True
    ):
        self.clock, self.enabled, self.every = clock, enabled, every
        self.path = os.path.join(directory, FILE) if directory and enabled else None
        self.before: list[dict[str, Any]] = []
        self.attempt: dict[str, Any] = {}
        self.redo_until = 0
        self._written = 0.0
        self._lock = threading.Lock()  # the stall watchdog's thread writes too

    def start(self, step: int) -> None:
        self.before = _read(self.path) if self.path else []
        if step == 0 and self.before and self.before[-1].get("ended") == "finished":
            self.before = []  # a new run from scratch in a finished run's directory
        self.redo_until = max([attempt["last_step"] for attempt in self.before] + [0])
        self.attempt = {
            "started": self.clock.started,
            "start_step": step,
            "last_step": step,
            "recomputed_steps": 0,
        }

    def progress(self, step: int) -> None:
        last, self.attempt["last_step"] = self.attempt["last_step"], step
        logged = self.every and step // self.every != last // self.every
        if self.path and (logged or time.monotonic() - self._written >= WRITE_EVERY):
            self._write()

    def finish(self, how: str) -> dict[str, Any]:
        """Ends the attempt (``finished`` or ``preempted``); the run's accounting."""
        if not self.attempt:
            self.start(0)
        self.attempt["ended"] = how
        if self.path:
            self._write()
        else:
            self._stamp()
        return summarize([*self.before, self.attempt])

    def stalled(self, mark) -> None:
        """Ends the attempt as the stall watchdog ends it: the time since the stalled
        process's last progress (`jdp.distributed.watchdog.Mark`) moved from the part this
        process was in to ``stalled``, and written."""
        # The lock, unless the loop's own write holds it (stuck on a hung filesystem).
        if not self.attempt or not self._lock.acquire(timeout=5.0):
            return
        try:
            self._stamp()
            self.attempt["ended"] = "stalled"
            parts = self.attempt["parts"]
            moved = min(mark.idle, parts[self.clock.part])
            parts[self.clock.part] -= moved
            parts["stalled"] += moved
            if self.path:
                self._dump()
        finally:
            self._lock.release()

    def _stamp(self) -> None:
        attempt = self.attempt
        attempt["updated"] = time.time()
        attempt["parts"] = self.clock.parts()
        redone = min(attempt["last_step"], self.redo_until) - attempt["start_step"]
        attempt["recomputed_steps"] = max(0, redone)  # those it reached

    def _write(self) -> None:
        with self._lock:
            if self.attempt.get("ended") == "stalled":
                return  # the watchdog's account is the last word
            self._stamp()
            self._dump()

    def _dump(self) -> None:
        self._written = time.monotonic()
        temporary = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(temporary, "w") as file:
                json.dump({"attempts": [*self.before, self.attempt]}, file, indent=1)
            os.replace(temporary, self.path)
        except OSError:
            pass  # a full disk: the metric logger says so; the run goes on


def summarize(attempts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's accounting over its attempts: ``{"wall", "goodput", "parts",
    "recomputed_steps", "restarts"}``, seconds for the parts and the wall."""
    parts = dict.fromkeys(PARTS, 0.0)
    wall, restarts, recomputed = 0.0, 0, 0
    for number, attempt in enumerate(attempts):
        for name, seconds in attempt.get("parts", {}).items():
            parts[name] = parts.get(name, 0.0) + seconds
        wall += attempt["updated"] - attempt["started"]
        recomputed += attempt.get("recomputed_steps", 0)
        if number and attempts[number - 1].get("ended") != "finished":
            gap = max(0.0, attempt["started"] - attempts[number - 1]["updated"])
            parts["restart"] += gap
            wall += gap
            restarts += 1
    return {
        "wall": wall,
        "goodput": parts["step"] / wall if wall > 0 else 0.0,
        "parts": parts,
        "recomputed_steps": recomputed,
        "restarts": restarts,
    }


def describe(summary: Mapping[str, Any]) -> str:
    """``goodput 91.2% of 63.0s: step 57.4s, compile 2.1s, ...`` (the parts that took time)."""
    parts = ", ".join(
        f"{name} {seconds:.1f}s" for name, seconds in summary["parts"].items() if seconds >= 0.05
    )
    redone = summary["recomputed_steps"]
    again = f"; {redone} steps computed again" if redone else ""
    return f"goodput {summary['goodput']:.1%} of {summary['wall']:.1f}s: {parts}{again}"


def _read(path: str) -> list[dict[str, Any]]:
    """The attempts written before (those that got as far as their first write); none
    when the file is missing, or damaged (set aside: `jdp.report.bookkeeping`)."""
    return read_or_set_aside(path, _attempts) or []


def _attempts(data: Any) -> list[dict[str, Any]]:
    attempts = [attempt for attempt in data["attempts"] if "updated" in attempt]
    for attempt in attempts:  # what summarize and a resume read, each of its type
        numbers = [attempt[key] for key in ("started", "updated", "start_step", "last_step")]
        numbers += [*attempt["parts"].values(), attempt.get("recomputed_steps", 0)]
        if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers):
            raise TypeError("an attempt's times, steps or parts are not numbers")
    return attempts
