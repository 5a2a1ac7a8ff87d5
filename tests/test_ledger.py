"""The data ledger (`jdp.data.splits.ledger`): each logged step's global batch digest and the sum
since step 1, the same on any mesh, loader and resume, kept with the checkpoints, and a
batch that is not the one ``(seed, step)`` gives caught before it is saved."""

import json
import sys

import numpy as np
import pytest
from helpers import run_python

import jdp
from jdp.checkpoint import read_record, step_directory
from jdp.data.loader.readers import TrainReader
from jdp.data.splits.ledger import BATCH, TOTAL, TOTAL_BYTES, step_digests

QUIET = jdp.Console(enabled=False)


def _split(seed=0, rows=256):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    return jdp.data.from_arrays(x, (x[:, 0] > 0).astype(np.int32))


def _fit(split=None, **flags):
    config = jdp.TrainConfig(
        **{
            "model": "mlp",
            "steps": 12,
            "batch_size": 32,
            "log_every": 2,
            "warmup_steps": 2,
            "eval_every": 0,
            **flags,
        }
    )
    return jdp.fit(config, train=split or _split(), console=QUIET)


def _ledger(result, *keys):
    return {
        record["step"]: tuple(record[key] for key in keys)
        for record in result.history
        if record["kind"] == "train"
    }


def test_the_processes_rows_add_up_to_the_global_batch_digest():
    marks = []
    for rows in (slice(0, 8), slice(8, 32), slice(None)):  # two processes, and one
        reader = TrainReader(_split(), batch_size=32, seed=3, rows=rows, ledger="indices")
        marks.append(np.stack([batch["__ledger__"] for batch in reader.steps(4, 4)]))
    two, one = marks[0] + marks[1], marks[2]  # steps 5..8
    np.testing.assert_array_equal(two[:, 0], one[:, 0])
    np.testing.assert_array_equal(marks[0][:, 2], one[:, 0])  # each saw the global batch
    np.testing.assert_array_equal(one[:, 3], [5, 6, 7, 8])
    # A row shifted by one place, or another example in it, changes the step's digest.
    indices = np.arange(32)[None, :]
    base = step_digests(5, 32, np.arange(32), indices)
    assert step_digests(5, 32, np.arange(1, 33), indices) != base
    assert step_digests(5, 32, np.arange(32), indices + (np.arange(32) == 7)) != base
    assert step_digests(6, 32, np.arange(32), indices) != base


@pytest.mark.slow
def test_digests_do_not_depend_on_the_mesh_the_loader_or_steps_per_call():
    one = _ledger(_fit(mesh="data=1"), BATCH, TOTAL)
    assert sorted(one) == [2, 4, 6, 8, 10, 12] and len({v for v in one.values()}) == 6
    eight = _ledger(_fit(mesh="data=8", steps_per_call=2, loader_workers=1), BATCH, TOTAL)
    assert eight == one


@pytest.mark.slow
def test_a_resumed_run_records_the_uninterrupted_runs_digests(tmp_path):
    whole = _fit(mesh="data=2")
    _fit(mesh="data=2", steps=6, ckpt_dir=str(tmp_path))
    record = read_record(step_directory(str(tmp_path)))
    assert record.ledger == {"step": 6, "since": 0, "indices": _ledger(whole, TOTAL)[6][0]}
    resumed = _fit(mesh="data=4", steps=12, ckpt_dir=str(tmp_path))
    assert _ledger(resumed, BATCH, TOTAL) == {
        step: value for step, value in _ledger(whole, BATCH, TOTAL).items() if step > 6
    }


@pytest.mark.slow
def test_the_bytes_ledger_sees_new_data_under_the_same_indices():
    first = _fit(_split(seed=0), mesh="data=2", data_ledger="bytes")
    other = _fit(_split(seed=1), mesh="data=2", data_ledger="bytes")
    assert _ledger(first, TOTAL) == _ledger(other, TOTAL)  # the same examples' indices
    assert _ledger(first, TOTAL_BYTES)[12] != _ledger(other, TOTAL_BYTES)[12]
    assert TOTAL not in _fit(mesh="data=2", data_ledger="off").history[0]


@pytest.mark.slow
def test_a_skipped_batch_stops_the_run_before_it_is_saved(tmp_path, monkeypatch):
    from jdp.data.loader.pipeline import Loader

    step_once = Loader.__next__

    def skipping(self):  # the loader loses the batch of step 5
        if self.position == 4:
            step_once(self)
        return step_once(self)

    monkeypatch.setattr(Loader, "__next__", skipping)
    with pytest.raises(
        jdp.DataLedgerError,
        match=r"^the data ledger: step 6's global batch .*"
        r"the loader gave 7 batches since step 0, not those steps in order; "
        r"the last was step 7's",
    ):
        _fit(mesh="data=2", ckpt_every=4, ckpt_dir=str(tmp_path))
    assert read_record(step_directory(str(tmp_path))).step == 4  # saved before it, kept


# Process 1 reads the rows of its half of each global batch one place early: its first
# row is process 0's last, and the batch's last row is nobody's.
SHIFTED = """
import os, runpy, sys
from jdp.data.loader import readers
if os.environ["JDP_PROCESS_ID"] == "1":
    made = readers.TrainReader.__init__
    def shifted(self, *args, rows, **kwargs):
        made(self, *args, rows=slice(rows.start - 1, rows.stop - 1), **kwargs)
    readers.TrainReader.__init__ = shifted
sys.argv = ["jdp.train", *sys.argv[1:]]
runpy.run_module("jdp.train", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_process_reading_shifted_rows_is_caught(tmp_path):
    result = run_python(
        *"-m jdp.launch --nproc 2 --devices-per-process 2 --".split(),
        sys.executable,
        "-c",
        SHIFTED,
        *"--mesh data=-1 --steps 40 --log-every 20 --ckpt-dir".split(),
        tmp_path / "ckpt",
        "--ckpt-every",
        "20",
        timeout=240,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    for process in (0, 1):  # every process stops, neither left waiting in a collective
        assert (
            f"[{process}] jdp.train: error: the data ledger: step 20's global batch is "
            "not the one the run's order gives (the processes' rows do not add up to it: "
            "a process read other rows)"
        ) in result.stderr
    assert not (tmp_path / "ckpt" / "20").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_processes_that_read_the_same_rows_count_them_once(tmp_path):
    """--mesh model=4 over 2 processes of 2 devices: the batch is not split, both read
    every row, and the ledger is the one process's."""
    flags = ["--steps", "20", "--log-every", "10", "--eval-every", "0"]
    two = run_python(
        *"-m jdp.launch --nproc 2 --devices-per-process 2 --".split(),
        sys.executable,
        *"-m jdp.train --mesh model=4".split(),
        *flags,
        "--log-dir",
        tmp_path / "two",
        timeout=240,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_python(
        *"-m jdp.train --mesh data=1".split(),
        *flags,
        "--log-dir",
        tmp_path / "one",
        devices=1,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert _logged(tmp_path / "two") == _logged(tmp_path / "one")


def _logged(log_dir):
    with open(log_dir / "metrics.jsonl") as file:
        return {
            r["step"]: (r[BATCH], r[TOTAL]) for r in map(json.loads, file) if r["kind"] == "train"
        }
