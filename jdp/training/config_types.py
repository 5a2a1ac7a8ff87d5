"""`TrainConfig`'s fields by their types: a value of another type (``steps="10"``,
``batch_size=1.5``, ``mesh=8``) is one line naming the field and what it takes."""

from __future__ import annotations

import functools
import numbers
import os
import typing
from collections.abc import Callable
from typing import Literal

from jdp.errors import UsageError

# What a field of each type takes (``str | None``: a path, as ``os.PathLike`` too); a
# ``Literal``'s words are checked with its choices.
_KINDS = {
    int: ("a whole number", lambda v: isinstance(v, numbers.Integral)),
    float: ("a number", lambda v: isinstance(v, numbers.Real)),
    str: ("text", lambda v: isinstance(v, str)),
    bool: ("True or False", lambda v: isinstance(v, bool)),
}


@functools.cache
def _kinds(cls) -> dict[str, tuple[str, Callable[[object], bool]]]:
    """Each field of ``cls`` whose type is not a ``Literal`` alone: what it takes."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = set(typing.get_args(hint)) if typing.get_origin(hint) is not Literal else set()
        base = next((kind for kind in _KINDS if hint is kind or kind in args), None)
        if base is None:
            continue
        words = {w for a in args if typing.get_origin(a) is Literal for w in typing.get_args(a)}
        what, takes = _KINDS[base]
        optional = type(None) in args

        def accepts(v, takes=takes, optional=optional, words=frozenset(words), path=base is str):
            if isinstance(v, bool) and takes is not _KINDS[bool][1]:
                return False
            return (optional and (v is None or (path and isinstance(v, os.PathLike)))) or (
                v in words if isinstance(v, str) and words else takes(v)
            )

        kinds[name] = (what + "".join(f" or {w}" for w in sorted(words)), accepts)
    return kinds


def check_types(config) -> None:
    """Raises `UsageError` for the first field whose value is not of its type (a `TrainConfig`
    made in code: the command line's flags are read by their types)."""
    for name, (what, accepts) in _kinds(type(config)).items():
        value = getattr(config, name)
        if not accepts(value):
            kind = type(value).__name__
            raise UsageError(
                f"--{name.replace('_', '-')} {value!r} is {'an' if kind[0] in 'aeiou' else 'a'} "
                f"{kind}; give {what}"
            )
