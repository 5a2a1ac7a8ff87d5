"""One run owns a checkpoint directory: a lock held for the run's life.

The directory itself and ``DIR/jdp.lock`` are held with ``flock``, which the
kernel (or an NFSv4 server) releases when its holder exits, however it exits.
So a lock that can be taken belongs to nobody: when its file still names an
owner, that owner is gone (killed, or its machine lost) and the lock is taken
over with a line saying so. A run that ends cleanly empties the file before
letting go.

The lock on the directory is what a deleted lock file cannot undo: a second run
is refused while the first lives, before it cleans up anything (a save in
flight included). The owner checks its lock before each save (`check`): a lock
file deleted is written again; a directory removed or replaced, or a lock file
another process made (where a filesystem cannot lock directories), stops it.
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
from collections.abc import Iterator

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


def _read_path(path: str) -> dict:
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as handle:
        return _read(handle)
    return {}


def _same_file(stat: os.stat_result, descriptor: int) -> bool:
    held = os.fstat(descriptor)
    return (stat.st_dev, stat.st_ino) == (held.st_dev, held.st_ino)


def _lock_folder(directory: str) -> int | None:
    """The directory's descriptor, flocked; None where its filesystem cannot lock a
    directory (the lock file then holds alone). BlockingIOError: another run holds it."""
    folder = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(folder)
        raise
    except OSError:  # not supported here (some network filesystems)
        os.close(folder)
        return None
    return folder


def _live_owner(path: str) -> dict | None:
    """Who holds the lock file ``path``, while a live run other than this process does;
    None for no file, a lock nobody holds, or this process's own."""
    try:
        handle = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed below)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(handle)
            mine = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
            return None if mine else owner
        except OSError:
            return None
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def refuse_a_live_runs(directory: str, flag: str, *, itself: bool = True) -> None:
    """UsageError when ``directory`` lies inside a directory another live run holds (or
    is one, with ``itself``): its files would be interleaved with that run's."""
    path = os.path.abspath(directory)
    here = path if itself else os.path.dirname(path)
    while True:
        owner = _live_owner(os.path.join(here, LOCK_NAME))
        if owner is not None and here == path:
            raise UsageError(
                f"{directory} is in use by another run ({_describe(owner)}); wait for it to "
                f"end, or choose another {flag}"
            )
        if owner is not None:
            raise UsageError(
                f"{flag} {directory} is inside {here}, which is in use by another run "
                f"({_describe(owner)}); choose a {flag} outside it"
            )
        if os.path.dirname(here) == here:
            return
        here = os.path.dirname(here)


class DirectoryLock:
    """The lock on ``directory``: `acquire` it once, `release` it at the end.

    Examples:
        >>> lock = jdp.distributed.lock.DirectoryLock(f"{tmp}/locked")
        >>> token = lock.acquire()
        >>> jdp.distributed.lock.DirectoryLock(f"{tmp}/locked").acquire()
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: ...locked is in use by another run (pid ...
        >>> lock.release()
    """

    def __init__(self, directory: str, flag: str = "--ckpt-dir"):
        self.directory, self.flag = directory, flag
        self.path = os.path.join(directory, LOCK_NAME)
        self._handle = None
        self._folder: int | None = None  # the directory's descriptor, flocked
        self._record = ""

    def acquire(self) -> str:
        """Takes the lock (or a stale one over); returns the token written in it.

        Raises:
            UsageError: another live run holds it (or a directory it lies in), or the
                directory cannot be written.
        """
        refuse_a_live_runs(self.directory, self.flag, itself=False)
        try:
            os.makedirs(self.directory, exist_ok=True)
            handle = open(self.path, "a+", encoding="utf-8", errors="replace")  # noqa: SIM115 (held for the run)
        except IsADirectoryError:
            raise UsageError(
                f"{self.path} is a directory, where jdp keeps the file that locks "
                f"{self.directory}; remove it (or choose another {self.flag})"
            ) from None
        except OSError as error:
            raise UsageError(
                f"cannot write in {self.flag} {self.directory} ({error.strerror or error}); "
                f"choose a writable {self.flag}"
            ) from None
        folder = None
        try:
            folder = _lock_folder(self.directory)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(handle)
            handle.close()
            if folder is not None:
                os.close(folder)
            raise UsageError(
                f"{self.directory} is in use by another run ({_describe(owner)}); wait for it "
                f"to end, or choose another {self.flag}"
            ) from None
        previous = _read(handle)
        token = secrets.token_hex(8)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": token,
        }
        self._record = json.dumps(record) + "\n"
        handle.seek(0)
        handle.truncate()
        handle.write(self._record)
        handle.flush()
        self._handle, self._folder = handle, folder
        if previous:
            print(
                f"jdp: took over the lock on {self.directory} from a run that is gone "
                f"({_describe(previous)})",
                file=sys.stderr,
                flush=True,
            )
        return token

    def check(self) -> None:
        """Before a save: the lock is still this run's (see the module).

        Raises:
            UsageError: the directory was removed or replaced, or another process
                made its lock file.
        """
        if self._handle is None:
            return
        gone = f"{self.directory} was removed or replaced while this run wrote to it"
        try:
            now = os.stat(self.directory)
        except OSError:
            now = None
        if now is None or (self._folder is not None and not _same_file(now, self._folder)):
            raise UsageError(
                f"{gone}; nothing more is saved there: restore it, or resume "
                "from another --ckpt-dir"
            )
        try:
            mine = _same_file(os.stat(self.path), self._handle.fileno())
        except FileNotFoundError:  # deleted: written again, this run still holding it
            self._rewrite()
            return
        if not mine:
            owner = _describe(_read_path(self.path))
            raise UsageError(
                f"another run took {self.directory} ({owner}) while this one held it (its "
                "lock file was deleted); this run stops without saving there, so that two "
                "runs never write one directory: resume one of them in another --ckpt-dir"
            )

    def _rewrite(self) -> None:
        handle = open(self.path, "a+", encoding="utf-8", errors="replace")  # noqa: SIM115 (held for the run)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise UsageError(
                f"another run took {self.directory} while this one held it (its lock file "
                "was deleted); this run stops without saving there"
            ) from None
        handle.write(self._record)
        handle.flush()
        self._handle.close()
        self._handle = handle
        print(
            f"jdp: {self.path} was deleted under this run; written again",
            file=sys.stderr,
            flush=True,
        )

    def token(self) -> str | None:
        """The token the lock file holds now (what another process of the run checks)."""
        with (
            contextlib.suppress(OSError),
            open(self.path, encoding="utf-8", errors="replace") as handle,
        ):
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
        if self._folder is not None:
            os.close(self._folder)
            self._folder = None


@contextlib.contextmanager
def held(directory: str, flag: str) -> Iterator[None]:
    """``directory`` locked for the block (`DirectoryLock`) by process 0; every process
    learns whether it could, so a refusal ends each one, not process 0 alone."""
    from jdp.distributed.agree import all_ok

    lock, problem = DirectoryLock(directory, flag), None
    if _process_index() == 0:
        try:
            lock.acquire()
        except UsageError as error:
            problem = error
    if not all_ok(problem is None):
        raise problem or UsageError(
            f"process 0 could not take {flag} {directory}; its error says why"
        )
    try:
        yield
    finally:
        lock.release()


def _process_index() -> int:
    import jax

    return jax.process_index()
