"""The metric logger: step metrics fetched and written off the training loop's path.

Only process 0 writes. Step metrics are fetched from the devices in a background
thread, so logging never makes the training loop wait for a step.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.report.throughput import Throughput
from jdp.report.writers import Writer

# Seconds the writer thread lets records gather before fetching and writing them,
# and how many it writes before letting the training loop have the GIL.
_DRAIN_PAUSE = 0.2
_WRITE_GROUP = 16
_DESCRIBE, _TAG = "__describe__", "__tag__"  # queued beside records, for the trackers


class MetricLogger:
    """Writes step metrics every ``every`` steps without making the loop wait for them.

    ``record`` only queues the step's metric arrays. A thread takes what has
    gathered every 0.2 s, copies it to the host (stacked on a device first: one
    transfer per 16 records), adds examples/s, steps/s, FLOP/s and MFU over the
    steps since the previous record, and hands the records to the writers.
    ``latest`` is the newest record written (for the progress display), ``history``
    all of them.
    Disabled (``enabled=False``, every process but 0), it does nothing.
    """

    def __init__(
        self,
        writers: Sequence[Writer] = (),
        *,
        every: int,
        throughput: Throughput,
        enabled: bool = True,
    ):
        self.every = every
        self.throughput = throughput  # may be set before the first record (FLOPs come later)
        self.latest: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []  # every record written, oldest first
        self._writers = list(writers)
        self._enabled = enabled
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._error: BaseException | None = None
        self._stopped_writing = False
        self._previous: tuple[int, float] | None = None
        self._thread = threading.Thread(target=self._drain, name="jdp-metrics", daemon=True)
        if enabled:
            self._thread.start()

    def record(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
        """Queues ``metrics`` of ``step`` when ``step`` is a logging step; never waits."""
        if not self._enabled or self._closing.is_set() or step % self.every:
            return
        self._raise_error()
        self._queue.put(("train", step, metrics, time.perf_counter(), time.time()))

    def write(self, kind: str, step: int, scalars: Mapping[str, float]) -> None:
        """Queues host values (say an eval's results) as a record of ``kind``."""
        if self._enabled and not self._closing.is_set():
            self._queue.put((kind, step, dict(scalars), None, time.time()))

    def describe(self, config: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
        """Hands the run's config and facts to the trackers that take them, off the loop."""
        if self._enabled and not self._closing.is_set():
            self._queue.put((_DESCRIBE, 0, (dict(config), dict(facts)), None, time.time()))

    def tag(self, name: str, value: str) -> None:
        """Tags the run in the trackers that take tags (the final checkpoint's path)."""
        if self._enabled and not self._closing.is_set():
            self._queue.put((_TAG, 0, (name, value), None, time.time()))

    def close(self, *, timeout: float = 120.0) -> None:
        """Writes what is queued, closes the writers; raises what the thread raised.

        A fetch that never completes (a device that stopped) is given ``timeout``
        seconds; then the writers are closed with what they have.
        """
        if self._enabled and not self._closing.is_set():
            self._closing.set()
            self._queue.put(None)
            self._thread.join(timeout)
        writers, self._writers = self._writers, []
        for writer in writers:
            try:
                writer.close()
            except OSError as error:
                self._stop_writing(error)
        self._raise_error()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the error on its way out matters more
            self.close(timeout=10.0)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing metrics failed: {error}") from error

    def _drain(self) -> None:
        done = False
        while not done:
            items = [self._queue.get()]
            self._closing.wait(_DRAIN_PAUSE)  # let records gather: one fetch for many
            while not self._queue.empty():
                items.append(self._queue.get())
            done = any(item is None for item in items)
            items = [item for item in items if item is not None]
            self._hand_over([item for item in items if item[0] in (_DESCRIBE, _TAG)])
            items = [item for item in items if item[0] not in (_DESCRIBE, _TAG)]
            for start in range(0, len(items), _WRITE_GROUP):
                if self._error is not None:
                    break
                try:
                    self._write(items[start : start + _WRITE_GROUP])
                except OSError as error:  # a full disk: the run goes on without its files
                    self._stop_writing(error)
                except Exception as error:  # reported to the loop by the next record or close
                    self._error = error
                # Hand the GIL back: the loop, waking from its wait on a step, must not
                # queue behind many writes (Python's switch interval is 5 ms).
                time.sleep(0)
            try:
                for writer in self._writers:  # a live run's files stay current, survive a kill
                    writer.flush()
            except OSError as error:
                self._stop_writing(error)

    def _hand_over(self, items: list[tuple]) -> None:
        """A description or a tag, to each writer that has the method for it."""
        for kind, _, payload, _, _ in items:
            for writer in self._writers:
                method = getattr(writer, "describe" if kind == _DESCRIBE else "tag", None)
                if method is not None:
                    method(*payload)

    def _stop_writing(self, error: OSError) -> None:
        """Says once that the metric files can no longer be written, and stops writing them."""
        writers, self._writers = self._writers, []
        for writer in writers:
            with contextlib.suppress(OSError):
                writer.close()
        if not self._stopped_writing:
            self._stopped_writing = True
            where = f" ({error.filename})" if error.filename else ""
            print(
                f"jdp: warning: metrics are no longer written: {error.strerror or error}{where}; "
                "training goes on (free space in --log-dir to keep its files whole)",
                file=sys.stderr,
                flush=True,
            )

    def _write(self, items: list[tuple]) -> None:
        fetched = _fetch([values for _, _, values, _, _ in items])
        for (kind, step, _, dispatched, wall), values in zip(items, fetched, strict=True):
            record: dict[str, Any] = {"kind": kind, "step": step, "time": wall}
            record.update(values)
            if kind == "train":
                record.update(self._rates(step, dispatched))
                if self.throughput.tokens_per_example:
                    tokens = self.throughput.batch_size * self.throughput.tokens_per_example
                    record["tokens_seen"] = step * tokens
                self.latest = record
            self.history.append(record)
            for writer in self._writers:
                writer.write(record)

    def _rates(self, step: int, dispatched: float) -> dict[str, float]:
        previous, self._previous = self._previous, (step, dispatched)
        if previous is None or dispatched <= previous[1]:
            return {}
        steps_per_sec = (step - previous[0]) / (dispatched - previous[1])
        rates = {
            "examples_per_sec": steps_per_sec * self.throughput.batch_size,
            "steps_per_sec": steps_per_sec,
        }
        if self.throughput.tokens_per_example:
            rates["tokens_per_sec"] = rates["examples_per_sec"] * self.throughput.tokens_per_example
        if self.throughput.flops_per_step:
            rates["flops_per_sec"] = steps_per_sec * self.throughput.flops_per_step
            if self.throughput.peak_flops:
                rates["mfu"] = rates["flops_per_sec"] / self.throughput.peak_flops
        return rates


# Device scalars are copied to the host in one transfer per this many (padded), but on
# the platforms whose arrays lie in host memory, read where they lie (`_fetch`).
_FETCH_CHUNK = 8 * _WRITE_GROUP
_READ_IN_PLACE = frozenset({"cpu"})


@jax.jit
def _stack(*scalars: jax.Array) -> jax.Array:
    return jnp.stack([scalar.astype(jnp.float32) for scalar in scalars])


def _fetch(records: list[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Records' values as floats: an accelerator's scalars stacked on it and copied at once.

    Copying an accelerator's scalars one by one costs some 7 us each in Python, which next to a
    1.5 ms step on a 2-core machine is most of what logging every step costs.
    Scalars are stacked per dtype, in chunks padded with zeros, so ``_stack``
    compiles once per dtype. Only this process's first copy of each is read:
    only process 0 logs, and a computation must not span the other processes. On a
    CPU device a scalar is read where it lies (about a microsecond): no program, whose
    compile (30 ms) fell inside a short run's timed steps, on the cores they use.
    """
    by_dtype: dict[Any, list[tuple[int, jax.Array]]] = {}
    flat: list[Any] = [value for values in records for value in values.values()]
    for index, value in enumerate(flat):
        if isinstance(value, jax.Array):
            by_dtype.setdefault(value.dtype, []).append((index, value.addressable_data(0)))
    host = [
        None if isinstance(value, jax.Array) else value if isinstance(value, str) else float(value)
        for value in flat
    ]
    for entries in by_dtype.values():
        if entries[0][1].device.platform in _READ_IN_PLACE:
            for index, array in entries:
                host[index] = float(np.asarray(array).astype(np.float32))
            continue
        zero = jnp.zeros((), entries[0][1].dtype, device=entries[0][1].device)
        for start in range(0, len(entries), _FETCH_CHUNK):
            chunk = entries[start : start + _FETCH_CHUNK]
            padded = [array for _, array in chunk] + [zero] * (_FETCH_CHUNK - len(chunk))
            for (index, _), value in zip(chunk, np.asarray(_stack(*padded)).tolist(), strict=False):
                host[index] = value
    values = iter(host)
    return [{key: next(values) for key in record} for record in records]
