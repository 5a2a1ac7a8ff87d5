"""The replica check: every device of every process holds the same parameter bytes."""

from __future__ import annotations

import collections
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jdp.errors import ReplicaMismatchError as ReplicaMismatchError


def replica_digests(tree: Any) -> dict[int, tuple[int, int]]:
    """Per device of this process: ``device id -> (crc32 of its bytes of tree, crc32 of
    which parts of each leaf it holds)``.

    Devices that hold the same parts (every device, for replicated leaves; those of
    one shard, for leaves split over ``fsdp`` or ``model``) must hold the same bytes.
    """
    digests: dict[int, tuple[int, int]] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            device = shard.device.id
            data, parts = digests.get(device, (0, 0))
            data = zlib.crc32(np.asarray(shard.data).tobytes(), data)
            parts = zlib.crc32(repr(shard.index).encode(), parts)
            digests[device] = (data, parts)
    return digests


def check_replicas(
    tree: Any, *, step: int | None = None, groups: Mapping[int, int] | None = None
) -> None:
    """Checks that every device of every process that holds the same parts of ``tree``
    holds the same bytes: every device for a replicated tree, each shard's replicas for
    a sharded one.

    ``groups`` (device id -> group) compares devices only within their group, for
    DiLoCo's groups' state, where each group holds its own (`jdp.diloco`).

    Raises:
        ReplicaMismatchError: naming the devices whose copy differs from the one
            most devices (of their group) hold (the first's, on a tie).
    """
    digests = replica_digests(tree)
    local = np.array(
        [(device, data, parts) for device, (data, parts) in sorted(digests.items())],
        dtype=np.uint32,
    )  # (devices, 3): id, crc of the bytes, crc of the parts held
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        table = np.asarray(multihost_utils.process_allgather(local))  # (processes, devices, 3)
    else:
        table = local[None]
    members: dict[tuple, list[tuple[int, int, int]]] = {}  # -> (process, device, digest)
    for process in range(table.shape[0]):
        for device, digest, parts in table[process]:
            group = (groups.get(int(device), 0) if groups else 0, int(parts))
            members.setdefault(group, []).append((process, int(device), int(digest)))
    differ, agree = [], 0
    for entries in members.values():
        counts = collections.Counter(digest for _, _, digest in entries)
        first = entries[0][2]
        reference = first if counts[first] == max(counts.values()) else counts.most_common(1)[0][0]
        odd = [(process, device) for process, device, digest in entries if digest != reference]
        if odd and not differ:
            agree = counts[reference]
        differ += odd
    if differ:
        where = ", ".join(f"process {process} device {device}" for process, device in differ)
        at = f" at step {step}" if step is not None else ""
        of = " of their group" if groups else ""
        raise ReplicaMismatchError(
            f"replicas differ{at}: parameters on {where} are not those the other "
            f"{agree} devices{of} hold; stopping, since the run is no longer "
            "data-parallel (a non-deterministic op or a faulty device)"
        )
