"""SIGTERM and SIGINT as "save at the next step boundary and stop", agreed by every process."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax

from jdp.distributed.leaving import loop_ended


def _forward_as_sigterm(number, frame) -> None:
    """SIGINT in a multi-process run: to JAX's runtime as SIGTERM, which every process
    hears of and stops at the same step for."""
    os.kill(os.getpid(), signal.SIGTERM)


class Preemption:
    """Turns SIGTERM and SIGINT into "save at the next step boundary and exit".

    In a multi-process run every process must stop at the same step: JAX's
    distributed runtime receives SIGTERM and ``reached`` asks it (Orbax's
    preemption sync), and SIGINT to any one process is passed on to it as
    SIGTERM (Ctrl-C under Slurm reaches the processes one by one); a single
    process uses its own handlers.
    """

    def __init__(self):
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self
        if jax.process_count() == 1:
            for number in (signal.SIGTERM, signal.SIGINT):
                self._previous[number] = signal.signal(number, self._handle)
        else:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, _forward_as_sigterm)
        return self

    def _handle(self, number, frame) -> None:
        self._signal = number

    def reached(self, step: int) -> bool:
        """Whether to save and stop after ``step`` (the same answer on every process)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._signal is not None

    @property
    def signalled(self) -> bool:
        """Whether this process's own handler heard a signal (one process only)."""
        return self._signal is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self._signal).name if self._signal else "preemption notice (SIGTERM)"

    def __exit__(self, *exc_info) -> None:
        loop_ended()  # a signal from now on is not told to the others (`jdp.distributed.leaving`)
        for number, handler in self._previous.items():
            signal.signal(number, handler)
