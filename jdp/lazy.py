"""Package faces whose names are imported when first used.

``import jdp`` would otherwise import every backend it can reach (Orbax, Grain,
TFDS, Flax's models, the trackers) before its first line runs, and so would each
``python -m jdp.*`` tool, ``--help`` included. A face built with `attach` keeps
every public name where it is (``jdp.fit``, ``from jdp.data import from_arrays``)
and imports its module on the first access, once; a type checker, and the layer
test, read the same table.

Examples:
    >>> import sys
    >>> from jdp import lazy
    >>> getattr_, dir_, all_ = lazy.attach("jdp", {"jdp.errors": ("UsageError",)})
    >>> getattr_("UsageError").__name__, all_
    ('UsageError', ['UsageError'])
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def attach(
    package: str,
    table: Mapping[str, Sequence[str]],
    *,
    submodules: Sequence[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for ``package``'s face.

    Args:
        package: the package's ``__name__``.
        table: each module (its full name) and the names the face takes from it.
        submodules: the package's submodules that are public names themselves
            (``jdp.data``), imported on first access.

    Returns:
        The face's ``__getattr__`` and ``__dir__``, and its public names, sorted.
    """
    owner = {name: module for module, names in table.items() for name in names}
    public = sorted([*owner, *submodules])
    face = importlib.import_module(package)
    namespace = face.__dict__
    # A public name that its own subpackage defines (``jdp.diloco``, the function, from the
    # package jdp/diloco/): importing the subpackage sets the face's attribute to the
    # module, which would hide the function; the face keeps the function.
    shadowed = {name for name, module in owner.items() if module == f"{package}.{name}"}

    class Face(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if not (name in shadowed and isinstance(value, types.ModuleType)):
                super().__setattr__(name, value)

    if shadowed:
        face.__class__ = Face

    def getattr_(name: str) -> Any:
        if name in owner:
            value = getattr(importlib.import_module(owner[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later reads find it without calling here
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *public})

    return getattr_, dir_, public
