"""A step's program without the key its outputs do not depend on.

Every train step is given the state's key; a model that does not draw (no dropout)
folds the step count and the replica's index into it and uses nothing of the result.
Its compiled program drops the key (`jax.jit` removes unused arguments), but each
call still passes it: one argument of the host's dispatch (on the 2-core CPU what it
costs is within the measurement's noise, about 2% of the 38k MLP's call:
docs/performance.md). `without_key` traces the program once, as its first call would,
and where JAX's dead-code elimination drops the key, gives the same traced program
as a function of the other arguments: the same operations, so the same bits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from jdp.errors import UsageError


def without_key(program: Any, changed: Any, keyed: Any, batch: Any) -> Callable[..., Any] | None:
    """``keyless(changed, read, batch)``: the jitted ``program(changed, keyed, batch)``'s
    outputs, ``keyed`` the key and then ``read``, computed without the key; None where
    the outputs depend on it. Every trace of ``keyless`` is ``program``'s at the same
    arguments, in the same context (a matmul precision, after `jax.clear_caches`): the
    first is the trace here, `jax.jit`'s own, which a first call of ``program`` reuses."""
    traced = program.trace(changed, keyed, batch)
    key, first = keyed[0], len(jax.tree.leaves(changed))
    found = _dropped(traced, first, len(jax.tree.leaves(key)))
    if found is None:
        return None
    key_spec = jax.tree.map(lambda leaf: _spec(leaf, _placed(leaf)), key)
    # Where the first call's arrays were placed: a trace of specs placed so is the
    # cached one (a trace elsewhere is a trace more, never another program).
    placed = [_placed(leaf) for leaf in jax.tree.leaves((changed, keyed[1:], batch))]

    def keyless(changed, read, batch):
        leaves, structure = jax.tree.flatten((changed, read, batch))
        where = placed if len(placed) == len(leaves) else [None] * len(leaves)
        specs = jax.tree.unflatten(structure, map(_spec, leaves, where))
        traced = program.trace(specs[0], (key_spec, *specs[1]), specs[2])
        found = _dropped(traced, first, len(jax.tree.leaves(key_spec)))
        if found is None:
            raise UsageError(
                "the step's outputs depend on the key at these shapes but not at its "
                "first call's; make the step again (jdp.make_train_step) for these shapes"
            )
        outputs = jaxpr_as_fun(found)(*leaves)
        return jax.tree.unflatten(jax.tree.structure(traced.out_info), outputs)

    return keyless


def _dropped(traced: Any, first: int, keys: int) -> ClosedJaxpr | None:
    """``traced``'s program without its arguments ``first`` to ``first + keys`` (the key's
    leaves), dead code removed; None where an output depends on them (or JAX's
    elimination is not where it was)."""
    # JAX's dead-code elimination, which `jax.jit` runs to drop a compiled program's
    # unused arguments: there is no public handle. Where a JAX has moved it, the step
    # keeps the key (its module is loaded whenever JAX is).
    partial_eval = sys.modules.get("jax._src.interpreters.partial_eval")
    dce_jaxpr = getattr(partial_eval, "dce_jaxpr", None)
    if dce_jaxpr is None:
        return None
    closed = traced.jaxpr
    kept = [True] * len(closed.jaxpr.invars)
    kept[first : first + keys] = [False] * keys
    outputs = [True] * len(closed.jaxpr.outvars)
    jaxpr, used = dce_jaxpr(closed.jaxpr, outputs, instantiate=kept)
    if any(used[first : first + keys]):
        return None
    return ClosedJaxpr(jaxpr, closed.consts)


def _spec(leaf: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(leaf)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)


def _placed(leaf: Any) -> Any:
    """A committed array's sharding, else None (a NumPy array's: `jax.jit` places it)."""
    return leaf.sharding if getattr(leaf, "committed", False) else None
