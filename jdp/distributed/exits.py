"""What a run's process's exit code says, for the launchers (`jdp.launch`, `jdp.on_ray`):
a failure, a stall, or a stop asked by a signal, and the code a shell gives it."""

from __future__ import annotations

import signal

from jdp.distributed.watchdog import EXIT_STALLED

# The exit codes of a process that stopped as a signal asked (`jdp.train`: saved first).
STOPPED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def is_stop(code: int) -> bool:
    """Whether a process ended on a stop's signal (SIGINT, SIGTERM): a jdp run, saved and
    exited 130 or 143, or a wrapper the signal itself ended (after the launcher's own
    signal its trainer saves: `jdp.distributed.process_groups.left_behind`)."""
    return code in STOPPED_CODES or -code in (signal.SIGINT, signal.SIGTERM)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_STALLED:
        return f"exit code {code}: the run stalled"
    if code in STOPPED_CODES:
        return f"exit code {code}: stopped on {signal.Signals(code - 128).name}"
    return f"exit code {code}"


def first_end(rank: int, nproc: int, code: int) -> str:
    """The launcher's line on the process that ended first: a failure, or a stop asked by a
    signal to it or to another (the processes told of a stop end before the one signalled:
    `jdp.distributed.leaving`)."""
    ended = "ended" if is_stop(code) else "failed"
    return f"process {rank} of {nproc} {ended} first ({describe_exit(code)})"


def shell_code(code: int) -> int:
    """A process's exit code as a shell gives it: 128 + N for a death by signal N."""
    return 128 - code if code < 0 else code
