"""What every ``python -m jdp.*`` tool does with bad input and an operator's faults: one
line on stderr naming the file or flag, the value and the fix, and exit code 2 (1 for a
fault met during the work: a full disk, an I/O error), never a Python traceback.

`command` wraps a tool's ``main``; `read_json` reads a JSON file jdp or a user wrote and
names the file and the key on any malformation.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jdp.errors import UsageError, not_there

# What a path that cannot be used is, and what to do about it (exit 2).
_BAD_PATHS = {
    errno.ENOENT: "give a path that exists",
    errno.ENOTDIR: "a part of the path is a file, not a directory; give another path",
    errno.EISDIR: "it is a directory where a file belongs; give a file",
    errno.EEXIST: "something of that name is in the way; give another path",
    errno.ELOOP: "it is a loop of symbolic links; give another path",
    errno.EACCES: "give a path this user may use",
    errno.EPERM: "give a path this user may use",
    errno.EROFS: "give a path on a writable file system",
    errno.ENAMETOOLONG: "give a shorter path",
}
# Faults met while working (exit 1).
_FAULTS = {
    errno.ENOSPC: "free space there and run it again",
    errno.EDQUOT: "free space there (or raise the quota) and run it again",
    errno.EFBIG: "the file grew past the limit on file sizes; raise it (ulimit -f)",
    errno.EIO: "the device reported an I/O error; check it and run it again",
}


def command(prog: str) -> Callable:
    """Decorates a tool's ``main(argv) -> int`` so that bad input and an operator's faults
    end in one line and exit 2 (or 1), whatever the tool's own code missed:

    - an argument that is not UTF-8 text (a file name in another encoding) is refused
      before any work, as the C++ libraries below (Orbax's tensorstore, array_record)
      cannot take such a name;
    - a `UsageError` is its line, exit 2;
    - an `OSError` is a line naming the path and the fix: exit 2 for a path that cannot
      be used (`_BAD_PATHS`), 1 for any other (a full disk, a network that failed): a
      fault met while working, which a launcher may restart.
    """

    def wrap(main: Callable[[Sequence[str] | None], int]) -> Callable:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> int:
            argv = list(sys.argv[1:] if argv is None else argv)
            ours = argv[: argv.index("--")] if "--" in argv else argv  # not a launcher's command
            if (bad := next((arg for arg in ours if not _is_utf8(arg)), None)) is not None:
                return _say(
                    prog,
                    f"{shown(bad)} is not UTF-8 text (a file name in another "
                    "encoding?); rename the file or give a UTF-8 name",
                    2,
                )
            with _outliving_its_reader(), _one_line_usage_errors():
                try:
                    return main(argv)
                except UsageError as error:
                    return _say(prog, str(error), 2)
                except OSError as error:
                    return _say(prog, *os_line(error))

        return run

    return wrap


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """While a tool runs, argparse's errors (a flag unknown, a value of the wrong type, a
    subcommand missing) are one line, as jdp.train's are, not a usage block and a line."""

    def error(parser: argparse.ArgumentParser, message: str):
        sys.stderr.write(f"{parser.prog}: error: {message} (see --help)\n")
        sys.exit(2)

    before = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = before


class _Survivor:
    """A text stream that outlives its reader: once writing to it meets a broken pipe
    (the reader, say a launcher's relay, was killed), its file descriptor is pointed at
    /dev/null, so the tool goes on (a run saves and stops) instead of dying at its next
    line; everything else is the stream's own."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _outliving_its_reader():
    """`_Survivor` in place of stdout and stderr while a tool runs (streams backed by a
    file descriptor only: nothing else has a pipe to break)."""
    before = sys.stdout, sys.stderr
    try:
        for stream in before:
            stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        yield
        return
    sys.stdout, sys.stderr = _Survivor(sys.stdout), _Survivor(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = before


def os_line(error: OSError) -> tuple[str, int]:
    """The line and exit code for an operating system's error: the path it names, the
    reason and the fix."""
    names = [shown(name) for name in (error.filename, error.filename2) if name is not None]
    where = " -> ".join(names) + ": " if names else ""
    reason = error.strerror or str(error)
    if error.errno in _BAD_PATHS:
        return f"{where}{reason}; {_BAD_PATHS[error.errno]}", 2
    fix = _FAULTS.get(error.errno, "a fault while working (a network's, say); run it again")
    if not names:  # a write to a file already open: "there" would name nothing
        fix = fix.replace(" there", " where the tool writes (its --out, --ckpt-dir, --log-dir)")
    return f"{where}{reason}; {fix}", 1


def shown(path: Any) -> str:
    """A path as it can be printed: bytes that are not UTF-8 escaped (``\\xff``)."""
    name = os.fsencode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    if isinstance(name, bytes):
        return name.decode("utf-8", "backslashreplace")
    return name


def read_json(path: str, what: str, fix: str) -> Any:
    """The JSON file ``path`` (``what`` it is, e.g. "a run's config.json"), or a
    `UsageError` naming the file, what is wrong with it and ``fix``."""
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        raise UsageError(f"{shown(path)} {not_there(path)}; {fix}") from None
    except OSError as error:
        raise UsageError(f"{shown(path)}: not readable ({error.strerror}); {fix}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{shown(path)} is not {what}: not UTF-8 text; {fix}") from None
    except json.JSONDecodeError as error:
        raise UsageError(
            f"{shown(path)} is not {what}: not JSON ({error.msg} at line {error.lineno}, "
            f"column {error.colno}); {fix}"
        ) from None


def key_of(data: Any, path: str, keys: Sequence[str], what: str, fix: str) -> Any:
    """``data[k0][k1]...``, read from the JSON file ``path``, or a `UsageError` naming the
    file and the first key that is missing or under something that is not an object."""
    for depth, key in enumerate(keys):
        if not isinstance(data, dict) or key not in data:
            named = ".".join(keys[: depth + 1])
            raise UsageError(f"{shown(path)} is not {what}: it has no {named!r}; {fix}")
        data = data[key]
    return data


def _is_utf8(arg: str) -> bool:
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _say(prog: str, line: str, code: int) -> int:
    sys.stderr.write(f"{prog}: error: {line}\n")
    return code
