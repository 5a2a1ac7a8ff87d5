"""A checkpoint's parameters without its run: `load_params`, `read_params`, the record,
and which step directory a path names."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jdp.checkpoint.record import Record
from jdp.checkpoint.storage import (
    _describe_mismatch,
    _digest_mismatch,
    _leaf_names,
    _restore_args,
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
        # Before the choice was recorded, checkpoints were kept by accuracy.
        chosen = record.config.get("best_checkpoint") or {"metric": "accuracy", "mode": "max"}
        if only is not None and chosen != only:
            continue
        value = record.metrics.get(chosen["metric"])
        if isinstance(value, float):
            scored[number] = (value if chosen["mode"] == "max" else -value, value)
    return scored


def best_recorded(path: str, metric: str, mode: str) -> float | None:
    """The best value of ``metric`` (``mode`` max or min) among the checkpoints in ``path``
    kept by it (a resumed run's best so far), or None."""
    if not os.path.isdir(path):
        return None
    steps = [int(name) for name in os.listdir(path) if name.isdigit()]
    whole = [s for s in steps if os.path.isdir(os.path.join(path, str(s), "state"))]
    chosen = {"metric": metric, "mode": mode}
    scored = _scores(path, whole, only=chosen)
    return max(scored.values())[1] if scored else None


def step_directory(path: str, step: str | int = "latest") -> str:
    """``path`` itself when it is one checkpoint, else its checkpoint ``step``:
    ``"latest"`` (complete), ``"best"`` (by the metric the run kept its best by, recorded
    with it: ``--best-metric``, by default accuracy, or a language model's loss) or a number."""
    if os.path.isdir(os.path.join(path, "state")):
        return path
    steps = (
        [int(name) for name in os.listdir(path) if name.isdigit()] if os.path.isdir(path) else []
    )
    # Whole ones only: a step directory emptied or a broken link is passed over.
    whole = sorted(s for s in steps if os.path.isdir(os.path.join(path, str(s), "state")))
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
    """``(params, model_state)`` of one checkpoint, digests checked.

    ``step`` picks it in a checkpoint directory: ``"latest"``, ``"best"`` (the
    highest recorded evaluation accuracy) or a step number. The arrays land
    replicated on ``mesh`` (default: the first device), or on the shardings of
    ``like``'s ``(params, model_state)``, whose structure they must have.

    Raises:
        UsageError: no such checkpoint, a damaged one, or one of another model than ``like``.
    """
    step_dir = step_directory(os.path.abspath(os.fspath(path)), step)
    state_dir = os.path.join(step_dir, "state")
    checkpointer = ocp.PyTreeCheckpointer()
    with quiet_absl():  # a step's item directory has no step-level metadata file; fine here
        metadata = checkpointer.metadata(state_dir).item_metadata
    saved = {"params": dict(metadata["params"]), "model_state": dict(metadata["model_state"] or {})}
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
    restored = checkpointer.restore(state_dir, args=_restore_args(target, partial=True))
    problem = _digest_mismatch(restored, _recorded_arrays(step_dir))
    if problem:
        raise UsageError(
            f"checkpoint {step_dir} is damaged ({problem}); load another of its step directories"
        )
    return restored["params"], restored.get("model_state") or {}


def saved_param_names(path: str | os.PathLike, step: str | int = "latest") -> set[str]:
    """The top-level names of a checkpoint's parameters (its modules), read from metadata."""
    step_dir = step_directory(os.path.abspath(os.fspath(path)), step)
    with quiet_absl():
        metadata = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, "state"))
    return set(metadata.item_metadata["params"])


def read_record(step_dir: str) -> Record:
    """A step directory's `Record` (its config, metrics and array digests); an empty one,
    at the directory's step, if it has none or it is unreadable."""
    name = os.path.basename(os.path.normpath(step_dir))
    step = int(name) if name.isdigit() else 0
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as file:
            meta = json.load(file)
    except (OSError, ValueError):
        meta = {}
    return Record.read(meta if isinstance(meta, dict) else {}, step=step)


def _recorded_arrays(step_dir: str) -> dict:
    """The digests a checkpoint's record holds for its params and model state."""
    arrays = read_record(step_dir).arrays
    return {
        name: value
        for name, value in arrays.items()
        if name.startswith(("params/", "model_state/"))
    }
