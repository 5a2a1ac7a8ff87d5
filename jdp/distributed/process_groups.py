"""A launcher's processes as process groups (Linux's ``/proc``): where a stop goes when
the command is a wrapper script, and whether a process still runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Collection, Iterator

# Commands that run another and pass on its exit code: a stop goes through them.
_WRAPPERS = {
    b"sh",
    b"bash",
    b"dash",
    b"zsh",
    b"ksh",
    b"env",
    b"nice",
    b"nohup",
    b"stdbuf",
    b"ionice",
    b"taskset",
    b"numactl",
    b"time",
}


def terminate(child: subprocess.Popen) -> list[int]:
    """SIGTERM to what runs the work in a process's group: the process itself, or where it
    is a wrapper (a shell script running the trainer as its child), what it runs; never
    loader workers, which their trainer stops. Returns the pids signalled."""
    members = _members(child)
    pids, below = [], [child.pid]
    while below:
        pid = below.pop()
        inner = [
            member
            for member, (parent, _) in members.items()
            if parent == pid and not _loader_worker(member)
        ]
        if members.get(pid, (0, b""))[1] in _WRAPPERS and inner:
            below += inner
        elif pid in members or child.poll() is None:  # no /proc: the process itself
            pids.append(pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return pids


def left_behind(child: subprocess.Popen, signalled: Collection[int]) -> list[int]:
    """SIGTERM to what still runs in ``child``'s process group and was not ``signalled``:
    what a wrapper of a name `terminate` does not know (a script running the trainer
    without ``exec``) left behind when the signal ended it; never loader workers.
    Returns the pids signalled."""
    pids = [pid for pid in _members(child) if pid not in signalled and not _loader_worker(pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return pids


def _members(child: subprocess.Popen) -> dict[int, tuple[int, bytes]]:
    """The live processes (not zombies) of ``child``'s process group: each one's parent and
    command name; none where there is no ``/proc``."""
    return {
        pid: (parent, name)
        for pid, name, state, parent, group in _processes()
        if state != b"Z" and group == child.pid
    }


def in_groups(groups: Collection[int]) -> list[int]:
    """The live processes (not zombies) of the process groups ``groups``."""
    return [pid for pid, _, state, _, group in _processes() if state != b"Z" and group in groups]


def _processes() -> Iterator[tuple[int, bytes, bytes, int, int]]:
    """Each process in Linux's ``/proc``: its pid, name, state, parent and group."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:  # pid (comm) state ppid pgrp
                head, tail = file.read().rsplit(b")", 1)
            state, parent, group = tail.split()[:3]
            yield int(entry), head.split(b"(", 1)[1], state, int(parent), int(group)
        except (OSError, ValueError):  # not a process, or gone
            continue


def _loader_worker(pid: int) -> bool:
    """Whether ``pid`` is a process Python's multiprocessing started (Grain's workers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            args = file.read().split(b"\0")
    except OSError:
        return False
    return b"--multiprocessing-fork" in args or any(
        arg.startswith(b"from multiprocessing.") for arg in args
    )


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not), read from Linux's ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


# The least a JAX process holds: one importing jdp.train and its devices took 159 MiB
# resident on the CPU, 200 MiB once it had made an array (2026-11-30, JAX 0.10.2).
PROCESS_MIB = 150


def most_processes() -> int:
    """How many processes of a run this machine's memory could hold at all (`PROCESS_MIB`
    each): beyond it a launch only fills the memory and the process table."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1024  # unknown: a bound all the same
    return max(1, memory // (PROCESS_MIB * 2**20))
