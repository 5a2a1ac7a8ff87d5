"""The gather of a step's rows on the devices (`jdp.data.loader.OnDevice`'s), and the
host's copy of the rows for a run too short to repay compiling a chunk's gather.

The loader gathers a chunk of 64 one-step batches with one program, which gives
each step's batch back as an output of its own: no call a step. XLA:CPU takes about
5 ms an output to compile it, 0.7 s for the digits' chunk, more than the train step's
own compile (0.4 s), and the run's first step waited for it. Reading the chunk's rows
from the split's preprocessed copy on the host (the arrays that were placed) and
placing them as the host loader places its batches costs the loader's thread more a
chunk instead: 2.6 against 0.5 ms on ``data=1``, 8 against 2.2 ms on ``data=8``. So a
training loader with fewer than `COMPILE_STEPS` steps to give (the README's first
command takes 400; a resume counts the steps left) reads its chunks from the host's
copy and compiles no chunk's gather; a longer one (or one whose length is not given)
compiles it on its first chunk, as before. A gather, a crop and a flip move values and
compute none: the batch is the same bits either way. The gather of one batch (an
evaluation's, two outputs) is compiled as ever; an evaluation's split, and a split over
`HOST_COPY_BYTES`, keeps no host copy.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jdp.data.formats.transforms import Augmentation, crop_and_flip
from jdp.mesh import batch_sharded, shard_batch

ROWS, OFFSETS, FLIPS = "rows", "offsets", "flips"  # an index batch's keys
# The largest split (bytes) whose preprocessed host copy is kept, to serve a short run's
# chunks: twice the host memory the split takes at most.
HOST_COPY_BYTES = 1 << 28
# The fewest steps a training loader gives for which a chunk's gather is compiled.
# Compiling it took 0.73 s; reading from the host's copy instead cost the digits run on
# data=1 76 us a step (4,000 steps: 300-313k examples/s against 355-377k), so it is
# repaid after about 10,000 steps. Below 2,000 steps it costs less than 0.15 s; above,
# runs keep the compiled gather's steady rate (the one the benchmarks time, from 4,000).
COMPILE_STEPS = 2_000


class Gathers:
    """The gather programs of ``arrays`` (the placed split, by name) on ``mesh``.

    Args:
        host: the same arrays on the host (as preprocessed), or None to keep none.
        input_key: the input that a crop moves, as its index batch draws, in ``padding``.
    """

    def __init__(
        self, arrays: dict, host: dict | None, mesh: Mesh, *, input_key: str, padding: int
    ):
        self.arrays, self.mesh = arrays, mesh
        self._host = host
        self._input_key, self._padding = input_key, padding
        self._jitted: dict[tuple, Any] = {}  # by (stacked, chunk, group)

    def jitted(self, stacked: bool = False, chunk: bool = False, group: int = 1):
        """The jitted gather of a placed index batch (`OnDevice.gather`)."""
        key = (stacked, chunk, group)
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                functools.partial(
                    _gather,
                    key=self._input_key,
                    padding=self._padding,
                    unstack=chunk,
                    group=group,
                ),
                out_shardings=batch_sharded(self.mesh, stacked=stacked),
            )
        return self._jitted[key]

    def gathered(self, item, *, stacked: bool = False, compiles: bool = True, place: bool = True):
        """A host index batch (or a chunk's list of them) -> its batch (list) on the
        devices: a chunk's indices stack into one transfer (`jax.device_put`'s Python
        cost is per leaf) and one gather; a chunk read from the host's copy instead
        where ``compiles`` is False (and a copy is kept), left on the host where
        ``place`` is False (the step's call places it, `jdp.data.loader.places_ahead`)."""
        if isinstance(item, list) and not compiles and self._host is not None:
            chunk = [self._on_host(one) for one in item]
            return shard_batch(chunk, self.mesh, stacked=stacked) if place else chunk
        if not isinstance(item, list):
            return self.gather(shard_batch(item, self.mesh, stacked=stacked), stacked=stacked)
        if stacked:  # calls of several steps: their steps in a row, gathered a call apiece
            steps = len(next(iter(item[0].values())))
            item = {key: np.concatenate([batch[key] for batch in item]) for key in item[0]}
            placed = shard_batch(item, self.mesh, stacked=True)
            return self.gather(placed, stacked=True, chunk=True, group=steps)
        item = {key: np.stack([batch[key] for batch in item]) for key in item[0]}
        return self.gather(shard_batch(item, self.mesh, stacked=True), chunk=True)

    def gather(self, item: dict, *, stacked: bool = False, chunk: bool = False, group: int = 1):
        """`OnDevice.gather`."""
        return self.jitted(stacked, chunk, group)(self.arrays, item)

    def _on_host(self, item: dict) -> dict:
        """The rows ``item`` names from the host's copy, cropped and flipped as it draws
        (over any leading axes), with its other keys."""
        rows = item[ROWS]
        batch = {name: value[rows] for name, value in self._host.items()}
        if OFFSETS in item:
            x = batch[self._input_key]
            flat = x.reshape(-1, *x.shape[rows.ndim :])
            drawn = Augmentation(item[OFFSETS].reshape(-1, 2), item[FLIPS].reshape(-1))
            batch[self._input_key] = crop_and_flip(flat, drawn, self._padding).reshape(x.shape)
        batch.update({name: v for name, v in item.items() if name not in (ROWS, OFFSETS, FLIPS)})
        return batch


def _gather(arrays: dict, item: dict, *, key: str, padding: int, unstack: bool, group: int = 1):
    """The index batch's rows of ``arrays``, ``key`` cropped and flipped as its draws say
    (the host's `jdp.data.formats.transforms.crop_and_flip`, over any leading axes); ``unstack``:
    the list of the batches stacked on axis 0 (of stacks of ``group`` of them, when more
    than one)."""
    rows = item[ROWS]
    # In bounds by construction (an epoch's permutation, row 0 for padding): no clamping.
    batch = {name: value.at[rows].get(mode="promise_in_bounds") for name, value in arrays.items()}
    if OFFSETS in item:
        batch[key] = _crop_and_flip(batch[key], item[OFFSETS], item[FLIPS], padding)
    batch.update(
        {name: value for name, value in item.items() if name not in (ROWS, OFFSETS, FLIPS)}
    )
    if not unstack:
        return batch
    if group > 1:
        return [
            {name: value[i : i + group] for name, value in batch.items()}
            for i in range(0, len(rows), group)
        ]
    return [{name: value[i] for name, value in batch.items()} for i in range(len(rows))]


def _crop_and_flip(x, offsets, flips, padding: int):
    """Over any leading axes, each kept (merging the step and row axes would move the rows
    between devices): two gathers along the rows, then the columns, of the padded image."""
    height, width = x.shape[-3:-1]
    lead = [(0, 0)] * (x.ndim - 3)
    padded = jnp.pad(x, (*lead, (padding, padding), (padding, padding), (0, 0)))
    ahead = (None,) * (offsets.ndim - 1)  # broadcast over the leading axes, explicitly
    rows = offsets[..., :1] + jnp.arange(height)[ahead]  # (..., height)
    cols = offsets[..., 1:] + jnp.arange(width)[ahead]
    cols = jnp.where(flips[..., None], cols[..., ::-1], cols)
    x = jnp.take_along_axis(padded, rows[..., :, None, None], axis=-3, mode="promise_in_bounds")
    return jnp.take_along_axis(x, cols[..., None, :, None], axis=-2, mode="promise_in_bounds")
