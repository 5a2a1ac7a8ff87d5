"""``python -m jdp.on_ray --nproc N -- COMMAND``: N processes of one run on a Ray cluster.

What ``python -m jdp.launch`` does on one machine, on the nodes of a running Ray
cluster (``ray start --head`` and workers, or a cluster Ray's launcher made): one
Ray actor per process, spread over the nodes, each running ``COMMAND`` with
``JDP_COORDINATOR`` (the first actor's node and a free port there),
``JDP_NUM_PROCESSES`` and ``JDP_PROCESS_ID``. Each process's lines reach this
terminal through Ray's log forwarding, prefixed ``[rank]``. It exits with the
first non-zero exit code; once a process fails, the others get ``--grace``
seconds and are then stopped. SIGTERM or SIGINT asks every process to save and
stop (SIGTERM), and it then exits 128 + that signal unless every process finished; a
second one kills them. A process's command dies with its actor.

Ray Train's ``JaxTrainer`` sets up JAX's distributed runtime only for TPU and GPU
workers; this does it for any, CPU included, with jdp's own start-up checks.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jdp.distributed import cluster
from jdp.distributed.exits import STOPPED_CODES, describe_exit, first_end, shell_code
from jdp.distributed.output import relay
from jdp.distributed.ports import free_port
from jdp.launch import (
    add_process_flags,
    checked_command,
    command_ending_with_parent,
    device_flags,
)
from jdp.tool import command

# Ray collapses lines repeated across workers into one by default; each process's
# lines are its own here (the same summary from two processes is two lines).
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


class Process:
    """One process of the run, in a Ray actor: where it is, then its command run."""

    def __init__(self):
        self.child: subprocess.Popen | None = None

    def where(self, pick_port: bool) -> tuple[str, int | None]:
        """This actor's node's address, as Ray's other nodes reach it, and a free port."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        (address,) = (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
        return address, free_port("") if pick_port else None

    def run(self, command: list[str], env: dict[str, str], rank: int) -> int:
        """Runs ``command``; its lines go to this actor's output, ``[rank]`` first."""
        if command[0] in ("python", "python3"):
            command = [sys.executable, *command[1:]]  # the Python Ray runs this actor with
        self.child = subprocess.Popen(
            command_ending_with_parent(command),
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="backslashreplace",
            start_new_session=True,
        )
        relay(self.child.stdout, rank, sys.stdout, threading.Lock())
        return self.child.wait()

    def stop(self, number: int) -> None:
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, number)


def run_on_ray(
    command: Sequence[str],
    nproc: int,
    *,
    address: str | None = None,
    devices_per_process: int | None = None,
    cpus_per_process: float = 1,
    gpus_per_process: float = 0,
    grace: float = 10.0,
) -> int:
    """Runs ``command`` as ``nproc`` processes of one run on the Ray cluster at
    ``address`` (default: Ray's, ``RAY_ADDRESS`` or the local one); returns the
    exit code, the first non-zero one of the processes."""
    import ray

    ray.init(address=address or "auto", log_to_driver=True, logging_level="ERROR")
    actor = ray.remote(Process).options(
        num_cpus=cpus_per_process,
        num_gpus=gpus_per_process,
        max_concurrency=2,
        scheduling_strategy="SPREAD",
    )
    actors = [actor.remote() for _ in range(nproc)]
    host, port = ray.get(actors[0].where.remote(True))
    say(f"coordinator {host}:{port}; {nproc} processes on {len(ray.nodes())} Ray nodes")
    env = {
        cluster.ENV_COORDINATOR: f"{host}:{port}",
        cluster.ENV_NUM_PROCESSES: str(nproc),
        "PYTHONUNBUFFERED": "1",
        **device_flags(devices_per_process),
    }
    runs = {
        a.run.remote(list(command), {**env, cluster.ENV_PROCESS_ID: str(rank)}, rank): rank
        for rank, a in enumerate(actors)
    }
    signals: list[int] = []

    def stop(number, frame):
        signals.append(number)
        for a in actors:
            a.stop.remote(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)

    previous = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(runs, actors, grace, signals)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        time.sleep(1)  # the last lines Ray forwards
        ray.shutdown()


def _supervise(runs: dict, actors: list, grace: float, signals: list[int]) -> int:
    """As `jdp.launch`'s: a process stopped as a signal asked (it saved) has not failed,
    and the run then exits 128 + the signal unless every process finished."""
    import ray

    failed, pending, interrupted = None, list(runs), False
    kill_at = None
    while pending:
        done, pending = ray.wait(pending, timeout=0.5)
        for ref in done:
            code = ray.get(ref)
            stopped = bool(signals) and code in STOPPED_CODES
            interrupted |= stopped
            if code and failed is None and not stopped:
                failed = (runs[ref], code)
                kill_at = time.monotonic() + grace
                say(f"process {runs[ref]} {describe_exit(code)}; the others have {grace:g} s")
        if kill_at is not None and time.monotonic() >= kill_at:
            for a in actors:
                a.stop.remote(signal.SIGKILL)
            kill_at = None
    if failed is None:
        return 128 + signals[0] if interrupted else 0
    rank, code = failed
    say(first_end(rank, len(actors), code))
    return shell_code(code)


def say(text: str) -> None:
    sys.stderr.write(f"jdp.on_ray: {text}\n")
    sys.stderr.flush()


@command("jdp.on_ray")
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jdp.on_ray",
        description="Run COMMAND as N processes of one multi-process run on a Ray cluster.",
        usage="python -m jdp.on_ray --nproc N [options] -- COMMAND [ARGS ...]",
    )
    add_process_flags(parser)
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (default: RAY_ADDRESS, or the one on this node)",
    )
    parser.add_argument(
        "--cpus-per-process",
        type=float,
        default=1,
        help="Ray CPUs each process's actor holds (default: 1)",
    )
    parser.add_argument(
        "--gpus-per-process",
        type=float,
        default=0,
        help="Ray GPUs each process's actor holds (CUDA_VISIBLE_DEVICES)",
    )
    args = parser.parse_args(argv)
    command = checked_command(parser, args)
    try:
        import ray  # noqa: F401
    except ImportError:
        parser.error("jdp.on_ray needs Ray: pip install 'jdp[ray]'")
    return run_on_ray(
        command,
        args.nproc,
        address=args.address,
        devices_per_process=args.devices_per_process,
        cpus_per_process=args.cpus_per_process,
        gpus_per_process=args.gpus_per_process,
        grace=args.grace,
    )


if __name__ == "__main__":
    sys.exit(main())
