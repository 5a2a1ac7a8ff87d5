"""DiLoCo's steps compiled over a mesh with a ``group`` axis: the groups' inner step
and the synchronisation (`make_sync_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, PartitionSpec

from jdp.diloco.outer import Outer
from jdp.diloco.state import groups_sharding, has_groups
from jdp.errors import UsageError
from jdp.mesh import (
    GROUP_AXIS,
    batch_sharded,
    batch_split,
    check_mesh,
    data_size,
    replicated,
)
from jdp.state import TrainState
from jdp.step import group_maths
from jdp.step.contract import (
    CompiledStep,
    as_step,
    bounded,
    check_rows,
    checks_replicas,
)


def _groups_given(state: TrainState) -> None:
    if not has_groups(state):
        raise UsageError(
            "this step trains DiLoCo groups (its mesh has a 'group' axis), but the state has "
            "none; create it with jdp.create_train_state(..., outer=jdp.diloco(...)) on that mesh"
        )


def _step_count(state: TrainState) -> TrainState:
    """What the inner step reads of the state besides the groups: the step count, the
    key, the loss scale. The synchronised parameters and the outer optimizer's state
    stay out of its program (passed through, each a buffer to hand over per call)."""
    return state.replace(params=None, opt_state=None, model_state=None, groups=None)


def compile_groups(group_fn: Callable[..., Any], mesh: Mesh, *, steps: int) -> CompiledStep:
    """Compiles a DiLoCo inner step (`jdp.step.group_maths.inner_step`) under `CompiledStep`'s
    contract, but for the groups' state, split over ``group``, and the metrics.

    The program takes the step count and key (`_step_count`), the groups, and the
    batch (its rows split over ``group`` and ``data``): no collective crosses
    ``group``.
    The metrics it returns are this process's first group's: each group's own
    sit on its devices, and another process's cannot be read without one.
    """
    stacked = steps > 1
    batch_axis, slices = int(stacked), batch_split(mesh)
    state_in, batch_in = replicated(mesh), batch_sharded(mesh, stacked=stacked)
    groups_in = groups_sharding(mesh)
    mapped = jax.shard_map(
        group_fn,
        mesh=mesh,
        in_specs=(PartitionSpec(), groups_in.spec, batch_in.spec),
        out_specs=(PartitionSpec(), groups_in.spec, groups_in.spec),
        check_vma=checks_replicas(mesh),
    )

    def checked(state, groups, batch):
        check_rows(batch, slices, batch_axis=batch_axis, steps=steps)  # while tracing
        return mapped(state, groups, batch)

    jitted = jax.jit(
        checked,
        in_shardings=(state_in, groups_in, batch_in),
        out_shardings=(state_in, groups_in, groups_in),
        donate_argnums=(0, 1),
    )
    first = jax.jit(lambda tree: jax.tree.map(lambda x: x[0], tree))
    every_group = None  # the last call's metrics as the program wrote them

    def inner(state, batch):
        nonlocal every_group
        _groups_given(state)
        rest, trained, every_group = jitted(_step_count(state), state.groups, batch)
        updated = rest.replace(
            params=state.params,
            opt_state=state.opt_state,
            model_state=state.model_state,
            groups=trained,
        )
        return updated, first(jax.tree.map(lambda x: x.addressable_data(0), every_group))

    program = as_step(inner, slices, batch_axis=batch_axis, steps=steps, outputs=2)

    def lower(state, batch):
        _groups_given(state)
        return jitted.lower(_step_count(state), state.groups, batch)

    # The witness of a call: its loss on every device (the metrics it returns are one
    # group's, and the other groups' calls must be bounded too). Not the state: the
    # next call donates it.
    witness = lambda out: every_group["loss"]  # noqa: E731
    return CompiledStep(bounded(program, witness), program, lower, state_in, batch_in)


def synchronised_eval(compiled: CompiledStep) -> CompiledStep:
    """An eval step on a mesh with groups, for a state with groups: it evaluates the
    synchronised parameters; the groups' own stay where they are."""

    def synchronised(fn):
        return lambda state, batch: fn(state.replace(groups=None), batch)

    return compiled._replace(
        call=synchronised(compiled.call),
        unbounded=synchronised(compiled.unbounded),
        lower=synchronised(compiled.lower),
    )


class SyncStep(NamedTuple):
    """DiLoCo's synchronisation compiled over a mesh: ``state = sync(state)``.

    Attributes:
        call: ``call(state)``; donates the state's arrays and waits for the result
            (it runs once every ``every`` steps).
        lower: ``lower(state) -> jax.stages.Lowered``, to read the program.
        every: the steps between synchronisations (``outer.sync_every``).
    """

    call: Callable[[TrainState], TrainState]
    lower: Callable[[TrainState], jax.stages.Lowered]
    every: int

    def __call__(self, state: TrainState) -> TrainState:
        return self.call(state)


def make_sync_step(outer: Outer, mesh: Mesh) -> SyncStep:
    """Builds DiLoCo's synchronisation: ``state = sync(state)``, every ``outer.sync_every``
    steps of the train step a mesh with a ``group`` axis makes.

    The groups' parameters are averaged over ``group`` (one all-reduce of the
    parameters' bytes, the only communication between groups), the outer
    optimizer applies the parameters of the last synchronisation minus that
    average, and every group continues from the result (see `jdp.diloco`).

    Args:
        outer: the outer loop, from `jdp.diloco`.
        mesh: the mesh of the train step, with a ``group`` axis.

    Raises:
        UsageError: a mesh without a ``group`` axis; when called, a state without
            groups or already donated.

    Examples:
        >>> def loss_fn(params, batch, rng):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> mesh = jdp.make_mesh("group=2,data=4")
        >>> outer = jdp.diloco(sync_every=4, lr=1.0, momentum=0.0)  # local SGD
        >>> state = jdp.create_train_state({"w": jnp.zeros((4, 1))}, optax.sgd(0.1), mesh,
        ...                                outer=outer)
        >>> step = jdp.make_train_step(loss_fn, optax.sgd(0.1), mesh)
        >>> sync = jdp.make_sync_step(outer, mesh)
        >>> batch = {"x": np.ones((64, 4), np.float32), "y": np.ones((64, 1), np.float32)}
        >>> for i in range(1, 9):
        ...     state, metrics = step(state, jdp.shard_batch(batch, mesh))
        ...     if i % sync.every == 0:
        ...         state = sync(state)
        >>> w = state.groups.params["w"]  # (groups, 4, 1): each group's, equal after a sync
        >>> int(state.step), w.shape, bool(jnp.all(w == state.params["w"][None]))
        (8, (2, 4, 1), True)
    """
    if not isinstance(outer, Outer):
        raise UsageError(
            f"make_sync_step takes DiLoCo's outer loop, e.g. jdp.diloco(sync_every=50), got "
            f"{type(outer).__name__}"
        )
    check_mesh(mesh)
    if GROUP_AXIS not in mesh.shape:
        raise UsageError(
            f"mesh {dict(mesh.shape)} has no {GROUP_AXIS!r} axis to synchronise over; "
            "DiLoCo needs one, e.g. group=2,data=4"
        )
    data_size(mesh)
    state_in, groups_in = replicated(mesh), groups_sharding(mesh)
    mapped = jax.shard_map(
        group_maths.sync_step(outer),
        mesh=mesh,
        in_specs=(PartitionSpec(), groups_in.spec),
        out_specs=(PartitionSpec(), groups_in.spec),
    )
    jitted = jax.jit(
        mapped,
        in_shardings=(state_in, groups_in),
        out_shardings=(state_in, groups_in),
        donate_argnums=(0, 1),
    )

    def call(state: TrainState) -> TrainState:
        _groups_given(state)
        if state.step.is_deleted():
            raise UsageError(
                "this state was given to an earlier step, which donated its arrays; pass on "
                "the state that step returned"
            )
        rest, synced = jitted(state.replace(groups=None), state.groups)
        # Rare, and a collective: wait for it rather than add to the calls in flight.
        return jax.block_until_ready(rest.replace(groups=synced))

    def lower(state: TrainState) -> jax.stages.Lowered:
        _groups_given(state)
        return jitted.lower(state.replace(groups=None), state.groups)

    return SyncStep(call, lower, outer.sync_every)
