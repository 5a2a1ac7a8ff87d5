"""Grain's worker processes for a loader's host work: started, watching their parent, and
their deaths told in one line."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable

import grain

from jdp.errors import LoaderError


def host_batches(
    reader: Callable[[int], dict], *, start: int, stop: int | None, workers: int = 0
) -> grain.IterDataset:
    """Grain's pipeline of host batches ``reader(start), reader(start + 1), ...``.

    With ``workers`` > 0 the reader runs in that many processes; batches still
    come out in order, so the result does not depend on the number of workers.
    """
    dataset = grain.MapDataset.range(start, stop if stop is not None else 2**62).map(reader)
    # The Loader's thread already overlaps host work with the step: no Grain threads.
    host = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if workers:
        _allow_grain_workers()
        # Arrays over 32 KiB travel from workers in shared memory, the rest pickled.
        # A worker whose pickled batch is larger than the pipe's buffer cannot exit
        # until the batch is read, so closing the loader waited out Grain's 25 s
        # per worker. The cost: the shared memory of batches still in flight when
        # the loader closes is removed at exit by Python's resource tracker, which
        # reports it ("leaked shared_memory objects").
        options = grain.experimental.DatasetOptions(min_shm_size=32 * 1024)
        host = grain.experimental.WithOptionsIterDataset(host, options)
        host = host.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers), worker_init_fn=die_with_parent
        )
    return host


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
