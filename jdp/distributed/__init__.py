"""Multi-process runs on the JAX distributed runtime: start-up.

Every process of a run calls `initialize` before anything touches devices. Where
the processes are comes from flags, ``JDP_*`` variables or the cluster
(`jdp.distributed.cluster`); before JAX connects they meet in a handshake that names a
process that never came (`jdp.distributed.handshake`). The replica check lives in
`jdp.distributed.replica_check`, and is here for the API's sake.
"""

from __future__ import annotations

import time

from jdp import lazy
from jdp.distributed.cluster import Cluster, resolve
from jdp.distributed.handshake import handshake
from jdp.distributed.leaving import interrupt_held, joined
from jdp.errors import ReplicaMismatchError as ReplicaMismatchError

# The replica check needs JAX; the launcher, which reads only where processes sit, does not.
__getattr__, __dir__, _checks = lazy.attach(
    __name__, {"jdp.distributed.replica_check": ("check_replicas", "replica_digests")}
)
__all__ = sorted(["Cluster", "ReplicaMismatchError", "initialize", "resolve", *_checks])


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    startup_timeout: float = 300,
    heartbeat_timeout: float = 60,
    settings: dict | None = None,
    error: str | None = None,
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
        settings: what every process must agree on (JSON values by flag name);
            a difference stops every process at start-up, naming the flags.
        error: why this process cannot run (found before joining, e.g. its
            data is missing); every process then stops at start-up with it.

    Returns:
        The `Cluster` this process belongs to.

    Raises:
        UsageError: incomplete settings, or processes that did not arrive in time
            (named).

    Examples:
        Process 0 of two: ``initialize("10.0.0.1:12355", num_processes=2,
        process_id=0)``. With no settings, variables or cluster, one process:

        >>> jdp.distributed.initialize().num_processes
        1
    """
    import jax
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is not None:
        joined()
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
    handshake(cluster, startup_timeout, settings, error)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with interrupt_held():  # a Ctrl-C while JAX connects arrives once it has joined
        _connect(cluster, startup_timeout - (time.monotonic() - started), heartbeat_timeout)
        joined()
    return cluster


def _connect(cluster: Cluster, timeout: float, heartbeat_timeout: float) -> None:
    import jax

    jax.distributed.initialize(
        cluster.coordinator,
        cluster.num_processes,
        cluster.process_id,
        local_device_ids=cluster.local_device_ids,
        cluster_detection_method="deactivate",
        initialization_timeout=max(30, int(timeout)),
        heartbeat_timeout_seconds=max(1, round(heartbeat_timeout)),
        # How long a finished process waits for the others at exit: they may be
        # seconds behind (a last eval, a save), never longer than a lost one is
        # waited for.
        shutdown_timeout_seconds=max(1, round(heartbeat_timeout)),
        coordinator_bind_address=cluster.bind,
    )
