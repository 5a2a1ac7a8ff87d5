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
)
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
) -> CompiledStep:
    """Compiles ``replica_fn(state, batch)`` for a backend, under `CompiledStep`'s contract.

    ``replica_fn`` returns ``outputs`` values (a tuple when more than one), each
    identical on every replica after its reductions. ``steps`` > 1: batch leaves
    are ``(steps, rows, ...)``, the rows split over ``data``. ``sharded``: the
    same step for a state that is not replicated (`_compile_sharded`'s
    ``make_fn``), which the ``jit`` backend runs for a state whose `Placement` says
    ``"sharded"``.
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

        def checked(state, batch):
            # While tracing, once per batch shape: a check on every call costs
            # the host more than the dispatch of a small model's step.
            check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)
            return mapped(state, batch)

        jitted = jax.jit(
            checked,
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
            jitted, replicas, batch_axis=batch_axis, steps=steps, outputs=outputs,
            sharded=layouts and layouts.unbounded,
        )  # fmt: skip
        lower = _lower_by_placement(jitted.lower, layouts)
    else:
        program, lower = _pmapped(
            replica_fn, mesh, batch_axis, steps, outputs, donate, (state_in, batch_in)
        )
    witness = (lambda out: out[1]) if outputs > 1 else (lambda out: out)
    return CompiledStep(bounded(program, witness), program, lower, state_in, batch_in)


def _lower_by_placement(lower: Callable[..., Any], layouts: CompiledStep | None
                        ) -> Callable[..., Any]:  # fmt: skip
    """``lower`` for a replicated state, ``layouts``' for one whose `Placement` says
    ``"sharded"``."""
    if layouts is None:
        return lower
    return lambda state, batch: (layouts.lower if state.placement.kind == "sharded" else lower)(
        state, batch
    )
