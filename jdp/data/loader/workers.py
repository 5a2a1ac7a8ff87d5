"""Grain's worker processes for a loader's host work: started, watching their parent, and
their deaths told in one line. Without workers a loader's thread calls the reader itself,
and Grain is not imported (about 0.2 s of a process's start on the 2-core development
machine)."""

from __future__ import annotations

import ast
import gc
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable

from jdp.errors import LoaderError, UsageError


def host_batches(
    reader: Callable[[int], dict], *, start: int, stop: int | None, workers: int = 0
) -> Iterable[dict]:
    """The host batches ``reader(start), reader(start + 1), ...``: with ``workers`` > 0,
    Grain's pipeline reading them in that many processes (they still come out in order,
    so the result does not depend on the number of workers); else the reader's calls, in
    the loader's thread, which already overlaps host work with the step."""
    indices = range(start, stop if stop is not None else 2**62)
    if not workers:
        return map(reader, indices)
    import grain

    check_main_guard()
    _allow_grain_workers()
    dataset = grain.MapDataset.range(indices.start, indices.stop).map(reader)
    host = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    # Arrays over 32 KiB travel from workers in shared memory, the rest pickled.
    # A worker whose pickled batch is larger than the pipe's buffer cannot exit
    # until the batch is read, so closing the loader waited out Grain's 25 s
    # per worker. A closing loader unlinks what it was sent (`release_shared_memory`).
    options = grain.experimental.DatasetOptions(min_shm_size=32 * 1024)
    host = grain.experimental.WithOptionsIterDataset(host, options)
    return host.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=workers), worker_init_fn=die_with_parent
    )


def check_main_guard() -> None:
    """Raises UsageError where worker processes would run the training again.

    A worker is a spawned process: it imports the script that started it again, as
    ``__mp_main__``. A script that trains at its top level, outside ``if __name__ ==
    "__main__":``, would start workers in each worker, which fails there; the parent
    then waits forever on a worker that never reads its task. So where the calling
    code runs at the top level of such a script, outside that block, the loader
    refuses to start its workers. Any case it cannot read it lets through.
    """
    found = _script_line()
    if found is None:
        return
    path, line = found
    try:
        with open(path, encoding="utf-8") as file:
            guarded = is_guarded(file.read(), line)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    if not guarded:
        raise UsageError(
            f"loader workers are processes that import {os.path.basename(path)} again, and "
            f"its line {line} would start them again in each; put that under "
            f'if __name__ == "__main__":, or start no workers (loader_workers=0 in the '
            f"config, --loader-workers 0, workers=0 in train_batches)"
        )


def _script_line() -> tuple[str, int] | None:
    """``(path, line)``: the top-level line of the script, run again by each spawned
    process, that led to this call; None where there is none (no file, a call not
    from the script's top level) or where a spawned process runs nothing again (a
    package's ``__main__``, ``python -m pkg``). A worker runs the script as
    ``__mp_main__``, its own ``__main__`` being another."""
    mains = {
        id(vars(module)): module
        for name in ("__main__", "__mp_main__")
        if (module := sys.modules.get(name)) is not None
    }
    frame = sys._getframe(2)
    while frame is not None and not (
        id(frame.f_globals) in mains and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:
        return None
    module = mains[id(frame.f_globals)]
    name = getattr(getattr(module, "__spec__", None), "name", None) or ""
    path = getattr(module, "__file__", None)
    if path is None or name == "__main__" or name.endswith(".__main__"):
        return None
    return path, frame.f_lineno


def is_guarded(source: str, line: int) -> bool:
    """Whether ``line`` of a module's ``source`` runs only under ``if __name__ ==
    "__main__":`` (in its body: its ``else`` runs in a worker too)."""
    return any(
        isinstance(node, ast.If)
        and _names_main(node.test)
        and node.body[0].lineno <= line <= node.body[-1].end_lineno
        for node in ast.walk(ast.parse(source))
    )


def _names_main(test: ast.expr) -> bool:
    """Whether ``test`` holds only where ``__name__ == "__main__"`` (either way round, or
    as one term of an ``and``)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_names_main(value) for value in test.values)
    if not (isinstance(test, ast.Compare) and [type(op) for op in test.ops] == [ast.Eq]):
        return False
    sides = {ast.dump(side) for side in (test.left, *test.comparators)}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def release_shared_memory() -> None:
    """Unlinks now the shared memory of the workers' batches that nothing holds any more.

    Each batch a worker sends in shared memory is unlinked when its last array is
    collected, by a thread of Grain's. A batch held in a reference cycle, or queued
    for that thread, would still exist at exit, where Python's resource tracker
    removes it and warns of "leaked shared_memory objects". So a closing loader
    collects the cycles and waits (at most `_RELEASE_SECONDS`) for the queued
    unlinks; that thread takes them in order.
    """
    from grain.multiprocessing import SharedMemoryArray  # a loader of workers imported it

    gc.collect()
    pool = getattr(SharedMemoryArray, "_del_thread_pool", None)
    try:
        if pool is not None:
            pool.apply_async(int).wait(_RELEASE_SECONDS)
    except ValueError:  # the pool already stopped, at the interpreter's exit
        pass


_RELEASE_SECONDS = 5.0


def die_with_parent(worker_index: int = 0, worker_count: int = 0) -> None:
    """In a worker process: exit when the process that started it is gone.

    A parent killed with SIGKILL cannot stop its workers, which would go on
    holding their memory; each worker watches its parent's pid instead (a
    daemon thread, once a second) and exits when it changes.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="jdp-watch-parent", daemon=True).start()


# Grain's word for a worker process that died (killed, out of memory).
_WORKER_DIED = re.compile(r"Worker process was terminated unexpectedly with exit code (-?\d+)")


def worker_died(error: BaseException) -> LoaderError | None:
    """A loader worker's death as one line naming it, or None for another error."""
    found = _WORKER_DIED.search(str(error))
    if found is None:
        return None
    code = int(found.group(1))
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return LoaderError(
        f"a loader worker process died ({how}; running out of memory is a common cause)"
    )


def _allow_grain_workers() -> None:
    """Grain 0.2.18 reads an absl flag in its worker set-up and fails when flags were
    never parsed, as in any program not started by ``absl.app`` (google/grain#1355)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
