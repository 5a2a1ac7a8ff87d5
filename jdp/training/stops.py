"""How a run stops early: a signal (every process agreeing on the step), or a loop that
cannot go on; the state of the last step saved first."""

from __future__ import annotations

import os
import re
import signal

import jax

from jdp.actions import Progress
from jdp.distributed.marks import SAVING
from jdp.distributed.preemption import Preemption
from jdp.errors import LoaderError, UsageError
from jdp.training.run_actions import Checkpoint


class StopOnPreemption:
    """On SIGTERM or SIGINT (every process agreeing): save, then stop without the end.

    Asked after every call: with several processes, JAX's sync point wants a
    counter that rises by one at a time, the steps of the call.
    """

    phase = SAVING  # for the stall watchdog: its pass may save (`jdp.distributed.watchdog`)

    def __init__(
        self,
        preemption: Preemption,
        *,
        checkpoint: Checkpoint | None,
        ckpt_dir: str | None,
    ):
        self.preemption = preemption
        self.checkpoint, self.ckpt_dir = checkpoint, ckpt_dir
        self._stall: str | None = None

    def stall(self, what: str) -> None:
        """The stall watchdog's ask, from its thread (one process, its loop waiting for
        data): stop as for a signal, saving the last step's state, and end stalled."""
        self._stall = what

    def __call__(self, progress: Progress) -> bool:
        if progress.final or not progress.ran:
            return False
        # Each step of the call counts once, in order: JAX's sync point (the processes'
        # furthest count, plus one) is then a step, which a count of calls could pass by
        # while the processes agree (calls of 20 steps missed it 3 times in 4).
        first = progress.step - progress.ran + 1
        if not any([self.preemption.reached(step) for step in range(first, progress.step + 1)]):
            return False
        self._save_and_stop(progress, f"jdp.train: {self.preemption.signal_name}")
        return True

    def interrupted(self) -> Interrupted | None:
        """For a loop waiting on its loader: the stop a signal asked for, if one came (one
        process: several agree on a step, and a stuck one is the stall watchdog's)."""
        if self._stall is not None:
            return Stalled(f"jdp.train: {self._stall}")
        if self.preemption.signalled:
            return Interrupted(f"jdp.train: {self.preemption.signal_name} while waiting for data")
        return None

    def now(self, progress: Progress, why: Interrupted | LoaderError | UsageError) -> None:
        """Saves the state of the last step (whole: the next one never began) and stops,
        for a loop that cannot go on: ``why`` a signal (stopped as preempted), a loader
        that broke, or data found bad mid-run (a token outside the vocabulary at step 250;
        both raised again as they were, with where the state was saved)."""
        if isinstance(why, Interrupted):
            self._save_and_stop(progress, str(why))
            return
        error, where = type(why), f"{why} after step {progress.step}"
        if isinstance(why, UsageError):  # its line ends with its own fix
            where = f"{why} (met after step {progress.step})"
        if jax.process_count() > 1:  # a save needs every process; the others are in the step
            raise error(
                f"{where}; not saved (a save needs every process): the last complete "
                "checkpoint is where a rerun resumes"
            ) from why
        if self.checkpoint is None or not progress.ran:
            kept = (
                "nothing saved (no --ckpt-dir)"
                if self.checkpoint is None
                else "no step ran since the last checkpoint, which a rerun resumes"
            )
            raise error(f"{where}; {kept}") from why
        self.checkpoint.save_now(progress)
        resume = "" if error is UsageError else ": run the same command to resume"
        raise error(
            f"{where}; that step's state is saved in {os.path.abspath(self.ckpt_dir)}{resume}"
        ) from why

    def _save_and_stop(self, progress: Progress, what: str) -> None:
        where = f"{what} at step {progress.step}"
        if self.checkpoint is not None and progress.ran:
            self.checkpoint.save_now(progress)
            saved = f"checkpoint saved in {os.path.abspath(self.ckpt_dir)}"
            progress.stop(f"{where}; {saved}; run the same command to resume", finish=False)
        elif self.checkpoint is not None:
            progress.stop(
                f"{where}; no step ran since the last checkpoint, which the same command resumes",
                finish=False,
            )
        else:
            progress.stop(f"{where}; stopped without saving (no --ckpt-dir)", finish=False)


def signal_of(reason: str) -> int:
    """The signal that stopped a preempted run, read from its stop line (made above from
    `Preemption.signal_name`: ``SIGTERM``, ``SIGINT``, or a notice of another process's
    ``SIGTERM``)."""
    found = re.match(r"jdp\.train: (?:preemption notice \()?(SIG[A-Z]+)", reason)
    return signal.Signals[found.group(1)] if found else signal.SIGTERM


class Interrupted(Exception):
    """A signal's stop, raised where the loop waits for data (`Loader.interrupt`)."""


class Stalled(Interrupted):
    """The stall watchdog's stop, raised where the loop waits for data: saved as for a
    signal, and the run ends stalled (`jdp.distributed.watchdog.EXIT_STALLED`)."""


STALLED = "jdp.train: stalled"  # how a stop line made from `Stalled` begins


def stalled(reason: str | None) -> bool:
    """Whether a run's stop line is the stall watchdog's (`Stalled`)."""
    return bool(reason) and reason.startswith(STALLED)
