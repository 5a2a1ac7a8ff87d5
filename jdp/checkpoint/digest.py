"""Checksums of a pytree's array bytes, computed where the arrays live.

A checkpoint records one digest per leaf when it is saved and checks it when it
is restored, so a flipped bit in the files is found instead of trained on.

Each leaf's bytes are read as 32-bit words ``w_i``; each word is mixed with
its position, ``h_i = mix(w_i ^ (i * 0x9E3779B1 + 0x243F6A88))``, and two sums
are kept modulo 2**32: of ``h_i``, and of ``h_i * (2i + 1)``. ``mix`` is
MurmurHash3's 32-bit finalizer, a bijection: a change confined to one word (any
single-bit flip) changes that word's ``h_i`` by some ``d != 0`` and so the first
sum, always (and the second, ``d`` times an odd number). Any other change (words
swapped, every value doubled, a leaf rewritten) leaves the sums equal only by
chance. One mix per word keeps the cost near a memory pass on an accelerator.
The sums run under ``jit`` where the arrays live (one copy of replicated ones),
so only 8 bytes per leaf come back to the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def leaf_name(path: tuple) -> str:
    """``"params/Dense_0/kernel"`` for a pytree path."""
    parts = (getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))) for key in path)
    return "/".join(map(str, parts))


def _words(leaf: jax.Array) -> jax.Array:
    """The leaf's bytes as a flat vector of uint32 words (narrower items widened)."""
    if leaf.dtype == jnp.bool_:
        leaf = leaf.astype(jnp.uint8)
    size = jnp.dtype(leaf.dtype).itemsize
    if size >= 4:
        words = jax.lax.bitcast_convert_type(leaf, jnp.uint32)  # 8-byte items: two words
    else:
        words = jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{8 * size}"))
    return words.astype(jnp.uint32).reshape(-1)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection of uint32 that spreads every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _sums(leaves: list[jax.Array]) -> jax.Array:
    rows = []
    for leaf in leaves:
        words = _words(leaf)
        index = jnp.arange(words.size, dtype=jnp.uint32)
        mixed = _mix(words ^ (index * jnp.uint32(0x9E3779B1) + jnp.uint32(0x243F6A88)))
        weights = (index << 1) | jnp.uint32(1)  # odd
        rows.append(
            jnp.stack(
                [jnp.sum(mixed, dtype=jnp.uint32), jnp.sum(mixed * weights, dtype=jnp.uint32)]
            )
        )
    return jnp.stack(rows) if rows else jnp.zeros((0, 2), jnp.uint32)


_sums_jit = jax.jit(_sums)


def _replicated(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return sharding is None or sharding.is_fully_replicated


def start_digests(tree: Any) -> tuple[list[str], jax.Array]:
    """Dispatches the digests of ``tree``'s leaves without waiting for them: the leaf
    names, and a device array of their sums for `finish_digests`."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [leaf for _, leaf in flat]
    if all(_replicated(leaf) for leaf in leaves):
        # One copy is the whole of each: hash it on one device, not once per replica;
        # the last one, since Orbax copies a checkpoint's arrays from the first and
        # would wait behind the hashing there.
        copies = [
            leaf.addressable_shards[-1].data if hasattr(leaf, "sharding") else leaf
            for leaf in leaves
        ]
        device = next((c.device for c in copies if hasattr(c, "device")), None)
        leaves = jax.device_put(copies, device) if device is not None else copies
    return [leaf_name(path) for path, _ in flat], _sums_jit(leaves)


def finish_digests(names: list[str], sums: jax.Array) -> dict[str, str]:
    """``{leaf name: 16 hex digits}`` once the sums `start_digests` dispatched are done."""
    values = np.asarray(jax.device_get(sums))
    return {name: f"{a:08x}{b:08x}" for name, (a, b) in zip(names, values, strict=True)}


def tree_digests(tree: Any) -> dict[str, str]:
    """``{leaf name: 16 hex digits}`` for every array leaf of ``tree``.

    When every leaf is replicated, each process hashes its first device's copy
    alone; otherwise every process of a multi-process run must call it together
    (one compiled computation over the global arrays).

    Examples:
        >>> digests = jdp.checkpoint.digest.tree_digests({"w": jnp.ones(3), "b": jnp.zeros(2)})
        >>> sorted(digests), len(digests["w"])
        (['b', 'w'], 16)
    """
    return finish_digests(*start_digests(tree))
