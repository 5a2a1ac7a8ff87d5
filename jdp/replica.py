"""What one replica computes in a step: pure functions of (state, its slice of the batch).

Each replica takes its slice of the global batch, computes its gradient, and the
one all-reduce (`jdp.reduce`) averages gradients, metrics and model state
(BatchNorm statistics) before the optimizer update. With equal slices the
average of the replicas' mean-loss gradients is the gradient of the mean loss
over the global batch, so N replicas on a global batch B compute what one
device computes on B. `jdp.step` compiles these over a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp.errors import UsageError
from jdp.mesh import DATA_AXIS
from jdp.precision import Precision, all_finite, cast_floats
from jdp.reduce import global_norm, pmean_bucketed, pmean_floats
from jdp.rngs import micro_rng, replica_rng
from jdp.state import TrainState

LossFn = Callable[..., Any]
Metrics = dict[str, jax.Array]


def loss_with_state(loss_fn: LossFn, *, has_aux: bool, has_model_state: bool) -> LossFn:
    """``loss_fn`` in any of its forms as ``(params, model_state, batch, rng) -> (loss,
    aux, model_state)``: the one form the step calls."""
    if has_model_state:

        def with_state(params, model_state, batch, rng):
            return _unpack(
                loss_fn(params, model_state, batch, rng),
                3,
                "has_model_state=True",
                "(loss, aux, model_state)",
            )

        return with_state
    if has_aux:

        def with_aux(params, model_state, batch, rng):
            loss, aux = _unpack(loss_fn(params, batch, rng), 2, "has_aux=True", "(loss, aux)")
            return loss, aux, model_state

        return with_aux

    def plain(params, model_state, batch, rng):
        loss = loss_fn(params, batch, rng)
        if isinstance(loss, tuple | list):  # (loss, aux), say: a flag tells the step so
            raise UsageError(
                f"loss_fn returned a {len(loss)}-tuple; without has_aux it returns the loss "
                "alone: pass has_aux=True for (loss, aux), or has_model_state=True for "
                "(loss, aux, model_state)"
            )
        return loss, {}, model_state

    return plain


def _unpack(result: Any, count: int, flag: str, form: str) -> tuple:
    if not isinstance(result, tuple | list) or len(result) != count:
        got = f"a {len(result)}-tuple" if isinstance(result, tuple | list) else "one value"
        raise UsageError(f"with {flag}, loss_fn must return {form}; it returned {got}")
    return tuple(result)


def _check_params(params: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise UsageError(
                f"parameter {jax.tree_util.keystr(path)} is {jnp.result_type(leaf)}; parameters "
                "must be floating point (keep integer constants out of params)"
            )


# The metrics a train step reports of its own, which no aux metric may replace.
STEP_METRICS = {
    "loss": "the whole objective loss_fn returns, penalties included",
    "lr": "the learning rate",
    "grad_norm": "the averaged gradient's norm",
    "loss_scale": "fp16's loss scale",
    "skipped_steps": "the steps skipped for a non-finite loss or gradient",
}


def _check_objective(loss: Any, aux: Any) -> None:
    """One line for a loss or aux that has no useful gradient or average."""
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != ():
        raise UsageError(
            f"loss_fn returned a loss of shape {shape}; return one number, the mean over the "
            "batch (e.g. jnp.mean(per_example))"
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UsageError(
            f"loss_fn returned a {dtype} loss, which has no gradient; compute it in floating point"
        )
    if not isinstance(aux, Mapping):
        raise UsageError(f"aux must be a dict of scalar metrics, got {type(aux).__name__}")
    for name in STEP_METRICS:
        if name in aux:
            raise UsageError(
                f"aux metric {name!r} is a name the step reports itself ({STEP_METRICS[name]}), "
                f"which yours would replace; name it another way (e.g. {name + '_aux'!r})"
            )
    for name, value in aux.items():
        if jnp.shape(value) != ():
            raise UsageError(
                f"aux metric {name!r} has shape {jnp.shape(value)}; aux holds scalars, "
                "averaged over replicas (e.g. jnp.mean(per_example))"
            )


def check_accumulate(rows: int, accumulate: int, replicas: int = 1) -> None:
    """UsageError unless ``accumulate`` micro-batches divide a replica's ``rows``."""
    if accumulate < 1 or rows % accumulate:
        raise UsageError(
            f"accumulate {accumulate} does not divide the per-replica batch of {rows}; use "
            f"a global batch that is a multiple of {max(accumulate, 1) * replicas} "
            f"({max(accumulate, 1)} micro-batches x {replicas} replicas)"
        )


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes over which ``x`` may differ, as shard_map's type checking sees it."""
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # the attribute's name before JAX 0.10
    if varying is None:
        varying = aval.manual_axis_type.varying
    return frozenset(varying)


def _varying(tree: Any, axes: tuple[str, ...] = (DATA_AXIS,)) -> Any:
    """Marks leaves varying over ``axes`` (``data``, and ``group`` with DiLoCo groups,
    whose parameters differ by group): under shard_map a scan carry keeps one type."""

    def cast(x):
        missing = tuple(axis for axis in axes if axis not in _varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _gradients(grad_fn, vary, accumulate: int, axes: tuple[str, ...]):
    """``(params, model_state, batch, rng, scale) -> (grads, (loss, aux, model_state))``:
    this replica's mean gradient over its slice, in ``accumulate`` micro-batches."""
    if accumulate == 1:
        return grad_fn

    def gradients(params, model_state, batch, rng, scale):
        def micro_step(carry, inputs):
            grads_sum, loss_sum, aux_sum, model_state = carry
            index, micro_batch = inputs
            rows = jax.tree.leaves(micro_batch)[0].shape[0]
            grads, (loss, aux, model_state) = grad_fn(
                params, model_state, micro_batch, micro_rng(rng, index, rows), scale
            )
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            carry = (add(grads_sum, grads), loss_sum + loss, add(aux_sum, aux), model_state)
            return vary(carry), None

        rows = jax.tree.leaves(batch)[0].shape[0]
        check_accumulate(rows, accumulate, math.prod(lax.axis_size(axis) for axis in axes))
        split = lambda x: x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:])  # noqa: E731
        micro_batches = jax.tree.map(split, batch)
        first = jax.tree.map(lambda leaf: leaf[0], micro_batches)
        _, (loss_shape, aux_shape, _) = jax.eval_shape(
            grad_fn, params, model_state, first, rng, scale
        )
        zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)  # noqa: E731
        init = vary((zeros(params), zeros(loss_shape), zeros(aux_shape), model_state))
        (grads, loss, aux, model_state), _ = lax.scan(
            micro_step, init, (jnp.arange(accumulate), micro_batches)
        )
        mean = lambda tree: jax.tree.map(lambda x: x / accumulate, tree)  # noqa: E731
        return mean(grads), (loss / accumulate, mean(aux), model_state)

    return gradients


def _apply(
    optimizer,
    precision: Precision,
    skip_nonfinite: bool,
    state: TrainState,
    grads,
    model_state,
    metrics,
):
    """The optimizer update; skipped when a gradient is not finite under fp16 loss scaling
    or ``skip_nonfinite``."""
    made = jax.tree.structure(jax.eval_shape(optimizer.init, state.params))  # as it traces
    if made != jax.tree.structure(state.opt_state):
        raise UsageError(
            "the state's optimizer state is another optimizer's than this step's: make the "
            "state (jdp.create_train_state) and the step with the same optimizer"
        )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss_scale = state.loss_scale
    if precision.loss_scaling or skip_nonfinite:
        # Every replica decides on the same averaged gradient, so all skip together.
        finite = all_finite(grads) & jnp.isfinite(metrics["loss"])
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        model_state = keep(model_state, state.model_state)
        if precision.loss_scaling:
            loss_scale = loss_scale.update(finite, precision.growth_interval)
            metrics["loss_scale"] = loss_scale.scale
        else:
            skipped = loss_scale.skipped + (~finite).astype(jnp.int32)
            loss_scale = loss_scale.replace(skipped=skipped)
        metrics["skipped_steps"] = loss_scale.skipped
    return state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        model_state=model_state,
        loss_scale=loss_scale,
    )


class StepParts(NamedTuple):
    """A replica's train step in its two halves: ``gradients(state, batch) -> (grads,
    metrics, model_state)``, all averaged over ``data`` (it runs where ``data`` is
    mapped by hand), and ``update(state, grads, model_state, metrics) -> (state,
    metrics)``, the optimizer's (it runs anywhere: on a sharded layout, where XLA
    partitions the state); ``finish(state, grads)``: averaged gradients in the reduce
    dtype to the parameters' dtype, the loss scale divided out."""

    gradients: Callable[[TrainState, Any], tuple[Any, Metrics, Any]]
    update: Callable[..., tuple[TrainState, Metrics]]
    finish: Callable[[TrainState, Any], Any]


def _after(value: jax.Array, finite_or_not: jax.Array) -> jax.Array:
    """``value``, computed in one piece with ``finite_or_not`` (it adds an exact 0).

    A scalar computed on a branch of its own (the learning rate, from the step
    count alone) changed how XLA:CPU ran the 38k MLP's one-device step: its
    calling thread waited 650 us a step for the thread pool instead of 240 us
    (a profile), and the step took about 60 us longer, a tenth. Joined to a
    value the step computes anyway (the gradient norm, else the loss), the
    scalar is computed with it, and the cost is gone (docs/performance.md has
    the measurements).
    """
    zero = 0.0 * jnp.where(jnp.isfinite(finite_or_not), finite_or_not, 0.0)
    return value + zero.astype(value.dtype)


def _objective(
    loss_fn: LossFn, precision: Precision, gather: Callable[[Any], Any] | None
) -> Callable[..., Any]:
    """What the gradient is taken of: ``objective(params, model_state, batch, rng, scale)
    -> (scaled loss, (loss, aux, model_state))``, with the parameters and the batch in
    the compute dtype (the parameters gathered by ``gather``, when given) and the loss
    and metrics in float32."""

    def objective(params, model_state, batch, rng, scale):
        params = cast_floats(params, precision.compute_dtype)
        if gather is not None:
            params = gather(params)
        batch = cast_floats(batch, precision.compute_dtype)
        loss, aux, model_state = loss_fn(params, model_state, batch, rng)
        _check_objective(loss, aux)
        loss = loss.astype(jnp.float32)
        return loss * scale, (loss, cast_floats(aux, jnp.float32), model_state)

    return objective


def train_step_parts(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    local_grads: bool,
    replicas: int | None,
    pack_leaf_bytes: int,
    precision: Precision,
    accumulate: int,
    lr_schedule: optax.Schedule | None,
    skip_nonfinite: bool = False,
    axes: tuple[str, ...] = (DATA_AXIS,),
    gather: Callable[[Any], Any] | None = None,
    reduce_grads: bool = True,
    grad_norm: bool = False,
    row_keys: bool = False,
) -> StepParts:
    """The halves of `train_step`; ``replicas`` None: ``update`` runs outside the
    replicas' mapping (the gradient norm is then XLA's to partition). ``grad_norm``:
    report the averaged gradient's global norm (one more pass over it). ``gather``:
    applied to the parameters in the compute dtype, before the loss uses them.
    ``reduce_grads`` False: ``gradients`` returns this replica's gradients in the
    reduce dtype, for the caller to average and pass through ``finish``. ``row_keys``:
    the loss takes a `jdp.rngs.RowKey` (its model draws per example)."""

    objective = _objective(loss_fn, precision, gather)
    vary = (lambda tree: _varying(tree, axes)) if local_grads else (lambda tree: tree)
    gradients_of = _gradients(jax.grad(objective, has_aux=True), vary, accumulate, axes)

    def gradients(state: TrainState, batch: Any) -> tuple[Any, Metrics, Any]:
        # Under shard_map, replicated params are "invariant" and their gradient would
        # come back already summed over replicas; marked varying, each replica's
        # gradient stays local and the one reduction is the explicit pmean below.
        _check_params(state.params)
        params = lax.pcast(state.params, DATA_AXIS, to="varying") if local_grads else state.params
        # A constant 1 folds away; only fp16 pays for scaling.
        scale = state.loss_scale.scale if precision.loss_scaling else 1.0
        rows = jax.tree.leaves(batch)[0].shape[0]
        rng = replica_rng(state, rows, axes, row_keys)
        grads, (loss, aux, model_state) = gradients_of(params, state.model_state, batch, rng, scale)
        # The one gradient all-reduce of the step (after all micro-batches).
        grads = cast_floats(grads, precision.reduce_dtype)
        metrics = {"loss": loss, **aux}
        if not reduce_grads:  # the caller averages this replica's gradients (`finish`)
            return grads, lax.pmean(metrics, DATA_AXIS), pmean_floats(model_state)
        if replicas == 1:
            # Nothing to average, and an all-reduce over one device is not free on
            # XLA:CPU: the 10.8M MLP's one-device step ran 1.2x longer with one.
            return finish(state, grads), metrics, model_state
        grads, metrics = pmean_bucketed(
            (grads, metrics), vary=vary, pack_leaf_bytes=pack_leaf_bytes
        )
        return finish(state, grads), metrics, pmean_floats(model_state)

    def finish(state: TrainState, grads: Any) -> Any:
        """Averaged gradients in the reduce dtype -> in the parameters' dtype, unscaled."""
        scale = state.loss_scale.scale if precision.loss_scaling else 1.0
        return jax.tree.map(lambda g, p: g.astype(p.dtype) / scale, grads, state.params)

    def update(
        state: TrainState, grads: Any, model_state: Any, metrics: Metrics
    ) -> tuple[TrainState, Metrics]:
        metrics = dict(metrics)
        if grad_norm:
            norm = optax.tree.norm if replicas is None else partial(global_norm, replicas=replicas)
            metrics["grad_norm"] = norm(grads)
        if lr_schedule is not None:
            # The optimizer's count advances only on applied updates (not fp16 skips).
            count = state.step - state.loss_scale.skipped
            lr = jnp.asarray(lr_schedule(count), jnp.float32)
            metrics["lr"] = _after(lr, metrics.get("grad_norm", metrics["loss"]))
        updated = _apply(optimizer, precision, skip_nonfinite, state, grads, model_state, metrics)
        if lr_schedule is None:  # an optimizer made with optax.inject_hyperparams says its own
            injected = optax.tree_utils.tree_get(updated.opt_state, "learning_rate")
            if injected is not None:
                metrics["lr"] = jnp.asarray(injected, jnp.float32)
        return updated, metrics

    return StepParts(gradients, update, finish)


def train_step(
    loss_fn: LossFn, optimizer: optax.GradientTransformation, **options: Any
) -> Callable[[TrainState, Any], tuple[TrainState, Metrics]]:
    """The step one replica runs on its slice of the batch.

    ``loss_fn`` has the form `loss_with_state` gives. Options (`train_step_parts`):
    ``local_grads``: under ``shard_map``, where replicated parameters must be
    marked varying for their gradient to stay this replica's until the explicit
    all-reduce. ``skip_nonfinite``: leave the state as it was (but the step
    count) when the loss or the averaged gradient is not finite, as fp16 loss
    scaling does. ``axes``: the mesh axes the batch is split over (``group`` and
    ``data`` with DiLoCo groups); the all-reduce is over ``data`` alone.
    """
    parts = train_step_parts(loss_fn, optimizer, **options)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        grads, metrics, model_state = parts.gradients(state, batch)
        return parts.update(state, grads, model_state, metrics)

    return step
