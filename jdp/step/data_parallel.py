"""The data-parallel step: one program over the replicas (``shard_map`` under ``jit``,
or ``pmap``) for a replicated state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from jdp.mesh import (
    batch_sharded,
    batch_split,
    replicated,
)
from jdp.step.contract import (
    Backend,
    CompiledStep,
    as_step,
    bounded,
    check_rows,
    checks_replicas,
    eval_count,
    needs_bound,
    refusing_donated,
    train_loss,
)
from jdp.step.lean import Lean, Programs, lean_call, lean_lower, lean_program
from jdp.step.pmap import _pmapped
from jdp.step.sharded import _compile_sharded


def _compile(
    replica_fn: Callable[..., Any],
    mesh: Mesh,
    backend: Backend,
    *,
    outputs: int,
    donate_state: bool,
    steps: int = 1,
    sharded: Callable[..., Any] | None = None,
    lean: Lean | None = None,
) -> CompiledStep:
    """Compiles ``replica_fn(state, batch)`` for a backend, under `CompiledStep`'s contract.

    ``replica_fn`` returns ``outputs`` values (a tuple when more than one), each
    identical on every replica after its reductions. ``steps`` > 1: batch leaves
    are ``(steps, rows, ...)``, the rows split over ``data``. ``sharded``: the
    same step for a state that is not replicated (`_compile_sharded`'s
    ``make_fn``), which the ``jit`` backend runs for a state whose `Placement` says
    ``"sharded"``. ``lean``: a train step's, whose ``jit`` program of a replicated
    state takes only what it changes (`jdp.step.lean`; ``pmap`` takes the whole state).
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
            check_vma=checks_replicas(mesh),
        )

        jitted = jax.jit(
            _rows_checked(mapped, replicas, batch_axis, steps),
            in_shardings=(state_in, batch_in),
            out_shardings=per_output(replicated(mesh)),
            donate_argnums=donate,
        )
        layouts = None
        if sharded is not None:  # a state of this mesh may be split (ZeRO-1's optimizer state)
            layouts = _compile_sharded(
                sharded, mesh, outputs=outputs, donate_state=donate_state, steps=steps
            )
        program = as_step(
            jitted,
            replicas,
            batch_axis=batch_axis,
            steps=steps,
            outputs=outputs,
            sharded=layouts and layouts.unbounded,
        )
        lower = _lower_by_placement(jitted.lower, layouts)
        if lean is not None:
            program, lower = _lean(replica_fn, mesh, lean, program, lower, steps=steps)
    else:
        program, lower = _pmapped(
            replica_fn, mesh, batch_axis, steps, outputs, donate, (state_in, batch_in)
        )
    witness = train_loss if outputs > 1 else eval_count
    if needs_bound(mesh):
        call = bounded(program, witness)
    else:  # the lean call refuses a donated state itself
        refuses = backend == "jit" and lean is not None
        call = program if refuses else refusing_donated(program)
    return CompiledStep(call, program, lower, state_in, batch_in)


def _rows_checked(
    mapped: Callable[..., Any], replicas: int, batch_axis: int, steps: int
) -> Callable[..., Any]:
    def checked(*args):
        # While tracing, once per batch shape: a check on every call costs
        # the host more than the dispatch of a small model's step.
        check_rows(args[-1], replicas, batch_axis=batch_axis, steps=steps)
        return mapped(*args)

    return checked


def _lean(
    replica_fn: Callable[..., Any],
    mesh: Mesh,
    lean: Lean,
    whole: Callable[..., Any],
    whole_lower: Callable[..., Any],
    *,
    steps: int,
) -> tuple[Callable, Callable]:
    """The train step's (call, lower) on what it changes (`jdp.step.lean`), ``whole`` and
    ``whole_lower`` for a state that is not replicated."""
    batch_axis, replicas = int(steps > 1), batch_split(mesh)
    batch_in = batch_sharded(mesh, stacked=steps > 1)

    def jit(fn: Callable[..., Any]) -> Any:
        return jax.jit(
            fn,
            in_shardings=(replicated(mesh), replicated(mesh), batch_in),
            out_shardings=(replicated(mesh), replicated(mesh)),
            donate_argnums=(0,),
        )

    def make(rng_impl: str):
        mapped = jax.shard_map(
            lean_program(replica_fn, rng_impl=rng_impl, **lean._asdict()),
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), batch_in.spec),
            out_specs=(PartitionSpec(), PartitionSpec()),
            check_vma=checks_replicas(mesh),
        )
        # One call in the traced program, which `jdp.step.keyless` binds again as it is.
        return jit(_rows_checked(jax.jit(mapped), replicas, batch_axis, steps))

    programs = Programs(make, jit)
    call = lean_call(
        programs, whole, lean=lean, replicas=replicas, batch_axis=batch_axis, steps=steps
    )
    return call, lean_lower(programs, whole_lower, lean=lean)


def _lower_by_placement(
    lower: Callable[..., Any], layouts: CompiledStep | None
) -> Callable[..., Any]:
    """``lower`` for a replicated state, ``layouts``' for one whose `Placement` says
    ``"sharded"``."""
    if layouts is None:
        return lower
    return lambda state, batch: (layouts.lower if state.placement.kind == "sharded" else lower)(
        state, batch
    )
