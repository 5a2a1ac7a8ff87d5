"""Global batches whose contents depend only on ``(seed, step)``, loaded with Grain.

Training reads an endless stream of epochs, each a permutation of the split drawn
from ``(seed, epoch)``; step ``s`` takes positions ``[s*B, (s+1)*B)`` of it, and
its augmentation is drawn from ``(seed, s)`` for the whole global batch. Every
process computes the same global indices and loads only its own rows, so 1 device
and 8, or 1 process and 2, see the same examples in the same global batches, and
the loader's whole position is the next step.

A reader (`jdp.data.loader.readers`) does one step's host work (gather, preprocess,
augment); a Grain ``MapDataset`` indexed by step runs it, optionally in worker
processes; a ``Loader`` thread turns host batches into global arrays on the mesh
a few steps ahead of the train step.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import jax
from jax.sharding import Mesh

from jdp.data.loader.on_device import EvalIndexReader, HostChunks, IndexReader, OnDevice
from jdp.data.loader.readers import (
    NO_BOUNDS,
    CallBounds,
    ChunkedReader,
    EvalReader,
    Singles,
    StackedReader,
    TrainReader,
    item_steps,
)
from jdp.data.loader.streams import BatchStream, stream_rows
from jdp.data.loader.workers import host_batches, release_shared_memory, worker_died
from jdp.data.splits.ledger import take_marks
from jdp.data.splits.sources import Split
from jdp.errors import UsageError
from jdp.mesh import on_cpus, process_rows, shard_batch

_END = object()


# Training batches are read, preprocessed and placed on the devices up to
# TRAIN_CHUNK steps at a time, at most CHUNK_BYTES of them: a small batch's host
# work is mostly fixed cost (a transfer call alone took 94 us for a digits batch),
# and paid per batch by a thread beside a fast step it made the step wait.
TRAIN_CHUNK = 64
CHUNK_BYTES = 16 * 1024 * 1024
# The data ledger's marks of the steps given are summed when asked (at logged and
# saved steps), or once this many are held: a run that never logs holds no more.
MARKS_HELD = 1024


class Loader(Iterator[dict]):
    """Global batches on the mesh, made by Grain and placed ``prefetch`` batches ahead.

    Iterate it like any iterator; close it (or use it as a context manager) to stop its
    thread and workers. ``position`` is the index of the next batch, the whole state a
    resumed run needs; ``wait_seconds`` is the time callers spent blocked waiting for a
    batch. ``steps_per_item`` stacks that many steps' batches into one item, fewer where
    one of ``bounds`` comes sooner (`jdp.data.loader.readers.call_steps`, as the run's
    calls are); ``chunk`` has a `TrainReader` read, preprocess and place that many
    steps' batches at once, yielded one by one. ``prefetch`` counts items (or chunks) placed
    ahead. ``place=False`` yields the host's NumPy batches, for a step that places them
    itself (`places_ahead`). ``stream``, host batches already made
    (`jdp.data.loader.streams.stream_rows`), replaces the reader. ``device``: the reader
    gives index batches, gathered from that split on the devices.
    """

    def __init__(
        self,
        reader: Callable[[int], dict],
        mesh: Mesh,
        *,
        start: int,
        stop: int | None,
        workers: int = 0,
        prefetch: int = 2,
        steps_per_item: int = 1,
        chunk: int = 1,
        place: bool = True,
        stream: Iterable[dict] | None = None,
        device: OnDevice | HostChunks | None = None,
        bounds: CallBounds = NO_BOUNDS,
    ):
        if workers < 0 or prefetch < 1 or steps_per_item < 1:
            raise UsageError(
                f"need workers >= 0, prefetch >= 1 and steps_per_item >= 1, got "
                f"workers={workers} prefetch={prefetch} steps_per_item={steps_per_item}"
            )
        if stream is not None:  # your batches, in your order (jdp.data.loader.streams)
            if workers or steps_per_item > 1 or chunk > 1:
                raise UsageError(
                    "a stream of batches is read in this process, a batch a "
                    "step: no --loader-workers or --steps-per-call"
                )
            host = stream
        elif steps_per_item > 1 or chunk > 1:
            if stop is not None or not isinstance(reader, TrainReader):
                raise UsageError(
                    "stacked (steps_per_item > 1) or chunked (chunk > 1) batches are for "
                    "a TrainReader's endless training stream only"
                )
            if steps_per_item > 1:
                reader = StackedReader(
                    reader, steps=steps_per_item, start=start, calls=chunk, bounds=bounds
                )
            else:
                reader = ChunkedReader(reader, steps=chunk, start=start)
            host = host_batches(reader, start=0, stop=None, workers=workers)
        else:
            host = host_batches(reader, start=start, stop=stop, workers=workers)
        self.position = start
        self._steps_per_item = steps_per_item
        self._chunk: collections.deque = collections.deque()  # placed batches not yet taken
        self.wait_seconds = 0.0
        self._marks_last, self._marks_total = (0, 0, 0, start), [0, 0, 0]
        self._marks_given: list = []  # the marks of the batches given since `marks` was asked
        self._given, self._order = 0, 0
        self._mesh, self._place, self._device = mesh, place, device
        self._workers = workers
        # A deque and two semaphores rather than a queue.Queue: the consumer's
        # side is on the training loop's path every step, and Queue.get's
        # condition variable cost more than a fast step can spare.
        self._ready: collections.deque = collections.deque()
        self._free = threading.Semaphore(prefetch)
        self._filled = threading.Semaphore(0)
        self._stop = threading.Event()
        # Asked while the loop waits for a batch: an exception to raise instead of waiting
        # on (a signal's stop, a stall), or None.
        self.interrupt: Callable[[], BaseException | None] | None = None
        # Processes started before this loader's workers: not its to kill when it closes.
        self._others = {child.pid for child in multiprocessing.active_children()}
        self._thread = threading.Thread(target=self._fill, args=(host,), daemon=True)
        self._thread.start()

    def _fill(self, host) -> None:
        iterator = None
        try:
            iterator = iter(host)
            for item in iterator:
                marks = take_marks(item)
                stacked = self._steps_per_item > 1 and not isinstance(item, Singles)
                steps = item_steps(item) if stacked else 1  # a shorter call's, closing a gap
                if self._device:  # the indices placed (a chunk's stacked); the rows gathered there
                    item = self._device.gathered(item, stacked=stacked, place=self._place)
                elif self._place:  # a chunk (a list of batches) is placed in one transfer call
                    item = shard_batch(item, self._mesh, stacked=stacked)
                if not self._put((item, marks, steps)):
                    return
            self._put(_END)
        except BaseException as error:  # handed to the consumer, raised there
            self._put(error)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            if self._free.acquire(timeout=0.1):
                self._ready.append(item)
                self._filled.release()
                return True
        return False

    def __next__(self) -> dict:
        if self._stop.is_set():
            raise StopIteration
        waited = time.perf_counter()
        if self._chunk:
            item, marks, steps = self._chunk.popleft()
        else:
            self._wait()
            item = self._ready.popleft()
            self._free.release()
            if item is _END:
                self._stop.set()
                raise StopIteration
            if isinstance(item, BaseException):
                self.close()
                raise worker_died(item) or item
            item, marks, steps = item
            if isinstance(item, list):  # a chunk of batches
                marks = marks or [None] * len(item)
                self._chunk.extend(zip(item, marks, [steps] * len(item), strict=True))
                item, marks, steps = self._chunk.popleft()
        self.wait_seconds += time.perf_counter() - waited
        self.position += steps
        if marks is not None:  # the digests of the step (or steps) just given, summed when asked
            self._marks_given.append(marks)
            if len(self._marks_given) >= MARKS_HELD:
                self._sum_marks()
        return item

    def _wait(self) -> None:
        """Until a batch is ready, asking `interrupt` every `_ASK_EVERY` seconds."""
        if self._filled.acquire(blocking=False):
            return
        while not self._filled.acquire(timeout=_ASK_EVERY):
            if self.interrupt is not None and (error := self.interrupt()) is not None:
                raise error

    def marks(self) -> tuple[tuple[int, ...], list[int], int, int]:
        """The data ledger's marks (`jdp.data.splits.ledger`) of the batches given: the last
        step's ``(rows' digest, their bytes', the global batch's, step)``, the sums of
        the first three over every step given, how many steps it gave, and the sum of
        ``i * step`` over the i-th step given (their order)."""
        self._sum_marks()
        return self._marks_last, list(self._marks_total), self._given, self._order

    def _sum_marks(self) -> None:
        total, given = self._marks_total, self._marks_given
        for marks in given:
            for mark in marks:
                self._given += 1
                self._order += self._given * mark[3]
                for column in range(3):
                    total[column] = (total[column] + mark[column]) & _MASK64
        if given:
            self._marks_last = given[-1][-1]
            given.clear()

    def close(self) -> None:
        """Stops the thread and any Grain workers; the loader yields nothing more."""
        self._stop.set()
        self._thread.join(timeout=_CLOSE_SECONDS)
        if self._thread.is_alive():  # waiting on a worker that stopped (SIGSTOP, a hung read)
            for child in multiprocessing.active_children():
                if child.pid not in self._others:  # its own workers
                    child.kill()
            self._thread.join(timeout=_CLOSE_SECONDS)
        if self._workers:  # batches placed ahead, not taken: their shared memory goes now
            self._ready.clear()
            self._chunk.clear()
            release_shared_memory()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# Seconds between a waiting loop's questions to `Loader.interrupt`, and those a closing
# loader gives its thread to end before its worker processes are killed.
_ASK_EVERY, _CLOSE_SECONDS = 0.25, 5.0


_MASK64 = (1 << 64) - 1


def check_train_batch(split: Split, batch_size: int) -> None:
    """Raises UsageError when a global batch cannot be drawn from the split."""
    if isinstance(split, BatchStream):
        rows = len(split)  # the first batch's
        if rows != batch_size:
            raise UsageError(
                f"your batches have {rows} rows and the global batch is {batch_size}; "
                f"use --batch-size {rows}, or give batches of {batch_size}"
            )
        return
    if batch_size > len(split):
        raise UsageError(
            f"global batch {batch_size} is larger than the training split ({len(split)} "
            f"examples); use --batch-size {len(split)} or less"
        )


def train_batches(
    split: Split,
    mesh: Mesh,
    *,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    workers: int = 0,
    prefetch: int = 2,
    steps_per_call: int = 1,
    place: bool = True,
    ledger: str = "off",
    steps: int | None = None,
    bounds: CallBounds = NO_BOUNDS,
) -> Loader:
    """Global training batches (sharded on ``data``) from ``start_step`` on, forever.

    Args:
        split: the training split (``load_split``).
        mesh: the training mesh; this process loads only the rows its devices hold.
        batch_size: the global batch size.
        seed: with the step, the only input to order and augmentation.
        start_step: the first step to yield; a resumed run passes its loader position.
        workers: Grain worker processes for the host work (0: in a thread of this process).
        prefetch: global batches placed on the devices ahead of the step.
        steps_per_call: yield this many consecutive steps' batches stacked on a
            leading axis, for a step built with the same ``steps_per_call``.
        bounds: the steps at which a run acts between calls: where one comes before
            the next multiple of ``steps_per_call``, a shorter stack closes the gap up
            to it (`jdp.data.loader.readers.call_steps`).
        place: False yields the host's NumPy batches, which a train step's call
            places itself (where `places_ahead` says that costs the host less).
        steps: the batches a run will take (None: not known); chunks of steps made at
            once are no longer (nor, on the devices, their gather's program). Past
            them the batches go on, the same.

    Raises:
        UsageError: the batch is larger than the split.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> split = jdp.load_split("digits", "train", data_dir=tmp)
        >>> with jdp.train_batches(split, mesh, batch_size=128, seed=0) as batches:
        ...     batch = next(batches)
        >>> batch["image"].shape, batch["label"].shape
        ((128, 8, 8, 1), (128,))
    """
    check_train_batch(split, batch_size)
    shared = {
        "start": start_step,
        "stop": None,
        "workers": workers,
        "prefetch": prefetch,
        "steps_per_item": steps_per_call,
        "place": place,
    }
    if isinstance(split, BatchStream):  # your batches, in your order
        rows = process_rows(mesh, batch_size)
        stream = stream_rows(split, start=start_step, batch_size=batch_size, rows=rows)
        return Loader(None, mesh, stream=stream, **shared)
    on_device = isinstance(split, OnDevice)
    shared["workers"] = workers = 0 if on_device else workers  # nothing to read on the host
    reader = (IndexReader if on_device else TrainReader)(
        split, batch_size=batch_size, seed=seed, rows=process_rows(mesh, batch_size), ledger=ledger
    )
    return Loader(
        reader,
        mesh,
        # Chunks are for the loader's own thread, whose per-batch cost they save;
        # Grain workers pay that cost in other processes.
        chunk=1 if workers else max(1, _chunk_steps(reader, start_step, steps) // steps_per_call),
        device=split.for_steps(steps) if on_device else None,
        bounds=bounds,
        **shared,
    )


def places_ahead(mesh: Mesh) -> bool:
    """Whether a training loop's loader should place its batches on the devices ahead of
    the step (else the step's call takes the host's arrays and places them itself).

    Ahead, except on one CPU device in one process: there placing is a copy in host
    memory, and `jax.device_put`'s Python cost the loader's thread about 18 us a leaf
    (37 us a digits batch), CPU taken from a step that keeps both cores of a 2-core
    machine busy; the step's call places a NumPy batch in C++, for about 4 us a leaf.
    On an accelerator the transfer overlaps the step; with several devices XLA:CPU's
    programs all-reduce, and a NumPy argument would be split on the loop's path.
    """
    return not (jax.process_count() == 1 and mesh.devices.size == 1 and on_cpus(mesh))


def _chunk_steps(reader: TrainReader, step: int, steps: int | None) -> int:
    """How many steps' batches to read and place at once (see TRAIN_CHUNK), at most the
    ``steps`` a run takes; one for a split that decodes each batch (`jdp.data.formats.images`),
    whose encoded bytes read in bulk would be TRAIN_CHUNK batches' worth held at once,
    for an overhead that decoding dwarfs."""
    if getattr(reader.split, "decodes", False):
        return 1
    if isinstance(reader.split, OnDevice):  # the rows gathered, not their indices
        nbytes = reader.split.nbytes * reader.batch_size // len(reader.split)
    else:
        nbytes = sum(value.nbytes for value in reader(step).values())
    most = TRAIN_CHUNK if steps is None else min(TRAIN_CHUNK, steps)
    return max(1, min(most, CHUNK_BYTES // max(1, nbytes)))


def eval_batches(
    split: Split, mesh: Mesh, *, batch_size: int, prefetch: int = 2, batches: int = 0
) -> Loader:
    """The split once, in order, as global batches with a ``mask``; the last is padded.
    ``batches``: the first that many only (0: all).

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> test = jdp.load_split("digits", "test", data_dir=tmp)
        >>> [int(batch["mask"].sum()) for batch in jdp.eval_batches(test, mesh, batch_size=128)]
        [128, 128, 103]
    """
    on_device = isinstance(split, OnDevice)
    reader = (EvalIndexReader if on_device else EvalReader)(
        split, batch_size=batch_size, rows=process_rows(mesh, batch_size)
    )
    stop = min(len(reader), batches) if batches else len(reader)
    return Loader(
        reader, mesh, start=0, stop=stop, prefetch=prefetch, device=split if on_device else None
    )
