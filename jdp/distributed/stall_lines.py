"""What a stall says and writes: process 0's line (which process, where, where a restart
begins), each process's stacks file, and the line naming the files written
(`jdp.distributed.watchdog` decides when)."""

from __future__ import annotations

import faulthandler
import os
from typing import TYPE_CHECKING

from jdp.distributed.marks import NOT_ANSWERING

if TYPE_CHECKING:
    from jdp.distributed.marks import Mark

# The process's exit code after a stall: sysexits.h's EX_TEMPFAIL ("a temporary failure;
# the user is invited to retry"), which no other jdp ending uses.
EXIT_STALLED = 75


def stacks_file(directory: str, process: int) -> str:
    return os.path.join(directory, "stalls", f"process-{process}.txt")


def describe(mark: Mark, processes: int, timeout: float, directory: str, resume: str) -> str:
    """Process 0's line about a stall: which process, where, and where a restart begins."""
    if mark.phase == NOT_ANSWERING:  # said by another process: process 0 cannot
        return (
            f"jdp: process 0 of {processes} does not answer: the store it holds for the run "
            f"has been silent for {mark.idle:.0f} s (it is stopped, or its process is stuck); "
            f"this process's Python stacks go to {os.path.join(directory, 'stalls')}; ending "
            f"the run with exit code {EXIT_STALLED}, nothing saved now ({resume})"
        )
    who = f"process {mark.process} of {processes}" if processes > 1 else "the run"
    where = f" ({mark.where})" if mark.where else ""
    return (
        f"jdp: {who} stalled {mark.phase}{where} after step {mark.step}: no progress for "
        f"{mark.idle:.0f} s (--stall-timeout {timeout:g}); Python stacks go to "
        f"{os.path.join(directory, 'stalls')}; ending the run with exit code {EXIT_STALLED}, "
        f"{resume if resume.startswith('the loop') else f'nothing saved now ({resume})'}"
    )


RESUME_UNKNOWN = "a restart resumes from the last complete checkpoint, if there is one"


def resume_point(ckpt_dir: str | None) -> str:
    """Where a restart of this run begins: the last complete checkpoint (a directory named
    by its step: Orbax renames a save's into place once it is whole), or step 0."""
    if not ckpt_dir:
        return "without --ckpt-dir a restart begins at step 0"
    steps = [int(name) for name in os.listdir(ckpt_dir) if name.isdigit()]
    if not steps:
        return f"no checkpoint in {ckpt_dir} yet: a restart begins at step 0"
    return f"a restart resumes from step {max(steps)}, the last complete checkpoint"


def stacks_written(directory: str, processes: int) -> str:
    """Process 0's line naming the stacks files that were written, and who wrote none."""
    paths = {p: stacks_file(directory, p) for p in range(processes)}
    written = [path for path in paths.values() if os.path.exists(path)]
    missing = [str(p) for p, path in paths.items() if not os.path.exists(path)]
    line = f"jdp: Python stacks written: {', '.join(written) or 'none'}"
    if missing:
        line += f"; process {', '.join(missing)} wrote none (stopped or killed)"
    return line


def write_stacks(path: str, mark: Mark) -> None:
    """Every thread's Python stack (`faulthandler`), under a line with this process's mark."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        file.write(
            f"process {mark.process}: {mark.phase}{f' ({mark.where})' if mark.where else ''}"
            f", step {mark.step}, no progress for {mark.idle:.1f} s\n\n"
        )
        file.flush()
        faulthandler.dump_traceback(file, all_threads=True)
