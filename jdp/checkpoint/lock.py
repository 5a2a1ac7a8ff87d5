"""One run owns a checkpoint directory: a lock file held for the run's life.

``DIR/jdp.lock`` is held with ``flock``, which the kernel (or an NFSv4 server)
releases when its holder exits, however it exits. So a lock that can be taken
belongs to nobody: when its file still names an owner, that owner is gone
(killed, or its machine lost) and the lock is taken over with a line saying so.
A run that ends cleanly empties the file before letting go.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import secrets
import socket
import sys

from jdp.errors import UsageError

LOCK_NAME = "jdp.lock"


def _describe(owner: dict) -> str:
    return (
        f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, "
        f"started {owner.get('started', '?')}"
    )


def _read(handle) -> dict:
    handle.seek(0)
    text = handle.read()
    if not text.strip():
        return {}
    try:
        owner = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "started": "? (unreadable lock file)"}
    return owner if isinstance(owner, dict) else {}


class DirectoryLock:
    """The lock on ``directory``: `acquire` it once, `release` it at the end.

    Examples:
        >>> lock = jdp.checkpoint.lock.DirectoryLock(f"{tmp}/locked")
        >>> token = lock.acquire()
        >>> jdp.checkpoint.lock.DirectoryLock(f"{tmp}/locked").acquire()
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: ...locked is in use by another run (pid ...
        >>> lock.release()
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._handle = None

    def acquire(self) -> str:
        """Takes the lock (or a stale one over); returns the token written in it.

        Raises:
            UsageError: another live run holds it, or the directory cannot be written.
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
            handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held for the run)
        except OSError as error:
            raise UsageError(
                f"cannot write checkpoints in {self.directory} ({error.strerror or error}); "
                "choose a writable --ckpt-dir"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _read(handle)
            handle.close()
            raise UsageError(
                f"{self.directory} is in use by another run ({_describe(owner)}); wait for it "
                "to end, or choose another --ckpt-dir"
            ) from None
        previous = _read(handle)
        token = secrets.token_hex(8)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": token,
        }
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        self._handle = handle
        if previous:
            print(
                f"jdp: took over the lock on {self.directory} from a run that is gone "
                f"({_describe(previous)})",
                file=sys.stderr,
                flush=True,
            )
        return token

    def token(self) -> str | None:
        """The token the lock file holds now (what another process of the run checks)."""
        with contextlib.suppress(OSError), open(self.path, encoding="utf-8") as handle:
            return _read(handle).get("token")
        return None

    def release(self) -> None:
        """Empties the lock file and lets go (a clean end leaves no owner behind)."""
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.flush()
        self._handle.close()  # closing the file releases the flock
        self._handle = None
