"""A step's program without the key its outputs do not depend on.

Every train step is given the state's key; a model that does not draw (no dropout)
folds the step count and the replica's index into it and uses nothing of the result.
Its compiled program drops the key (`jax.jit` removes unused arguments), but each
call still passes it, about a microsecond of the host's time, a few percent of a
small model's call. `without_key` traces the program once, as its first call would,
and where JAX's dead-code elimination drops the key, gives the same traced program
as a function of the other arguments: the same operations, so the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from jdp.errors import UsageError


def without_key(program: Any, changed: Any, keyed: Any, batch: Any) -> Callable[..., Any] | None:
    """``keyless(changed, read, batch)``: the jitted ``program(changed, keyed, batch)``'s
    outputs, ``keyed`` the key and then ``read``, computed without the key; None where
    the outputs depend on it. Its first trace is ``program``'s trace here (`jax.jit`'s
    own, which a first call of ``program`` reuses); a call at other shapes traces
    ``program`` at those."""
    traced = program.trace(changed, keyed, batch)
    key, first = keyed[0], len(jax.tree.leaves(changed))
    found = _dropped(traced, first, len(jax.tree.leaves(key)))
    if found is None:
        return None
    jaxprs = {_signature((changed, keyed[1:], batch)): (found, jax.tree.structure(traced.out_info))}
    key_spec = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), key)

    def keyless(changed, read, batch):
        signature = _signature((changed, read, batch))
        if signature not in jaxprs:  # other shapes: their own trace, the key dropped again
            specs = jax.tree.map(_spec, (changed, read, batch))
            traced = program.trace(specs[0], (key_spec, *specs[1]), specs[2])
            found = _dropped(traced, first, len(jax.tree.leaves(key_spec)))
            if found is None:
                raise UsageError(
                    "the step's outputs depend on the key at these shapes but not at its "
                    "first call's; make the step again (jdp.make_train_step) for these shapes"
                )
            jaxprs[signature] = found, jax.tree.structure(traced.out_info)
        jaxpr, outputs = jaxprs[signature]
        return jax.tree.unflatten(
            outputs, jaxpr_as_fun(jaxpr)(*jax.tree.leaves((changed, read, batch)))
        )

    return keyless


def _dropped(traced: Any, first: int, keys: int) -> ClosedJaxpr | None:
    """``traced``'s program without its arguments ``first`` to ``first + keys`` (the key's
    leaves), dead code removed; None where an output depends on them."""
    # JAX's dead-code elimination, which `jax.jit` runs to drop a compiled program's
    # unused arguments: there is no public handle.
    from jax._src.interpreters import partial_eval

    closed = traced.jaxpr
    kept = [True] * len(closed.jaxpr.invars)
    kept[first : first + keys] = [False] * keys
    outputs = [True] * len(closed.jaxpr.outvars)
    jaxpr, used = partial_eval.dce_jaxpr(closed.jaxpr, outputs, instantiate=kept)
    if any(used[first : first + keys]):
        return None
    return ClosedJaxpr(jaxpr, closed.consts)


def _signature(args: Any) -> tuple:
    """What a trace of ``args`` depends on: their structure, shapes and types."""
    leaves, structure = jax.tree.flatten(args)
    typed = (jax.typeof(leaf) for leaf in leaves)
    return structure, tuple((aval.shape, aval.dtype, aval.weak_type) for aval in typed)


def _spec(leaf: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(leaf)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
