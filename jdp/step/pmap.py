"""The ``pmap`` backend: the global batch split per device, in one ``jit`` call where one
process holds every device."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.errors import UsageError
from jdp.mesh import (
    DATA_AXIS,
    data_size,
    replicated,
)
from jdp.step.contract import as_step, check_rows


def _pmapped(
    replica_fn,
    mesh: Mesh,
    batch_axis: int,
    steps: int,
    outputs: int,
    donate,
    shardings: tuple[NamedSharding, NamedSharding],
    *,
    axis_name: str = DATA_AXIS,
    train_state: bool = True,
):
    """The pmap backend's (call, lower): the global batch split per device first.
    ``shardings``: the state's and the batch's, as `CompiledStep` holds them;
    every output is replicated, as the state. ``axis_name``: the replicas' name inside
    ``replica_fn``. ``train_state``: the state is jdp's `TrainState` (checked to be
    replicated, its compiled programs found by its placement); False for any pytree."""
    replicas = data_size(mesh)

    def per_output(value):
        return value if outputs == 1 else (value,) * outputs

    def pmap(donate_argnums):
        return jax.pmap(
            replica_fn,
            axis_name=axis_name,
            in_axes=(None, 0),
            out_axes=per_output(None),
            devices=list(mesh.devices.flat),
            donate_argnums=donate_argnums,
        )

    def per_replica(x):
        """``(rows, ...)`` -> ``(replicas, rows / replicas, ...)``; stacked steps stay 2nd."""
        shape = (*x.shape[:batch_axis], replicas, x.shape[batch_axis] // replicas)
        return jnp.moveaxis(x.reshape(*shape, *x.shape[batch_axis + 1 :]), batch_axis, 0)

    def per_device(batch):
        check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)  # while tracing
        return jax.tree.map(per_replica, batch)

    def stepped(program):
        return as_step(program, replicas, batch_axis=batch_axis, steps=steps, outputs=outputs)

    if jax.process_count() == 1:
        # JAX's pmap is jit over shard_map, so inside jit it is the same program, and
        # the global batch's split into its per-device layout (a reshape of each
        # device's rows) costs no dispatch of its own: one call a step, as the jit
        # backend. The outer jit donates. With several processes pmap traced inside
        # jit maps this process's devices only, so there the split is its own call.
        inner = pmap(())
        fused = jax.jit(
            lambda state, batch: inner(state, per_device(batch)),
            in_shardings=shardings,
            out_shardings=per_output(shardings[0]),
            donate_argnums=donate,
        )
        return stepped(_checked_state(fused) if train_state else fused), fused.lower
    pmapped = pmap(donate)
    split = jax.jit(per_device, out_shardings=NamedSharding(mesh, PartitionSpec(DATA_AXIS)))
    call = _across_processes(pmapped, split, mesh, train_state=train_state)
    return stepped(call), lambda state, batch: pmapped.lower(state, split(batch))


def _across_processes(pmapped, split, mesh: Mesh, *, train_state: bool):
    """The pmap backend's call where each process holds some of the devices: the
    global batch split per device in a call of its own (``split``), then ``pmapped``.

    Called, jax.pmap re-derives its arguments' layout in Python each time (about
    70 us a call more than its program compiled ahead of time, on a 2-core CPU: a
    tenth of a small model's step). A `TrainState`'s programs are compiled once per
    placement and batch shape, found again by them, and called as they are."""
    programs: dict[tuple, jax.stages.Compiled] = {}

    def call(state, batch):
        if not train_state:
            return _on_mesh(pmapped(state, split(batch)), mesh)
        _check_pmap_state(state)
        per_device_batch = split(batch)
        leaves, structure = jax.tree.flatten(per_device_batch)
        key = (state.placement, structure, tuple((x.shape, x.dtype) for x in leaves))
        if key not in programs:
            programs[key] = pmapped.lower(state, per_device_batch).compile()
        return _on_mesh(programs[key](state, per_device_batch), mesh)

    return call


def _check_pmap_state(state: Any) -> None:
    if state.placement.kind != "replicated":
        raise UsageError(
            "backend 'pmap' takes a state replicated on every device, and this one is "
            "sharded (--shard-optimizer, say); use backend 'jit'"
        )


def _checked_state(program):
    """``program`` that refuses a state not replicated (pmap's layout) first."""

    def call(state, batch):
        _check_pmap_state(state)
        return program(state, batch)

    return call


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
