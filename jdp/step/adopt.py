"""`data_parallel_step`: a train step of your own, written for ``jax.pmap``, run
data-parallel on jdp's mesh with either backend.

A script written for ``pmap`` has a ``train_step(state, batch)`` that sees one
replica's rows, reduces its gradients and metrics with ``lax.pmean`` over an axis
name of its own, and returns the same values on every replica; its state is its
own type (Flax's ``TrainState`` with ``batch_stats``, an optimizer state, any
pytree). `data_parallel_step` compiles that function as it is: the mesh's ``data``
axis is bound under the script's name, the state is replicated, the global batch
split over the replicas, and nothing of the script's math changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.errors import UsageError
from jdp.mesh import DATA_AXIS, batch_sharded, data_size, replicated
from jdp.step.axes import bound_axes
from jdp.step.contract import Backend, _check_backend, check_rows
from jdp.step.pmap import _pmapped


def data_parallel_step(
    train_step: Callable[[Any, Any], Any],
    mesh: Mesh,
    *,
    axis_name: str = DATA_AXIS,
    backend: Backend = "jit",
    donate_state: bool = True,
) -> Callable[[Any, Any], Any]:
    """Runs a pmap-style ``train_step(state, batch)`` data-parallel over ``mesh``.

    ``jdp.data_parallel_step(train_step, mesh, axis_name="batch")`` stands where a
    script had ``jax.pmap(train_step, axis_name="batch")``: the same function, its
    collectives over the same name, now over the mesh's ``data`` replicas. The
    returned ``step(state, batch)`` takes the state whole (not replicated by hand:
    host values are placed on every device; `jdp.Checkpointer` saves and restores
    it) and the global batch (`jdp.shard_batch`, or host arrays in a single
    process), each replica getting its consecutive rows as pmap's reshape gave
    them; it returns ``train_step``'s outputs, each a global array replicated on
    the mesh. One device gives bitwise what ``pmap`` on one device gives; N give
    its values to float32 rounding.

    Args:
        train_step: ``train_step(state, batch) -> outputs``, as written for
            ``jax.pmap``; every output must be the same on every replica (reduce
            metrics over ``axis_name`` before returning them).
        mesh: a mesh of replicas alone (`jdp.make_mesh`: ``"data=8"``, ``"data=-1"``).
        axis_name: the name ``train_step``'s collectives and its model's layers
            (``nn.BatchNorm(axis_name=...)``) use for the replicas.
        backend: ``"jit"`` (``shard_map`` under ``jit``) or ``"pmap"``.
        donate_state: the input state's arrays are donated (keep the returned one).

    Raises:
        UsageError: the mesh splits more than the batch, ``train_step`` reduces over
            another axis name, or returns a value that differs between replicas.

    Examples:
        >>> def train_step(state, batch):
        ...     grad = jax.lax.pmean(jnp.mean(batch["x"], axis=0), axis_name="batch")
        ...     return state - 0.5 * grad, {"seen": jax.lax.psum(batch["x"].shape[0], "batch")}
        >>> step = jdp.data_parallel_step(train_step, jdp.make_mesh("data=8"), axis_name="batch")
        >>> state, metrics = step(jnp.zeros(3), {"x": np.ones((64, 3), np.float32)})
        >>> state.tolist(), int(metrics["seen"])
        ([-0.5, -0.5, -0.5], 64)
    """
    _check_backend(backend, mesh)
    replicas = data_size(mesh)
    _check_replicas_only(mesh, axis_name)
    named = bound_axes(train_step, {axis_name: replicas}, _pass_name)
    state_in, batch_in = replicated(mesh), batch_sharded(mesh)
    donate = (0,) if donate_state else ()
    if backend == "pmap":
        shardings = (state_in, batch_in)
        program, _ = _pmapped(
            named, mesh, 0, 1, 1, donate, shardings, axis_name=axis_name, train_state=False
        )
    else:
        program = _jitted(named, mesh, axis_name, donate, pmap_semantics=True)
    checked = _jitted(named, mesh, axis_name, (), pmap_semantics=False)
    return _called(_first_call_checked(program, checked, mesh), train_step, axis_name, replicas)


def _check_replicas_only(mesh: Mesh, axis_name: str) -> None:
    others = {axis: size for axis, size in mesh.shape.items() if axis != DATA_AXIS}
    if any(size > 1 for size in others.values()):
        raise UsageError(
            f"data_parallel_step replicates the state over 'data', and mesh "
            f"{dict(mesh.shape)} splits more; make it with data= alone, e.g. "
            f"jdp.make_mesh('data={mesh.size}')"
        )
    if axis_name in others:
        raise UsageError(
            f"axis_name {axis_name!r} is another axis of mesh {dict(mesh.shape)}; "
            f"name the replicas as the step does, e.g. axis_name='batch'"
        )


def _jitted(
    train_step: Callable, mesh: Mesh, axis_name: str, donate: tuple, *, pmap_semantics: bool
) -> Callable:
    """``shard_map`` under ``jit``, over ``mesh`` with its ``data`` axis named
    ``axis_name``: the same devices, so arrays placed on ``mesh`` need no copy.

    ``pmap_semantics``: the step's math is pmap's. ``shard_map`` checking which values
    vary over the replicas (its default) also differentiates as if the replicated
    state were used by every replica at once: a replicated parameter's gradient
    comes back already summed over them, and the script's own ``lax.pmean`` would then
    average a sum. Without the check each replica's gradient is its own, as under
    pmap. With it (``False`` here), tracing says whether every output is replicated."""
    names = tuple(axis_name if axis == DATA_AXIS else axis for axis in mesh.axis_names)
    renamed = Mesh(mesh.devices, names, axis_types=mesh.axis_types)
    mapped = jax.shard_map(
        train_step,
        mesh=renamed,
        in_specs=(PartitionSpec(), PartitionSpec(axis_name)),
        out_specs=PartitionSpec(),
        check_vma=not pmap_semantics,
    )
    return jax.jit(
        mapped,
        in_shardings=(replicated(renamed), NamedSharding(renamed, PartitionSpec(axis_name))),
        out_shardings=replicated(mesh),
        donate_argnums=donate,
    )


def _first_call_checked(program: Callable, checked: Callable, mesh: Mesh) -> Callable:
    """``program`` whose first call traces ``checked`` (`_jitted`'s with the check): with
    pmap's semantics an output that is not replicated would pass as one replica's value.
    A state given as host values (or on one device) is placed on the mesh first, every
    leaf replicated, so its donation never needs a copy."""
    first = True

    def call(state, batch):
        nonlocal first
        if first:
            jax.eval_shape(checked, state, batch)
            state = jax.tree.map(lambda x: _replicated(x, mesh), state)
            first = False
        return program(state, batch)

    return call


def _replicated(x: Any, mesh: Mesh) -> jax.Array:
    sharding = replicated(mesh)
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    # Every process holds the whole value: its local data is the global array.
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def _pass_name(axis: str) -> str:
    return f"pass axis_name={axis!r} to jdp.data_parallel_step"


def _called(program: Callable, train_step: Callable, axis_name: str, replicas: int) -> Callable:
    """The step's call: a state given before (its arrays donated) refused, at most two
    calls in flight (`jdp.step.CompiledStep`), and one line for an output that is not
    the replicas' one value."""
    name = getattr(train_step, "__name__", "the train step")
    previous = None

    def step(state, batch):
        nonlocal previous
        if any(_donated(x) for x in jax.tree.leaves(state)[:1]):
            raise UsageError(
                "this state was given to an earlier step, which donated its arrays; "
                "pass on the state that step returned"
            )
        try:
            out = program(state, batch)
        except ValueError as error:
            check_rows(batch, replicas, batch_axis=0, steps=1)
            if "replicat" not in str(error):
                raise
            raise UsageError(
                f"an output of {name} differs between replicas; reduce it over "
                f"{axis_name!r} (lax.pmean or lax.psum) before returning it"
            ) from None
        # Wait on the call before last: its outputs that were not donated since (the
        # metrics), or this call's where every one was (a step that returns its state).
        before, previous = previous, out
        if before is not None:
            alive = [x for x in jax.tree.leaves(before) if not _donated(x)]
            jax.block_until_ready(alive or out)
        return out

    return step


def _donated(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()
