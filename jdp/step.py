"""Train and eval steps compiled over a mesh, with the ``jit`` or the ``pmap`` backend.

`jdp.replica` says what one replica computes; this module states, once, how it
is compiled: shardings, donation, the backends and the bound on calls in flight
(`CompiledStep`). Both backends run the same per-replica function and take and
return the same state and batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import groups, replica
from jdp.errors import UsageError
from jdp.groups import Outer
from jdp.mesh import (
    DATA_AXIS,
    FSDP_AXIS,
    GROUP_AXIS,
    batch_axes,
    batch_sharded,
    batch_split,
    data_size,
    is_sharded,
    manual_axes,
    replicated,
)
from jdp.precision import Precision
from jdp.reduce import pack_leaf_bytes
from jdp.replica import LossFn, Metrics
from jdp.state import TrainState

Backend = Literal["jit", "pmap"]
BACKENDS = ("jit", "pmap")


def _check_backend(backend: str, mesh: Mesh) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    data_size(mesh)
    if backend == "pmap" and len(mesh.shape) > 1:
        raise UsageError(
            f"backend 'pmap' maps over one axis, but mesh {dict(mesh.shape)} has "
            f"{len(mesh.shape)}; use backend 'jit' or a mesh with only a 'data' axis"
        )


class CompiledStep(NamedTuple):
    """A step compiled over a mesh; call it as ``step(state, batch)``.

    The contract, for both backends: the state is replicated on every device of
    the mesh (``state_sharding``; with DiLoCo groups all but ``state.groups``,
    which is split over ``group``), or, with the ``jit`` backend, laid out as
    `jdp.layout` says (``fsdp``, ``model``, ZeRO-1: the step compiles for the
    layout of the state it is given, on its own mesh, and the state stays in it;
    ``state_sharding`` is None for a step made on a mesh with ``fsdp`` or
    ``model``); the batch's rows are split over ``data`` (and ``group``, and
    ``fsdp``) (``batch_sharding``; with several steps per call the steps stack
    on axis 0 and the rows are axis 1), a train step donates its input state
    (passed again, to any step, it is refused with a `UsageError`), and every
    other output is replicated (but the groups' state). At most two calls are in
    flight: on the CPU backend, steps with collectives dispatched without bound
    can leave the replicas' threads waiting on each other's rendezvous until XLA
    aborts the process; waiting on the call before last keeps the device busy
    (one call runs while the next is queued) and bounds what is in flight.

    Attributes:
        call: ``call(state, batch)``, the compiled program under that bound.
        unbounded: the compiled program alone, to measure dispatch; many calls of
            it without waiting can deadlock on CPU.
        lower: ``lower(state, batch) -> jax.stages.Lowered``, to read the program.
        state_sharding: where the state lives.
        batch_sharding: where the batch lives (`jdp.shard_batch` puts it there).
    """

    call: Callable[..., Any]
    unbounded: Callable[..., Any]
    lower: Callable[..., jax.stages.Lowered]
    state_sharding: NamedSharding | None
    batch_sharding: NamedSharding

    def __call__(self, state: TrainState, batch: Any) -> Any:
        return self.call(state, batch)


def _bounded(fn: Callable[..., Any], witness: Callable[[Any], Any]) -> Callable[..., Any]:
    """``fn`` that waits on the output of the call before last (see `CompiledStep`)."""
    previous = None

    def call(state, batch):
        nonlocal previous
        # Donated arrays passed again make XLA:CPU crash the process when several
        # devices run the step (one replica fails while the others wait in a
        # collective). The step count is donated with the rest and cheap to ask.
        if isinstance(state.step, jax.Array) and state.step.is_deleted():
            raise UsageError(
                "this state was given to an earlier train step, which donated its "
                "arrays; pass on the state that step returned"
            )
        out = fn(state, batch)
        before, previous = previous, witness(out)
        if before is not None:
            jax.block_until_ready(before)
        return out

    return call


def _check_rows(batch: Any, replicas: int, *, batch_axis: int, steps: int) -> None:
    """UsageError unless every leaf stacks ``steps`` batches (when more than one) and
    its rows split evenly over the replicas."""
    for leaf in jax.tree.leaves(batch):
        if steps > 1 and (not leaf.ndim or leaf.shape[0] != steps):
            raise UsageError(
                f"batch leaf of shape {leaf.shape}: a step of steps_per_call={steps} takes "
                "that many batches stacked on axis 0"
            )
        if leaf.ndim <= batch_axis or leaf.shape[batch_axis] % replicas:
            raise UsageError(
                f"batch leaf of shape {leaf.shape} does not split over {replicas} "
                f"replicas; the global batch must be a multiple of {replicas}"
            )


def _compile(
    replica_fn: Callable[..., Any],
    mesh: Mesh,
    backend: Backend,
    *,
    outputs: int,
    donate_state: bool,
    steps: int = 1,
    sharded: Callable[..., Any] | None = None,
) -> CompiledStep:
    """Compiles ``replica_fn(state, batch)`` for a backend, under `CompiledStep`'s contract.

    ``replica_fn`` returns ``outputs`` values (a tuple when more than one), each
    identical on every replica after its reductions. ``steps`` > 1: batch leaves
    are ``(steps, rows, ...)``, the rows split over ``data``. ``sharded``: the
    same step for a state that is not replicated (`_compile_sharded`'s
    ``make_fn``), which the ``jit`` backend switches to when it is given one.
    """
    stacked = steps > 1
    batch_axis, replicas = int(stacked), batch_split(mesh)
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
            check_vma=_checks_replicas(mesh),
        )

        def checked(state, batch):
            # While tracing, once per batch shape: a check on every call costs
            # the host more than the dispatch of a small model's step.
            _check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)
            return mapped(state, batch)

        jitted = jax.jit(
            checked,
            in_shardings=(state_in, batch_in),
            out_shardings=per_output(replicated(mesh)),
            donate_argnums=donate,
        )
        layouts = None
        if sharded is not None:
            layouts = _compile_sharded(
                sharded, mesh, outputs=outputs, donate_state=donate_state, steps=steps
            )
        switched = [False]  # given a sharded state (ZeRO-1's optimizer state, say)

        def lower(state, batch):
            if layouts is not None and not _replicated(state):
                return layouts.lower(state, batch)
            return jitted.lower(state, batch)

        def program(state, batch):
            if switched[0]:
                return layouts.unbounded(state, batch)
            try:
                return jitted(state, batch)
            except ValueError:  # jit places a host batch before tracing: say why it can't
                if layouts is not None and not _replicated(state):
                    switched[0] = True
                    return layouts.unbounded(state, batch)
                _check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)
                raise
    else:
        program, lower = _pmapped(
            replica_fn, mesh, batch_axis, steps, per_output, donate, (state_in, batch_in)
        )
    witness = (lambda out: out[1]) if outputs > 1 else (lambda out: out)
    return CompiledStep(_bounded(program, witness), program, lower, state_in, batch_in)


def _checks_replicas(mesh: Mesh) -> bool:
    """Whether ``shard_map`` checks that outputs said to be replicated are.

    With one replica the step all-reduces nothing (`jdp.replica.train_step_parts`),
    so its outputs are typed as varying over ``data``, and over one device they
    are replicated: the check is off there, for the whole program (with DiLoCo
    groups too, whose outputs said to be replicated are the step count and key).
    """
    return data_size(mesh) > 1


def _replicated(tree: Any) -> bool:
    """Whether every array of ``tree`` is whole on every device."""
    return all(
        getattr(leaf, "sharding", None) is None or leaf.sharding.is_fully_replicated
        for leaf in jax.tree.leaves(tree)
    )


def _layout(tree: Any) -> tuple:
    """``tree``'s structure and each leaf's sharding: what a sharded program is compiled for."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(getattr(leaf, "sharding", None) for leaf in leaves)


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
    the replicas itself (`_over_replicas`). One program is compiled per layout of
    the state; the metrics are replicated.
    """
    stacked = steps > 1
    batch_axis, slices = int(stacked), batch_split(mesh)
    batch_in = batch_sharded(mesh, stacked=stacked)
    donate = (0,) if donate_state else ()
    programs: dict[tuple, Any] = {}
    current: list[Any] = [None]

    def for_state(state):
        key = _layout(state)
        if key not in programs:
            shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
            _check_mesh(jax.tree.leaves(shardings), mesh)
            fn = make_fn(shardings.params)

            def checked(state, batch):
                _check_rows(batch, slices, batch_axis=batch_axis, steps=steps)  # while tracing
                return fn(state, batch)

            metrics_out = replicated(mesh)
            programs[key] = jax.jit(
                checked,
                in_shardings=(shardings, batch_in),
                out_shardings=(shardings, metrics_out) if outputs == 2 else metrics_out,
                donate_argnums=donate,
            )
        return programs[key]

    def program(state, batch):
        if current[0] is not None:
            try:
                return current[0](state, batch)
            except ValueError:  # a state of another layout, or a host batch jit can't place
                pass
        current[0] = for_state(state)
        try:
            return current[0](state, batch)
        except ValueError:
            _check_rows(batch, slices, batch_axis=batch_axis, steps=steps)
            raise

    def lower(state, batch):
        return for_state(state).lower(state, batch)

    witness = (lambda out: out[1]) if outputs > 1 else (lambda out: out)
    return CompiledStep(_bounded(program, witness), program, lower, None, batch_in)


def _check_mesh(shardings: list, mesh: Mesh) -> None:
    """UsageError unless every array lives on ``mesh``: a step compiles for the layout
    of the state it is given, which must be on its own mesh."""
    for sharding in shardings:
        other = getattr(sharding, "mesh", None)
        if other is not None and other != mesh:
            raise UsageError(
                f"this state lives on mesh {dict(other.shape)} and the step was made for "
                f"mesh {dict(mesh.shape)}; create the state on the step's mesh, or restore "
                "it onto that mesh (jdp.Checkpointer.restore with a state made there)"
            )


def _over_replicas(fn: Callable[..., Any], mesh: Mesh, *, out_axes: Any = None
                   ) -> Callable[..., Any]:  # fmt: skip
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


def _gathered(param_shardings: Any) -> Any:
    """The parameters' shardings without ``fsdp``: where each is used. FSDP gathers a
    parameter where it is used and splits its gradient back (a reduce-scatter);
    without this, XLA may keep the parameter split and all-reduce the activations
    instead (for a 1M-parameter GPT on ``data=2,fsdp=4``, 8x the bytes)."""

    def without_fsdp(sharding):
        def keep(entry):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            kept = tuple(axis for axis in axes if axis != FSDP_AXIS)
            return None if not kept else kept[0] if len(kept) == 1 else kept

        spec = PartitionSpec(*(keep(entry) for entry in sharding.spec))
        return NamedSharding(sharding.mesh, spec)

    return jax.tree.map(without_fsdp, param_shardings)


def _sharded_train(loss: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh,
                   steps: int, **options: Any):  # fmt: skip
    """``make_fn`` for `_compile_sharded`: the gradient half mapped over the replicas
    (`_over_replicas`: each replica's rows, one all-reduce over ``data``), with each
    parameter gathered over ``fsdp`` where it is used (after the cast to the compute
    dtype); the optimizer's half where XLA partitions the state, the gradients laid
    out as the parameters."""

    def make_fn(param_shardings):
        gathered = _gathered(param_shardings)
        parts = replica.train_step_parts(
            loss, optimizer, local_grads=False, replicas=None, pack_leaf_bytes=0,
            axes=(DATA_AXIS,), gather=lambda p: lax.with_sharding_constraint(p, gathered),
            reduce_grads=False, **options,
        )  # fmt: skip
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
        gathered = _gathered(param_shardings)

        def fn(state, batch):
            params = lax.with_sharding_constraint(state.params, gathered)
            return mapped(state.replace(params=params, opt_state=None), batch)

        return fn

    return make_fn


def _groups_given(state: TrainState) -> None:
    if state.groups is None:
        raise UsageError(
            "this step trains DiLoCo groups (its mesh has a 'group' axis), but the state has "
            "none; create it with jdp.create_train_state(..., outer=jdp.diloco(...)) on that mesh"
        )


def _step_count(state: TrainState) -> TrainState:
    """What the inner step reads of the state besides the groups: the step count, the
    key, the loss scale. The synchronised parameters and the outer optimizer's state
    stay out of its program (passed through, each a buffer to hand over per call)."""
    return state.replace(params=None, opt_state=None, model_state=None, groups=None)


def _compile_groups(group_fn: Callable[..., Any], mesh: Mesh, *, steps: int) -> CompiledStep:
    """Compiles a DiLoCo inner step (`jdp.groups.inner_step`) under `CompiledStep`'s
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
    groups_in = NamedSharding(mesh, PartitionSpec(GROUP_AXIS))
    mapped = jax.shard_map(
        group_fn,
        mesh=mesh,
        in_specs=(PartitionSpec(), groups_in.spec, batch_in.spec),
        out_specs=(PartitionSpec(), groups_in.spec, groups_in.spec),
        check_vma=_checks_replicas(mesh),
    )

    def checked(state, groups, batch):
        _check_rows(batch, slices, batch_axis=batch_axis, steps=steps)  # while tracing
        return mapped(state, groups, batch)

    jitted = jax.jit(
        checked,
        in_shardings=(state_in, groups_in, batch_in),
        out_shardings=(state_in, groups_in, groups_in),
        donate_argnums=(0, 1),
    )
    first = jax.jit(lambda tree: jax.tree.map(lambda x: x[0], tree))
    every_group = [None]  # the last call's metrics as the program wrote them

    def program(state, batch):
        _groups_given(state)
        try:
            rest, trained, metrics = jitted(_step_count(state), state.groups, batch)
        except ValueError:  # jit places a host batch before tracing: say why it can't
            _check_rows(batch, slices, batch_axis=batch_axis, steps=steps)
            raise
        updated = rest.replace(
            params=state.params, opt_state=state.opt_state, model_state=state.model_state,
            groups=trained,
        )  # fmt: skip
        every_group[0] = metrics
        return updated, first(jax.tree.map(lambda x: x.addressable_data(0), metrics))

    def lower(state, batch):
        _groups_given(state)
        return jitted.lower(_step_count(state), state.groups, batch)

    # The witness of a call: its metrics on every device (the ones it returns are one
    # group's, and the other groups' calls must be bounded too). Not the state: the
    # next call donates it.
    witness = lambda out: every_group[0]  # noqa: E731
    return CompiledStep(_bounded(program, witness), program, lower, state_in, batch_in)


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
    average, and every group continues from the result (see `jdp.groups`).

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
    if GROUP_AXIS not in mesh.shape:
        raise UsageError(
            f"mesh {dict(mesh.shape)} has no {GROUP_AXIS!r} axis to synchronise over; "
            "DiLoCo needs one, e.g. group=2,data=4"
        )
    data_size(mesh)
    state_in, groups_in = replicated(mesh), NamedSharding(mesh, PartitionSpec(GROUP_AXIS))
    mapped = jax.shard_map(
        groups.sync_step(outer),
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


def _pmapped(replica_fn, mesh: Mesh, batch_axis: int, steps: int, per_output, donate,
             shardings: tuple[NamedSharding, NamedSharding]):  # fmt: skip
    """The pmap backend's (call, lower): the global batch split per device first.
    ``shardings``: the state's and the batch's, as `CompiledStep` holds them."""
    replicas = data_size(mesh)

    def pmap(donate_argnums):
        return jax.pmap(
            replica_fn,
            axis_name=DATA_AXIS,
            in_axes=(None, 0),
            out_axes=per_output(None),
            devices=list(mesh.devices.flat),
            donate_argnums=donate_argnums,
        )

    def per_replica(x):
        """``(rows, ...)`` -> ``(replicas, rows / replicas, ...)``; stacked steps stay 2nd."""
        shape = (*x.shape[:batch_axis], replicas, x.shape[batch_axis] // replicas)
        return jnp.moveaxis(x.reshape(*shape, *x.shape[batch_axis + 1 :]), batch_axis, 0)

    def check_rows(batch):
        _check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)

    def per_device(batch):
        check_rows(batch)  # while tracing: once per shape
        return jax.tree.map(per_replica, batch)

    if jax.process_count() == 1:  # the outer jit donates
        return _pmapped_fused(pmap(()), per_device, shardings, donate, check_rows=check_rows)
    pmapped = pmap(donate)
    split = jax.jit(per_device, out_shardings=NamedSharding(mesh, PartitionSpec(DATA_AXIS)))

    # Called, jax.pmap re-derives its arguments' layout in Python each time (about
    # 70 us a call more than its program compiled ahead of time, on a 2-core CPU:
    # a tenth of a small model's step). Its programs are compiled once per argument
    # layout and called as they are; another layout fails a program's argument
    # check (TypeError) before anything runs or is donated.
    programs: list[jax.stages.Compiled] = []

    def call(state, batch):
        per_device_batch = split(batch)
        for program in programs:
            try:
                out = program(state, per_device_batch)
            except TypeError:  # compiled for another layout
                continue
            return _on_mesh(out, mesh)
        _check_pmap_state(state)
        programs.append(pmapped.lower(state, per_device_batch).compile())
        return _on_mesh(programs[-1](state, per_device_batch), mesh)

    def lower(state, batch):
        return pmapped.lower(state, split(batch))

    return call, lower


def _check_pmap_state(state: Any) -> None:
    if not _replicated(state):
        raise UsageError(
            "backend 'pmap' takes a state replicated on every device, and this one is "
            "sharded (--shard-optimizer, say); use backend 'jit'"
        )


def _pmapped_fused(pmapped, per_device, shardings, donate, *, check_rows):
    """pmap's (call, lower) in one process: the split and pmap's program in one ``jit``.

    JAX's ``pmap`` is ``jit`` over ``shard_map``, so inside ``jit`` it is the same
    program, and the global batch's split into its per-device layout (a reshape
    of each device's rows) costs no dispatch of its own: one call a step, as the
    ``jit`` backend. With several processes ``pmap`` traced inside ``jit`` maps
    this process's devices only, so there the split is its own call.
    """
    fused = jax.jit(
        lambda state, batch: pmapped(state, per_device(batch)),
        in_shardings=shardings,
        donate_argnums=donate,
    )

    def call(state, batch):
        try:
            return fused(state, batch)
        except ValueError:  # a state not on pmap's layout, or a host batch jit can't place
            _check_pmap_state(state)
            check_rows(batch)
            raise

    return call, fused.lower


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
    skip_nonfinite: bool = False,
    grad_norm: bool = False,
) -> CompiledStep:
    """Builds a data-parallel train step: ``state, metrics = step(state, batch)``.

    Each replica computes the gradient of ``loss_fn`` on its slice of the global
    batch; ``lax.pmean`` over ``data`` averages gradients, metrics and model
    state (with one replica there is nothing to average, and the step
    all-reduces nothing); every replica applies the same ``optimizer`` update.
    The input state is donated: use the returned one.

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
        mesh: a mesh with a ``data`` axis. With ``fsdp`` or ``model`` axes the
            parameters and optimizer state are split as the state's layout says
            (`create_train_state`'s ``param_specs``; ``jit`` only): each replica's
            rows are one block of the batch, split again over ``fsdp``, and the
            step computes what the ``data`` mesh of as many replicas computes.
            With a ``group`` axis first (DiLoCo,
            ``group=2,data=4``), each group takes its block of the batch's rows
            and trains its own parameters (``state.groups``, from
            ``create_train_state(..., outer=...)``) with ``optimizer``,
            all-reducing over ``data`` only; `make_sync_step` brings the groups
            together. The metrics are then this process's first group's.
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
        skip_nonfinite: when the loss or the averaged gradient is not finite,
            keep the parameters, optimizer and model state as they were (every
            replica decides alike) and count the step in ``skipped_steps``, as
            fp16 loss scaling does for overflows.
        grad_norm: also report ``grad_norm``, the global norm of the averaged
            gradient before clipping. It costs one more pass over the gradients,
            which a step bound by memory traffic pays in full (on the CPU, 4-7% of a
            10.8M-parameter MLP's step on one and on two devices).

    Returns:
        A `CompiledStep`: ``step(state, batch) -> (state, metrics)``, where
        ``batch`` is a pytree of global arrays sharded on ``data`` (see
        `shard_batch`) and ``metrics`` holds ``loss`` and the ``aux`` entries
        averaged over the global batch, ``grad_norm`` when asked for, ``lr``
        (the schedule at the optimizer's update count) when ``lr_schedule`` is
        given, else the learning rate an optimizer made with
        ``optax.inject_hyperparams`` holds, ``loss_scale`` under loss scaling,
        and ``skipped_steps`` under loss scaling or ``skip_nonfinite``.

    Raises:
        UsageError: unknown backend, a mesh without ``data``, ``pmap`` on a mesh
            with more than one axis, or ``accumulate`` < 1; when called, a batch
            whose rows do not split over the replicas, or a state that an earlier
            call donated.

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
    if accumulate < 1 or steps_per_call < 1:
        raise UsageError(
            f"accumulate and steps_per_call must be at least 1, got {accumulate} and "
            f"{steps_per_call}"
        )
    has_groups = GROUP_AXIS in mesh.shape
    if has_groups and is_sharded(mesh):
        raise UsageError(
            f"mesh {dict(mesh.shape)}: DiLoCo groups train replicated parameters; drop the "
            "'fsdp' and 'model' axes, or the 'group' axis"
        )
    options = dict(
        precision=precision or Precision(),
        accumulate=accumulate,
        lr_schedule=lr_schedule,
        skip_nonfinite=skip_nonfinite,
        grad_norm=grad_norm,
    )
    loss = replica.loss_with_state(loss_fn, has_aux=has_aux, has_model_state=has_model_state)
    # For a state that is not replicated: the gradients' half maps ``data`` by hand,
    # the optimizer's runs where XLA partitions the state.
    sharded = _sharded_train(loss, optimizer, mesh, steps_per_call, **options)
    if is_sharded(mesh):
        return _compile_sharded(sharded, mesh, outputs=2, donate_state=True, steps=steps_per_call)
    one_step = replica.train_step(
        loss,
        optimizer,
        local_grads=backend == "jit",
        replicas=data_size(mesh),
        pack_leaf_bytes=pack_leaf_bytes(mesh),
        axes=batch_axes(mesh),
        **options,
    )
    if has_groups:
        return _compile_groups(groups.inner_step(one_step, steps=steps_per_call), mesh,
                               steps=steps_per_call)  # fmt: skip
    if steps_per_call > 1:
        replica_fn = lambda state, batches: lax.scan(one_step, state, batches)  # noqa: E731
    else:
        replica_fn = one_step
    return _compile(
        replica_fn, mesh, backend, outputs=2, donate_state=True, steps=steps_per_call,
        sharded=sharded if backend == "jit" else None,
    )  # fmt: skip


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
    of all batches to `evaluate`, or divide by ``sums["count"]`` yourself.

    Args:
        metrics_fn: ``metrics_fn(params, batch) -> {name: values}`` (or
            ``metrics_fn(params, model_state, batch)`` with ``has_model_state=True``),
            each ``values`` of shape ``(rows,)`` for this replica's rows.
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
    metrics = replica.metrics_with_state(metrics_fn, has_model_state=has_model_state)
    # DiLoCo's groups train replicated parameters: no layout to follow there.
    sharded = None
    if GROUP_AXIS not in mesh.shape:
        sharded = _sharded_eval(replica.eval_step(metrics, manual_axes(mesh)), mesh)
    if is_sharded(mesh):
        return _compile_sharded(sharded, mesh, outputs=1, donate_state=False)
    compiled = _compile(
        replica.eval_step(metrics, batch_axes(mesh)), mesh, backend, outputs=1,
        donate_state=False, sharded=sharded if backend == "jit" else None,
    )  # fmt: skip
    if GROUP_AXIS not in mesh.shape:
        return compiled
    # The synchronised parameters are evaluated; the groups' own stay where they are.
    synchronised = lambda fn: lambda state, batch: fn(state.replace(groups=None), batch)  # noqa: E731
    return compiled._replace(
        call=synchronised(compiled.call),
        unbounded=synchronised(compiled.unbounded),
        lower=synchronised(compiled.lower),
    )


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
    means = {name: float(value) / count for name, value in total.items()}
    means["count"] = int(count)
    return means
