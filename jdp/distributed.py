"""Multi-process runs on the JAX distributed runtime: start-up and the replica check.

Every process of a run calls `initialize` before anything touches devices. Where
the processes are comes from flags, from ``JDP_*`` environment variables (what
``python -m jdp.launch`` sets), or from the cluster (Slurm, Open MPI, Cloud TPU),
in that order. One process (or none of this) is an ordinary single-process run.

Before JAX connects, the processes meet in a short handshake on the coordinator
port: JAX's own start-up, when a process never comes, aborts every process
after its timeout without saying which one is missing; the handshake names it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import socket
import time
import zlib
from typing import Any

import jax
import numpy as np

from jdp.errors import UsageError

# Environment variables, read when the matching flag is not given.
ENV_COORDINATOR = "JDP_COORDINATOR"  # HOST:PORT of process 0
ENV_NUM_PROCESSES = "JDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDP_PROCESS_ID"
ENV_COORDINATOR_BIND = "JDP_COORDINATOR_BIND"  # where process 0 listens (default: all interfaces)

# Cluster environments whose variables say where every process is; the Kubernetes
# detector needs the kubernetes package and a JobSet, mpi4py is opt-in: for those,
# set the JDP_* variables (docs/multihost.md shows how).
_DETECTED_CLUSTERS = ("slurm", "ompi", "gcetpu", "gketpu")

_HELLO = "jdp-hello/1"


class ReplicaMismatchError(RuntimeError):
    """Replicas that should hold identical parameters do not."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits in a run: the coordinator, the process count and its id."""

    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    bind: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "single process"


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not an integer") from None


def _split_address(address: str, what: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{what} {address!r} is not HOST:PORT, e.g. 10.0.0.1:12355")
    return host.strip("[]"), int(port)


def _detect_cluster(timeout: float) -> Cluster | None:
    from jax._src import clusters  # JAX's cluster detectors; there is no public handle

    for env in clusters.ClusterEnv._cluster_types:
        if env.name in _DETECTED_CLUSTERS and env.is_env_present():
            address, count, index, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
                None, None, None, None, env.name, int(timeout)
            )
            if count is None or count < 2:
                return None
            return Cluster(
                num_processes=count,
                process_id=index,
                coordinator=address,
                local_device_ids=tuple(local) if local is not None else None,
                source=env.name,
            )
    return None


def resolve(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    detect_timeout: float = 60,
) -> Cluster:
    """Where this process sits: flags first, then ``JDP_*`` variables, then the cluster.

    Raises:
        UsageError: the settings are incomplete or contradict each other.
    """
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    bind = os.environ.get(ENV_COORDINATOR_BIND) or None
    if bind is not None:
        _split_address(bind, ENV_COORDINATOR_BIND)
    if coordinator is None and num_processes is None and process_id is None:
        detected = _detect_cluster(detect_timeout)
        return dataclasses.replace(detected, bind=bind) if detected else Cluster()
    if num_processes is None:
        # Never guess 1 here: every process would train alone into one --ckpt-dir.
        raise UsageError(
            "--coordinator or --process-id is set but not --num-processes (or "
            f"{ENV_NUM_PROCESSES}); give every process the run's process count"
        )
    if num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {num_processes}")
    if process_id is not None and not 0 <= process_id < num_processes:
        raise UsageError(
            f"--process-id {process_id} is not in 0..{num_processes - 1} "
            f"(--num-processes {num_processes})"
        )
    if num_processes == 1:
        return Cluster(source="flags")
    missing = [
        f"{flag} (or {env})"
        for flag, env, value in (
            ("--coordinator", ENV_COORDINATOR, coordinator),
            ("--process-id", ENV_PROCESS_ID, process_id),
        )
        if value is None
    ]
    if missing:
        raise UsageError(f"a {num_processes}-process run also needs {' and '.join(missing)}")
    _split_address(coordinator, "--coordinator")
    return Cluster(
        num_processes=num_processes,
        process_id=process_id,
        coordinator=coordinator,
        bind=bind,
        source="flags and JDP_* variables",
    )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    startup_timeout: float = 300,
    heartbeat_timeout: float = 60,
) -> Cluster:
    """Joins this process to a multi-process run; a no-op for a single process.

    Call it before anything asks JAX for devices. On CPU it selects the gloo
    collectives. A process that dies stops the others: JAX's runtime aborts them
    once it has missed the dead one's heartbeats for ``heartbeat_timeout`` s.

    Args:
        coordinator: ``HOST:PORT`` of process 0 (or ``$JDP_COORDINATOR``).
        num_processes: processes in the run (or ``$JDP_NUM_PROCESSES``).
        process_id: this process, ``0 .. num_processes - 1`` (or ``$JDP_PROCESS_ID``).
        startup_timeout: seconds to wait for every process to arrive.
        heartbeat_timeout: seconds without a heartbeat after which a process is lost.

    Returns:
        The `Cluster` this process belongs to.

    Raises:
        UsageError: incomplete settings, or processes that did not arrive in time
            (named).

    Examples:
        >>> jdp.distributed.initialize("10.0.0.1:12355", num_processes=2, process_id=0)
    """
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is not None:
        state = jax_distributed.global_state
        return Cluster(
            state.num_processes,
            state.process_id,
            state.coordinator_address,
            source="already joined",
        )
    cluster = resolve(coordinator, num_processes, process_id, detect_timeout=startup_timeout)
    if cluster.num_processes == 1:
        return cluster
    started = time.monotonic()
    _handshake(cluster, startup_timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        cluster.coordinator,
        cluster.num_processes,
        cluster.process_id,
        local_device_ids=cluster.local_device_ids,
        cluster_detection_method="deactivate",
        initialization_timeout=max(30, int(startup_timeout - (time.monotonic() - started))),
        heartbeat_timeout_seconds=max(1, round(heartbeat_timeout)),
        # How long a finished process waits for the others at exit: they may be
        # seconds behind (a last eval, a save), so not the short heartbeat timeout.
        shutdown_timeout_seconds=max(1, round(startup_timeout)),
        coordinator_bind_address=cluster.bind,
    )
    return cluster


def _handshake(cluster: Cluster, timeout: float) -> None:
    """Waits until every process has reached process 0, naming those that did not."""
    if cluster.process_id == 0:
        _gather(cluster, timeout)
    else:
        _report(cluster, timeout)


def _listen(cluster: Cluster) -> socket.socket:
    """Process 0's handshake socket: where JAX's service will listen next."""
    port = _split_address(cluster.bind or cluster.coordinator, "coordinator")[1]
    try:
        if cluster.bind:
            host = _split_address(cluster.bind, ENV_COORDINATOR_BIND)[0]
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return socket.create_server((host, port), family=family)
        if socket.has_dualstack_ipv6():  # every interface, IPv4 and IPv6, as JAX's service
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as error:
        raise UsageError(
            f"process 0 cannot listen on port {port} ({error.strerror or error}); choose a "
            "free port in --coordinator"
        ) from None


def _gather(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    arrived: dict[int, socket.socket] = {}
    message = None
    with _listen(cluster) as server:
        try:
            while message is None:
                _drop_departed(arrived)
                if len(arrived) == cluster.num_processes - 1:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in range(1, cluster.num_processes) if p not in arrived]
                    message = _missing_message(missing, cluster, timeout)
                    break
                server.settimeout(min(left, 1.0))
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:  # an aborted connection, or out of file descriptors
                    time.sleep(0.1)
                    continue
                message = _admit(connection, cluster, arrived)
            reply = f"error {message}" if message else "go"
            for connection in arrived.values():
                _send(connection, reply)
            for connection in arrived.values():  # the peers close first (TIME_WAIT stays there)
                connection.settimeout(5)
                with contextlib.suppress(OSError):
                    connection.recv(1)
        finally:
            for connection in arrived.values():
                connection.close()
    if message:
        raise UsageError(message)


def _drop_departed(arrived: dict[int, socket.socket]) -> None:
    """Forgets processes whose connection closed while they waited (they gave up or died)."""
    for index, connection in list(arrived.items()):
        try:
            departed = connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            departed = False  # open, nothing to read: still waiting for the verdict
        except OSError:
            departed = True
        if departed:
            connection.close()
            del arrived[index]


def _admit(connection: socket.socket, cluster: Cluster, arrived: dict) -> str | None:
    """Reads one process's hello and keeps its connection; returns what is wrong, if anything."""
    connection.settimeout(5)
    try:
        words = connection.makefile("r").readline().split()
    except OSError:
        words = []
    if len(words) != 3 or words[0] != _HELLO or not (words[1] + words[2]).isdigit():
        connection.close()  # not a jdp process: a port scanner, a health probe
        return None
    index, count = int(words[1]), int(words[2])
    problem = None
    if count != cluster.num_processes:
        problem = (
            f"process {index} was started with --num-processes {count}, process 0 with "
            f"{cluster.num_processes}; start every process with the same count"
        )
    elif index in arrived:
        problem = f"two processes were started with --process-id {index}; give each its own id"
    if problem:
        _send(connection, f"error {problem}")
        connection.close()
        return problem
    connection.settimeout(None)
    arrived[index] = connection
    return None


def _missing_message(missing: list[int], cluster: Cluster, timeout: float) -> str:
    names = ", ".join(map(str, missing))
    noun = "process" if len(missing) == 1 else "processes"
    return (
        f"{noun} {names} of {cluster.num_processes} did not reach the coordinator "
        f"{cluster.coordinator} within {timeout:g} s; start {'it' if len(missing) == 1 else 'them'}"
        " with the same --coordinator and --num-processes, or raise --startup-timeout"
    )


def _send(connection: socket.socket, text: str) -> None:
    with contextlib.suppress(OSError):
        connection.sendall(text.encode() + b"\n")


def _report(cluster: Cluster, timeout: float) -> None:
    host, port = _split_address(cluster.coordinator, "--coordinator")
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            connection = socket.create_connection((host, port), timeout=min(left, 2.0))
        except OSError:
            time.sleep(min(0.2, max(left, 0)))
            continue
        with connection:
            _send(connection, f"{_HELLO} {cluster.process_id} {cluster.num_processes}")
            # Process 0 answers by its own deadline, at most `timeout` from now (it is
            # listening already); until then this process waits, whatever its own
            # deadline, so that it is not counted and then lost.
            connection.settimeout(timeout + 10)
            try:
                reply = connection.makefile("r").readline().strip()
            except OSError:
                reply = ""
        if reply == "go":
            return
        if reply.startswith("error "):
            raise UsageError(reply.removeprefix("error "))
        time.sleep(0.2)  # something else answered on the port; try again
    raise UsageError(
        f"process 0 did not answer at {cluster.coordinator} within {timeout:g} s; check that "
        "it runs, that --coordinator names its host and port, and that the port is reachable"
    )


def replica_digests(tree: Any) -> dict[int, int]:
    """A checksum of ``tree``'s bytes on each of this process's devices: device id -> crc32.

    Every leaf must be replicated (each device holds all of it), as parameters are
    in data parallelism.
    """
    digests: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            device = shard.device.id
            digests[device] = zlib.crc32(np.asarray(shard.data).tobytes(), digests.get(device, 0))
    return digests


def check_replicas(tree: Any, *, step: int | None = None) -> None:
    """Checks that every device of every process holds the same bytes of ``tree``.

    Raises:
        ReplicaMismatchError: naming the devices whose copy differs from the one
            most devices hold (process 0's, on a tie).
    """
    digests = replica_digests(tree)
    local = np.array(sorted(digests.items()), dtype=np.uint32)  # (devices, 2): id, crc
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        table = np.asarray(multihost_utils.process_allgather(local))  # (processes, devices, 2)
    else:
        table = local[None]
    counts = collections.Counter(int(digest) for digest in table[..., 1].ravel())
    most = max(counts.values())
    first = int(table[0, 0, 1])
    reference = first if counts[first] == most else counts.most_common(1)[0][0]
    differ = [
        (process, int(device))
        for process in range(table.shape[0])
        for device, digest in table[process]
        if digest != reference
    ]
    if differ:
        where = ", ".join(f"process {process} device {device}" for process, device in differ)
        at = f" at step {step}" if step is not None else ""
        raise ReplicaMismatchError(
            f"replicas differ{at}: parameters on {where} are not those the other "
            f"{counts[reference]} devices hold; stopping, since the run is no longer "
            "data-parallel (a non-deterministic op or a faulty device)"
        )
