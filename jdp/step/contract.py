"""The step's contract, once for every way of compiling it: `CompiledStep` (shardings,
donation, the bound on calls in flight), the backends, and the checks of a batch's rows
and a state's mesh."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding

from jdp.errors import UsageError
from jdp.mesh import data_size, on_cpus
from jdp.state import TrainState, carry_placement

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
    other output is replicated (but the groups' state). On several CPU devices at
    most two calls are in flight: there, steps with collectives dispatched without
    bound can leave the replicas' threads waiting on each other's rendezvous until
    XLA aborts the process; waiting on the call before last keeps the device busy
    (one call runs while the next is queued) and bounds what is in flight. On one
    device, or a GPU's or TPU's queue, a replicated state's train step is its
    program's call alone (`needs_bound`, `jdp.step.lean`).

    Attributes:
        call: ``call(state, batch)``, the compiled program (under that bound, where
            it applies).
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

    # ``step(state, batch)`` is ``step.call(state, batch)``: the call's attribute read in
    # C (Python's call of an instance binds a descriptor found as ``__call__``), with no
    # Python frame of its own on a small model's every step.
    __call__ = property(operator.attrgetter("call"))


def needs_bound(mesh: Mesh) -> bool:
    """Whether calls in flight must be bounded (`bounded`): several CPU devices, whose
    replicas' threads meet in the collectives (on one device, or on a GPU or TPU, whose
    queue runs the calls in order, the bound only costs the host)."""
    return mesh.devices.size > 1 and on_cpus(mesh)


def refuse_donated(state: Any) -> None:
    if not isinstance(state, TrainState):  # (params, batch) or (batch, state), say
        raise UsageError(
            f"a train step is called as step(state, batch), a jdp.TrainState first "
            f"(jdp.create_train_state), got {type(state).__name__}"
        )
    # Donated arrays passed again make XLA:CPU crash the process when several
    # devices run the step (one replica fails while the others wait in a
    # collective), and elsewhere fail in JAX's words. The step count is donated
    # with the rest and cheap to ask (an `isinstance` of `jax.Array` costs more).
    deleted = getattr(state.step, "is_deleted", None)
    if deleted is not None and deleted():
        raise UsageError(
            "this state was given to an earlier train step, which donated its "
            "arrays; pass on the state that step returned"
        )


def refusing_donated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that refuses, in one line, a state an earlier call donated."""

    def call(state, batch):
        refuse_donated(state)
        return fn(state, batch)

    return call


def bounded(fn: Callable[..., Any], witness: Callable[[Any], jax.Array]) -> Callable[..., Any]:
    """``fn`` that waits on the output of the call before last (see `CompiledStep`).

    ``witness(out)``: one array of a call's outputs that lies on every device the call
    ran on (its metrics' loss, its sums' count): every output of a device's part of a
    call is ready at once, so that array is ready when the whole call is. Waiting on
    one array, not every output, costs a small model's call a few percent less."""
    previous = None

    def call(state, batch):
        nonlocal previous
        refuse_donated(state)
        out = fn(state, batch)
        before, previous = previous, witness(out)
        if before is not None:
            before.block_until_ready()
        return out

    return call


def train_loss(out: Any) -> jax.Array:
    """A train step's witness for `bounded`: its call's metrics' loss."""
    return out[1]["loss"]


def eval_count(out: Any) -> jax.Array:
    """An evaluation step's witness for `bounded`: its call's sums' count."""
    return out["count"]


def check_rows(batch: Any, replicas: int, *, batch_axis: int, steps: int) -> None:
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


def as_step(
    program: Callable[..., Any],
    replicas: int,
    *,
    batch_axis: int,
    steps: int,
    outputs: int,
    sharded: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A step's call of its compiled ``program``, for every way of compiling.

    ``sharded``, when given, runs instead for a state whose `Placement` says
    ``"sharded"`` (ZeRO-1's on a mesh of ``data`` alone). The output state
    (``outputs`` 2: a train step) carries the input's placement: every way keeps
    the state where it is, so a training loop reads it from the arrays once. The
    call's refusals say why in one line: ``jit`` refuses, before tracing, a host
    batch it cannot split over the replicas (the rows are otherwise checked while
    tracing, once per shape).
    """
    reads = sharded is not None or outputs == 2

    def call(state, batch):
        where = state.placement if reads else None
        if sharded is not None and where.kind == "sharded":
            return sharded(state, batch)
        try:
            out = program(state, batch)
        except ValueError:
            check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)
            raise
        if outputs == 2:
            carry_placement(out[0], where)
        return out

    return call


def checks_replicas(mesh: Mesh) -> bool:
    """Whether ``shard_map`` checks that outputs said to be replicated are.

    With one replica the step all-reduces nothing (`jdp.replica.train_step_parts`),
    so its outputs are typed as varying over ``data``, and over one device they
    are replicated: the check is off there, for the whole program (with DiLoCo
    groups too, whose outputs said to be replicated are the step count and key).
    """
    return data_size(mesh) > 1


def check_mesh(shardings: list, mesh: Mesh) -> None:
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
