"""Orbax checkpoints of a whole run: async saves, retention, resume, restore onto another mesh.

A checkpoint is one Orbax step directory with two items: ``state``, the whole
`TrainState` (params, optimizer state, model state, step, rng as raw key data,
loss scale) in Orbax's array format, and ``meta``, JSON with the loader position
the config that made the run, the shape, dtype and digest of every array
(`jdp.digest`) and a digest of the record itself. Orbax writes into a temporary
directory and renames it when complete, so a step directory either is a whole
checkpoint or was damaged afterwards: cut short, deleted in part, or with bytes
changed in place. Restore checks all of it; damaged checkpoints are set aside
with a warning naming what failed. One run at a time owns the directory
(`jdp.lock`). Nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jdp.digest import finish_digests, leaf_name, start_digests, tree_digests
from jdp.errors import UsageError, os_failure
from jdp.lock import DirectoryLock
from jdp.mesh import replicated
from jdp.report.console import quiet_absl
from jdp.state import TrainState


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


def _not_a_save_thread_error(record: logging.LogRecord) -> bool:
    """Drops Orbax's logs of a failed background write (tracebacks from its threads): the
    same error comes back from the save or the wait, and `Checkpointer` reports it in
    one line."""
    from_orbax = f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in record.pathname
    with_traceback = record.exc_info is not None or "raised an exception" in str(record.msg)
    return not (from_orbax and record.levelno >= logging.ERROR and with_traceback)


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


@dataclasses.dataclass
class _RecordSave(ocp.args.CheckpointArgs):
    """Save arguments of the record: a `_PendingRecord`."""

    item: _PendingRecord


class _RecordHandler(ocp.JsonCheckpointHandler):
    """The record as Orbax's JSON item, finished (its digests fetched) and written in the
    save's background commit, as Orbax writes JSON: the loop does not wait for it."""

    _FILENAME = "metadata"

    def __init__(self):
        super().__init__(filename=self._FILENAME)

    async def async_save(self, directory, item=None, args=None):
        if not isinstance(args, _RecordSave):
            return await super().async_save(directory, item, args)

        async def write() -> None:  # once Orbax has made the item's directory
            record = args.item.finish()
            if jax.process_index() == 0:
                (directory / self._FILENAME).write_text(json.dumps(record, default=repr))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jdp_record")]


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


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler with one change: no "replica-parallel" saving.

    By default Orbax splits each replicated array into one slice per replica and
    copies the slices off the devices, dispatching a slice op per piece; on
    8 replicas that blocked the training loop for 63 ms per 384 MB save, against
    8 ms for whole arrays (``python -m jdp.bench checkpoint``).
    """
    array_handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, array_handler))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _restore_args(target: Any, *, partial: bool = False) -> ocp.args.PyTreeRestore:
    """Read every array straight into ``target``'s shardings (only ``target``'s leaves
    when ``partial``)."""
    return ocp.args.PyTreeRestore(
        item=target,
        partial_restore=partial,
        restore_args=jax.tree.map(
            lambda leaf: ocp.ArrayRestoreArgs(
                sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype
            ),
            target,
        ),
    )


def warn(text: str) -> None:
    if jax.process_index() == 0:
        print(f"jdp: warning: {text}", file=sys.stderr, flush=True)


def _all_ok(ok: bool) -> bool:
    """Whether ``ok`` holds in every process (each process asks together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _from_process_0(values: list[int]) -> list[int]:
    """Process 0's list, in every process: process 0 decides, the others follow."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    count = int(multihost_utils.broadcast_one_to_all(np.asarray(len(values), np.int64)))
    mine = np.asarray(values if jax.process_index() == 0 else [0] * count, np.int64)
    return [int(v) for v in multihost_utils.broadcast_one_to_all(mine.reshape(count))]


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _manager(directory: str, keep: int, best_metric: str | None, async_save: bool
             ) -> ocp.CheckpointManager:  # fmt: skip
    """Orbax's manager of the directory: retention, async saves, the two items' handlers."""
    policies = [ocp.checkpoint_managers.LatestN(keep)]
    if best_metric:
        policies.append(
            ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda metrics: metrics[best_metric],
                n=1,
                keep_checkpoints_without_metrics=False,
            )
        )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # left by a run killed mid-save
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, record = _state_handler(), _RecordHandler()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", _RecordSave, record)
    registry.add("meta", ocp.args.JsonRestore, record)
    return ocp.CheckpointManager(directory, options=options, handler_registry=registry)


class Checkpointer:
    """Saves and restores a run's checkpoints in one directory through Orbax.

    The directory belongs to one run at a time (`jdp.lock`): a second
    Checkpointer on it, in this process or another, is refused until this one
    is closed. Every save records a digest of each array (`jdp.digest`) and of
    its own record; restore checks them and sets aside a checkpoint that does
    not match, naming the leaf, and uses the previous one. With several
    processes, process 0 holds the lock and decides which checkpoints exist;
    the others follow.

    Args:
        directory: where the step directories live (created if missing).
        keep: how many of the latest checkpoints to keep.
        best_metric: also keep the checkpoint with the highest value of this
            eval metric (among saves that were given metrics).
        async_save: write in the background; ``save`` returns once the arrays
            are copied off the devices.

    Raises:
        UsageError: another run holds the directory, or it cannot be written.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> state = jdp.create_train_state({"w": jnp.ones(3)}, optax.sgd(0.1), mesh)
        >>> with jdp.Checkpointer(f"{tmp}/run", keep=3) as checkpoints:
        ...     checkpoints.restore(state) is None  # none there yet
        ...     checkpoints.save(state, loader_step=int(state.step))  # a save started
        True
        True
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        best_metric: str | None = "accuracy",
        async_save: bool = True,
    ):
        if keep < 1:
            raise UsageError(f"--keep must be at least 1, got {keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise UsageError(f"--ckpt-dir {self.directory} is a file, not a directory")
        self._lock = DirectoryLock(self.directory)
        self._failed = False
        self._async = async_save
        _quiet_orbax_failures()
        self._take_lock()
        try:
            self._manager = _manager(self.directory, keep, best_metric, async_save)
        except BaseException:
            self._lock.release()
            raise

    def _take_lock(self) -> None:
        """Process 0 takes the lock; the others check that they see the same lock file."""
        token, problem = None, None
        if jax.process_index() == 0:
            try:
                token = self._lock.acquire()
            except UsageError as error:
                problem = error
        if not _all_ok(problem is None):
            raise problem or UsageError(
                f"process 0 could not take {self.directory}; its error says why"
            )
        if jax.process_count() == 1:
            return
        expected = _process_0_token(token)
        if not _all_ok(jax.process_index() == 0 or self._lock.token() == expected):
            self._lock.release()
            raise UsageError(
                f"--ckpt-dir {self.directory} is not the same directory in every process; "
                "give every process one shared directory"
            )

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (process 0's list in every process)."""
        return _from_process_0(sorted(self._manager.all_steps()))

    def save(
        self,
        state: TrainState,
        *,
        loader_step: int,
        config: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Saves ``state`` at its step, unless a checkpoint of that step exists.

        Returns:
            Whether a save was started.
        """
        step = int(state.step)
        if step in self._manager.all_steps():
            return False
        arrays = {
            name: {"shape": list(shape), "dtype": dtype}
            for name, (shape, dtype) in _leaf_names(state).items()
        }
        meta = {
            "step": step,
            "loader_step": loader_step,
            "config": dict(config or {}),
            "arrays": arrays,
            "metrics": dict(metrics or {}),  # what chose the best checkpoint, if any
        }
        record = _PendingRecord(meta)
        if not self._async:  # the commit happens inside the save: the digests go first
            record.start(state)
        try:
            return self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(_on_disk(state)), meta=_RecordSave(record)
                ),
                metrics=dict(metrics) if metrics else None,
                force=True,
            )
        except Exception as error:  # this save, or the one before it in the background
            raise self._write_failed(error) from None
        finally:
            # The digests: dispatched before the next step can donate the arrays, and
            # fetched in the background commit.
            if self._async:
                record.start(state)

    def _write_failed(self, error: Exception) -> UsageError:
        """One line for a save that failed: why, and the last checkpoint that is whole."""
        self._failed = True
        # The save's other writes failed alike; asyncio would log each one at exit.
        logging.getLogger("asyncio").addFilter(_not_an_abandoned_write)
        complete: list[int] = []
        with contextlib.suppress(Exception):
            self._manager.reload()
            complete = sorted(self._manager.all_steps())
        last = (
            f"the last complete checkpoint is step {complete[-1]}"
            if complete
            else "no checkpoint there is complete"
        )
        return UsageError(
            f"could not write a checkpoint in {self.directory} ({_os_reason(error)}); {last}; "
            "free space there, or choose another --ckpt-dir"
        )

    def restore(
        self, like: TrainState, *, check: Callable[[dict], None] | None = None
    ) -> tuple[TrainState, dict] | None:
        """Restores the latest good checkpoint onto ``like``'s shardings.

        ``like`` is a state of the same model and optimizer on the mesh to restore
        onto (any mesh, either backend); only its structure and shardings are used,
        and the arrays are read straight into those shardings. A checkpoint that is
        incomplete, unreadable or not what was saved (an array or the record whose
        digest differs, missing metadata) is moved aside as ``damaged-STEP-TIME``
        with a warning, and the one before it is tried.

        Args:
            like: a state of the same structure, placed where the result should be.
            check: called with the checkpoint's ``meta`` before any array is read;
                raises to refuse it.

        Returns:
            ``(state, meta)``, or None when the directory holds no good checkpoint.

        Raises:
            UsageError: the checkpoint holds a different model or optimizer.
        """
        target = _on_disk(_abstract(like))
        expected = _leaf_names(target)
        for step in reversed(self.steps()):
            try:
                meta, saved = self._read_record(step)
            except _Damaged as damage:
                problem = str(damage)
            else:
                problem = None
            if not _all_ok(problem is None):
                self._set_aside(step, problem or "another process could not read it")
                continue
            if check is not None:
                check(dict(meta))
            if saved != expected:
                raise UsageError(
                    f"checkpoint step {step} in {self.directory} does not match this model "
                    f"and optimizer: {_describe_mismatch(saved, expected)}; use the flags that "
                    f"made it, or another --ckpt-dir"
                )
            try:
                restored = self._manager.restore(
                    step, args=ocp.args.Composite(state=_restore_args(target))
                ).state
                problem = None
            except Exception as error:  # truncated or missing array files
                problem = _first_line(error)
            if _all_ok(problem is None):  # every process restored: compare digests (together)
                problem = _digest_mismatch(restored, meta.get("arrays"))
            elif problem is None:
                problem = "another process could not read it"
            if problem is not None:
                self._set_aside(step, problem or "another process could not read it")
                continue
            return (like.replace(**restored) if dataclasses.is_dataclass(like) else restored), meta
        return None

    def _read_record(self, step: int) -> tuple[dict, dict]:
        """The checkpoint's meta record and its arrays' (shape, dtype), both checked."""
        try:
            meta = dict(
                self._manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                ).meta
            )
        except Exception as error:
            raise _Damaged(f"its record is unreadable: {_first_line(error)}") from None
        if "meta_digest" in meta and meta["meta_digest"] != _meta_digest(meta):
            raise _Damaged("its record does not match its digest")
        try:
            with quiet_absl():
                saved = _leaf_names(self._manager.item_metadata(step)["state"])
        except Exception as error:
            raise _Damaged(f"its array metadata is unreadable: {_first_line(error)}") from None
        if not saved:
            raise _Damaged("its array metadata is missing")
        recorded = {
            name: (tuple(array["shape"]), array["dtype"])
            for name, array in meta.get("arrays", {}).items()
        }
        if recorded and recorded != saved:
            raise _Damaged(
                "its array metadata is not what was saved: "
                + _describe_mismatch(saved, recorded, limit=1)
            )
        return meta, saved

    def _set_aside(self, step: int, reason: str) -> None:
        """Moves a damaged checkpoint out of the way (kept for inspection, never deleted)."""
        aside = os.path.join(self.directory, f"damaged-{step}-{int(time.time())}")
        if jax.process_index() == 0:
            os.rename(os.path.join(self.directory, str(step)), aside)
        warn(f"checkpoint step {step} is damaged ({reason}); moved to {aside}, using an older one")
        _barrier(f"jdp-set-aside-{step}")
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until every started save is committed to disk.

        Raises:
            UsageError: a save failed (a full disk, a directory gone), naming the
                last complete checkpoint.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise self._write_failed(error) from None

    def close(self) -> None:
        try:
            if self._failed:  # reported already: let the rest go quietly
                with contextlib.suppress(Exception):
                    self._manager.close()
            else:
                self.wait()
                self._manager.close()
        finally:
            self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else repr(error)


def _process_0_token(token: str | None) -> str:
    """Process 0's lock token, in every process."""
    from jax.experimental import multihost_utils

    raw = np.frombuffer(bytes.fromhex(token or "0" * 16), np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)).hex()


def _digest_mismatch(restored: Any, arrays: Mapping[str, Mapping] | None) -> str | None:
    """Which restored leaf's bytes differ from the digest saved with it, if any."""
    if not arrays:
        return None  # written before checkpoints carried digests: nothing to compare
    digests = tree_digests(restored)
    for name in sorted(digests):  # every restored leaf has a recorded digest to match
        if arrays.get(name, {}).get("digest") != digests[name]:
            return f"{name} does not match its digest"
    return None


def step_directory(path: str, step: str | int = "latest") -> str:
    """``path`` itself when it is one checkpoint, else its checkpoint ``step``:
    ``"latest"`` (complete), ``"best"`` (highest recorded accuracy) or a number."""
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
        scored = {}
        for number in whole:
            accuracy = read_record(os.path.join(path, str(number))).get("metrics", {})
            if isinstance(accuracy, dict) and isinstance(accuracy.get("accuracy"), float):
                scored[number] = accuracy["accuracy"]
        if not scored:
            raise UsageError(
                f"no checkpoint in {path} recorded an evaluation; load step='latest' or a step "
                f"number ({', '.join(map(str, whole))})"
            )
        best = max(scored, key=lambda number: (scored[number], number))
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


def read_record(step_dir: str) -> dict:
    """A step directory's record (its config, metrics and array digests); {} if unreadable."""
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as file:
            record = json.load(file)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _recorded_arrays(step_dir: str) -> dict:
    """The digests a checkpoint's record holds for its params and model state."""
    arrays = read_record(step_dir).get("arrays", {})
    if not isinstance(arrays, dict):
        return {}
    return {
        name: value
        for name, value in arrays.items()
        if name.startswith(("params/", "model_state/"))
    }
