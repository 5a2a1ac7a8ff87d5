"""The processes' agreement: what every process of a run learns together, each asking at
the same point (a single process answers alone, touching no runtime)."""

from __future__ import annotations

import jax
import numpy as np


def all_ok(ok: bool) -> bool:
    """Whether ``ok`` holds in every process (each process asks together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def from_process_0(values: list[int]) -> list[int]:
    """Process 0's list, in every process: process 0 decides, the others follow."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    count = int(multihost_utils.broadcast_one_to_all(np.asarray(len(values), np.int64)))
    mine = np.asarray(values if jax.process_index() == 0 else [0] * count, np.int64)
    return [int(v) for v in multihost_utils.broadcast_one_to_all(mine.reshape(count))]


def barrier(name: str) -> None:
    """Every process waits here until all have come (a no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
