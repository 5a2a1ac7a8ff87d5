"""The replica check: every device of every process holds the same parameter bytes."""

from __future__ import annotations

import collections
import zlib
from typing import Any

import jax
import numpy as np


class ReplicaMismatchError(RuntimeError):
    """Replicas that should hold identical parameters do not."""


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
