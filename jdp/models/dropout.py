"""Dropout drawn per example: the mask of each row comes from its own key, ``fold_in(key,
row)``, ``row`` the example's index in the step's global batch. A replica holding rows
``[r*b, (r+1)*b)`` draws exactly those rows' masks, so 1 device and 8, or 1 process and 2,
drop the same units of the same examples: a run is the same on any mesh, and an elastic
restart onto fewer devices continues it (`jdp.rngs.RowKey` gives the rows)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def row_masks(
    key: jax.Array, rows: jax.Array | None, shape: tuple[int, ...], keep: float
) -> jax.Array:
    """Which entries of an array of ``shape`` to keep, each with probability ``keep``:
    row ``i`` drawn from ``fold_in(key, rows[i])`` (``rows`` None: ``0, 1, ...``)."""
    if rows is None:
        rows = jnp.arange(shape[0])
    draw = lambda row: jax.random.bernoulli(jax.random.fold_in(key, row), keep, shape[1:])  # noqa: E731
    return jax.vmap(draw)(rows)


def drop(x: jax.Array, keep_mask: jax.Array, keep: float) -> jax.Array:
    """``x`` with the entries ``keep_mask`` leaves out zeroed and the rest scaled by 1/keep
    (``keep_mask`` broadcast to ``x``'s shape), as `flax.linen.Dropout` does."""
    return jax.lax.select(jnp.broadcast_to(keep_mask, x.shape), x / keep, jnp.zeros_like(x))


class RowDropout(nn.Module):
    """`flax.linen.Dropout` with each row's mask drawn from its own key (`row_masks`), from
    the ``dropout`` rng stream; ``rows``: the rows' indices in the global batch."""

    rate: float

    @nn.compact
    def __call__(
        self, x: jax.Array, rows: jax.Array | None = None, *, deterministic: bool
    ) -> jax.Array:
        if deterministic or self.rate == 0:
            return x
        keep = 1.0 - self.rate
        return drop(x, row_masks(self.make_rng("dropout"), rows, x.shape, keep), keep)
