"""The exceptions jdp raises: bad input, a run that stopped being finite, replicas or
batches that are not what they should be."""


class UsageError(ValueError):
    """Bad input from the user: a mesh, batch, model or dataset that cannot work.

    The message is one line that names the fix. The CLI prints it on stderr and
    exits with code 2; library callers get the exception.
    """


class NonFiniteError(RuntimeError):
    """Training stopped being finite (``--nan-policy``): a NaN or infinite loss or
    gradient, or too many skipped updates. The CLI prints it and exits with code 1;
    no non-finite state was saved.
    """


class DataLedgerError(RuntimeError):
    """A global batch was not the one the run's seed and step give (`jdp.data.splits.ledger`):
    a process read other rows, or the loader skipped or repeated a batch. The CLI
    prints it and exits with code 1; nothing trained on that batch was saved.
    """


class LoaderError(RuntimeError):
    """The training data stopped coming: a loader worker process died. The CLI saves the
    state of the last step, prints the line and exits with code 1."""


class ReplicaMismatchError(RuntimeError):
    """Replicas that should hold identical parameters do not (`jdp.distributed.check_replicas`).
    The CLI prints it and exits with code 1."""


# What the operating system says when a write fails, as it appears (nested) in the
# errors of Orbax, tensorstore and TFDS.
_OS_FAILURES = (
    "No space left on device",
    "Disk quota exceeded",
    "File too large",
    "Read-only file system",
    "Permission denied",
    "No such file or directory",
    "Operation not permitted",
    "Input/output error",
)


def os_failure(error: BaseException) -> str | None:
    """The operating system's reason inside a library's long error, if it holds one."""
    text = str(error).lower()
    return next((reason for reason in _OS_FAILURES if reason.lower() in text), None)


def check_input_file(path: str, what: str) -> None:
    """UsageError, naming ``what``, when ``path`` exists but is not a regular file (after
    links): a FIFO's read blocks until something writes, a device's (``/dev/zero``) never
    ends, a directory's fails. A missing path is left to the read, which names it."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "not a regular file (a FIFO, a socket or a device)"
        )
        raise UsageError(f"{what} {path} is {kind}; give a file")


def not_there(path: str, wanted: str = "a regular file") -> str:
    """Why ``path`` is not the ``wanted`` a tool looked for, in words: it "does not
    exist", or it is something else (a directory, a FIFO, a device, a broken link)."""
    import os
    import stat

    if not os.path.lexists(path):
        return "does not exist"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "is a link to nothing"
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a file")
    return f"is {kind}, not {wanted}"
