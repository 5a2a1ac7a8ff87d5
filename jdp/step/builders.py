"""The public step builders: `make_train_step`, `make_eval_step` and `evaluate`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh

from jdp import replica, replica_eval
from jdp.diloco.state import check_group_mesh
from jdp.errors import UsageError
from jdp.mesh import (
    DATA_AXIS,
    GROUP_AXIS,
    batch_axes,
    data_size,
    is_sharded,
    manual_axes,
)
from jdp.optim import check_optimizer
from jdp.precision import Precision
from jdp.reduce import pack_leaf_bytes
from jdp.replica import LossFn, Metrics
from jdp.rngs import wants_row_keys
from jdp.state import TrainState
from jdp.step import group_maths
from jdp.step.axes import bound_axes
from jdp.step.contract import Backend, CompiledStep, _check_backend
from jdp.step.data_parallel import _compile
from jdp.step.groups import compile_groups, synchronised_eval
from jdp.step.lean import Lean
from jdp.step.sharded import _compile_sharded, _sharded_eval, _sharded_train


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    backend: Backend = "jit",
    has_aux: bool = False,
    has_model_state: bool = False,
    precision: Precision | None = None,
    accumulate: int = 1,
    lr_schedule: optax.Schedule | None = None,
    steps_per_call: int = 1,
    skip_nonfinite: bool = False,
    grad_norm: bool = False,
) -> CompiledStep:
    """Builds a data-parallel train step: ``state, metrics = step(state, batch)``.

    Each replica computes the gradient of ``loss_fn`` on its rows of the global
    batch; gradients, metrics and model state are averaged over ``data``
    (``lax.pmean``) and every replica applies the same ``optimizer`` update; the
    input state is donated. With ``fsdp`` or ``model`` axes the state stays in its
    layout (`jdp.layout`; ``jit`` only), computing what a ``data`` mesh of as many
    replicas does; with a ``group`` axis the step trains DiLoCo's groups.

    Args:
        loss_fn: the mean loss over the examples it is given,
            ``loss_fn(params, batch, rng) -> loss``; ``-> (loss, aux)`` with
            ``has_aux`` (``aux`` a dict of scalar metrics); or ``loss_fn(params,
            model_state, batch, rng) -> (loss, aux, model_state)`` with
            ``has_model_state`` (BatchNorm statistics). ``rng`` differs per step and
            replica (a `jdp.rngs.RowKey` for a loss marked ``row_keys``: any mesh's).
        optimizer: any ``optax.GradientTransformation``.
        mesh: a mesh with a ``data`` axis (`make_mesh`).
        backend: ``"jit"`` (over ``shard_map``) or ``"pmap"`` (one-axis meshes).
        precision: a `Precision` (`make_precision`: compute and all-reduce dtypes,
            fp16 loss scaling); create the state with the same one.
        accumulate: micro-batches per replica, scanned; one all-reduce per update.
        lr_schedule: the optimizer's schedule, to report ``lr``.
        steps_per_call: steps per call, scanned: batch leaves ``(steps_per_call, rows, ...)``
            (`shard_batch(..., stacked=True)`), metrics ``(steps_per_call,)``; bitwise as many
            single steps where XLA compiles the step alike in its loop (not XLA:CPU's convs).
        skip_nonfinite: keep the state as it was (counting ``skipped_steps``) when the
            loss or the averaged gradient is not finite.
        grad_norm: also report ``grad_norm``, the averaged gradient's global norm
            before clipping (one more pass over the gradients).

    Returns:
        A `CompiledStep`; ``metrics``: ``loss`` and ``aux`` averaged over the global
        batch; ``grad_norm``, ``lr`` (the schedule's, or an ``inject_hyperparams``
        optimizer's), ``loss_scale`` and ``skipped_steps`` where they apply.

    Raises:
        UsageError: an unknown backend, a mesh without ``data``, ``pmap`` on several
            axes, counts below 1; when called, a batch whose rows do not split over
            the replicas, a donated state, or a loss reducing over another axis name.

    Examples:
        >>> def loss_fn(params, batch, rng):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> mesh = jdp.make_mesh("data=8")
        >>> state = jdp.create_train_state({"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh)
        >>> step = jdp.make_train_step(loss_fn, optax.sgd(0.1), mesh)
        >>> batch = {"x": np.ones((64, 4), np.float32), "y": np.ones((64, 1), np.float32)}
        >>> state, metrics = step(state, jdp.shard_batch(batch, mesh))
        >>> sorted(metrics), float(metrics["loss"])
        (['loss'], 1.0)
    """
    _check_backend(backend, mesh)
    _check_args(loss_fn, optimizer, accumulate, steps_per_call)
    way, steps = _way(mesh), steps_per_call
    options = dict(
        precision=precision or Precision(),
        accumulate=accumulate,
        lr_schedule=lr_schedule,
        skip_nonfinite=skip_nonfinite,
        grad_norm=grad_norm,
        row_keys=wants_row_keys(loss_fn),
    )
    loss = replica.loss_with_state(loss_fn, has_aux=has_aux, has_model_state=has_model_state)
    loss = _axes_named(loss, mesh)
    sharded = _sharded_train(loss, optimizer, mesh, steps, **options)
    if way == "sharded":
        return _compile_sharded(sharded, mesh, outputs=2, donate_state=True, steps=steps)
    one_step = replica.train_step(
        loss,
        optimizer,
        local_grads=backend == "jit",
        replicas=data_size(mesh),
        pack_leaf_bytes=pack_leaf_bytes(mesh),
        axes=batch_axes(mesh),
        **options,
    )
    if way == "groups":
        return compile_groups(group_maths.inner_step(one_step, steps=steps), mesh, steps=steps)
    scanned = lambda state, batches: lax.scan(one_step, state, batches)  # noqa: E731
    return _compile(
        scanned if steps > 1 else one_step,
        mesh,
        backend,
        outputs=2,
        donate_state=True,
        steps=steps,
        sharded=sharded if backend == "jit" else None,
        lean=Lean.of(**options),
    )


def _axes_named(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """``fn`` (the user's loss or metrics) whose reductions over an axis the step does not
    bind (a model written with ``axis_name="batch"``) fail in one line that names it."""
    return bound_axes(fn, {axis: mesh.shape[axis] for axis in manual_axes(mesh)}, _rename)


def _rename(axis: str) -> str:
    """The fix for a model that names its replicas' axis ``axis``."""
    return (
        f"name the model's axis {DATA_AXIS!r} (nn.BatchNorm(axis_name={DATA_AXIS!r}), "
        f"lax.pmean(x, {DATA_AXIS!r})), or keep a train step of your own and run it with "
        f"jdp.data_parallel_step(train_step, mesh, axis_name={axis!r})"
    )


def _check_args(loss_fn: Any, optimizer: Any, accumulate: int, steps_per_call: int) -> None:
    """A train step's arguments, each of its type and range, or one line naming it."""
    check_optimizer(optimizer)
    if not callable(loss_fn):
        raise UsageError(f"loss_fn must be a function, got {type(loss_fn).__name__}")
    counts = (accumulate, steps_per_call)
    if any(not isinstance(n, int) or isinstance(n, bool) for n in counts) or min(counts) < 1:
        raise UsageError(
            "accumulate and steps_per_call must be whole numbers of 1 or more, got "
            f"{accumulate} and {steps_per_call}"
        )


def make_eval_step(
    metrics_fn: LossFn,
    mesh: Mesh,
    *,
    backend: Backend = "jit",
    has_model_state: bool = False,
) -> CompiledStep:
    """Builds an exact eval step: ``sums = eval_step(state, batch)``.

    ``metrics_fn`` returns one value per example; the step sums them over the
    examples whose ``batch["mask"]`` is 1 (padding rows have 0) on every replica,
    so a padded last batch counts each real example exactly once. Pass the sums
    of all batches to `evaluate`, or divide by ``sums["count"]`` yourself. A metric
    may instead be a batch mean with its weight, ``(mean, weight)`` (the mean over
    this replica's real rows and how many they are, say): its sums are the pair
    ``(mean * weight, weight)``, and `evaluate` divides the one by the other.

    Args:
        metrics_fn: ``metrics_fn(params, batch) -> {name: values}`` (or
            ``metrics_fn(params, model_state, batch)`` with ``has_model_state=True``),
            each ``values`` of shape ``(rows,)`` for this replica's rows, or
            ``(mean, weight)``.
        mesh: a mesh with a ``data`` axis.
        backend: ``"jit"`` or ``"pmap"``.
        has_model_state: see ``metrics_fn``.

    Returns:
        A `CompiledStep`: ``eval_step(state, batch) -> {name: sum, ..., "count":
        examples}`` summed over the global batch.

    Examples:
        >>> def metrics_fn(params, batch):
        ...     return {"positive": (batch["x"] @ params["w"])[:, 0] > 0}
        >>> mesh = jdp.make_mesh("data=8")
        >>> state = jdp.create_train_state({"w": jnp.ones((2, 1))}, optax.sgd(0.1), mesh)
        >>> eval_step = jdp.make_eval_step(metrics_fn, mesh)
        >>> x = np.array([[1, 1], [-1, -1]] * 32, np.float32)  # half positive
        >>> jdp.evaluate(eval_step, state, [jdp.shard_batch({"x": x}, mesh)])
        {'positive': 0.5, 'count': 64}
    """
    _check_backend(backend, mesh)
    way = _way(mesh)
    metrics = _axes_named(
        replica_eval.metrics_with_state(metrics_fn, has_model_state=has_model_state), mesh
    )
    if way == "groups":  # the synchronised parameters, replicated: no layout to follow
        compiled = _compile(
            replica_eval.eval_step(metrics, batch_axes(mesh)),
            mesh,
            backend,
            outputs=1,
            donate_state=False,
        )
        return synchronised_eval(compiled)
    sharded = _sharded_eval(replica_eval.eval_step(metrics, manual_axes(mesh)), mesh)
    if way == "sharded":
        return _compile_sharded(sharded, mesh, outputs=1, donate_state=False)
    return _compile(
        replica_eval.eval_step(metrics, batch_axes(mesh)),
        mesh,
        backend,
        outputs=1,
        donate_state=False,
        sharded=sharded if backend == "jit" else None,
    )


def _way(mesh: Mesh) -> str:
    """How a step on ``mesh`` is compiled, decided here alone, from the mesh:

    - ``"groups"``: a ``group`` axis, DiLoCo (`jdp.step.groups`);
    - ``"sharded"``: ``fsdp`` or ``model`` axes, one program per layout of the
      state (`jdp.step.sharded`);
    - ``"data_parallel"``: the backend's program for a replicated state; with
      ``jit``, a state whose `jdp.state.Placement` says ``"sharded"`` (ZeRO-1's
      optimizer state) takes the sharded programs (`jdp.step.data_parallel`).
    """
    if GROUP_AXIS in mesh.shape:
        check_group_mesh(mesh)
        return "groups"
    return "sharded" if is_sharded(mesh) else "data_parallel"


def evaluate(
    eval_step: Callable[[TrainState, Any], Metrics], state: TrainState, batches: Iterable[Any]
) -> dict[str, float]:
    """Runs ``eval_step`` over ``batches`` and returns each metric's mean over real examples.

    The sums stay on the device until the end, so the loop never waits on the host.

    Returns:
        ``{name: mean, ..., "count": number of examples counted}``.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> state = jdp.create_train_state({"w": jnp.ones((2, 1))}, optax.sgd(0.1), mesh)
        >>> eval_step = jdp.make_eval_step(lambda params, batch: {"x0": batch["x"][:, 0]}, mesh)
        >>> batches = [jdp.shard_batch({"x": np.full((8, 2), v, np.float32)}, mesh) for v in (1, 3)]
        >>> jdp.evaluate(eval_step, state, batches)
        {'x0': 2.0, 'count': 16}
    """
    total = None
    for batch in batches:
        sums = eval_step(state, batch)
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    if total is None:
        raise UsageError("evaluate got no batches; the eval split is empty")
    total = jax.device_get(total)
    count = float(total.pop("count"))
    means = {
        name: float(value[0]) / float(value[1])
        if isinstance(value, tuple)
        else float(value) / count
        for name, value in total.items()
    }
    means["count"] = int(count)
    return means
