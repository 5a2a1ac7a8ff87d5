"""DiLoCo's per-device maths: the groups' inner step and the synchronisation, which
`jdp.step.groups` compiles over a mesh with a ``group`` axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp.diloco.outer import Outer
from jdp.diloco.state import GroupState
from jdp.mesh import GROUP_AXIS
from jdp.state import TrainState


def _mine(tree: Any) -> Any:
    """This device's group's entry of a ``(groups, ...)`` tree under ``shard_map``."""
    return jax.tree.map(lambda x: x[0], tree)


def _as_block(tree: Any) -> Any:
    """A group's values as its ``(1, ...)`` block of a ``(groups, ...)`` tree."""
    return jax.tree.map(lambda x: x[None], tree)


def inner_step(one_step: Callable[..., Any], *, steps: int) -> Callable[..., Any]:
    """``(state, groups, batch) -> (state, groups, metrics)`` on one device: ``steps``
    steps of its group (``one_step`` is `jdp.replica.train_step`'s, which reduces over
    ``data`` only). Metrics come back per group, ``(1, ...)`` blocks: averaging them over
    the groups would be a collective across ``group`` every step."""

    def step(state: TrainState, groups: GroupState, batch: Any):
        # Each group draws its own dropout keys; within it, replicas differ as usual.
        key = jax.random.fold_in(state.key, lax.axis_index(GROUP_AXIS))
        local = state.replace(
            params=_mine(groups.params),
            opt_state=_mine(groups.opt_state),
            model_state=_mine(groups.model_state),
            loss_scale=_mine(groups.loss_scale),
            rng=jax.random.key_data(key),
            groups=None,
        )
        if steps > 1:
            local, metrics = lax.scan(one_step, local, batch)
        else:
            local, metrics = one_step(local, batch)
        trained = GroupState(
            params=_as_block(local.params),
            opt_state=_as_block(local.opt_state),
            model_state=_as_block(local.model_state),
            loss_scale=_as_block(local.loss_scale),
        )
        return state.replace(step=local.step), trained, _as_block(metrics)

    return step


def _mean_over_groups(tree: Any) -> Any:
    """Float leaves averaged over the groups; others (counters) their largest value."""

    def mean(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return lax.pmean(x, GROUP_AXIS)
        return lax.pmax(x, GROUP_AXIS)

    return jax.tree.map(mean, tree)


def sync_step(outer: Outer) -> Callable[..., Any]:
    """``(state, groups) -> (state, groups)`` on one device: the synchronisation.

    The groups' parameters are averaged (the one all-reduce over ``group`` of
    DiLoCo, the parameters' bytes); the outer optimizer takes the parameters of
    the last synchronisation minus that average as its gradient; every group
    continues from the result, with its own inner optimizer state. Model state
    (BatchNorm statistics) is averaged too.
    """

    def sync(state: TrainState, groups: GroupState):
        average = lax.pmean(_mine(groups.params), GROUP_AXIS)
        outer_grads = jax.tree.map(lambda p, a: p - a.astype(p.dtype), state.params, average)
        updates, opt_state = outer.optimizer.update(outer_grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = _mean_over_groups(_mine(groups.model_state))
        groups = groups.replace(params=_as_block(params), model_state=_as_block(model_state))
        return state.replace(params=params, opt_state=opt_state, model_state=model_state), groups

    return sync
