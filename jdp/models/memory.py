"""Whether a model can exist on its mesh at all, asked from shapes before its
parameters are made: an input of 9 million features, or labels that run to 10**8,
make a model of tens of gigabytes, which is one line, not the allocator's traceback."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from jdp.errors import UsageError
from jdp.layout import bytes_per_device
from jdp.mesh import device_bytes


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
