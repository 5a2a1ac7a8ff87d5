"""What `jdp.param_specs` refuses in one line, before any layout: a parameter that is
not an array, names shaped otherwise than the parameters, a mesh's sizes that name
no axis, and axis rules that would change nothing."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import jax

from jdp.errors import UsageError
from jdp.mesh import FSDP_AXIS, KNOWN_AXES, MODEL_AXIS


def check_leaves(params: Any) -> None:
    """A parameter that is not an array (a name, a config value) has no layout."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise UsageError(
                f"parameter {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an "
                f"array; give a number as an array (jnp.asarray), and keep other values out "
                f"of params"
            )


def names_by_leaf(treedef: Any, names: Any) -> list:
    """``names`` (a tree like the parameters') in the order of ``treedef``'s leaves."""
    try:
        return treedef.flatten_up_to(names)
    except (ValueError, TypeError) as error:
        raise UsageError(
            f"names must have the parameters' structure, a tuple of names or None at each "
            f"parameter (jdp.layout.logical_names reads them from a Linen model): "
            f"{str(error).splitlines()[0]}"
        ) from None


def checked_sizes(sizes: Mapping[str, Any]) -> dict[str, int]:
    """A mesh given as its axes' sizes, each an axis jdp knows with 1 device or more."""
    checked = {}
    for name, size in sizes.items():
        try:
            checked[name] = operator.index(size)  # a NumPy integer too
        except TypeError:
            checked[name] = 0
        if name not in KNOWN_AXES or checked[name] < 1:
            raise UsageError(
                f"mesh axis {name}={size!r}: axes are {', '.join(KNOWN_AXES)}, each of a whole "
                f"number of devices (1 or more)"
            )
    return checked


def check_rules_apply(rules: dict[str, str | None], named: list, axes: dict[str, int]) -> None:
    """A rule for a name no parameter has, or to an axis the mesh lacks, would change
    nothing in silence (a misspelt name, a forgotten axis): refused in one line."""
    have = {name for leaf_names in named if leaf_names for name in leaf_names if name}
    unknown = [name for name in rules if name not in have | {FSDP_AXIS, MODEL_AXIS}]
    if unknown:
        raise UsageError(
            f"axis rules for {', '.join(unknown)}: no parameter has that axis name (the "
            f"model's: {', '.join(sorted(have)) or 'none'}); check the spelling"
        )
    for name, axis in rules.items():
        if axis is not None and axis not in axes:
            raise UsageError(
                f"axis rule {name}={axis}: the mesh has no {axis} axis ({', '.join(axes)}); "
                f"add {axis}=N to the mesh, or drop the rule"
            )
