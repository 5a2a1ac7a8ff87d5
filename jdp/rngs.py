"""The step's randomness: a key per step and replica, or per example of the global batch.

A model whose dropout is drawn per example (`jdp.models.Model.row_keys`) gets a
`RowKey`: the step's key, the same on every replica, and where this replica's rows
start in the step's global batch. Row ``i`` draws from ``fold_in(key, first_row + i)``
(`jdp.models.dropout`), so the mesh, the process count and the micro-batches change
nothing. Any other loss gets a key that differs per replica.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
from jax import lax

from jdp.mesh import DATA_AXIS
from jdp.state import TrainState


class RowKey(NamedTuple):
    """The rng a model that draws per example gets (`jdp.models.Model.row_keys`): the
    step's key, the same on every replica, and the index in the step's global batch of
    the first row it is given. Row ``i`` draws from ``fold_in(key, first_row + i)``
    (`jdp.models.dropout`), so the mesh and the process count change nothing."""

    key: jax.Array
    first_row: jax.Array


def wants_row_keys(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` (a `jdp.models.Model`'s, or one marked ``row_keys = True``)
    takes a `RowKey` for its rng."""
    owner = getattr(loss_fn, "__self__", None)
    return bool(getattr(owner, "row_keys", False) or getattr(loss_fn, "row_keys", False))


def step_key(state: TrainState) -> jax.Array:
    """This step's key: fresh every step, the same on every replica."""
    return jax.random.fold_in(state.key, state.step)


def replica_rng(state: TrainState, rows: int, axes: tuple[str, ...], row_keys: bool) -> Any:
    """This replica's rng for the step: a key different per replica, or with ``row_keys``
    a `RowKey` whose first row is that of this replica's ``rows`` (the batch laid over
    ``axes`` in order, as `jdp.shard_batch` lays it)."""
    if not row_keys:
        return jax.random.fold_in(step_key(state), lax.axis_index(DATA_AXIS))
    block = 0
    for axis in axes:
        block = block * lax.axis_size(axis) + lax.axis_index(axis)
    return RowKey(step_key(state), block * rows)


def micro_rng(rng: Any, index: jax.Array, rows: int) -> Any:
    """The rng of micro-batch ``index`` (of ``rows`` rows) of a replica's slice."""
    if isinstance(rng, RowKey):
        return RowKey(rng.key, rng.first_row + index * rows)
    return jax.random.fold_in(rng, index)


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """A run's two keys from its ``seed``, the parameters' and the training's:
    ``jax.random.split(jax.random.key(seed))``, the same bits, as one program (its three
    operations, each compiled apiece, took 35 ms more of a run's start on the CPU)."""
    return _run_keys(operator.index(seed))  # a NumPy integer too, as a Python int


# ``seed`` static: a Python int of any size makes its key as ``jax.random.key`` does.
_run_keys = jax.jit(lambda seed: tuple(jax.random.split(jax.random.key(seed))), static_argnums=0)
