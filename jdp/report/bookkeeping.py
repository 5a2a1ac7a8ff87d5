"""The run directory's bookkeeping files (``run.json``, ``goodput.json``,
``trackers.json``): jdp writes them and reads them back on a resume. One that is
damaged (cut short, edited, of another shape) is set aside, renamed
``PATH.damaged-TIME`` beside it with a warning naming both, and the run goes on
without what it held: a bookkeeping file is never a reason not to train.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def read_or_set_aside(path: str, check: Callable[[Any], T]) -> T | None:
    """``check`` of the JSON in ``path`` (it raises on a shape it does not take, or
    returns what the reader keeps); None when the file is missing, or damaged (then set
    aside with a warning).

    Examples:
        >>> path = os.path.join(tmp, "trackers.json")
        >>> with open(path, "w") as file:
        ...     _ = file.write('{"mlflow": ')  # cut short
        >>> read_or_set_aside(path, dict) is None, os.path.exists(path)
        (True, False)
    """
    try:
        with open(path) as file:
            text = file.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or type(error).__name__
        _set_aside(f"{path} cannot be read ({why})", path)
        return None
    try:
        return check(json.loads(text))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        why = "not JSON" if isinstance(error, json.JSONDecodeError) else "not in jdp's form"
        _set_aside(f"{path} is damaged ({why}: {type(error).__name__} {error})", path)
        return None


def mapping_of(kind: type) -> Callable[[Any], dict[str, Any]]:
    """A ``check`` for a JSON object whose values are all ``kind``."""

    def check(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict) or not all(isinstance(v, kind) for v in value.values()):
            raise TypeError(f"not an object of {kind.__name__} values")
        return value

    return check


def _set_aside(said: str, path: str) -> None:
    aside = f"{path}.damaged-{int(time.time())}"
    try:
        os.replace(path, aside)
        where = f"set aside as {aside}"
    except OSError as error:
        where = f"left where it is ({error.strerror})"
    print(
        f"jdp: warning: {said}; {where}, and the run goes on without it",
        file=sys.stderr,
        flush=True,
    )
