"""Global batches whose contents depend only on ``(seed, step)``, never on the topology.

Training reads an endless stream of epochs, each a permutation of the split drawn
from ``(seed, epoch)``; step ``s`` takes positions ``[s*B, (s+1)*B)`` of it. Every
process computes the same global indices and loads only its own rows, so 1 device
and 8, or 1 process and 2, see the same examples in the same global batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from jax.sharding import Mesh

from jdp.data.sources import Split
from jdp.errors import UsageError
from jdp.mesh import MASK_KEY, process_rows, shard_batch


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The order of the split in one epoch: a pure function of ``(seed, epoch)``."""
    return np.random.default_rng((seed, epoch)).permutation(num_examples)


def global_batch_indices(seed: int, step: int, batch_size: int, num_examples: int) -> np.ndarray:
    """Example indices of step ``step``'s global batch (may straddle two epochs)."""
    start, stop = step * batch_size, (step + 1) * batch_size
    parts = []
    for epoch in range(start // num_examples, (stop - 1) // num_examples + 1):
        order = epoch_permutation(seed, epoch, num_examples)
        first = epoch * num_examples
        parts.append(order[max(start - first, 0) : min(stop - first, num_examples)])
    return np.concatenate(parts)


def train_batches(
    split: Split, mesh: Mesh, *, batch_size: int, seed: int, start_step: int = 0
) -> Iterator[dict]:
    """Yields global training batches (sharded on ``data``) from ``start_step`` on, forever."""
    if batch_size > len(split):
        raise UsageError(
            f"global batch {batch_size} is larger than the training split ({len(split)} "
            f"examples); use --batch-size {len(split)} or less"
        )
    rows = process_rows(mesh, batch_size)
    step = start_step
    while True:
        indices = global_batch_indices(seed, step, batch_size, len(split))
        yield shard_batch(split.rows(indices[rows]), mesh)
        step += 1


def eval_batches(split: Split, mesh: Mesh, *, batch_size: int) -> Iterator[dict]:
    """Yields the split once, in order, as global batches; the last is padded.

    Padding rows repeat example 0 and carry ``mask`` 0, so an eval step that sums
    masked values counts every example exactly once.
    """
    rows = process_rows(mesh, batch_size)
    for start in range(0, len(split), batch_size):
        indices = np.arange(start, start + batch_size)
        mask = indices < len(split)
        batch = split.rows(np.where(mask, indices, 0)[rows])
        batch[MASK_KEY] = mask[rows].astype(np.float32)
        yield shard_batch(batch, mesh)
