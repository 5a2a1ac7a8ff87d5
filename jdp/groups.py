"""Local SGD and DiLoCo: groups of replicas that synchronise every H steps.

A mesh with a ``group`` axis (``group=2,data=4``) runs ordinary synchronous
data parallelism inside each group, over ``data``, every step. Across groups
nothing is communicated between synchronisations: each group trains its own
copy of the parameters with the inner optimizer on its block of every global
batch. Every ``sync_every`` steps the groups average their parameters over
``group`` (one all-reduce of the parameter bytes), the difference from the
parameters of the last synchronisation is the outer gradient, and an outer
optimizer applies it (Douillard et al. 2023, "DiLoCo": Nesterov momentum, lr 0.7,
momentum 0.9). Outer SGD with lr 1 and no momentum is local SGD: the groups'
plain average.

In the `TrainState`, ``params`` are the parameters as of the last
synchronisation, ``opt_state`` the outer optimizer's state and ``model_state``
the groups' averaged model state: evaluation, inference and ``load_params`` use
them. ``groups`` holds what each group trains between synchronisations
(`GroupState`), every leaf with a leading axis of one entry per group, sharded
over ``group``. Group ``g`` trains on the ``g``-th block of rows of every global
batch, so the data order stays a function of ``(seed, step)``.

This module holds the per-device maths; `jdp.step` compiles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS
from jdp.state import GroupState, Outer, TrainState

OUTER_OPTIMIZERS = ("nesterov", "sgd")


def diloco(
    *, sync_every: int, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> Outer:
    """DiLoCo's outer loop (defaults as in the paper); local SGD with ``lr=1, momentum=0``.

    The outer optimizer is SGD on the outer gradient (the parameters of the last
    synchronisation minus the groups' average), with ``momentum`` (Nesterov's
    when ``nesterov``).

    Raises:
        UsageError: ``sync_every`` below 1, a learning rate that is not positive,
            or a momentum outside [0, 1).

    Examples:
        >>> outer = jdp.diloco(sync_every=50)
        >>> outer.sync_every
        50
    """
    if sync_every < 1:
        raise UsageError(f"sync_every must be at least 1 step, got {sync_every}")
    if not lr > 0 or not 0 <= momentum < 1:
        raise UsageError(
            f"the outer optimizer needs lr > 0 and momentum in [0, 1), got {lr} and {momentum}"
        )
    optimizer = optax.sgd(lr, momentum=momentum or None, nesterov=nesterov and momentum > 0)
    return Outer(optimizer, sync_every)


def outer_from_flags(name: str, *, sync_every: int, lr: float, momentum: float) -> Outer:
    """`diloco` from ``--outer-optimizer nesterov|sgd``, ``--outer-lr``, ``--outer-momentum``."""
    if name not in OUTER_OPTIMIZERS:
        raise UsageError(
            f"unknown outer optimizer {name!r}; choose one of: {', '.join(OUTER_OPTIMIZERS)}"
        )
    return diloco(sync_every=sync_every, lr=lr, momentum=momentum, nesterov=name == "nesterov")


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
