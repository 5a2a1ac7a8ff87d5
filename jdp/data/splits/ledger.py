"""The data ledger: which examples each step's global batch held, as digests a run records.

Every row a process reads gets a 64-bit hash of its place in the run's stream of
examples (the step and its place in the global batch) and its example index; a
step's digest is the sum of its rows' hashes (mod 2^64), and the ledger the sum of
every step's since step 1. Sums do not care which process read a row, so a run on
1 process and one on 2, a resumed run and a replayed one, record the same digests
when they trained on the same batches; a row that moved, repeated or went missing
changes them. ``bytes`` adds a second pair of digests over the rows' bytes as read
(before augmentation), for data that may change under the same indices.

The readers hash their rows as they read them, in the loader's thread or workers,
and with them the whole global batch as ``(seed, step)`` gives it (they draw its
indices anyway); the loader sums both as it hands the batches over (`Loader.marks`).
At a logged or saved step the processes' sums are added up (with several
processes, through the coordinator's key-value store) and checked: the rows read
must add up to the global batches, and each loader must have given each step once,
in order. Either failing stops every process (`DataLedgerError`) before it trains
on more. The global batch's digest comes from the same order the readers draw
from: the check finds rows read wrongly, not a wrong seed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import jax
import numpy as np

from jdp.errors import DataLedgerError

LEDGER_KEY = "__ledger__"  # a host batch's digests, taken out before it goes to the devices
MODES = ("indices", "bytes", "off")

# The record keys: the step's digests, and the sums since step 1 (the ledger).
BATCH, TOTAL = "batch_digest", "data_ledger"
BATCH_BYTES, TOTAL_BYTES = "batch_bytes_digest", "data_ledger_bytes"
# A step's marks, as the readers attach them: its rows' index and bytes digests, the
# whole global batch's index digest, and the step (1-based, as logged).
MARKS = 4

_MASK = (1 << 64) - 1
_MIX = (
    np.uint64(30),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(27),
    np.uint64(0x94D049BB133111EB),
    np.uint64(31),
)
_PLACE = np.uint64(0x9E3779B97F4A7C15)  # keeps place 0's hash from being mix(0) = 0


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place on a fresh uint64 array: every input bit moves
    about half the output bits."""
    first, times, second, again, third = _MIX
    x ^= x >> first
    x *= times
    x ^= x >> second
    x *= again
    x ^= x >> third
    return x


def step_digests(first: int, batch_size: int, places: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The digests of steps ``first, first + 1, ...`` (1-based) over rows at ``places``
    of their global batches with ``values`` (example indices or bytes hashes)
    ``(steps, rows)``: each step's sum of ``mix(mix(place in the run's stream) ^ value)``."""
    steps = np.arange(first - 1, first - 1 + len(values), dtype=np.uint64)[:, None]
    stream = steps * np.uint64(batch_size) + np.asarray(places, np.uint64)[None, :]
    hashes = _mix(_mix(stream + _PLACE) ^ np.asarray(values).astype(np.uint64))
    return hashes.sum(axis=1, dtype=np.uint64)


def bytes_hashes(batch: Mapping[str, np.ndarray], rows: int) -> np.ndarray:
    """A 64-bit hash of each row's bytes over every array of ``batch`` (by name)."""
    hashes = np.zeros(rows, np.uint64)
    for name in sorted(batch):
        array = batch[name]
        if array.dtype == object:  # encoded images: one bytes object a row
            flat = [bytes(row) for row in array.reshape(-1)]
        else:
            flat = [row.tobytes() for row in np.ascontiguousarray(array).reshape(rows, -1)]
        column = np.array(
            [
                int.from_bytes(hashlib.blake2b(row, digest_size=8).digest(), "little")
                for row in flat
            ],
            np.uint64,
        )
        hashes = _mix(hashes ^ column)
    return hashes


def marks(
    first: int,
    batch_size: int,
    rows: slice,
    stream: np.ndarray,
    batch: Mapping[str, np.ndarray] | None,
) -> np.ndarray:
    """What a reader attaches to each step's host batch, ``(steps, MARKS)`` uint64: for
    steps ``first ..`` (1-based) of the global batches ``stream`` ``(steps, batch)``,
    the digest of this process's ``rows`` of each, of their bytes (with ``batch``, the
    rows as read, step by step; else 0), of the whole global batch, and the step."""
    count, places = len(stream), np.arange(batch_size)
    out = np.zeros((count, MARKS), np.uint64)
    out[:, 2] = step_digests(first, batch_size, places, stream)
    if places[rows].size == batch_size:
        out[:, 0] = out[:, 2]  # one process reads every row
    else:
        out[:, 0] = step_digests(first, batch_size, places[rows], stream[:, rows])
    if batch is not None:
        local = stream[:, rows]
        hashes = bytes_hashes(batch, local.size).reshape(local.shape)
        out[:, 1] = step_digests(first, batch_size, places[rows], hashes)
    out[:, 3] = np.arange(first, first + count)
    return out


def hex64(value: int) -> str:
    return f"{int(value) & _MASK:016x}"


class Ledger:
    """The run's ledger at its logged and saved steps, checked as it is read.

    Args:
        loader: the training `Loader`, whose ``marks`` are this process's sums.
        rows: the rows of each global batch this process reads (`process_rows`):
            processes that read the same rows (a ``model`` axis across processes)
            count them once.
        start: the step the run starts after (a resume's).
        base: the ledger as the checkpoint resumed from recorded it
            (``{"step", "since", "indices"[, "bytes", "bytes_since"]}``), or None or {}
            (a fresh run, or a checkpoint that kept none: the ledger counts from
            ``start``).
        with_bytes: whether the readers digest the rows' bytes too.
        timeout: seconds to wait for the other processes' sums.
    """

    def __init__(
        self,
        loader,
        *,
        rows: slice,
        start: int,
        base: Mapping | None,
        with_bytes: bool,
        timeout: float = 300.0,
    ):
        self.loader, self.start, self.with_bytes = loader, start, with_bytes
        self.rows, self.timeout = (rows.start, rows.stop), timeout
        base = dict(base or {}) if (base or {}).get("step") == start else {}
        self.since = int(base.get("since", start))  # the ledger sums the steps after this
        self.bytes_since = int(base.get("bytes_since", self.since)) if "bytes" in base else start
        self._base = [int(base.get(name, "0"), 16) for name in ("indices", "bytes")]
        self._at: tuple[int, dict[str, str]] | None = None

    def at(self, step: int) -> dict[str, str]:
        """The digests of ``step`` and the ledger through it.

        Raises:
            DataLedgerError: in every process, when the rows the processes read do not
                add up to the global batches the run's order gives, or a loader did not
                give each step up to ``step`` once, in order.
        """
        if self._at is not None and self._at[0] == step:
            return self._at[1]
        previous = self._at[0] if self._at is not None else None
        reports = _exchange(step, self._report(step), self.timeout, forget=previous)
        problems = [
            f"process {number}: {report['problem']}" if len(reports) > 1 else report["problem"]
            for number, report in enumerate(reports)
            if report["problem"]
        ]
        distinct = {tuple(report["rows"]): report for report in reports}.values()
        batch, batch_bytes, rows, rows_bytes = (
            sum(report[key][column] for report in distinct) & _MASK
            for key, column in (("last", 0), ("last", 1), ("total", 0), ("total", 1))
        )
        if not problems and (batch != reports[0]["last"][2] or rows != reports[0]["total"][2]):
            problems = ["the processes' rows do not add up to it: a process read other rows"]
        if problems:
            raise DataLedgerError(
                f"the data ledger: step {step}'s global batch is not the one the run's order "
                f"gives ({'; '.join(problems)}); stopping at step {step}, before training on "
                "more; the checkpoints saved before it are kept"
            )
        values = {BATCH: hex64(batch), TOTAL: hex64(rows + self._base[0])}
        if self.with_bytes:
            values |= {
                BATCH_BYTES: hex64(batch_bytes),
                TOTAL_BYTES: hex64(rows_bytes + self._base[1]),
            }
        self._at = (step, values)
        return values

    def _report(self, step: int) -> dict:
        """This process's sums, and what is wrong with its loader's steps, if anything."""
        last, total, count, order = self.loader.marks()
        # The i-th batch given must be step start + i: their count, the last, and the
        # sum of i * step (a skipped, repeated or swapped batch changes it).
        steps = step - self.start
        want = self.start * steps * (steps + 1) // 2 + steps * (steps + 1) * (2 * steps + 1) // 6
        problem = None
        if count != steps or last[3] != step or order != want:
            problem = (
                f"the loader gave {count} batches since step {self.start}, not those "
                f"steps in order; the last was step {last[3]}'s"
            )
        return {"rows": self.rows, "last": list(last), "total": total, "problem": problem}

    def record(self, step: int) -> dict[str, object]:
        """What a checkpoint of ``step`` records: the ledger through it."""
        values = self.at(step)
        return {
            "step": step,
            "since": self.since,
            "indices": values[TOTAL],
            **(
                {"bytes": values[TOTAL_BYTES], "bytes_since": self.bytes_since}
                if self.with_bytes
                else {}
            ),
        }


def _exchange(step: int, report: dict, timeout: float, *, forget: int | None) -> list[dict]:
    """Every process's report of ``step``, in process order. With several processes they
    travel through the coordinator's key-value store: host to host, never waiting for
    the devices (a collective would queue behind the step in flight). This process's
    report of step ``forget`` is deleted: every process read it before reporting
    ``step``."""
    if jax.process_count() == 1:
        return [report]
    from jax._src import distributed

    client, me = distributed.global_state.client, jax.process_index()
    client.key_value_set(f"jdp/ledger/{step}/{me}", json.dumps(report))
    reports = []
    for number in range(jax.process_count()):
        key = f"jdp/ledger/{step}/{number}"
        try:
            reports.append(json.loads(client.blocking_key_value_get(key, int(timeout * 1000))))
        except Exception as error:  # the runtime's deadline: a process that stopped
            raise DataLedgerError(
                f"the data ledger: process {number} did not report step {step} within "
                f"{timeout:.0f} s ({str(error).splitlines()[0][:200]})"
            ) from None
    if forget is not None:
        client.key_value_delete(f"jdp/ledger/{forget}/{me}")
    return reports


def take_marks(item):
    """The ledger's marks (`jdp.data.splits.ledger`) taken out of a host item, as Python ints
    (cheaper to add on the loop's path than NumPy's): a list of its step's (or stacked
    steps') marks; for a chunk, a list of them; None without."""
    if isinstance(item, list):
        marks = [take_marks(batch) for batch in item]
        return None if marks[0] is None else marks
    marks = item.pop(LEDGER_KEY, None)
    return None if marks is None else marks.reshape(-1, MARKS).tolist()
