"""Steps for a state laid out over the mesh (``fsdp``, ``model``, ZeRO-1): one program
per layout of the state, the replicas mapped by XLA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import replica
from jdp.layout import SCANNED_LAYERS, gathering_layers
from jdp.mesh import (
    DATA_AXIS,
    FSDP_AXIS,
    batch_sharded,
    batch_split,
    data_size,
    replicated,
)
from jdp.replica import LossFn
from jdp.state import Placement
from jdp.step.contract import (
    CompiledStep,
    as_step,
    bounded,
    check_mesh,
    check_rows,
    eval_count,
    train_loss,
)


def _compile_sharded(
    make_fn: Callable[[Any], Callable[..., Any]],
    mesh: Mesh,
    *,
    outputs: int,
    donate_state: bool,
    steps: int = 1,
) -> CompiledStep:
    """Compiles a step for the layout of the state it is given (`jdp.layout`), under
    `CompiledStep`'s contract but for the state's place: it stays where it is.

    ``make_fn(param_shardings)`` returns ``fn(state, batch)``, which runs where
    XLA partitions the arrays (``fsdp``, ``model``, ZeRO-1's ``data``) and maps
    the replicas itself (`_over_replicas`). One program is compiled per `Placement`
    of the state, and found again by it; the metrics are replicated.
    """
    stacked = steps > 1
    batch_axis, slices = int(stacked), batch_split(mesh)
    batch_in = batch_sharded(mesh, stacked=stacked)
    donate = (0,) if donate_state else ()
    programs: dict[Placement, tuple[Callable[..., Any], Callable[..., Any]]] = {}

    def for_state(state):
        where = state.placement
        if where not in programs:
            shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
            check_mesh(jax.tree.leaves(shardings), mesh)
            fn = make_fn(shardings.params)

            def checked(state, batch):
                check_rows(batch, slices, batch_axis=batch_axis, steps=steps)  # while tracing
                return fn(state, batch)

            metrics_out = replicated(mesh)
            jitted = jax.jit(
                checked,
                in_shardings=(shardings, batch_in),
                out_shardings=(shardings, metrics_out) if outputs == 2 else metrics_out,
                donate_argnums=donate,
            )
            call = as_step(jitted, slices, batch_axis=batch_axis, steps=steps, outputs=outputs)
            programs[where] = call, jitted.lower
        return programs[where]

    def program(state, batch):
        return for_state(state)[0](state, batch)

    def lower(state, batch):
        return for_state(state)[1](state, batch)

    witness = train_loss if outputs > 1 else eval_count
    return CompiledStep(bounded(program, witness), program, lower, None, batch_in)


def _over_replicas(
    fn: Callable[..., Any], mesh: Mesh, *, out_axes: Any = None
) -> Callable[..., Any]:
    """``fn(state, batch)`` mapped over the ``data`` replicas for a state XLA partitions:
    a ``vmap`` that names the ``data`` axis, over the batch's rows in ``data`` blocks
    (the leading axis split over ``data``, each block's rows over ``fsdp``). Its
    collectives over ``data`` become XLA's, over the mesh axis. ``out_axes`` as
    ``vmap``'s: None for outputs that are the same on every replica, 0 for each
    replica's own (with a leading ``data`` axis).

    Not ``shard_map`` by hand over ``data`` with ``fsdp`` and ``model`` left to XLA:
    in JAX 0.10 XLA aborts the process partitioning that program on a mesh with
    both (``data=2,fsdp=2,model=2``), and cannot partition an all-reduce over a
    manual axis of size 1.
    """
    replicas = data_size(mesh)
    rows = FSDP_AXIS if mesh.shape.get(FSDP_AXIS, 1) > 1 else None
    blocks = NamedSharding(mesh, PartitionSpec(DATA_AXIS, rows))
    mapped = jax.vmap(fn, axis_name=DATA_AXIS, in_axes=(None, 0), out_axes=out_axes)

    def split(x):
        x = x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
        return lax.with_sharding_constraint(x, blocks)

    return lambda state, batch: mapped(state, jax.tree.map(split, batch))


def _gathered(param_shardings: Any) -> tuple[Any, Any]:
    """The parameters' shardings without ``fsdp``: where each is used. FSDP gathers a
    parameter where it is used and splits its gradient back (a reduce-scatter);
    without this, XLA may keep the parameter split and all-reduce the activations
    instead (for a 1M-parameter GPT on ``data=2,fsdp=4``, 8x the bytes).

    Returns ``(whole, layer)``: the shardings to gather the parameters at the start,
    and for one scanned layer (`jdp.layout.SCANNED_LAYERS`; else None) those gathered
    and split: its stacked parameters stay split and are gathered one layer at a
    time inside the scan (`jdp.layout.gather_layer`), so the gathered model never
    exists whole.
    """

    def without_fsdp(sharding, skip: int = 0):
        def keep(entry):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            kept = tuple(axis for axis in axes if axis != FSDP_AXIS)
            return None if not kept else kept[0] if len(kept) == 1 else kept

        spec = PartitionSpec(*(keep(entry) for entry in sharding.spec[skip:]))
        return NamedSharding(sharding.mesh, spec)

    whole = jax.tree.map(without_fsdp, param_shardings)
    stacked = param_shardings.get(SCANNED_LAYERS) if isinstance(param_shardings, dict) else None
    if stacked is None:
        return whole, None
    layer = (
        jax.tree.map(lambda sharding: without_fsdp(sharding, skip=1), stacked),
        jax.tree.map(lambda s: NamedSharding(s.mesh, PartitionSpec(*s.spec[1:])), stacked),
    )
    return {**whole, SCANNED_LAYERS: stacked}, layer


def _sharded_train(
    loss: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh, steps: int, **options: Any
):
    """``make_fn`` for `_compile_sharded`: the gradient half mapped over the replicas
    (`_over_replicas`: each replica's rows, one all-reduce over ``data``), with each
    parameter gathered over ``fsdp`` where it is used (after the cast to the compute
    dtype); the optimizer's half where XLA partitions the state, the gradients laid
    out as the parameters."""

    def make_fn(param_shardings):
        gathered, layer = _gathered(param_shardings)
        layer = layer or (None, None)
        parts = replica.train_step_parts(
            loss,
            optimizer,
            local_grads=False,
            replicas=None,
            pack_leaf_bytes=0,
            axes=(DATA_AXIS,),
            gather=lambda p: lax.with_sharding_constraint(p, gathered),
            reduce_grads=False,
            **options,
        )
        gradients = _over_replicas(parts.gradients, mesh, out_axes=(0, None, None))
        replicas = data_size(mesh)
        # Each replica's gradient laid out as its parameter, the replicas over ``data``:
        # the average over ``data`` then moves each device's share, not the whole.
        stacked = jax.tree.map(
            lambda s: NamedSharding(mesh, PartitionSpec(DATA_AXIS, *s.spec)), param_shardings
        )

        def average(grads):
            grads = lax.with_sharding_constraint(grads, stacked)
            mean = lambda g: jnp.sum(g, axis=0, dtype=g.dtype) / replicas  # noqa: E731
            return lax.with_sharding_constraint(jax.tree.map(mean, grads), param_shardings)

        def one_step(state, batch):
            # The optimizer's state stays out of the replicas' mapping: under ZeRO-1
            # it is split over ``data``, which the mapping would gather.
            with gathering_layers(*layer):
                grads, metrics, model_state = gradients(state.replace(opt_state=None), batch)
            grads = parts.finish(state, average(grads))
            grads = lax.with_sharding_constraint(grads, param_shardings)
            return parts.update(state, grads, model_state, metrics)

        if steps == 1:
            return one_step
        return lambda state, batches: lax.scan(one_step, state, batches)

    return make_fn


def _sharded_eval(replica_fn: Callable[..., Any], mesh: Mesh):
    """``make_fn`` for `_compile_sharded`: the eval step mapped over the replicas, the
    parameters gathered over ``fsdp``, the optimizer's state left out (ZeRO-1 splits it
    over ``data``)."""
    mapped = _over_replicas(replica_fn, mesh)

    def make_fn(param_shardings):
        gathered, layer = _gathered(param_shardings)
        layer = layer or (None, None)

        def fn(state, batch):
            params = lax.with_sharding_constraint(state.params, gathered)
            with gathering_layers(*layer):
                return mapped(state.replace(params=params, opt_state=None), batch)

        return fn

    return make_fn
