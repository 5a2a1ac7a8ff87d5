"""Where a process sits in a multi-process run: from flags, ``JDP_*`` variables or the cluster.

Flags come first, then the ``JDP_*`` environment variables (what ``python -m
jdp.launch`` sets), then the cluster (Slurm, Open MPI, Cloud TPU). One process,
or none of these, is an ordinary single-process run.
"""

from __future__ import annotations

import dataclasses
import os

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


def split_address(address: str, what: str) -> tuple[str, int]:
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
        split_address(bind, ENV_COORDINATOR_BIND)
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
    split_address(coordinator, "--coordinator")
    return Cluster(
        num_processes=num_processes,
        process_id=process_id,
        coordinator=coordinator,
        bind=bind,
        source="flags and JDP_* variables",
    )
