"""Run directories: TensorBoard events, JSONL records, run facts, profiles, plots, MFU."""

import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli, subprocess_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jdp
from jdp.plot import main as plot_main
from jdp.plot import read_run
from jdp.report.logger import MetricLogger
from jdp.report.throughput import Throughput, peak_flops
from jdp.report.writers import JsonlWriter, TensorBoardWriter, output_file

_RUN = ["--mesh", "data=8", "--steps", "60", "--warmup-steps", "10", "--eval-every", "30"]


def _env():
    return subprocess_env()  # the commands set up their devices


def _train(*flags, launch=None, timeout=240):
    command = [sys.executable, "-m", "jdp.train", *_RUN, *flags]
    if launch:
        command = [sys.executable, "-m", "jdp.launch", *launch, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env())


def _records(log_dir, kind):
    with open(os.path.join(log_dir, "metrics.jsonl")) as file:
        return [r for r in map(json.loads, file) if r["kind"] == kind]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run in this process (what it writes is the point, not its start); the command
    line a run directory records is checked on a fresh one's, `test_only_process_0_writes`."""
    log_dir = tmp_path_factory.mktemp("run") / "adam"
    result = cli(
        *_RUN, "--log-dir", str(log_dir), *"--log-every 10 --profile-steps 5:8 --grad-norm".split()
    )
    assert result.returncode == 0, result.stderr
    return log_dir, result.stdout


def test_jsonl_has_one_record_per_logging_step(run_dir):
    log_dir, _ = run_dir
    train = _records(log_dir, "train")
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
    for record in train:
        assert {"step", "time", "loss", "lr", "grad_norm"} <= record.keys()
    for record in train[1:]:  # rates are over the steps since the previous record
        assert record["examples_per_sec"] > 0 and record["steps_per_sec"] > 0
        assert record["flops_per_sec"] > 0
        assert "mfu" not in record  # no peak figure for CPUs
    evals = _records(log_dir, "eval")
    assert [r["step"] for r in evals] == [30, 60]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["count"] == 359 for r in evals)


def test_tensorboard_reads_the_scalars(run_dir):
    log_dir, _ = run_dir
    (events,) = [name for name in os.listdir(log_dir) if "tfevents" in name]
    accumulator = EventAccumulator(str(log_dir / events))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/accuracy"} <= tags
    assert {"perf/examples_per_sec", "perf/steps_per_sec", "perf/flops_per_sec"} <= tags
    assert "eval/count" not in tags  # a fact of the record (in metrics.jsonl), not a curve
    loss = accumulator.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20, 30, 40, 50, 60]
    jsonl = [r["loss"] for r in _records(log_dir, "train")]
    np.testing.assert_allclose([e.value for e in loss], jsonl, rtol=1e-6)


def test_run_directory_says_how_to_rerun(run_dir):
    log_dir, stdout = run_dir
    config = json.loads((log_dir / "config.json").read_text())
    assert config["mesh"] == "data=8" and config["steps"] == 60 and config["log_every"] == 10
    run = json.loads((log_dir / "run.json").read_text())
    assert run["versions"]["jax"] == jax.__version__ and "jdp" in run["versions"]
    assert run["mesh"] == {"data": 8} and run["devices"] == 8 and run["processes"] == 1
    assert run["device_kinds"] == ["cpu"] and run["peak_flops_per_device"] is None
    assert run["flops_per_step"] > 0
    assert re.search(
        r"^jdp: [\d.e+]+ model FLOPs per step; XLA counts [\d.e+]+ on 8 devices", stdout, re.M
    )


def test_profile_trace_is_written(run_dir):
    log_dir, _ = run_dir
    traces = [
        name
        for _, _, files in os.walk(log_dir / "profile")
        for name in files
        if name.endswith((".xplane.pb", ".trace.json.gz"))
    ]
    assert len(traces) == 2, traces


def test_plot_writes_a_png_of_runs(run_dir, tmp_path, capsys):
    log_dir, _ = run_dir
    out = tmp_path / "curves.png"
    assert plot_main([str(log_dir), str(log_dir), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert plot_main([str(tmp_path), "--out", str(out)]) == 2
    assert "has no metrics.jsonl; train with --log-dir" in capsys.readouterr().err
    # Bytes that are not UTF-8 make their line unreadable, as a line cut short is.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "metrics.jsonl").write_bytes(
        (log_dir / "metrics.jsonl").read_bytes() + b'{"kind": "train", "step": 9\xff}\n'
    )
    assert plot_main([str(damaged), "--out", str(out)]) == 0
    assert "jdp.plot: skipped 1 unreadable line(s)" in capsys.readouterr().err
    # Without a suffix the PNG is curves.png: the line names the file written.
    assert plot_main([str(log_dir), "--out", str(tmp_path / "curves")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"jdp.plot: wrote {out}"


def test_an_output_is_only_ever_a_regular_file_in_a_directory(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/null", tmp_path / "device")
    os.symlink(tmp_path / "target.json", tmp_path / "link.json")
    refused = {
        "fifo": "is not a regular file (a FIFO, a socket or a device)",
        "device": f"(a link to {os.path.realpath('/dev/null')}) is not a regular file",
        ".": "is a directory",
        "no/such.json": f"its directory {tmp_path / 'no'} does not exist",
    }
    for name, words in refused.items():
        with pytest.raises(jdp.UsageError, match=re.escape(words)):
            output_file(str(tmp_path / name), "--out")
    # A link is written through to its target, never replaced by a file of its own.
    assert output_file(str(tmp_path / "link.json"), "--out") == str(tmp_path / "target.json")
    assert output_file(str(tmp_path / "new.json"), "--out") == str(tmp_path / "new.json")


@pytest.mark.slow
def test_only_process_0_writes(tmp_path):
    log_dir = tmp_path / "two"
    result = _train(
        "--log-dir",
        str(log_dir),
        "--log-every",
        "20",
        launch=["--nproc", "2", "--devices-per-process", "4"],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    events = [name for name in os.listdir(log_dir) if "tfevents" in name]
    assert len(events) == 1  # one writer, process 0's (the file name holds its pid)
    assert [r["step"] for r in _records(log_dir, "train")] == [20, 40, 60]
    run = json.loads((log_dir / "run.json").read_text())
    assert run["processes"] == 2
    assert run["command"] == [
        "python",
        "-m",
        "jdp.train",
        *_RUN,
        "--log-dir",
        str(log_dir),
        "--log-every",
        "20",
    ]  # as typed, to rerun it


def test_a_disabled_logger_writes_nothing(mesh8):
    records = []

    class Recorder:
        def write(self, record):
            records.append(record)

        def flush(self):
            pass

        def close(self):
            pass

    metrics = {"loss": jax.device_put(np.float32(1.0))}
    with MetricLogger([Recorder()], every=1, throughput=Throughput(8), enabled=False) as logger:
        logger.record(1, metrics)
        logger.write("eval", 1, {"accuracy": 1.0})
    assert records == []


def test_logger_rates_and_errors(capfd):
    written = []

    class Writer:
        def write(self, record):
            if record["step"] == 99:
                raise OSError(28, "No space left on device")
            if record["step"] == 98:
                raise ValueError("not a number")
            written.append(record)

        def flush(self):
            pass

        def close(self):
            pass

    throughput = Throughput(batch_size=10, flops_per_step=1e6, peak_flops=1e9)
    logger = MetricLogger([Writer()], every=2, throughput=throughput)
    for step in range(1, 7):
        logger.record(step, {"loss": jax.device_put(np.float32(step))})
        time.sleep(0.01)
    logger.close()
    assert [r["step"] for r in written] == [2, 4, 6]
    assert "examples_per_sec" not in written[0]
    rate = written[1]["steps_per_sec"]
    assert written[1]["examples_per_sec"] == pytest.approx(10 * rate)
    assert written[1]["mfu"] == pytest.approx(rate * 1e6 / 1e9)
    assert logger.latest["step"] == 6

    # A full disk: one warning, and the run goes on without its metric files.
    full = MetricLogger([Writer()], every=1, throughput=throughput)
    for step in (99, 99, 100):
        full.record(step, {"loss": jax.device_put(np.float32(0))})
    full.close()
    err = capfd.readouterr().err
    assert err.count("jdp: warning: metrics are no longer written: No space left on device") == 1
    assert written[-1]["step"] == 6  # nothing more was written
    # Any other failure is a bug to report, not to train past.
    failing = MetricLogger([Writer()], every=1, throughput=throughput)
    failing.record(98, {"loss": jax.device_put(np.float32(0))})
    with pytest.raises(RuntimeError, match="writing metrics failed: not a number"):
        failing.close()


def test_scalars_read_in_place_are_the_values_a_stacked_copy_gives(monkeypatch):
    """On the CPU the logger reads each scalar where it lies; an accelerator's are
    stacked on the device and copied at once (`_stack`, run here on the CPU): the
    same floats, over more than one copy's chunk (128) and several dtypes."""
    from jdp.report import logger

    records = [
        {
            "loss": jax.device_put(np.float32(step / 3 if step != 7 else np.nan)),
            "count": jax.device_put(np.int32(step + (1 << 24) * (step % 2))),  # float32 rounds
            "half": jax.device_put(jnp.bfloat16(step / 10)),
            "lr": 0.5,
            "note": "host values pass as they are",
        }
        for step in range(150)
    ]
    in_place = logger._fetch(records)
    monkeypatch.setattr(logger, "_READ_IN_PLACE", frozenset())
    assert repr(in_place) == repr(logger._fetch(records))  # nan prints alike
    assert in_place[3]["loss"] == float(np.float32(1.0)) and in_place[148]["count"] == 148.0


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 NVL", 835e12),
        ("TPU v4 lite", None),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("cpu", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_table(kind, peak):
    assert peak_flops(kind) == peak


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--profile-steps", "5:8"], "--profile-steps needs --log-dir DIR"),
        (["--profile-steps", "8-5", "--log-dir", "x"], "write FIRST:LAST steps"),
        (["--profile-steps", "50:80", "--log-dir", "x"], "ends after --steps 60"),
        (["--log-every", "0"], "--log-every must be at least 1"),
    ],
)
def test_bad_logging_flags_are_one_line(flags, needle):
    result = cli(*_RUN, *flags)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert needle in result.stderr


def test_records_reach_the_files_while_the_run_goes_on(tmp_path):
    logger = MetricLogger(
        [JsonlWriter(str(tmp_path / "metrics.jsonl"))], every=1, throughput=Throughput(8)
    )
    logger.record(1, {"loss": jax.device_put(np.float32(0.5))})
    deadline = time.monotonic() + 10
    while not (tmp_path / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline, "nothing flushed before close"
        time.sleep(0.05)
    logger.close()


def test_jsonl_survives_a_cut_line_and_writes_nan_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 1.0}\n{"kind": "train", "st')
    writer = JsonlWriter(str(path))
    writer.write({"kind": "train", "step": 2, "loss": float("nan")})
    writer.close()
    lines = path.read_text().splitlines()
    assert lines[2] == '{"kind": "train", "step": 2, "loss": null}'
    records = read_run(str(tmp_path))["train"]
    assert sorted(records) == [1, 2] and "loss" not in records[2]


def test_event_file_holds_large_and_negative_steps(tmp_path):
    writer = TensorBoardWriter(str(tmp_path))
    for step in (-1, 0, 2**40):
        writer.write({"kind": "train", "step": step, "time": 1.0, "loss": 0.25})
    writer.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("train/loss")] == [-1, 0, 2**40]


def test_the_plot_draws_every_split_a_run_evaluated(tmp_path):
    from jdp.plot import panels

    records = [
        {
            "kind": "train",
            "step": s,
            "loss": 1.0 / s,
            "accuracy": 0.5,
            "lr": 1e-3,
            "examples_per_sec": 100.0,
        }
        for s in (10, 20, 30)
    ]
    records += [{"kind": "val", "step": s, "loss": 0.5, "accuracy": 0.8} for s in (10, 20, 30)]
    records.append({"kind": "eval", "step": 30, "loss": 0.6, "accuracy": 0.75})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn = panels({"run": read_run(str(tmp_path))})
    by_title = {title.split(" (")[0]: lines for title, _, _, _, lines in drawn}
    for panel in ("Loss", "Accuracy"):
        kinds = {kind: (list(steps), len(values)) for _, kind, _, steps, values in by_title[panel]}
        assert kinds == {"train": ([10, 20, 30], 3), "val": ([10, 20, 30], 3), "eval": ([30], 1)}, (
            panel
        )
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
