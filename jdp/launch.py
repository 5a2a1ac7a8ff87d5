"""``python -m jdp.launch --nproc N -- COMMAND``: N processes of one run on this machine.

What a cluster scheduler does, on one host: each process gets ``JDP_COORDINATOR``
(127.0.0.1 and a free port), ``JDP_NUM_PROCESSES`` and ``JDP_PROCESS_ID``, and
the coordinator listens on loopback only. Output lines carry the process id. The
launcher exits with the first non-zero exit code; once a process fails, the
others get ``--grace`` seconds to end on their own and are then killed.
SIGTERM, SIGINT or SIGHUP sends SIGTERM to every process (a jdp run saves and
stops); a second signal kills them. On Linux the processes get SIGTERM when the
launcher dies, however it dies: none is left training without it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from jdp.distributed import cluster

_CPU_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    flags = _CPU_COUNT.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices_per_process}"}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _relay(stream, rank: int, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"[{rank}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n")
            out.flush()
    stream.close()


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace: float = 10.0,
) -> int:
    """Runs ``command`` as ``nproc`` processes of one run; returns the launcher's exit code."""
    port = port or free_port()
    lock = threading.Lock()
    children: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    signals: list[int] = []

    def stop(number, frame):
        # The first signal asks every process to stop as a run stops for preemption
        # (SIGTERM: a jdp run saves at an agreed step; SIGINT would interrupt it
        # mid-step); a second one kills.
        signals.append(number)
        for child in children:
            if child.poll() is None:
                if len(signals) == 1:
                    child.send_signal(signal.SIGTERM)  # the process, not its loader workers
                else:
                    _signal_group(child, signal.SIGKILL)

    previous = {
        number: signal.signal(number, stop)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    failed = None
    try:
        for rank in range(nproc):
            if signals:
                break
            env = process_env(rank, nproc, port, devices_per_process=devices_per_process)
            child, child_relays = _start(command, env, rank, lock)
            children.append(child)
            relays.extend(child_relays)
            _say(lock, f"started process {rank} of {nproc} (pid {child.pid})")
        failed = _supervise(children, grace, lock)
    finally:
        for child in children:  # nothing outlives the launcher
            if child.poll() is None:
                _signal_group(child, signal.SIGKILL)
                child.wait()
        for number, handler in previous.items():
            signal.signal(number, handler)
        for relay in relays:
            relay.join(timeout=5)
    if failed is None:
        return 0
    rank, code = failed
    _say(
        lock,
        f"process {rank} of {nproc} failed first ({describe_exit(code)}); exit code "
        f"{_shell_code(code)}",
    )
    return _shell_code(code)


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
        relay = threading.Thread(target=_relay, args=(stream, rank, out, lock), daemon=True)
        relay.start()
        relays.append(relay)
    return child, relays


def _supervise(
    children: list[subprocess.Popen], grace: float, lock: threading.Lock
) -> tuple[int, int] | None:
    """Waits for every process; after the first failure, kills those still running after grace."""
    failed: tuple[int, int] | None = None
    kill_at = None
    while True:
        running = False
        for rank, child in enumerate(children):
            code = child.poll()
            if code is None:
                running = True
            elif code != 0 and failed is None:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jdp.launch",
        description="Run COMMAND as N processes of one multi-process run on this machine.",
        usage="python -m jdp.launch --nproc N [options] -- COMMAND [ARGS ...]",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="simulated CPU devices per process (sets XLA_FLAGS; default: as the command asks)",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the other processes get to stop after one fails (default: 10)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python -m jdp.train")
    if args.nproc < 1 or (args.devices_per_process is not None and args.devices_per_process < 1):
        parser.error("--nproc and --devices-per-process must be at least 1")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if not 0 <= args.grace < float("inf"):  # also false for NaN
        parser.error(f"--grace must be a finite number of seconds >= 0, got {args.grace}")
    if shutil.which(command[0]) is None:
        parser.error(f"command not found: {command[0]}")
    return launch(
        command,
        args.nproc,
        devices_per_process=args.devices_per_process,
        port=args.port,
        grace=args.grace,
    )


if __name__ == "__main__":
    sys.exit(main())
