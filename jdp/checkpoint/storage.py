"""Beneath the checkpointer, without Orbax itself (`jdp.checkpoint.handlers`): the on-disk
form of a state, the record's digests, quiet failure logs, and the messages of a damaged
checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jdp.checkpoint.digest import finish_digests, leaf_name, start_digests, tree_digests
from jdp.errors import os_failure


def _abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings of ``tree``: where restored arrays must land."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _on_disk(state: Any) -> Any:
    """A state as it is saved: its array fields by name, and ``groups`` only when it has
    DiLoCo groups; so a checkpoint of a run without groups is what jdp wrote before
    ``TrainState`` had the field, and those restore as they always did."""
    if not dataclasses.is_dataclass(state):
        return state
    fields = {
        field.name: getattr(state, field.name)
        for field in dataclasses.fields(state)
        if field.metadata.get("pytree_node", True)
    }
    if fields.get("groups", ...) is None:
        del fields["groups"]
    return fields


def _leaf_names(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``"params/Dense_0/kernel" -> (shape, dtype)`` for every array leaf."""
    return {
        leaf_name(path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _meta_digest(meta: Mapping[str, Any]) -> str:
    """A digest of the meta record's own content (all but this digest)."""
    body = {key: value for key, value in meta.items() if key != "meta_digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()


def _quiet_orbax_failures() -> None:
    """Silences, for good, the noise of Orbax reads and writes that failed.

    When tensorstore fails a read, Orbax closes its event loop while tensorstore's
    other reads of the same checkpoint are still finishing; each then reports
    "Event loop is closed" as an unraisable error, a traceback apiece (and
    leaves coroutines unawaited). A failed background write is logged with its
    traceback by Orbax's threads, and its abandoned writes at exit. The failure
    itself comes back from `Checkpointer.restore`, `save` or `wait`, which
    report it in one line.
    """
    previous = sys.unraisablehook
    if getattr(previous, "jdp_filter", False):
        return

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if isinstance(error, ImportError) and "shutting down" in str(error):
            return  # a failed save's writes, abandoned at exit
        if isinstance(error, RuntimeWarning) and "was never awaited" in str(error):
            return  # the unawaited reads above, where warnings are errors
        previous(unraisable)

    hook.jdp_filter = True
    sys.unraisablehook = hook
    # A damaged array's metadata read leaves Orbax's other reads unawaited.
    warnings.filterwarnings(
        "ignore", message="coroutine '.*' was never awaited", category=RuntimeWarning
    )
    logging.getLogger("absl").addFilter(_not_a_save_thread_error)
    logging.getLogger("absl").addFilter(_metadata_file_said_once)


def _not_a_save_thread_error(record: logging.LogRecord) -> bool:
    """Drops Orbax's logs of a failed background write (tracebacks from its threads): the
    same error comes back from the save or the wait, and `Checkpointer` reports it in
    one line."""
    from_orbax = f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in record.pathname
    with_traceback = record.exc_info is not None or "raised an exception" in str(record.msg)
    return not (from_orbax and record.levelno >= logging.ERROR and with_traceback)


# Orbax's lines on a step's own record of itself (``_CHECKPOINT_METADATA``: its times)
# that is missing or damaged; it logs one each time it reads the step's metadata.
_METADATA_FILE = {
    "Metadata file does not exist": "missing",
    "Failed to read Metadata file": "unreadable",
    "Failed to json parse Metadata file": "not JSON",
}
_METADATA_FILES_SAID: set[str] = set()


def _metadata_file_said_once(record: logging.LogRecord) -> bool:
    """Turns Orbax's lines on a step's missing or damaged ``_CHECKPOINT_METADATA`` (two
    ``ERROR:absl`` lines with the file's bytes, each time it is read) into one jdp warning:
    a restore does not use that file, it checks jdp's own record and the arrays' digests."""
    message = str(record.msg)
    what = next((what for start, what in _METADATA_FILE.items() if message.startswith(start)), None)
    path = os.fspath(record.args[0]) if what and record.args else ""
    if os.path.basename(path) != "_CHECKPOINT_METADATA":  # another file Orbax reads: its lines
        return True
    if what == "unreadable" and len(record.args) > 1:
        what = f"unreadable ({record.args[1]})"  # the system's reason
    if path not in _METADATA_FILES_SAID:
        _METADATA_FILES_SAID.add(path)
        warn(
            f"Orbax's record of the checkpoint in {os.path.dirname(path)} "
            f"({os.path.basename(path)}, its times) is {what}; a restore checks jdp's own "
            "record and the arrays' digests instead"
        )
    return False


def _not_an_abandoned_write(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in str(record.msg)


def _os_reason(error: Exception) -> str:
    """The operating system's reason in a (long, nested) Orbax or tensorstore error."""
    return os_failure(error) or _first_line(error)


class _PendingRecord:
    """A checkpoint's record whose array digests are still being computed on the devices.

    `start` dispatches them once Orbax has its copies of the arrays (hashing
    first would hold up the copies on a CPU); `finish` waits for them, in the
    save's background commit.
    """

    def __init__(self, meta: dict):
        self.meta = meta
        self._started = threading.Event()
        self._digests: tuple[list[str], jax.Array] | None = None

    def start(self, tree: Any) -> None:
        try:
            self._digests = start_digests(tree)
        finally:
            self._started.set()

    def finish(self) -> dict:
        # Set right after Orbax's save returns; a wait this long would be a bug, so fail
        # the save rather than hang the run.
        if not self._started.wait(timeout=300) or self._digests is None:
            raise RuntimeError("the checkpoint's digests could not be computed")
        digests = finish_digests(*self._digests)
        for name, array in self.meta["arrays"].items():
            array["digest"] = digests[name]
        self.meta["meta_digest"] = _meta_digest(self.meta)
        return self.meta


class _Damaged(Exception):
    """A checkpoint whose files are incomplete, unreadable or not what was saved."""


def _describe_mismatch(saved: Mapping, expected: Mapping, limit: int = 4) -> str:
    problems = [
        f"{name} is {saved[name][0]} {saved[name][1]}, expected {expected[name][0]} "
        f"{expected[name][1]}"
        for name in sorted(saved.keys() & expected.keys())
        if saved[name] != expected[name]
    ]
    problems += [f"missing {name}" for name in sorted(expected.keys() - saved.keys())]
    problems += [f"unexpected {name}" for name in sorted(saved.keys() - expected.keys())]
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def warn(text: str) -> None:
    if jax.process_index() == 0:
        print(f"jdp: warning: {text}", file=sys.stderr, flush=True)


def _first_line(error: Exception) -> str:
    """The error's first line; a long one (tensorstore's chain of causes) keeps its start
    and its end, where the last cause is, around an ellipsis.

    Examples:
        >>> line = _first_line(ValueError("opening: " + "x" * 300 + " bad header\\nmore"))
        >>> len(line), line[:9], " ... " in line, line.endswith("x bad header")
        (235, 'opening: ', True, True)
    """
    text = str(error).strip()
    if not text:
        return repr(error)
    line = text.splitlines()[0]
    return line if len(line) <= 240 else f"{line[:150]} ... {line[-80:]}"


def _digest_mismatch(restored: Any, arrays: Mapping[str, Mapping] | None) -> str | None:
    """Which restored leaf's bytes differ from the digest saved with it, if any."""
    if not arrays:
        return None  # written before checkpoints carried digests: nothing to compare
    digests = tree_digests(restored)
    for name in sorted(digests):  # every restored leaf has a recorded digest to match
        if arrays.get(name, {}).get("digest") != digests[name]:
            return f"{name} does not match its digest"
    return None
