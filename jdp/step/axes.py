"""The axis names a step's collectives use, checked against those its compilation binds.

A model written for another program names its own replica axis (Flax's examples
use ``axis_name="batch"`` in BatchNorm and ``lax.pmean``). Traced where that name
is not bound, JAX fails deep inside the model: a bare ``AssertionError`` under
``shard_map``, ``NameError: unbound axis name`` under ``pmap``. `bound_axes` turns
either into one line that names the axis and the fix.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jdp.errors import UsageError

_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


def unbound_axis(fn: Callable[..., Any], args: tuple, axes: Mapping[str, int]) -> str | None:
    """The first axis name ``fn(*args)`` reduces over that ``axes`` does not bind, or None
    (it binds them all, or ``fn`` fails for another reason). ``fn`` is traced again on
    the arguments' shapes alone, with ``axes`` as the only named axes."""

    def trace() -> str | None:
        try:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), args)
            jax.make_jaxpr(fn, axis_env=list(axes.items()))(*abstract)
        except NameError as error:
            found = _UNBOUND.search(str(error))
            return found.group(1) if found else None
        except Exception:  # another failure: the caller's own error stands
            return None
        return None

    # In a thread of its own: JAX's tracing context is the thread's, and inside a
    # step's trace (a ``shard_map``'s) an unbound name fails the same bare way.
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(trace).result()


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def bound_axes(
    fn: Callable[..., Any], axes: Mapping[str, int], fix: Callable[[str], str]
) -> Callable[..., Any]:
    """``fn`` that, where tracing it fails because it reduces over an axis ``axes`` does not
    bind, raises a `UsageError` of one line instead: ``fix(name)`` says what to do."""

    @functools.wraps(fn)
    def traced(*args):
        try:
            return fn(*args)
        except (AssertionError, NameError) as error:
            named = _UNBOUND.search(str(error))  # pmap's NameError names it; shard_map's not
            name = named.group(1) if named else unbound_axis(fn, args, axes)
            if name is None or name in axes:
                raise
            bound = ", ".join(repr(axis) for axis in axes)
            raise UsageError(
                f"the step reduces over axis {name!r}, which is not bound here (the "
                f"replicas are {bound}); {fix(name)}"
            ) from None

    return traced
