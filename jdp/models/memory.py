"""Whether a model can exist on its mesh at all, asked from shapes before its
parameters are made: an input of 9 million features, or labels that run to 10**8,
make a model of tens of gigabytes, which is one line, not the allocator's traceback."""

from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import Mesh

from jdp.errors import UsageError
from jdp.layout import bytes_per_device


def device_bytes(mesh: Mesh) -> int | None:
    """What one device of ``mesh`` holds: its memory, or on a CPU its share of this
    machine's (simulated devices share it); None where neither can be read."""
    device = mesh.devices.flat[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend that keeps no statistics
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    return total // max(1, local)


def check_fits(abstract: Any, specs: Any, mesh: Mesh) -> None:
    """UsageError when the parameters (laid out by ``specs``) and their gradients alone
    are more than a device holds: training needs that much at least, whatever the
    optimizer (Adam's moments add twice the parameters again)."""
    limit = device_bytes(mesh)
    if limit is None:
        return
    per_device = bytes_per_device(abstract, specs, mesh)
    if 2 * per_device <= limit:
        return
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract))
    raise UsageError(
        f"the model has {_count(count)} parameters, {per_device / 1e9:.1f} GB a device on "
        f"this mesh; with their gradients that is more than the {limit / 1e9:.1f} GB a "
        "device has here: use a smaller model or input (the inputs' size, the number of "
        "classes), or shard the parameters (--mesh fsdp=N)"
    )


def _count(count: int) -> str:
    for size, name in ((1e9, "billion"), (1e6, "million")):
        if count >= size:
            return f"{count / size:.1f} {name}"
    return f"{count:,}"
