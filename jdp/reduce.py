"""The step's one gradient all-reduce: which leaves share a buffer, and the global norm.

These run inside a replica's step (under ``shard_map`` or ``pmap``), over the
``data`` axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh

from jdp.mesh import DATA_AXIS, data_size, on_cpus


def pmean_floats(tree: Any) -> Any:
    """``pmean`` over ``data`` of the floating-point leaves; other leaves as they are."""
    return jax.tree.map(
        lambda x: lax.pmean(x, DATA_AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree
    )


# XLA:CPU pays a fixed cost per all-reduced buffer (a rendezvous of the device
# threads; a gloo round trip between processes), so on CPU the step packs leaves
# of up to PACK_LEAF_BYTES into shared buffers of up to BUCKET_BYTES. Larger leaves
# are reduced as they are: packing a 4 MiB leaf made the whole step 4-8x slower,
# the concatenation and the slices back out running as slow loops. On one device
# nothing is reduced, and accelerators' collectives take many buffers well: there
# nothing is packed. docs/performance.md has the measurements.
PACK_LEAF_BYTES = 256 * 1024
BUCKET_BYTES = 4 * 1024 * 1024


def reduction_buckets(
    leaves: Sequence[Any], *, pack_leaf_bytes: int, bucket_bytes: int = BUCKET_BYTES
) -> list[list[int]]:
    """Groups leaf indices into the buffers one all-reduce sends.

    Leaves of at most ``pack_leaf_bytes`` share buffers with leaves of their dtype,
    in order, up to ``bucket_bytes`` a buffer; every other leaf is a buffer alone.
    ``pack_leaf_bytes=0`` packs nothing.
    """
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}
    for index, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if not pack_leaf_bytes or nbytes > pack_leaf_bytes:
            buckets.append([index])
            continue
        bucket, filled = open_bucket.get(leaf.dtype, (None, 0))
        if bucket is None or filled + nbytes > bucket_bytes:
            bucket, filled = [], 0
            buckets.append(bucket)
        bucket.append(index)
        open_bucket[leaf.dtype] = (bucket, filled + nbytes)
    return buckets


def pmean_bucketed(tree: Any, *, vary: Callable[[Any], Any], pack_leaf_bytes: int) -> Any:
    """``pmean`` over ``data`` of every leaf, small leaves packed (`reduction_buckets`).

    The leaves are taken through an optimization barrier before they are packed,
    so that XLA:CPU cannot fuse their producers (the backward pass's bias
    reductions) into the concatenation's loop.
    """
    leaves, treedef = jax.tree.flatten(vary(tree))
    buckets = reduction_buckets(leaves, pack_leaf_bytes=pack_leaf_bytes)
    alone = [bucket[0] for bucket in buckets if len(bucket) == 1]
    packs = [bucket for bucket in buckets if len(bucket) > 1]
    reduced = list(leaves)
    if packs:
        barrier = lax.optimization_barrier([[leaves[i] for i in bucket] for bucket in packs])
        vectors = [jnp.concatenate([leaf.ravel() for leaf in parts]) for parts in barrier]
    else:
        vectors = []
    means = lax.pmean(([leaves[i] for i in alone], vectors), DATA_AXIS)
    for index, mean in zip(alone, means[0], strict=True):
        reduced[index] = mean
    for bucket, vector in zip(packs, means[1], strict=True):
        bounds = np.cumsum([leaves[i].size for i in bucket])[:-1]
        for index, part in zip(bucket, jnp.split(vector, bounds), strict=True):
            reduced[index] = part.reshape(leaves[index].shape)
    return jax.tree.unflatten(treedef, reduced)


# From this many gradient bytes on, each replica squares its 1/N share of the
# averaged gradient for ``grad_norm`` and one scalar psum adds the shares, instead
# of every replica reading all of it: the extra scalar all-reduce costs less than
# the pass it saves (5-10% of a 10.8M-parameter MLP's step on 8 CPU devices).
SHARED_NORM_BYTES = 4 * 1024 * 1024


def global_norm(grads: Any, *, replicas: int) -> jax.Array:
    """The global L2 norm of ``grads``, identical on every replica."""
    leaves = jax.tree.leaves(grads)
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    if replicas == 1:
        # Behind a barrier the norm's squares are its own: otherwise XLA merges them
        # with the optimizer's (Adam squares the same gradient), and XLA:CPU writes
        # them out and reads them back, three passes over the gradients instead of
        # one. Only on one device: on several, the barrier changed how the
        # 1-process program rounds Adam's update against the 2-process one (on
        # one device it rounds as it did without).
        return optax.tree.norm(lax.optimization_barrier(grads))
    if nbytes < SHARED_NORM_BYTES:
        return optax.tree.norm(grads)
    index = lax.axis_index(DATA_AXIS)
    total = jnp.zeros((), jnp.float32)
    for leaf in leaves:
        flat = leaf.ravel()
        share = -(-flat.size // replicas)
        if flat.size < replicas:
            total += jnp.where(index == 0, jnp.sum(jnp.square(flat.astype(jnp.float32))), 0.0)
            continue
        # The last share is clamped to end at the leaf's end; the overlap is masked out.
        start = jnp.minimum(index * share, flat.size - share)
        part = lax.dynamic_slice(flat, (start,), (share,)).astype(jnp.float32)
        owned = start + jnp.arange(share) >= index * share
        total += jnp.sum(jnp.where(owned, jnp.square(part), 0.0))
    return jnp.sqrt(lax.psum(total, DATA_AXIS))


def pack_leaf_bytes(mesh: Mesh) -> int:
    """The largest leaf the step's all-reduce packs on ``mesh`` (see PACK_LEAF_BYTES)."""
    return PACK_LEAF_BYTES if on_cpus(mesh) and data_size(mesh) > 1 else 0
