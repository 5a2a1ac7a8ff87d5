"""Train and eval steps compiled over a mesh, with the ``jit`` or the ``pmap`` backend.

Both backends run the same per-replica function: each replica takes its slice of
the global batch, computes its gradient, and ``lax.pmean`` over ``data`` averages
the gradients, the metrics and the model state (BatchNorm statistics) before the
optimizer update. With equal slices the average of the replicas' mean-loss
gradients is the gradient of the mean loss over the global batch, so N replicas on
a global batch B compute what one device computes on B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.errors import UsageError
from jdp.mesh import DATA_AXIS, MASK_KEY, batch_sharded, data_size, replicated
from jdp.precision import Precision, all_finite, cast_floats
from jdp.state import TrainState

Backend = Literal["jit", "pmap"]
BACKENDS = ("jit", "pmap")

LossFn = Callable[..., Any]
Metrics = dict[str, jax.Array]


def _check_backend(backend: str, mesh: Mesh) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    data_size(mesh)
    if backend == "pmap" and len(mesh.shape) > 1:
        raise UsageError(
            f"backend 'pmap' maps over one axis, but mesh {dict(mesh.shape)} has "
            f"{len(mesh.shape)}; use backend 'jit' or a mesh with only a 'data' axis"
        )


def _replica_rng(state: TrainState) -> jax.Array:
    """A key for this step and this replica: fresh every step, different per replica."""
    return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), lax.axis_index(DATA_AXIS))


def _is_varying(x: jax.Array) -> bool:
    """Whether ``x`` may differ across ``data`` replicas, as shard_map's type checking sees it."""
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # the attribute's name before JAX 0.10
    if varying is None:
        varying = aval.manual_axis_type.varying
    return DATA_AXIS in varying


def _pmean_floats(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: lax.pmean(x, DATA_AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree
    )


# XLA:CPU pays a fixed cost per all-reduced buffer (a rendezvous of the device
# threads; a gloo round trip between processes), so on CPU the step packs leaves
# of up to PACK_LEAF_BYTES into shared buffers of up to BUCKET_BYTES. Larger leaves
# are reduced as they are: packing a 4 MiB leaf made the whole step 4-8x slower,
# the concatenation and the slices back out running as slow loops. On one device
# nothing is reduced, and accelerators' collectives take many buffers well: there
# nothing is packed. docs/performance.md has the measurements.
PACK_LEAF_BYTES = 256 * 1024
BUCKET_BYTES = 4 * 1024 * 1024


def reduction_buckets(
    leaves: Sequence[Any], *, pack_leaf_bytes: int, bucket_bytes: int = BUCKET_BYTES
) -> list[list[int]]:
    """Groups leaf indices into the buffers one all-reduce sends.

    Leaves of at most ``pack_leaf_bytes`` share buffers with leaves of their dtype,
    in order, up to ``bucket_bytes`` a buffer; every other leaf is a buffer alone.
    ``pack_leaf_bytes=0`` packs nothing.
    """
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}
    for index, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if not pack_leaf_bytes or nbytes > pack_leaf_bytes:
            buckets.append([index])
            continue
        bucket, filled = open_bucket.get(leaf.dtype, (None, 0))
        if bucket is None or filled + nbytes > bucket_bytes:
            bucket, filled = [], 0
            buckets.append(bucket)
        bucket.append(index)
        open_bucket[leaf.dtype] = (bucket, filled + nbytes)
    return buckets


def pmean_bucketed(tree: Any, *, vary: Callable[[Any], Any], pack_leaf_bytes: int) -> Any:
    """``pmean`` over ``data`` of every leaf, small leaves packed (`reduction_buckets`).

    The leaves are taken through an optimization barrier before they are packed,
    so that XLA:CPU cannot fuse their producers (the backward pass's bias
    reductions) into the concatenation's loop.
    """
    leaves, treedef = jax.tree.flatten(vary(tree))
    buckets = reduction_buckets(leaves, pack_leaf_bytes=pack_leaf_bytes)
    alone = [bucket[0] for bucket in buckets if len(bucket) == 1]
    packs = [bucket for bucket in buckets if len(bucket) > 1]
    reduced = list(leaves)
    if packs:
        barrier = lax.optimization_barrier([[leaves[i] for i in bucket] for bucket in packs])
        vectors = [jnp.concatenate([leaf.ravel() for leaf in parts]) for parts in barrier]
    else:
        vectors = []
    means = lax.pmean(([leaves[i] for i in alone], vectors), DATA_AXIS)
    for index, mean in zip(alone, means[0], strict=True):
        reduced[index] = mean
    for bucket, vector in zip(packs, means[1], strict=True):
        bounds = np.cumsum([leaves[i].size for i in bucket])[:-1]
        for index, part in zip(bucket, jnp.split(vector, bounds), strict=True):
            reduced[index] = part.reshape(leaves[index].shape)
    return jax.tree.unflatten(treedef, reduced)


# From this many gradient bytes on, each replica squares its 1/N share of the
# averaged gradient for ``grad_norm`` and one scalar psum adds the shares, instead
# of every replica reading all of it: the extra scalar all-reduce costs less than
# the pass it saves (5-10% of a 10.8M-parameter MLP's step on 8 CPU devices).
SHARED_NORM_BYTES = 4 * 1024 * 1024


def _global_norm(grads: Any, *, replicas: int) -> jax.Array:
    """The global L2 norm of ``grads``, identical on every replica."""
    leaves = jax.tree.leaves(grads)
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    if replicas == 1 or nbytes < SHARED_NORM_BYTES:
        return optax.tree.norm(grads)
    index = lax.axis_index(DATA_AXIS)
    total = jnp.zeros((), jnp.float32)
    for leaf in leaves:
        flat = leaf.ravel()
        share = -(-flat.size // replicas)
        if flat.size < replicas:
            total += jnp.where(index == 0, jnp.sum(jnp.square(flat.astype(jnp.float32))), 0.0)
            continue
        # The last share is clamped to end at the leaf's end; the overlap is masked out.
        start = jnp.minimum(index * share, flat.size - share)
        part = lax.dynamic_slice(flat, (start,), (share,)).astype(jnp.float32)
        owned = start + jnp.arange(share) >= index * share
        total += jnp.sum(jnp.where(owned, jnp.square(part), 0.0))
    return jnp.sqrt(lax.psum(total, DATA_AXIS))


def pack_leaf_bytes(mesh: Mesh) -> int:
    """The largest leaf the step's all-reduce packs on ``mesh`` (see PACK_LEAF_BYTES)."""
    cpu = mesh.devices.flat[0].platform == "cpu"
    return PACK_LEAF_BYTES if cpu and data_size(mesh) > 1 else 0


def _split_micro_batches(batch: Any, accumulate: int) -> Any:
    """Reshapes each leaf ``(rows, ...)`` to ``(accumulate, rows // accumulate, ...)``."""

    def split(leaf):
        if leaf.shape[0] % accumulate:
            raise UsageError(
                f"accumulate {accumulate} does not divide the per-replica batch of "
                f"{leaf.shape[0]}; use a global batch that is a multiple of "
                f"{accumulate} x the data axis"
            )
        return leaf.reshape(accumulate, leaf.shape[0] // accumulate, *leaf.shape[1:])

    return jax.tree.map(split, batch)


def _replica_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool,
    has_model_state: bool,
    local_grads: bool,
    replicas: int,
    pack_leaf_bytes: int,
    precision: Precision,
    accumulate: int,
    lr_schedule: optax.Schedule | None,
) -> Callable[[TrainState, Any], tuple[TrainState, Metrics]]:
    """The step one replica runs on its slice of the batch."""

    def objective(params, model_state, batch, rng, scale):
        params = cast_floats(params, precision.compute_dtype)
        batch = cast_floats(batch, precision.compute_dtype)
        if has_model_state:
            loss, aux, model_state = loss_fn(params, model_state, batch, rng)
        elif has_aux:
            loss, aux = loss_fn(params, batch, rng)
        else:
            loss, aux = loss_fn(params, batch, rng), {}
        loss = loss.astype(jnp.float32)
        return loss * scale, (loss, cast_floats(aux, jnp.float32), model_state)

    grad_fn = jax.grad(objective, has_aux=True)

    def vary(tree):
        """Marks leaves varying over ``data``: under shard_map a scan carry keeps one type."""
        if not local_grads:
            return tree
        return jax.tree.map(
            lambda x: x if _is_varying(x) else lax.pcast(x, DATA_AXIS, to="varying"), tree
        )

    def gradients(params, model_state, batch, rng, scale):
        """This replica's mean gradient over its slice, in K micro-batches when accumulating."""
        if accumulate == 1:
            return grad_fn(params, model_state, batch, rng, scale)

        def micro_step(carry, inputs):
            grads_sum, loss_sum, aux_sum, model_state = carry
            index, micro_batch = inputs
            grads, (loss, aux, model_state) = grad_fn(
                params, model_state, micro_batch, jax.random.fold_in(rng, index), scale
            )
            carry = (
                jax.tree.map(jnp.add, grads_sum, grads),
                loss_sum + loss,
                jax.tree.map(jnp.add, aux_sum, aux),
                model_state,
            )
            return vary(carry), None

        micro_batches = _split_micro_batches(batch, accumulate)
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

    def step(state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        params = state.params
        if local_grads:
            # Under shard_map, replicated params are "invariant" and their gradient
            # would come back already summed over replicas. Marking them varying
            # keeps each replica's gradient local, so the one reduction is the
            # explicit pmean below.
            params = lax.pcast(params, DATA_AXIS, to="varying")
        # A constant 1 folds away; only fp16 pays for scaling.
        scale = state.loss_scale.scale if precision.loss_scaling else 1.0
        grads, (loss, aux, model_state) = gradients(
            params, state.model_state, batch, _replica_rng(state), scale
        )
        # The one gradient all-reduce of the step (after all micro-batches).
        grads = cast_floats(grads, precision.reduce_dtype)
        metrics = {"loss": loss, **aux}
        grads, metrics = pmean_bucketed(
            (grads, metrics), vary=vary, pack_leaf_bytes=pack_leaf_bytes
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype) / scale, grads, state.params)
        metrics["grad_norm"] = _global_norm(grads, replicas=replicas)
        if lr_schedule is not None:
            # The optimizer's count advances only on applied updates (not fp16 skips).
            count = state.step - state.loss_scale.skipped
            metrics["lr"] = jnp.asarray(lr_schedule(count), jnp.float32)
        model_state = _pmean_floats(model_state)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        loss_scale = state.loss_scale
        if precision.loss_scaling:
            # Every replica decides on the same averaged gradient, so all skip together.
            finite = all_finite(grads)
            keep = lambda new, old: jax.tree.map(  # noqa: E731
                lambda a, b: jnp.where(finite, a, b), new, old
            )
            new_params = keep(new_params, state.params)
            opt_state = keep(opt_state, state.opt_state)
            model_state = keep(model_state, state.model_state)
            loss_scale = loss_scale.update(finite, precision.growth_interval)
            metrics["loss_scale"] = loss_scale.scale
            metrics["skipped_steps"] = loss_scale.skipped
        new_state = state.replace(
            step=state.step + 1,
            params=new_params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=loss_scale,
        )
        return new_state, metrics

    return step


def _replica_eval_step(metrics_fn: LossFn, *, has_model_state: bool) -> Callable[..., Metrics]:
    """Masked sums of per-example metrics over one replica's slice, summed over replicas."""

    def step(state: TrainState, batch: Any) -> Metrics:
        if has_model_state:
            per_example = metrics_fn(state.params, state.model_state, batch)
        else:
            per_example = metrics_fn(state.params, batch)
        rows = jax.tree.leaves(batch)[0].shape[0]
        if isinstance(batch, Mapping) and MASK_KEY in batch:
            mask = batch[MASK_KEY].astype(jnp.float32)
        else:
            mask = jnp.ones((rows,), jnp.float32)
        sums = {}
        for name, values in per_example.items():
            if values.shape != (rows,):
                raise UsageError(
                    f"eval metric {name!r} has shape {values.shape}; metrics_fn must "
                    f"return one value per example, shape ({rows},)"
                )
            sums[name] = jnp.sum(values.astype(jnp.float32) * mask)
        sums["count"] = jnp.sum(mask)
        return lax.psum(sums, DATA_AXIS)

    return step


class _Step:
    """A compiled step that never lets more than two calls be in flight.

    On the CPU backend, steps with collectives dispatched without bound can leave
    the replicas' threads waiting on each other's rendezvous until XLA aborts the
    process. Waiting on the call before last keeps the device busy (one call runs
    while the next is queued) and bounds what is in flight.
    """

    def __init__(self, fn: Callable[..., Any], witness: Callable[[Any], Any], lower):
        self._fn = fn
        self._witness = witness
        self._lower = lower
        self._previous = None

    def __call__(self, state: TrainState, batch: Any) -> Any:
        out = self._fn(state, batch)
        previous, self._previous = self._previous, self._witness(out)
        if previous is not None:
            jax.block_until_ready(previous)
        return out

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """Lowers the compiled computation for these arguments (to read its HLO)."""
        return self._lower(state, batch)


def _compile(
    replica_fn: Callable[..., Any],
    mesh: Mesh,
    backend: Backend,
    *,
    outputs: int,
    donate_state: bool,
    stacked: bool = False,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Compiles ``replica_fn(state, batch)`` for a backend; returns (call, lower).

    ``replica_fn`` returns ``outputs`` values (a tuple when more than one), each
    replicated: identical on every replica after its reductions. ``stacked``:
    batch leaves are ``(steps, rows, ...)``, the rows split over ``data``.
    """
    batch_axis = 1 if stacked else 0
    state_in, batch_in = replicated(mesh), batch_sharded(mesh, stacked=stacked)

    def per_output(value):
        return value if outputs == 1 else (value,) * outputs

    donate = (0,) if donate_state else ()
    if backend == "jit":
        mapped = jax.shard_map(
            replica_fn,
            mesh=mesh,
            in_specs=(PartitionSpec(), batch_in.spec),
            out_specs=per_output(PartitionSpec()),
        )
        jitted = jax.jit(
            mapped,
            in_shardings=(state_in, batch_in),
            out_shardings=per_output(replicated(mesh)),
            donate_argnums=donate,
        )
        return jitted, jitted.lower

    replicas = data_size(mesh)
    pmapped = jax.pmap(
        replica_fn,
        axis_name=DATA_AXIS,
        in_axes=(None, 0),
        out_axes=per_output(None),
        devices=list(mesh.devices.flat),
        donate_argnums=donate,
    )

    def per_replica(x):
        """``(rows, ...)`` -> ``(replicas, rows / replicas, ...)``; stacked steps stay 2nd."""
        shape = (*x.shape[:batch_axis], replicas, x.shape[batch_axis] // replicas)
        return jnp.moveaxis(x.reshape(*shape, *x.shape[batch_axis + 1 :]), batch_axis, 0)

    split = jax.jit(
        lambda batch: jax.tree.map(per_replica, batch),
        out_shardings=NamedSharding(mesh, PartitionSpec(DATA_AXIS)),
    )

    def check(batch):
        for leaf in jax.tree.leaves(batch):
            if leaf.ndim <= batch_axis or leaf.shape[batch_axis] % replicas:
                raise UsageError(
                    f"batch leaf of shape {leaf.shape} does not split over {replicas} "
                    f"replicas; the global batch must be a multiple of {replicas}"
                )

    def call(state, batch):
        check(batch)
        return _on_mesh(pmapped(state, split(batch)), mesh)

    def lower(state, batch):
        check(batch)
        return pmapped.lower(state, split(batch))

    return call, lower


def _on_mesh(tree: Any, mesh: Mesh) -> Any:
    """pmap's unmapped outputs as global arrays replicated on ``mesh``.

    With several processes, ``out_axes=None`` gives arrays that span only this
    process's devices; the jit backend's state, and Orbax, need global ones.
    The per-device buffers are reused, not copied.
    """
    if jax.process_count() == 1:
        return tree
    sharding = replicated(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shard.data for shard in x.addressable_shards]
        ),
        tree,
    )


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
) -> Callable[[TrainState, Any], tuple[TrainState, Metrics]]:
    """Builds a data-parallel train step: ``state, metrics = step(state, batch)``.

    Each replica computes the gradient of ``loss_fn`` on its slice of the global
    batch; ``lax.pmean`` over ``data`` averages gradients, metrics and model
    state; every replica applies the same ``optimizer`` update. The input state is
    donated: use the returned one.

    Args:
        loss_fn: the loss, averaged over the examples it is given. Its form:

            * ``loss_fn(params, batch, rng) -> loss`` (default);
            * ``loss_fn(params, batch, rng) -> (loss, aux)`` with ``has_aux=True``,
              ``aux`` a dict of scalar metrics;
            * ``loss_fn(params, model_state, batch, rng) -> (loss, aux, model_state)``
              with ``has_model_state=True``, for models with mutable state such as
              BatchNorm statistics.

            ``rng`` differs per step and per replica (for dropout).
        optimizer: any ``optax.GradientTransformation``.
        mesh: a mesh with a ``data`` axis.
        backend: ``"jit"`` (``jit`` over ``shard_map``) or ``"pmap"`` (``jax.pmap``,
            one-axis meshes only). Both take and return the same state and batch.
        has_aux: see ``loss_fn``.
        has_model_state: see ``loss_fn``.
        precision: a `Precision` (see `make_precision`): compute dtype with fp32
            master parameters, all-reduce dtype, and fp16 dynamic loss scaling,
            whose skip-or-apply decision is made on the averaged gradient so every
            replica takes the same one. Create the state with the same precision.
        accumulate: split each replica's slice into this many micro-batches,
            scanned inside the compiled step; the gradients are averaged over them
            and all-reduced once per update.
        lr_schedule: the optimizer's schedule, to report ``lr`` in the metrics.
        steps_per_call: run this many optimizer steps per call, scanned inside
            the compiled program, to save the host's dispatch time per step for
            small models. The batch then stacks the steps' global batches,
            leaves ``(steps_per_call, rows, ...)`` (`shard_batch` with
            ``stacked=True``), and each metric comes back as ``(steps_per_call,)``,
            one value per step. The result equals as many single steps.

    Returns:
        ``step(state, batch) -> (state, metrics)``, where ``batch`` is a pytree of
        global arrays sharded on ``data`` (see `shard_batch`) and ``metrics`` holds
        ``loss`` and the ``aux`` entries averaged over the global batch,
        ``grad_norm`` (global norm of the averaged gradient, before clipping),
        ``lr`` (the schedule at the optimizer's update count) when ``lr_schedule``
        is given, and ``loss_scale`` and
        ``skipped_steps`` under loss scaling.

    Raises:
        UsageError: unknown backend, a mesh without ``data``, ``pmap`` on a mesh
            with more than one axis, or ``accumulate`` < 1.

    Examples:
        >>> def loss_fn(params, batch, rng):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> step = jdp.make_train_step(loss_fn, optax.sgd(0.1), mesh)
        >>> state, metrics = step(state, jdp.shard_batch(batch, mesh))
    """
    _check_backend(backend, mesh)
    if accumulate < 1 or steps_per_call < 1:
        raise UsageError(
            f"accumulate and steps_per_call must be at least 1, got {accumulate} and "
            f"{steps_per_call}"
        )
    replica_fn = _replica_train_step(
        loss_fn,
        optimizer,
        has_aux=has_aux,
        has_model_state=has_model_state,
        local_grads=backend == "jit",
        replicas=data_size(mesh),
        pack_leaf_bytes=pack_leaf_bytes(mesh),
        precision=precision or Precision(),
        accumulate=accumulate,
        lr_schedule=lr_schedule,
    )
    if steps_per_call > 1:
        one_step = replica_fn

        def replica_fn(state, batches):
            return lax.scan(one_step, state, batches)

    call, lower = _compile(
        replica_fn,
        mesh,
        backend,
        outputs=2,
        donate_state=True,
        stacked=steps_per_call > 1,
    )
    if steps_per_call > 1:
        compiled = call

        def call(state, batches):
            for leaf in jax.tree.leaves(batches):
                if not leaf.ndim or leaf.shape[0] != steps_per_call:
                    raise UsageError(
                        f"batch leaf of shape {leaf.shape}: a step of steps_per_call="
                        f"{steps_per_call} takes that many batches stacked on axis 0"
                    )
            return compiled(state, batches)

    return _Step(call, witness=lambda out: out[1], lower=lower)


def make_eval_step(
    metrics_fn: LossFn,
    mesh: Mesh,
    *,
    backend: Backend = "jit",
    has_model_state: bool = False,
) -> Callable[[TrainState, Any], Metrics]:
    """Builds an exact eval step: ``sums = eval_step(state, batch)``.

    ``metrics_fn`` returns one value per example; the step sums them over the
    examples whose ``batch["mask"]`` is 1 (padding rows have 0) on every replica,
    so a padded last batch counts each real example exactly once. Pass the sums
    of all batches to `evaluate`, or divide by ``sums["count"]`` yourself.

    Args:
        metrics_fn: ``metrics_fn(params, batch) -> {name: values}`` (or
            ``metrics_fn(params, model_state, batch)`` with ``has_model_state=True``),
            each ``values`` of shape ``(rows,)`` for this replica's rows.
        mesh: a mesh with a ``data`` axis.
        backend: ``"jit"`` or ``"pmap"``.
        has_model_state: see ``metrics_fn``.

    Returns:
        ``eval_step(state, batch) -> {name: sum, ..., "count": examples}`` summed
        over the global batch.

    Examples:
        >>> def metrics_fn(params, batch):
        ...     return {"accuracy": (predict(params, batch["x"]) == batch["y"])}
        >>> eval_step = jdp.make_eval_step(metrics_fn, mesh)
        >>> jdp.evaluate(eval_step, state, batches)["accuracy"]
    """
    _check_backend(backend, mesh)
    replica_fn = _replica_eval_step(metrics_fn, has_model_state=has_model_state)
    call, lower = _compile(replica_fn, mesh, backend, outputs=1, donate_state=False)
    return _Step(call, witness=lambda out: out, lower=lower)


def evaluate(
    eval_step: Callable[[TrainState, Any], Metrics], state: TrainState, batches: Iterable[Any]
) -> dict[str, float]:
    """Runs ``eval_step`` over ``batches`` and returns each metric's mean over real examples.

    The sums stay on the device until the end, so the loop never waits on the host.

    Returns:
        ``{name: mean, ..., "count": number of examples counted}``.
    """
    total = None
    for batch in batches:
        sums = eval_step(state, batch)
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    if total is None:
        raise UsageError("evaluate got no batches; the eval split is empty")
    total = jax.device_get(total)
    count = float(total.pop("count"))
    means = {name: float(value) / count for name, value in total.items()}
    means["count"] = int(count)
    return means
