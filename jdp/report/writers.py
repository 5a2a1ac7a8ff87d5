"""Where metric records go: the writer protocol, JSONL and TensorBoard writers."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any, Protocol

from jdp.distributed.lock import refuse_a_live_runs
from jdp.errors import UsageError
from jdp.report.events import event, masked_crc32c

# Record keys that describe speed rather than the model (TensorBoard's perf/ group).
_PERF_KEYS = ("examples_per_sec", "tokens_per_sec", "steps_per_sec", "flops_per_sec", "mfu")

# Record keys that are facts about a record, not curves: the evaluation's example
# count stays in metrics.jsonl and out of TensorBoard and the trackers.
_NOT_CURVES = ("kind", "step", "time", "count")


def curves(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record's scalars under the names TensorBoard and the trackers show: ``KIND/NAME``
    (``train/loss``, ``test/accuracy``), speed as ``perf/NAME``."""
    return {
        f"{'perf' if key in _PERF_KEYS else record['kind']}/{key}": value
        for key, value in record.items()
        if key not in _NOT_CURVES and not isinstance(value, str)  # the data ledger's digests
    }


class Writer(Protocol):
    """What the metric logger hands records to: a dict with ``kind``, ``step``,
    ``time`` and the scalars; ``flush`` after each batch of records."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


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
    messages a scalar needs are encoded here directly (`jdp.report.events`): a tenth of
    the cost of building them through a protobuf library, and tensorboardX's
    SummaryWriter (a multiprocessing queue per scalar, a pure-Python CRC) cost
    0.26 ms per record, a sixth of the default MLP's step. The tests read the
    files back with TensorBoard's own reader.
    """

    def __init__(self, log_dir: str):
        name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
        self._file = open(os.path.join(log_dir, name), "ab")  # noqa: SIM115 (the writer's life)
        self._append(event(time.time(), 0, file_version="brain.Event:2"))

    def write(self, record: Mapping[str, Any]) -> None:
        self._append(event(record["time"], record["step"], scalars=curves(record)))

    def _append(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header
            + struct.pack("<I", masked_crc32c(header))
            + data
            + struct.pack("<I", masked_crc32c(data))
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def output_file(path: str, flag: str) -> str:
    """The regular file ``path`` names, to write whole: ``path`` itself, or a link's
    target (written through, never replaced by a file of its own). Refused, in one line:
    a directory, a FIFO, a socket or a device (renaming a file over one would replace it;
    writing into one blocks or goes nowhere), or a path whose directory does not exist.

    Raises:
        UsageError: one line naming the flag and the fix.
    """
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        kind = (
            "a directory"
            if os.path.isdir(target)
            else "not a regular file (a FIFO, a socket or a device)"
        )
        via = f" (a link to {target})" if target != os.path.abspath(path) else ""
        raise UsageError(f"{flag} {path}{via} is {kind}; give the path of a file to write")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise UsageError(
            f"{flag} {path}: its directory {folder} does not exist; create it, or give another path"
        )
    return target


def check_writable(directory: str, flag: str) -> None:
    """Creates ``directory`` and writes and removes a probe file in it, or says why not.

    Raises:
        UsageError: one line naming the flag and the reason.
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"{flag} {directory} is a file, not a directory")
    if flag in ("--log-dir", "--ckpt-dir"):  # a live run's own is its lock's to refuse
        refuse_a_live_runs(directory, flag, itself=flag == "--log-dir")
    probe = os.path.join(directory, f".jdp-probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as file:
            file.write("probe")
        os.remove(probe)
    except OSError as error:
        raise UsageError(
            f"cannot write in {flag} {directory} ({error.strerror or error}); choose a "
            "writable directory"
        ) from None
