"""The exceptions jdp raises: bad input, and a run that stopped being finite."""


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
