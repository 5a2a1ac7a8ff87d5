"""The one exception jdp raises for bad input."""


class UsageError(ValueError):
    """Bad input from the user: a mesh, batch, model or dataset that cannot work.

    The message is one line that names the fix. The CLI prints it on stderr and
    exits with code 2; library callers get the exception.
    """
