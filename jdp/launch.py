"""``python -m jdp.launch --nproc N -- COMMAND``: N processes of one run on this machine.

What a cluster scheduler does, on one host: each process gets ``JDP_COORDINATOR``
(127.0.0.1 and a free port), ``JDP_NUM_PROCESSES`` and ``JDP_PROCESS_ID``, and
the coordinator listens on loopback only. Output lines carry the process id. The
launcher exits with the first non-zero exit code; once a process fails, the
others get ``--grace`` seconds to end on their own and are then killed. With
``--max-restarts K`` the group is started again instead, up to K times (a jdp run
resumes from its last complete checkpoint: torchrun's elastic semantics; a run that
stalls, `jdp.distributed.watchdog`'s exit code 75, fails as a death does), and
``--min-nproc M`` leaves out a process that fails twice in a row while more than
M remain: the run finishes on fewer, its global batch and data order unchanged.
SIGTERM, SIGINT or SIGHUP sends SIGTERM to every process (a jdp run saves and
stops, exit code 143; through a wrapper script, the trainer it runs gets it), and
the launcher then exits as a shell does, 128 + its signal (130 for SIGINT), unless
every process finished; a second signal kills them. On Linux the processes get SIGTERM
when the launcher dies, however it dies: none is left training without it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jdp.distributed import cluster
from jdp.distributed.exits import describe_exit, first_end, is_stop, shell_code
from jdp.distributed.output import relay
from jdp.distributed.ports import free_port
from jdp.distributed.process_groups import (
    PROCESS_MIB,
    alive,
    in_groups,
    left_behind,
    most_processes,
    terminate,
)
from jdp.mesh_spec import child_environment
from jdp.tool import command


def process_env(
    rank: int, nproc: int, port: int, *, devices_per_process: int | None = None
) -> dict[str, str]:
    """The environment of process ``rank``: this one's, plus where the run's processes meet."""
    env = dict(os.environ)
    address = f"127.0.0.1:{port}"
    env.update(
        {
            cluster.ENV_COORDINATOR: address,
            cluster.ENV_COORDINATOR_BIND: address,
            cluster.ENV_NUM_PROCESSES: str(nproc),
            cluster.ENV_PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(device_flags(devices_per_process))
    return env


def device_flags(devices_per_process: int | None) -> dict[str, str]:
    """``XLA_FLAGS`` simulating ``devices_per_process`` CPU devices (this process's other
    flags kept); nothing when None."""
    if not devices_per_process:
        return {}
    return {"XLA_FLAGS": child_environment(devices_per_process)["XLA_FLAGS"]}


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace: float = 10.0,
    max_restarts: int = 0,
    min_nproc: int | None = None,
) -> int:
    """Runs ``command`` as ``nproc`` processes of one run; returns the launcher's exit code.

    When a process fails, the group is stopped and started again, up to
    ``max_restarts`` times (a jdp run resumes from its last complete checkpoint);
    a process that fails twice in a row is left out while more than ``min_nproc``
    remain (the run goes on with fewer, its global batch and order unchanged). An
    exit code of 2 (bad input) and a stop asked by a signal to the launcher are never
    restarted. A process that ends on a signal sent to it alone (exit code 130 or 143)
    is said to have ended, not failed, and is never the one left out.
    """
    lock = threading.Lock()
    children: list[subprocess.Popen] = []
    signals: list[int] = []
    stopped: list[int] = []  # the processes the first signal reached

    def stop(number, frame):
        # The first signal asks every process to stop as a run stops for preemption
        # (SIGTERM: a jdp run saves at an agreed step; SIGINT would interrupt it
        # mid-step); a second one kills.
        signals.append(number)
        for child in children:
            if len(signals) == 1:
                stopped.extend(terminate(child))
            else:
                _signal_group(child, signal.SIGKILL)

    previous = {
        number: signal.signal(number, stop)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    failed_before, restarts, min_nproc = None, 0, min(min_nproc or nproc, nproc)
    try:
        while True:
            children.clear()
            failed = _group(
                command, nproc, devices_per_process, port, grace, lock, children, signals, stopped
            )
            if failed is None:
                # Stopped as asked, each saved where it could: the launcher says so as a
                # shell does (130 for SIGINT, 143 for SIGTERM), unless every one finished.
                interrupted = signals and any(child.returncode for child in children)
                return 128 + signals[0] if interrupted else 0
            rank, code = failed
            if _ends_the_run(lock, rank, code, nproc, bool(signals), restarts, max_restarts):
                return shell_code(code)
            restarts, port = restarts + 1, None  # a fresh port: the old one may linger
            if rank == failed_before and nproc > min_nproc:
                nproc -= 1
                _say(
                    lock,
                    f"process {rank} failed twice in a row; going on with {nproc} "
                    f"processes (--min-nproc {min_nproc})",
                )
            # A stop's first to end need not be the one signalled (the others, told, end
            # first: `jdp.distributed.leaving`): it is never the one left out.
            failed_before = None if is_stop(code) else rank
            _say(
                lock,
                f"restart {restarts} of {max_restarts}: {nproc} processes, resuming "
                "from the last complete checkpoint",
            )
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _ends_the_run(lock, rank, code, nproc, signalled, restarts, max_restarts) -> bool:
    """Whether the first failure of a group, process ``rank``'s exit ``code``, ends the run
    (said in one line; else it is restarted): a stop asked by a signal to the launcher,
    bad input (exit code 2), and restarts spent."""
    line = first_end(rank, nproc, code)
    if not (signalled or code == 2 or restarts == max_restarts):
        _say(lock, line)
        return False
    _say(lock, f"{line}; exit code {shell_code(code)}")
    if max_restarts and restarts == max_restarts and not (signalled or code == 2):
        _say(
            lock,
            f"--max-restarts {max_restarts} spent; the last complete checkpoint is where "
            "a rerun resumes",
        )
    return True


def _group(
    command, nproc, devices_per_process, port, grace, lock, children, signals, stopped
) -> tuple[int, int] | None:
    """Starts the ``nproc`` processes once and waits for them: the first failure, or None."""
    port = port or free_port()
    relays: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            if signals:
                break
            env = process_env(rank, nproc, port, devices_per_process=devices_per_process)
            child, child_relays = _start(command, env, rank, lock)
            children.append(child)
            relays.extend(child_relays)
            _say(lock, f"started process {rank} of {nproc} (pid {child.pid})")
        failed = _supervise(children, grace, lock, signals)
        if signals:  # a wrapper the signal ended may have left its trainer: it saves too
            for child in children:
                stopped.extend(left_behind(child, stopped))
        while any(map(alive, stopped)):  # a wrapper's trainer, still saving
            time.sleep(0.1)
        return failed
    finally:
        for child in children:  # nothing outlives the launcher
            if child.poll() is None or any(map(alive, stopped)) or in_groups([child.pid]):
                _signal_group(child, signal.SIGKILL)
                child.wait()
        for relay in relays:
            relay.join(timeout=5)


# Run in front of a process's command on Linux: the kernel sends it SIGTERM when the
# launcher dies, however it dies (kill -9 included), and a jdp run saves and stops as
# for preemption; then the command itself replaces this (the signal stays set).
_DIE_WITH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)  # the launcher died before the signal was set\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def command_ending_with_parent(command: Sequence[str]) -> list[str]:
    """``command``, set up to end with the process that starts it (the launcher, a Ray
    actor) where the kernel can do it: Linux."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *command]


def _start(command: Sequence[str], env: dict[str, str], rank: int, lock: threading.Lock):
    """Starts one process of the run, its output relayed with a ``[rank]`` prefix."""
    child = subprocess.Popen(
        command_ending_with_parent(command),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="backslashreplace",  # a stray byte must not stop the relay (and the child)
        start_new_session=True,  # the launcher's signals go through `stop`
    )
    relays = []
    for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
        thread = threading.Thread(target=relay, args=(stream, rank, out, lock), daemon=True)
        thread.start()
        relays.append(thread)
    return child, relays


def _supervise(
    children: list[subprocess.Popen], grace: float, lock: threading.Lock, signals: list[int]
) -> tuple[int, int] | None:
    """Waits for every process; after the first failure, kills those still running after
    grace. Once a signal asked the processes to stop, one that ends as a signal's stop
    (130, 143: it saved) has not failed, and the others keep the time their save takes."""
    failed: tuple[int, int] | None = None
    kill_at = None
    while True:
        running = False
        for rank, child in enumerate(children):
            code = child.poll()
            if code is None:
                running = True
            elif code != 0 and failed is None and not (signals and is_stop(code)):
                failed = (rank, code)
                kill_at = time.monotonic() + grace
                _say(
                    lock,
                    f"process {rank} {describe_exit(code)}; the others have {grace:g} s to stop",
                )
        if not running:
            return failed
        if kill_at is not None and time.monotonic() >= kill_at:
            for rank, child in enumerate(children):
                if child.poll() is None:
                    _say(
                        lock,
                        f"killing process {rank}, still running {grace:g} s after "
                        f"process {failed[0]} failed",
                    )
                    _signal_group(child, signal.SIGKILL)
            kill_at = None
        time.sleep(0.05)


def _signal_group(child: subprocess.Popen, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, number)


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        sys.stderr.write(f"jdp.launch: {text}\n")
        sys.stderr.flush()


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every launcher of a run's processes takes: ``--nproc``,
    ``--devices-per-process``, ``--grace`` and the command after ``--``."""
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="simulated CPU devices per process (sets XLA_FLAGS; default: as the command asks)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the other processes get to stop after one fails (default: 10)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")


def checked_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command after ``--``, once `add_process_flags`' values are checked (else the
    parser's one-line error, exit code 2)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python -m jdp.train")
    if args.nproc < 1 or (args.devices_per_process is not None and args.devices_per_process < 1):
        parser.error("--nproc and --devices-per-process must be at least 1")
    if not 0 <= args.grace < float("inf"):  # also false for NaN
        parser.error(f"--grace must be a finite number of seconds >= 0, got {args.grace}")
    return command


@command("jdp.launch")
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jdp.launch",
        description="Run COMMAND as N processes of one multi-process run on this machine.",
        usage="python -m jdp.launch --nproc N [options] -- COMMAND [ARGS ...]",
    )
    add_process_flags(parser)
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start the processes again this many times when one fails; a jdp run resumes "
        "from its last complete checkpoint (default: 0)",
    )
    parser.add_argument(
        "--min-nproc",
        type=int,
        default=None,
        help="leave out a process that fails twice in a row while more than this many remain "
        "(default: --nproc: never)",
    )
    args = parser.parse_args(argv)
    command = checked_command(parser, args)
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_restarts < 0 or not 1 <= (args.min_nproc or args.nproc) <= args.nproc:
        parser.error("--max-restarts must be at least 0, and --min-nproc in 1..--nproc")
    if shutil.which(command[0]) is None:
        parser.error(f"command not found: {command[0]}")
    if args.nproc > (most := most_processes()):
        parser.error(
            f"--nproc {args.nproc} is more processes than this machine's memory holds ({most} "
            f"at most, {PROCESS_MIB} MiB each); use several machines (jdp.on_ray, a scheduler)"
        )
    return launch(
        command,
        args.nproc,
        devices_per_process=args.devices_per_process,
        port=args.port,
        grace=args.grace,
        max_restarts=args.max_restarts,
        min_nproc=args.min_nproc,
    )


if __name__ == "__main__":
    sys.exit(main())
