"""A checkpoint's parameters without its run: `load_params`, `read_params`,
`read_checkpoint`, the record, and which step directory a path names.

A reader never moves a run's files (the run may be live): a damaged checkpoint is
passed over with a warning, where the run itself sets it aside (`Checkpointer`)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from jax.sharding import Mesh

from jdp.checkpoint.record import Record
from jdp.checkpoint.storage import (
    _Damaged,
    _describe_mismatch,
    _digest_mismatch,
    _first_line,
    _leaf_names,
    _meta_digest,
    _quiet_orbax_failures,
    warn,
)
from jdp.errors import UsageError
from jdp.mesh import replicated
from jdp.report.console import quiet_absl


def _scores(path: str, steps, only: dict | None = None) -> dict[int, tuple[float, float]]:
    """``{step: (score, value)}`` of the checkpoints among ``steps`` that recorded the
    evaluation their run keeps its best by (``only``: that metric and mode alone); the
    score is higher for the better."""
    scored = {}
    for number in steps:
        record = read_record(os.path.join(path, str(number)))
        chosen = record.run.best
        if only is not None and chosen != only:
            continue
        value = record.metrics.get(chosen["metric"])
        if isinstance(value, float):
            scored[number] = (value if chosen["mode"] == "max" else -value, value)
    return scored


def best_recorded(path: str, metric: str, mode: str) -> float | None:
    """The best value of ``metric`` (``mode`` max or min) among the checkpoints in ``path``
    kept by it (a resumed run's best so far), or None."""
    chosen = {"metric": metric, "mode": mode}
    scored = _scores(path, whole_steps(path), only=chosen)
    return max(scored.values())[1] if scored else None


def whole_steps(path: str) -> list[int]:
    """The steps of the checkpoints in ``path``, oldest first: directories named by a
    step that hold an array item. A link named like a step is no checkpoint of this
    directory (it may be another run's), and a step directory emptied is passed over."""
    if not os.path.isdir(path):
        return []
    return sorted(
        int(name)
        for name in os.listdir(path)
        if name.isdigit()
        and not os.path.islink(os.path.join(path, name))
        and os.path.isdir(os.path.join(path, name, "state"))
    )


def step_directory(path: str, step: str | int = "latest") -> str:
    """``path`` itself when it is one checkpoint, else its checkpoint ``step``:
    ``"latest"`` (complete), ``"best"`` (by the metric the run kept its best by, recorded
    with it: ``--best-metric``, by default accuracy, or a language model's loss) or a number."""
    if os.path.isdir(os.path.join(path, "state")):
        return path
    steps = (
        [int(name) for name in os.listdir(path) if name.isdigit()] if os.path.isdir(path) else []
    )
    whole = whole_steps(path)
    if not whole:
        found = f" (steps {', '.join(map(str, sorted(steps)))} are incomplete)" if steps else ""
        raise UsageError(
            f"no checkpoint in {path}{found}; pass a --ckpt-dir or one of its step directories"
        )
    if step == "latest":
        return os.path.join(path, str(whole[-1]))
    if step == "best":
        scored = _scores(path, whole)
        if not scored:
            raise UsageError(
                f"no checkpoint in {path} recorded an evaluation; load step='latest' or a step "
                f"number ({', '.join(map(str, whole))})"
            )
        best = max(scored, key=lambda number: (scored[number][0], number))
        return os.path.join(path, str(best))
    if isinstance(step, int) and not isinstance(step, bool) and step in whole:
        return os.path.join(path, str(step))
    raise UsageError(
        f"no checkpoint of step {step!r} in {path}; it holds steps "
        f"{', '.join(map(str, whole))}, or ask for 'latest' or 'best'"
    )


def load_params(path: str | os.PathLike, mesh: Mesh | None = None) -> Any:
    """Reads only the parameters of a checkpoint, for inference or fine-tuning.

    Args:
        path: a checkpoint directory (its latest checkpoint is read) or one step
            directory in it.
        mesh: place the parameters replicated on this mesh; default: the first
            device.

    Returns:
        The parameter pytree (nested dicts of ``jax.Array``), as saved.

    Raises:
        UsageError: no checkpoint at ``path``.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> state = jdp.create_train_state({"w": jnp.ones(3)}, optax.sgd(0.1), mesh)
        >>> with jdp.Checkpointer(f"{tmp}/run") as checkpoints:
        ...     _ = checkpoints.save(state, loader_step=0)
        >>> jdp.load_params(f"{tmp}/run")["w"]
        Array([1., 1., 1.], dtype=float32)
    """
    return read_params(path, mesh=mesh)[0]


def read_params(
    path: str | os.PathLike,
    *,
    step: str | int = "latest",
    mesh: Mesh | None = None,
    like: tuple[Any, Any] | None = None,
) -> tuple[Any, Any]:
    """``(params, model_state)`` of one checkpoint, digests checked (`read_checkpoint`).

    ``step`` picks it in a checkpoint directory: ``"latest"``, ``"best"`` (the
    highest recorded evaluation accuracy) or a step number. The arrays land
    replicated on ``mesh`` (default: the first device), or on the shardings of
    ``like``'s ``(params, model_state)``, whose structure they must have.

    Raises:
        UsageError: no such checkpoint, a damaged one, or one of another model than ``like``.
    """
    return read_checkpoint(path, step, mesh=mesh, like=like)[2:]


def read_checkpoint(
    path: str | os.PathLike,
    step: str | int = "latest",
    *,
    mesh: Mesh | None = None,
    like: tuple[Any, Any] | None = None,
) -> tuple[str, Record, Any, Any]:
    """``(step_dir, record, params, model_state)`` of one checkpoint, its record's and
    arrays' digests checked (`read_params` places the arrays).

    The ``"latest"`` of a checkpoint directory is its newest whole checkpoint: one
    found damaged (a record or array metadata unreadable, an array cut short, bytes
    that do not match their digest) is passed over with a warning naming it and the
    step used instead, and left where it is. A checkpoint asked for by step, or
    the last one left, is an error instead.

    Raises:
        UsageError: no such checkpoint, no whole one, or one of another model than ``like``.
    """
    path = os.path.abspath(os.fspath(path))
    _quiet_orbax_failures()
    for _attempt in range(5):
        found = _first_whole(path, step, mesh, like)
        if found is not None:
            return found
    raise UsageError(
        f"the checkpoints in {path} were removed while they were read (a live run keeps "
        "only its latest); read it again, or copy the step directory first"
    )


def latest_record(path: str | os.PathLike) -> Record:
    """The record of the newest checkpoint in ``path`` whose record is whole (or of
    ``path`` itself, one step directory), as `read_checkpoint` reads it."""
    path = os.path.abspath(os.fspath(path))
    candidates = _candidates(path, "latest")
    for step_dir in candidates:
        try:
            return _checked_record(step_dir)
        except _Damaged:
            continue
    return read_record(candidates[0])


def _candidates(path: str, step: str | int) -> list[str]:
    """The step directories to try for ``step``, in order: the latest and, after it,
    every older whole one; anything else, the one asked for."""
    first = step_directory(path, step)
    if step != "latest" or first == path:
        return [first]
    newest = int(os.path.basename(first))
    older = [s for s in reversed(whole_steps(path)) if s < newest]
    return [first, *(os.path.join(path, str(s)) for s in older)]


def _first_whole(
    path: str, step: str | int, mesh: Mesh | None, like: tuple[Any, Any] | None
) -> tuple[str, Record, Any, Any] | None:
    """The first of `_candidates` that reads whole; None when one was removed while it was
    read (a live run's rotation: look again)."""
    candidates = _candidates(path, step)
    for index, step_dir in enumerate(candidates):
        try:
            record = _checked_record(step_dir)
            return (step_dir, record, *_read_arrays(step_dir, record, mesh, like))
        except _Damaged as damage:
            if not os.path.isdir(step_dir):
                return None
            if index + 1 == len(candidates):
                older = "no older checkpoint there is whole" if index else "load another one"
                raise UsageError(f"checkpoint {step_dir} is damaged ({damage}); {older}") from None
            warn(
                f"checkpoint {step_dir} is damaged ({damage}); reading step "
                f"{os.path.basename(candidates[index + 1])} instead"
            )
    return None


def _checked_record(step_dir: str) -> Record:
    """The step directory's record, its digest checked; `_Damaged` when it is there but
    unreadable or altered (one written without a record reads empty, as an older jdp's)."""
    name = os.path.basename(os.path.normpath(step_dir))
    meta_path = os.path.join(step_dir, "meta", "metadata")
    if not os.path.lexists(meta_path):
        return Record.read({}, step=int(name) if name.isdigit() else 0)
    try:
        with open(meta_path, encoding="utf-8") as file:
            meta = json.load(file)
    except (OSError, ValueError) as error:
        raise _Damaged(f"its record is unreadable: {_first_line(error)}") from None
    if not isinstance(meta, dict):
        raise _Damaged("its record is not a JSON object")
    if "meta_digest" in meta and meta["meta_digest"] != _meta_digest(meta):
        raise _Damaged("its record does not match its digest")
    return Record.read(meta, step=int(name) if name.isdigit() else 0)


def _read_arrays(
    step_dir: str, record: Record, mesh: Mesh | None, like: tuple[Any, Any] | None
) -> tuple[Any, Any]:
    """``(params, model_state)`` of one step directory, checked against ``record``'s digests."""
    from jdp.checkpoint import handlers  # Orbax, imported by a run that reads a checkpoint

    state_dir = os.path.join(step_dir, "state")
    checkpointer = handlers.pytree_checkpointer()
    try:
        with quiet_absl():  # a step's item directory has no step-level metadata file; fine here
            metadata = checkpointer.metadata(state_dir).item_metadata
        if metadata is None:
            raise _Damaged("its array metadata is missing")
        saved = {
            "params": dict(metadata["params"]),
            "model_state": dict(metadata["model_state"] or {}),
        }
    except _Damaged:
        raise
    except Exception as error:  # Orbax's or the OS's word for metadata missing or cut short
        raise _Damaged(f"its array metadata is unreadable: {_first_line(error)}") from None
    if like is not None:
        wanted = {"params": like[0], "model_state": like[1]}
        differs = _describe_mismatch(_leaf_names(saved), _leaf_names(wanted))
        if differs:
            raise UsageError(
                f"checkpoint {step_dir} holds another model than this run's ({differs}); "
                "start from a checkpoint of the same model"
            )
        target = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding),
            wanted,
        )
    else:
        sharding = (
            replicated(mesh)
            if mesh is not None
            else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
        target = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), saved
        )
    try:
        restored = checkpointer.restore(state_dir, args=handlers.restore_args(target, partial=True))
    except Exception as error:  # truncated or missing array files
        raise _Damaged(_first_line(error)) from None
    arrays = {
        name: value
        for name, value in record.arrays.items()
        if name.startswith(("params/", "model_state/"))
    }
    problem = _digest_mismatch(restored, arrays)
    if problem:
        raise _Damaged(problem)
    return restored["params"], restored.get("model_state") or {}


def saved_param_names(path: str | os.PathLike, step: str | int = "latest") -> set[str]:
    """The top-level names of a checkpoint's parameters (its modules), read from metadata."""
    from jdp.checkpoint import handlers  # Orbax, imported by a run that reads a checkpoint

    step_dir = step_directory(os.path.abspath(os.fspath(path)), step)
    with quiet_absl():
        metadata = handlers.pytree_checkpointer().metadata(os.path.join(step_dir, "state"))
    return set(metadata.item_metadata["params"])


def read_record(step_dir: str) -> Record:
    """A step directory's `Record` (its config, metrics and array digests); an empty one,
    at the directory's step, if it has none or it is unreadable."""
    try:
        return _checked_record(step_dir)
    except _Damaged:
        name = os.path.basename(os.path.normpath(step_dir))
        return Record.read({}, step=int(name) if name.isdigit() else 0)
