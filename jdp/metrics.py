"""What a run reports: the console, metric writers (JSONL, TensorBoard), throughput and MFU.

Only process 0 prints and writes. Step metrics are fetched from the devices in a
background thread, so logging never makes the training loop wait for a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

# Off a terminal a bar is noise in a log; print a plain line this often instead.
_LOG_FRACTION = 0.1


class Console:
    """Prints run information from process 0 only, around a progress display.

    On a terminal the progress is a live bar on stderr; elsewhere (logs, CI) it
    is a plain line on stdout every tenth of the run.
    """

    def __init__(self, *, enabled: bool | None = None, interactive: bool | None = None):
        self._enabled = enabled
        self._interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = None
        self._total = 0
        self._done = 0
        self._next_log = 0

    @property
    def enabled(self) -> bool:
        # Asked on first use, not at construction: asking JAX which process this
        # is starts its backends, and simulated CPU devices must be set up first.
        if self._enabled is None:
            self._enabled = jax.process_index() == 0
        return self._enabled

    def line(self, text: str) -> None:
        """One line on stdout (above the progress bar when one is shown)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def start_progress(self, total: int) -> None:
        self._total, self._done = total, 0
        self._started = time.perf_counter()
        self._next_log = max(1, round(total * _LOG_FRACTION))
        if self.enabled and self._interactive:
            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)

    def advance(self, steps: int, **postfix: str) -> None:
        """Records ``steps`` more steps done; ``postfix`` (e.g. loss) is shown with them."""
        self._done += steps
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(steps)
        elif self._done >= self._next_log:
            self._next_log += max(1, round(self._total * _LOG_FRACTION))
            extra = " ".join(f"{key}={value}" for key, value in postfix.items())
            elapsed = time.perf_counter() - self._started
            eta = elapsed / self._done * (self._total - self._done)
            self.line(f"step {self._done}/{self._total} {extra} eta={eta:.0f}s".replace("  ", " "))

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def quiet_absl():
    """Hides absl warnings (TFDS and Orbax log through absl) while keeping errors."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# Peak dense bf16 FLOP/s of one device, from the vendors' datasheets, for MFU.
# Matched in order against `jax.Device.device_kind`; the first match wins.
PEAK_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v6 lite", 918e12),  # v6e
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v4 lite", None),  # v4i: no figure here
    ("TPU v4", 275e12),
)

# Seconds the writer thread lets records gather before fetching and writing them,
# and how many it writes before letting the training loop have the GIL.
_DRAIN_PAUSE = 0.2
_WRITE_GROUP = 16

# Record keys that describe speed rather than the model (TensorBoard's perf/ group).
_PERF_KEYS = ("examples_per_sec", "steps_per_sec", "flops_per_sec", "mfu")


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of a device kind, or None when jdp has no figure (CPUs, unknown kinds)."""
    kind = device_kind.lower()
    for name, flops in PEAK_FLOPS:
        if name.lower() in kind:
            return flops
    return None


def step_flops(lowered: jax.stages.Lowered, devices: int) -> float | None:
    """FLOPs of one step on all devices, from XLA's cost analysis of the lowered step.

    The data-parallel step is one program per device (its slice of the batch, and
    the optimizer update every replica repeats), so it is counted ``devices`` times.
    XLA counts a loop's body once: for a step that loops (gradient accumulation)
    the figure is too low, and callers leave it out.
    """
    flops = _flops(lowered.cost_analysis())
    if flops is None:  # some backends (GPU in JAX 0.11) analyse only the compiled program
        flops = _flops(lowered.compile().cost_analysis())
    return flops * devices if flops is not None else None


def _flops(analysis) -> float | None:
    if isinstance(analysis, Sequence):
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


class JsonlWriter:
    """One JSON object per line: ``{"kind": "train", "step": 20, "loss": ..., ...}``.

    A non-finite value (a diverged loss) is written as ``null``: JSON has no NaN.
    """

    def __init__(self, path: str):
        self._file = open(path, "a+")  # noqa: SIM115 (open for the writer's life; a resumed run appends)
        if self._file.tell():
            self._file.seek(self._file.tell() - 1)
            if self._file.read(1) != "\n":  # a run killed mid-line: start on a fresh one
                self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        clean = {
            key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()
        }
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """TensorBoard event files without TensorFlow: one event per record, holding its scalars.

    An event file is a sequence of TFRecords (length, masked CRC-32C, data,
    masked CRC-32C), each holding one ``tensorflow.Event`` protobuf. The three
    messages a scalar needs are encoded here directly (``_event``): a tenth of
    the cost of building them through a protobuf library, and tensorboardX's
    SummaryWriter (a multiprocessing queue per scalar, a pure-Python CRC) cost
    0.26 ms per record, a sixth of the default MLP's step. The tests read the
    files back with TensorBoard's own reader.
    """

    def __init__(self, log_dir: str):
        name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
        self._file = open(os.path.join(log_dir, name), "ab")  # noqa: SIM115 (the writer's life)
        self._append(_event(time.time(), 0, file_version="brain.Event:2"))

    def write(self, record: Mapping[str, Any]) -> None:
        scalars = {
            f"{'perf' if key in _PERF_KEYS else record['kind']}/{key}": value
            for key, value in record.items()
            if key not in ("kind", "step", "time")
        }
        self._append(_event(record["time"], record["step"], scalars=scalars))

    def _append(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header
            + struct.pack("<I", _masked_crc32c(header))
            + data
            + struct.pack("<I", _masked_crc32c(data))
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # protobuf's int64: a negative number as its two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _event(
    wall_time: float,
    step: int,
    *,
    scalars: Mapping[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    """A serialized ``tensorflow.Event``: wall_time = 1 (double), step = 2 (int64),
    file_version = 3 (string), summary = 5 (``Summary``: value = 1, repeated ``Value``:
    tag = 1, simple_value = 2 (float))."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        values = b"".join(
            _length_delimited(
                1, _length_delimited(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
            )
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, values)
    return out


def _masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns step rates into FLOP/s and MFU."""

    batch_size: int
    flops_per_step: float | None = None
    peak_flops: float | None = None  # of all devices together


class MetricLogger:
    """Writes step metrics every ``every`` steps without making the loop wait for them.

    ``record`` only queues the step's metric arrays. A thread takes what has
    gathered every 0.2 s, copies it to the host (stacked on a device first: one
    transfer per 16 records), adds examples/s, steps/s, FLOP/s and MFU over the
    steps since the previous record, and hands the records to the writers.
    ``latest`` is the newest record written (for the progress display).
    Disabled (``enabled=False``, every process but 0), it does nothing.
    """

    def __init__(
        self,
        writers: Sequence[Any] = (),
        *,
        every: int,
        throughput: Throughput,
        enabled: bool = True,
    ):
        self.every = every
        self.throughput = throughput  # may be set before the first record (FLOPs come later)
        self.latest: dict[str, Any] | None = None
        self._writers = list(writers)
        self._enabled = enabled
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._error: BaseException | None = None
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

    def close(self, *, timeout: float = 120.0) -> None:
        """Writes what is queued, closes the writers; raises what the thread raised.

        A fetch that never completes (a device that stopped) is given ``timeout``
        seconds; then the writers are closed with what they have.
        """
        if self._enabled and not self._closing.is_set():
            self._closing.set()
            self._queue.put(None)
            self._thread.join(timeout)
        for writer in self._writers:
            writer.close()
        self._writers = []
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
            for start in range(0, len(items), _WRITE_GROUP):
                if self._error is not None:
                    break
                try:
                    self._write(items[start : start + _WRITE_GROUP])
                except Exception as error:  # reported to the loop by the next record or close
                    self._error = error
                # Hand the GIL back: the loop, waking from its wait on a step, must not
                # queue behind many writes (Python's switch interval is 5 ms).
                time.sleep(0)
            for writer in self._writers:  # a live run's files stay current, and survive a kill
                writer.flush()

    def _write(self, items: list[tuple]) -> None:
        fetched = _fetch([values for _, _, values, _, _ in items])
        for (kind, step, _, dispatched, wall), values in zip(items, fetched, strict=True):
            record: dict[str, Any] = {"kind": kind, "step": step, "time": wall}
            record.update(values)
            if kind == "train":
                record.update(self._rates(step, dispatched))
                self.latest = record
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
        if self.throughput.flops_per_step:
            rates["flops_per_sec"] = steps_per_sec * self.throughput.flops_per_step
            if self.throughput.peak_flops:
                rates["mfu"] = rates["flops_per_sec"] / self.throughput.peak_flops
        return rates


# Device scalars are copied to the host in one transfer per this many (padded).
_FETCH_CHUNK = 8 * _WRITE_GROUP


@jax.jit
def _stack(*scalars: jax.Array) -> jax.Array:
    return jnp.stack([scalar.astype(jnp.float32) for scalar in scalars])


def _fetch(records: list[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Records' values as floats: device scalars stacked on a device, then copied at once.

    Copying scalars one by one costs some 7 us each in Python, which next to a
    1.5 ms step on a 2-core machine is most of what logging every step costs.
    Scalars are stacked per dtype, in chunks padded with zeros, so ``_stack``
    compiles once per dtype. Only this process's first copy of each is read:
    only process 0 logs, and a computation must not span the other processes.
    """
    by_dtype: dict[Any, list[tuple[int, jax.Array]]] = {}
    flat: list[Any] = [value for values in records for value in values.values()]
    for index, value in enumerate(flat):
        if isinstance(value, jax.Array):
            by_dtype.setdefault(value.dtype, []).append((index, value.addressable_data(0)))
    host = [None if isinstance(value, jax.Array) else float(value) for value in flat]
    for entries in by_dtype.values():
        zero = jnp.zeros((), entries[0][1].dtype, device=entries[0][1].device)
        for start in range(0, len(entries), _FETCH_CHUNK):
            chunk = entries[start : start + _FETCH_CHUNK]
            padded = [array for _, array in chunk] + [zero] * (_FETCH_CHUNK - len(chunk))
            for (index, _), value in zip(chunk, np.asarray(_stack(*padded)).tolist(), strict=False):
                host[index] = value
    values = iter(host)
    return [{key: next(values) for key in record} for record in records]


def open_writers(log_dir: str) -> list[Any]:
    """The JSONL and TensorBoard writers of a run directory."""
    os.makedirs(log_dir, exist_ok=True)
    return [JsonlWriter(os.path.join(log_dir, "metrics.jsonl")), TensorBoardWriter(log_dir)]


def write_run_info(log_dir: str, config: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
    """Writes ``config.json`` and ``run.json`` (versions, mesh, devices): enough to rerun it.

    A run resumed into the same directory keeps the first start's files and adds
    its own facts to ``run.json``'s ``resumed`` list.
    """
    import flax
    import optax

    import jdp

    os.makedirs(log_dir, exist_ok=True)
    devices = jax.devices()
    run = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": _command_line(),
        "versions": {
            "jdp": jdp.__version__,
            "jax": jax.__version__,
            "jaxlib": jax.lib.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "python": platform.python_version(),
        },
        "platform": devices[0].platform,
        "device_kinds": sorted({device.device_kind for device in devices}),
        "devices": len(devices),
        "processes": jax.process_count(),
        **facts,
    }
    run_path = os.path.join(log_dir, "run.json")
    if os.path.exists(run_path):
        with open(run_path) as file:
            first = json.load(file)
        first.setdefault("resumed", []).append(run)
        run = first
    else:
        with open(os.path.join(log_dir, "config.json"), "w") as file:
            json.dump(dict(config), file, indent=2)
    with open(run_path, "w") as file:
        json.dump(run, file, indent=2)


def _command_line() -> list[str]:
    """This process's command as typed: ``python -m jdp.train ...`` rather than a file path."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return ["python", *sys.argv]


class ProfileWindow:
    """A JAX profiler trace of steps ``first..last`` (inclusive) into ``directory``."""

    def __init__(self, first: int, last: int, directory: str):
        self.first, self.last, self.directory = first, last, directory
        self._tracing = False

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.directory)
            self._tracing = True

    def after(self, step: int, outputs: Any) -> None:
        if self._tracing and step == self.last:
            jax.block_until_ready(outputs)  # the trace holds the steps' device work
            self.stop()

    def stop(self) -> None:
        if self._tracing:
            self._tracing = False
            jax.profiler.stop_trace()
