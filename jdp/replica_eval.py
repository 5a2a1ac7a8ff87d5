"""What one replica evaluates: its metrics summed over the real rows of its slice, then
over the replicas, so a padded last batch counts every example once on any mesh.
`jdp.step.make_eval_step` compiles it over a mesh."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdp.errors import UsageError
from jdp.mesh import DATA_AXIS, MASK_KEY
from jdp.replica import LossFn, Metrics
from jdp.state import TrainState


def metrics_with_state(metrics_fn: LossFn, *, has_model_state: bool) -> LossFn:
    """``metrics_fn`` as ``(params, model_state, batch) -> {name: per-example values}``."""
    if has_model_state:
        return metrics_fn
    return lambda params, model_state, batch: metrics_fn(params, batch)


def eval_step(
    metrics_fn: LossFn, axes: tuple[str, ...] = (DATA_AXIS,)
) -> Callable[[TrainState, Any], Metrics]:
    """Masked sums of per-example metrics over one replica's slice, summed over replicas
    (over ``axes``, the axes the batch is split over); a metric given as a batch mean
    with its weight, ``(mean, weight)``, as the pair ``(mean * weight, weight)``.

    ``metrics_fn`` has the form `metrics_with_state` gives.
    """

    def step(state: TrainState, batch: Any) -> Metrics:
        per_example = metrics_fn(state.params, state.model_state, batch)
        rows = jax.tree.leaves(batch)[0].shape[0]
        if isinstance(batch, Mapping) and MASK_KEY in batch:
            mask = batch[MASK_KEY].astype(jnp.float32)
        else:
            mask = jnp.ones((rows,), jnp.float32)
        if not isinstance(per_example, Mapping):
            raise UsageError(
                f"metrics_fn returns a dict of named per-example values, e.g. {{'loss': "
                f"losses}}, got {type(per_example).__name__}"
            )
        sums = {}
        for name, values in per_example.items():
            if _weighted_mean(values):
                mean, weight = (jnp.asarray(v, jnp.float32) for v in values)
                sums[name] = (mean * weight, weight)
                continue
            if jnp.shape(values) != (rows,):
                raise UsageError(
                    f"eval metric {name!r} has shape {jnp.shape(values)}; metrics_fn returns "
                    f"one value per example, shape ({rows},), or a mean over the real rows "
                    f"with its weight, (mean, weight) (batch['mask'] marks them)"
                )
            sums[name] = jnp.sum(values.astype(jnp.float32) * mask)
        sums["count"] = jnp.sum(mask)
        return lax.psum(sums, axes)

    return step


def _weighted_mean(values: Any) -> bool:
    """Whether an eval metric is ``(mean, weight)``: two numbers, not per-example values."""
    return (
        isinstance(values, tuple | list)
        and len(values) == 2
        and all(jnp.shape(v) == () for v in values)
    )
