"""The gather of a step's rows on the devices (`jdp.data.loader.OnDevice`'s): its
programs, each compiled in a thread of its own, and the host's copy of the rows while
it compiles.

The loader gathers a chunk of 64 one-step batches with one program, which gives
each step's batch back as outputs of their own: no call a step. XLA:CPU takes about
5 ms a output to compile it, 0.7 s for the chunk on the digits, more than the train
step's own compile (0.4 s), and the run's first step waited for it before the step
could compile. So a gather program compiles beside the run, and until it is ready
each chunk's rows are taken from the split's preprocessed copy on the host (the
arrays that were placed) and placed as the host loader places a batch. A gather, a
crop and a flip move values and compute none: the batch is the same bits either way.
Reading from the host costs the loader's thread more a chunk (2.6 against 0.5 ms on
``data=1``, 8 against 2.2 on ``data=8``), so a chunk's program is compiled once the
host's copy has served `COMPILE_AFTER` of its chunks: a run as short as the README's
(400 steps) compiles none, and a long one compiles it while it trains (`OnDevice.settle`
waits for it at the run's end). The gather of one batch (an evaluation's; two outputs)
compiles when first asked, as does every gather of a split over `HOST_COPY_BYTES`,
which keeps no host copy.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jdp.data.formats.transforms import Augmentation, crop_and_flip
from jdp.mesh import batch_sharded, shard_batch

ROWS, OFFSETS, FLIPS = "rows", "offsets", "flips"  # an index batch's keys
# The largest split (bytes) whose preprocessed host copy is kept, to serve the chunks
# read while their gather compiles: twice the host memory the split takes at most.
HOST_COPY_BYTES = 1 << 28
# The chunks of one program's shapes that the host's copy serves before it compiles: 16
# chunks of 64 one-step batches are 1,024 steps, and save 35-95 ms against compiling it
# for 0.7 s (the digits on the development machine); from the 16th on it compiles beside
# the run (non-stop, in a thread that the process waits for at its end).
COMPILE_AFTER = 16


class Gathers:
    """The gather programs of ``arrays`` (the placed split, by name) on ``mesh``.

    Args:
        host: the same arrays on the host (as preprocessed), or None to keep none.
        input_key: the input that a crop and flip move (``padding``, ``flip``).
    """

    def __init__(
        self,
        arrays: dict,
        host: dict | None,
        mesh: Mesh,
        *,
        input_key: str,
        padding: int,
        flip: bool,
    ):
        self.arrays, self.mesh = arrays, mesh
        self._host = host
        self._input_key, self._padding, self._flip = input_key, padding, flip
        self._jitted: dict[tuple, Any] = {}  # by (stacked, chunk, group)
        # By (stacked, chunk, group) and the index batch's shapes: the compiled program,
        # the thread compiling it, or what compiling it raised.
        self.programs: dict[tuple, Any] = {}
        self._asks: collections.Counter = collections.Counter()  # by the same, not compiled
        self._lock = threading.Lock()

    def jitted(self, stacked: bool = False, chunk: bool = False, group: int = 1):
        """The jitted gather of a placed index batch (`OnDevice.gather`)."""
        key = (stacked, chunk, group)
        with self._lock:
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

    def gathered(self, item, *, stacked: bool = False):
        """A host index batch (or a chunk's list of them) -> its batch (list) on the
        devices: a chunk's indices stack into one transfer (`jax.device_put`'s Python
        cost is per leaf) and one gather; read from the host's copy while that gather
        compiles."""
        if not isinstance(item, list):
            indices, how = item, (stacked, False, 1)
        elif stacked:  # calls of several steps: their steps in a row, gathered a call apiece
            steps = len(next(iter(item[0].values())))
            indices = {key: np.concatenate([batch[key] for batch in item]) for key in item[0]}
            how = (True, True, steps)
        else:
            indices = {key: np.stack([batch[key] for batch in item]) for key in item[0]}
            how = (False, True, 1)
        placed = stacked or isinstance(item, list)  # the indices' steps on axis 0
        program = self._program(how, indices, placed)
        if program is not None:
            return program(self.arrays, shard_batch(indices, self.mesh, stacked=placed))
        rows = (
            [self._on_host(one) for one in item] if isinstance(item, list) else self._on_host(item)
        )
        return shard_batch(rows, self.mesh, stacked=stacked)

    def _program(self, how: tuple, indices: dict, placed: bool):
        """The compiled gather for ``indices``' shapes, or None until it is compiled (a
        chunk's compile starts on the `COMPILE_AFTER`-th ask); compiled now (in a thread,
        waited for) for one batch, or without a host copy."""
        shapes = tuple(sorted((name, v.shape, v.dtype.str) for name, v in indices.items()))
        key = (how, shapes)
        with self._lock:
            program = self.programs.get(key)
            if program is None and self._host is not None and how[1]:  # a chunk's
                self._asks[key] += 1
                if self._asks[key] < COMPILE_AFTER:
                    return None
            if program is None:  # not a daemon: the process ends after it, not inside XLA
                program = threading.Thread(
                    target=self._compile,
                    args=(key, indices, placed),
                    name="jdp-gather-compile",
                    daemon=False,
                )
                program.start()  # its end waits for the lock: the program replaces it
                self.programs[key] = program
        if isinstance(program, threading.Thread) and (self._host is None or not how[1]):
            program.join()
            program = self.programs[key]
        if isinstance(program, BaseException):
            raise program
        return None if isinstance(program, threading.Thread) else program

    def wait(self) -> None:
        """Until no gather is compiling (`OnDevice.settle`)."""
        with self._lock:
            compiling = [p for p in self.programs.values() if isinstance(p, threading.Thread)]
        for thread in compiling:
            thread.join()

    def _compile(self, key: tuple, indices: dict, placed: bool) -> None:
        try:
            placed_indices = shard_batch(indices, self.mesh, stacked=placed)
            compiled = self.jitted(*key[0]).lower(self.arrays, placed_indices).compile()
        except BaseException as error:  # raised where the loader asks for the program
            compiled = error
        with self._lock:
            self.programs[key] = compiled

    def _on_host(self, item: dict) -> dict:
        """The rows ``item`` names from the host's copy, cropped and flipped as it draws
        (over any leading axes), with its other keys (an evaluation's mask)."""
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
