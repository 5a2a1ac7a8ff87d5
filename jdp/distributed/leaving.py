"""A process that ends in start-up tells the others, which end with it.

A Ctrl-C (SIGINT) in start-up, before the training loop takes signals over, ends a
process at once, with nothing to save. Without a word, the others of a multi-process
run would wait for it: in the first step's all-reduce, whose failure sends them to
JAX's shutdown barrier, until the heartbeat timeout aborts them with a C++ stack a
minute later; and when it was process 0, which holds the coordination service, each
aborts at once the same way. (SIGTERM, once a process has joined, is JAX's preemption
notice: every process saves at the first step and stops.) So the leaving process posts
why it ends in the coordinator's key-value store (`tell_the_others`), and a thread in
every process (`Listening`) reads it there and ends its own process with one line and
the same exit code. A process that ends closes its collectives' connections (the
others' steps fail) and process 0's end closes the store (their runtime aborts): so
each that hears posts so as its last act, the leaving process ends once every other
has heard (or left itself), and process 0 last, once every other has posted, or after
`_WAIT` seconds. Once a process's training loop has ended (`loop_ended`: its last
checkpoint may still be written as it closes) it neither posts nor listens: a signal
then costs no other process its work.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from jdp.distributed.watchdog import _end_process, _quietly

_LEFT = "jdp/left/"  # + the process: the name of the signal that ended it
_HEARD = "jdp/heard/"  # + the process: it heard, and ends
# How often a process asks the store: often in its first minutes (start-up), then
# seldom, so that thousands of processes do not keep the coordinator busy.
_POLL, _POLL_LATER, _POLL_OFTEN_FOR = 0.5, 5.0, 120.0
# Seconds a process that must end after the others waits for them to hear: each hears
# within a poll of its thread, unless its interpreter does not run (stopped).
_WAIT = 2 * _POLL_LATER + 2.0

_JOINED = threading.Event()  # `jdp.distributed.initialize` connected this process
_ENDED = threading.Event()  # this process's training loop ended


def joined() -> None:
    """Says that this process is connected to the run's coordination service: its store
    may be asked from now on (asked while JAX connects, it aborts the process)."""
    _JOINED.set()


def loop_ended() -> None:
    """Says that this process's training loop ended: from now on it neither tells the
    others it ends nor listens for them."""
    _ENDED.set()


@contextlib.contextmanager
def interrupt_held() -> Iterator[None]:
    """A SIGINT inside the block (from the main thread) delivered at its end: a Ctrl-C
    while JAX connects then arrives once the process has joined, and is told to the
    others. (SIGTERM is left alone: JAX takes it over as it connects.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: heard.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if heard:
            signal.raise_signal(signal.SIGINT)


def _runtime():
    """JAX's distributed runtime's client, this process and their number; a client of
    None before the process joined a run of several, and after its loop ended."""
    if not _JOINED.is_set() or _ENDED.is_set():
        return None, 0, 1
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None or (state.num_processes or 1) < 2:
        return None, 0, 1
    return state.client, state.process_id, state.num_processes


def tell_the_others(signal_name: str) -> None:
    """Posts that this process ends, ended by ``signal_name`` in start-up, and waits until
    every other process has heard (at most `_WAIT` seconds). A no-op in a single process,
    before this one joined the run, and after its training loop ended. Never raises: the
    process ends anyway."""
    client, process, processes = _runtime()
    if client is None:
        return
    _LEAVING.set()
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_LEFT}{process}", signal_name)
        _wait_until_heard(client, process, processes)
        client.key_value_set(f"{_HEARD}{process}", "1")  # process 0 waits for this


_LEAVING = threading.Event()  # this process ends on its own: it does not listen


def _wait_until_heard(client, process: int, processes: int) -> None:
    """Until every other process has heard, at most `_WAIT` seconds; for a process other
    than 0, one that left itself counts too (it says it heard only after its own wait,
    and process 0, which holds the store, waits for that: it ends last)."""
    deadline = time.monotonic() + _WAIT
    while time.monotonic() < deadline:
        done = {process}
        for prefix in (_HEARD,) if process == 0 else (_LEFT, _HEARD):
            done |= {int(key.rsplit("/", 1)[-1]) for key, _ in client.key_value_dir_get(prefix)}
        if len(done) >= processes:
            return
        time.sleep(0.05)


class Listening:
    """A daemon thread that, once this process has joined a run of several and until its
    training loop ends, reads every `_POLL` seconds (`_POLL_LATER` after its first
    minutes) whether another process ended in start-up; then says so (``say(line)``) and
    ends this process with that process's exit code (128 + its signal), having posted
    that it heard (process 0 last, once the others have). Stopped on leaving the
    ``with`` block."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jdp-leaving", daemon=True)

    def __enter__(self) -> Listening:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=_POLL_LATER)

    def _run(self) -> None:
        asked_since = None  # when this process first asked the store
        while not self._stop.wait(_poll(asked_since)):
            client, process, processes = _runtime()
            if _ENDED.is_set():
                return
            if client is None or _LEAVING.is_set():
                continue
            asked_since = asked_since or time.monotonic()
            try:
                left = sorted(
                    (int(key.rsplit("/", 1)[-1]), name)
                    for key, name in client.key_value_dir_get(_LEFT)
                )
            except Exception:  # the store did not answer: ask again
                continue
            if left and not self._stop.is_set():
                self._end(client, process, processes, *left[0])
                return

    def _end(self, client, process: int, processes: int, other: int, name: str) -> None:
        self.say(
            f"process {other} of {processes} ended on {name} outside training steps; "
            "this process ends too"
        )
        _quietly(sys.stdout.flush)
        _quietly(sys.stderr.flush)
        # The main thread's error, once the other process is gone, would follow the line.
        _quietly(_silence_output)
        _quietly(lambda: client.key_value_set(f"{_HEARD}{process}", "1"))
        if process == 0:  # the store ends with this process: the others hear first
            _quietly(lambda: _wait_until_heard(client, process, processes))
        _end_process(128 + _signal_number(name))  # its loader workers killed first


def _poll(asked_since: float | None) -> float:
    often = asked_since is None or time.monotonic() - asked_since < _POLL_OFTEN_FOR
    return _POLL if often else _POLL_LATER


def _signal_number(name: str) -> int:
    try:
        return signal.Signals[name].value
    except KeyError:
        return signal.SIGTERM.value


def _silence_output() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for descriptor in (1, 2):
        os.dup2(devnull, descriptor)
