"""`Checkpointer`: async saves, retention, resume and restore, and the checks that set
a damaged checkpoint aside."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jdp.checkpoint.record import Record
from jdp.checkpoint.storage import (
    _abstract,
    _Damaged,
    _describe_mismatch,
    _digest_mismatch,
    _first_line,
    _leaf_names,
    _meta_digest,
    _not_an_abandoned_write,
    _on_disk,
    _os_reason,
    _PendingRecord,
    _quiet_orbax_failures,
    warn,
)
from jdp.distributed.agree import all_ok, barrier, from_process_0
from jdp.distributed.lock import DirectoryLock
from jdp.errors import UsageError
from jdp.report.console import quiet_absl
from jdp.state import TrainState


class Checkpointer:
    """Saves and restores a run's checkpoints in one directory through Orbax.

    The directory belongs to one run at a time (`jdp.lock`): a second
    Checkpointer on it, in this process or another, is refused until this one
    is closed. Every save records a digest of each array (`jdp.checkpoint.digest`) and of
    its own record; restore checks them and sets aside a checkpoint that does
    not match, naming the leaf, and uses the previous one. With several
    processes, process 0 holds the lock and decides which checkpoints exist;
    the others follow.

    Args:
        directory: where the step directories live (created if missing).
        keep: how many of the latest checkpoints to keep.
        best_metric: also keep the checkpoint with the best value of this eval
            metric (among saves that were given metrics).
        best_mode: ``max`` (a higher ``best_metric`` is better) or ``min``.
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
        best_mode: str = "max",
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
        from jdp.checkpoint import handlers  # Orbax, imported by a run that checkpoints

        try:
            self._strays_aside()
            best = (best_metric, best_mode)
            self._manager = handlers.manager(self.directory, keep, best, async_save)
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
        if not all_ok(problem is None):
            raise problem or UsageError(
                f"process 0 could not take {self.directory}; its error says why"
            )
        if jax.process_count() == 1:
            return
        expected = _process_0_token(token)
        if not all_ok(jax.process_index() == 0 or self._lock.token() == expected):
            self._lock.release()
            raise UsageError(
                f"--ckpt-dir {self.directory} is not the same directory in every process; "
                "give every process one shared directory"
            )

    def _strays_aside(self) -> None:
        """Moves aside, by name, what is named like a step but is no checkpoint of this
        directory: a link (to another run's checkpoint, or to nothing) or a file. Orbax
        would count it as the latest, resume from it and delete a real one in its place."""
        if jax.process_index() == 0:
            for name in sorted(os.listdir(self.directory)):
                path = os.path.join(self.directory, name)
                if not name.isdigit() or (os.path.isdir(path) and not os.path.islink(path)):
                    continue
                link = os.path.islink(path)
                aside = os.path.join(self.directory, f"stray-{name}-{int(time.time())}")
                os.rename(path, aside)
                what = "a link (its target untouched)" if link else "not a directory"
                warn(f"{path} is named like a checkpoint but is {what}; moved to {aside}")
        barrier("jdp-strays-aside")

    def damaged_steps(self) -> list[int]:
        """Steps of the damaged checkpoints set aside in the directory (``damaged-STEP-TIME``),
        by this run or an earlier one (process 0's list in every process)."""
        steps = []
        if jax.process_index() == 0:
            for name in os.listdir(self.directory):
                parts = name.split("-")
                if len(parts) == 3 and parts[0] == "damaged" and parts[1].isdigit():
                    steps.append(int(parts[1]))
        return from_process_0(sorted(set(steps)))

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (process 0's list in every process)."""
        return from_process_0(sorted(self._manager.all_steps()))

    def save(
        self,
        state: TrainState,
        *,
        loader_step: int,
        config: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        ledger: Mapping[str, Any] | None = None,
    ) -> bool:
        """Saves ``state`` at its step, unless a checkpoint of that step exists; ``ledger``
        is the run's data ledger through it (`jdp.data.splits.ledger`).

        Returns:
            Whether a save was started.
        """
        step = int(state.step)
        if step in self._manager.all_steps():
            return False
        self._check_lock()
        arrays = {
            name: {"shape": list(shape), "dtype": dtype}
            for name, (shape, dtype) in _leaf_names(state).items()
        }
        meta = Record(
            step,
            loader_step,
            config=dict(config or {}),
            arrays=arrays,
            metrics=dict(metrics or {}),
            ledger=dict(ledger or {}),
        ).to_json()
        record = _PendingRecord(meta)
        if not self._async:  # the commit happens inside the save: the digests go first
            record.start(state)
        from jdp.checkpoint import handlers  # imported with the manager, in __init__

        try:
            return self._manager.save(
                step,
                args=handlers.save_args(state, record),
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

    def _check_lock(self) -> None:
        """Before a save, in every process alike: process 0 still holds the directory
        (`DirectoryLock.check`); a run that lost it saves nothing more there."""
        problem = None
        if jax.process_index() == 0:
            try:
                self._lock.check()
            except UsageError as error:
                problem = error
        if not all_ok(problem is None):
            self._failed = True
            raise problem or UsageError(
                f"process 0 no longer holds {self.directory}; its error says why"
            )

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
        reason = _os_reason(error)
        return UsageError(
            f"could not write a checkpoint in {self.directory} ({reason}); {last}; "
            f"{_remedy(reason)}, or choose another --ckpt-dir"
        )

    def restore(
        self,
        like: TrainState,
        *,
        check: Callable[[dict], None] | None = None,
        at_most: int | None = None,
    ) -> tuple[TrainState, dict] | None:
        """Restores the latest good checkpoint (of a step ``at_most`` or before, when given)
        onto ``like``'s shardings.

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
        from jdp.checkpoint import handlers  # imported with the manager, in __init__

        target = _on_disk(_abstract(like))
        expected = _leaf_names(target)
        candidates = [s for s in self.steps() if at_most is None or s <= at_most]
        for step in reversed(candidates):
            older = step != candidates[0]
            try:
                meta, saved = self._read_record(step)
            except _Damaged as damage:
                problem = str(damage)
            else:
                problem = None
            if not all_ok(problem is None):
                self._set_aside(step, problem or "another process could not read it", older)
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
                restored = self._manager.restore(step, args=handlers.state_restore(target)).state
                problem = None
            except Exception as error:  # truncated or missing array files
                problem = _first_line(error)
            if all_ok(problem is None):  # every process restored: compare digests (together)
                problem = _digest_mismatch(restored, meta.get("arrays"))
            elif problem is None:
                problem = "another process could not read it"
            if problem is not None:
                self._set_aside(step, problem or "another process could not read it", older)
                continue
            return (like.replace(**restored) if dataclasses.is_dataclass(like) else restored), meta
        return None

    def _read_record(self, step: int) -> tuple[dict, dict]:
        """The checkpoint's meta record and its arrays' (shape, dtype), both checked."""
        from jdp.checkpoint import handlers  # imported with the manager, in __init__

        try:
            meta = dict(self._manager.restore(step, args=handlers.record_restore()).meta)
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

    def _set_aside(self, step: int, reason: str, older: bool) -> None:
        """Moves a damaged checkpoint out of the way (kept for inspection, never deleted);
        ``older``: whether an older checkpoint is left to try."""
        aside = os.path.join(self.directory, f"damaged-{step}-{int(time.time())}")
        if jax.process_index() == 0:
            os.rename(os.path.join(self.directory, str(step)), aside)
        then = "trying an older one" if older else "no older one is left"
        warn(f"checkpoint step {step} is damaged ({reason}); moved to {aside}, {then}")
        barrier(f"jdp-set-aside-{step}")
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


def _remedy(reason: str) -> str:
    """What to do about a write that failed for ``reason`` (the OS's words, or a library's)."""
    text = reason.lower()
    if any(word in text for word in ("permission", "not permitted", "read-only")):
        return "make it writable again (mount, permissions, chattr -i)"
    if "no such file or directory" in text:
        return "it was removed while the run wrote to it: restore it"
    if any(word in text for word in ("input/output error", "i/o error")):
        return "check the disk (an I/O error)"
    return "free space there"


def _process_0_token(token: str | None) -> str:
    """Process 0's lock token, in every process."""
    from jax.experimental import multihost_utils

    raw = np.frombuffer(bytes.fromhex(token or "0" * 16), np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)).hex()
