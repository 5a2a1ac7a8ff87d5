"""The goodput ledger (`jdp.report.goodput`): a run's wall time in parts that add up to it,
across restarts, in run.json, the summary line and the plot. A killed and restarted run's
recomputed steps are counted in tests/test_elastic.py."""

import json
import time

import numpy as np
import pytest

import jdp
from jdp.plot import main as plot_main
from jdp.report.goodput import PARTS, Clock, Goodput, summarize


def _attempt(started, seconds, *, step=0.0, ended=None, recomputed=0):
    parts = dict.fromkeys(PARTS, 0.0) | {"startup": seconds - step, "step": step}
    attempt = {
        "started": started,
        "updated": started + seconds,
        "parts": parts,
        "recomputed_steps": recomputed,
    }
    return attempt | ({"ended": ended} if ended else {})


def test_a_failed_attempts_gap_is_restart_time_and_a_finished_ones_is_not():
    killed = _attempt(100.0, 10.0, step=8.0)
    restarted = _attempt(115.0, 20.0, step=16.0, ended="finished", recomputed=30)
    later = _attempt(1000.0, 10.0, step=9.0, ended="finished")  # resumed with more steps
    accounting = summarize([killed, restarted, later])
    assert accounting["wall"] == pytest.approx(10 + 5 + 20 + 10)
    assert accounting["parts"]["restart"] == pytest.approx(5.0)
    assert accounting["restarts"] == 1 and accounting["recomputed_steps"] == 30
    assert accounting["goodput"] == pytest.approx(33 / 45)
    assert sum(accounting["parts"].values()) == pytest.approx(accounting["wall"])


def test_the_clock_gives_each_moment_to_one_part():
    clock = Clock()
    began = time.perf_counter()
    assert clock.switch("step") == "startup"
    time.sleep(0.05)
    assert clock.switch("input") == "step"
    parts = clock.parts()
    elapsed = time.perf_counter() - began
    assert parts["step"] >= 0.05
    assert sum(parts.values()) - parts["startup"] <= elapsed + 1e-3


QUIET = jdp.Console(enabled=False)


def _fit(log_dir, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype(np.float32)
    config = jdp.TrainConfig(
        model="mlp",
        mesh="data=2",
        steps=steps,
        batch_size=32,
        warmup_steps=2,
        log_every=4,
        log_dir=str(log_dir),
        ckpt_dir=str(log_dir / "ckpt"),
    )
    return jdp.fit(
        config, train=jdp.data.from_arrays(x, (x[:, 0] > 0).astype(np.int32)), console=QUIET
    )


@pytest.mark.slow
def test_a_run_accounts_its_wall_time_in_run_json_the_summary_and_the_plot(tmp_path, capsys):
    result = _fit(tmp_path, 12)
    accounting = result.goodput
    assert accounting == json.loads((tmp_path / "run.json").read_text())["goodput"]
    parts = accounting["parts"]
    assert parts["step"] > 0 and parts["compile"] > 0 and parts["checkpoint"] > 0
    # From fit's call (a jdp command's would start at its process's start).
    assert abs(sum(parts.values()) - accounting["wall"]) <= 0.02 * accounting["wall"]
    assert f"goodput={accounting['goodput']:.1%} " in result.summary_line()
    # Resumed later with more steps: the time between the two is nobody's.
    time.sleep(1.0)
    again = _fit(tmp_path, 20).goodput
    assert again["restarts"] == 0 and again["recomputed_steps"] == 0
    assert again["parts"]["step"] > parts["step"]
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "curves.png")]) == 0
    assert f"goodput {again['goodput']:.1%} of {again['wall']:.1f}s: startup" in (
        capsys.readouterr().out
    )


def test_a_new_run_in_a_finished_runs_directory_starts_a_new_ledger(tmp_path):
    finished = Goodput(Clock(), str(tmp_path))
    finished.start(0)
    finished.progress(50)
    finished.finish("finished")
    again = Goodput(Clock(), str(tmp_path))
    again.start(0)  # from scratch (no checkpoint): nothing is computed again, nothing before
    assert again.before == [] and again.redo_until == 0
    killed = Goodput(Clock(), str(tmp_path))
    killed.start(0)
    killed.progress(30)
    killed._write()  # as a live run does, then never finishes
    restarted = Goodput(Clock(), str(tmp_path))
    restarted.start(20)
    restarted.progress(25)  # killed again before it reached step 30: 5 steps again so far
    accounting = restarted.finish("preempted")
    assert restarted.redo_until == 30 and accounting["recomputed_steps"] == 5


@pytest.mark.parametrize(
    "text",
    [
        '{"attempts": [{"started": 1.0, "upd',  # cut short
        '{"attempts": [{"started": 1.0, "updated": 2.0, "parts": {}}]}',  # no steps: edited
        '{"attempts": [{"started": "1", "updated": 2.0, "start_step": 0, "last_step": 9, '
        '"parts": {}}]}',  # a time in quotes
        "[1, 2]",  # another shape
    ],
    ids=["cut", "edited", "quoted", "shape"],
)
def test_a_damaged_bookkeeping_file_is_set_aside_and_the_run_goes_on(tmp_path, capsys, text):
    from jdp.report.trackers import _run_ids

    (tmp_path / "goodput.json").write_text(text)
    ledger = Goodput(Clock(), str(tmp_path))
    ledger.start(7)  # a resume: what was before is dropped, not a KeyError
    assert ledger.before == [] and ledger.finish("finished")["wall"] >= 0
    assert json.loads((tmp_path / "goodput.json").read_text())["attempts"][0]["start_step"] == 7
    (aside,) = tmp_path.glob("goodput.json.damaged-*")
    assert aside.read_text() == text
    (tmp_path / "trackers.json").write_text(text.replace("attempts", "mlflow"))
    assert _run_ids(str(tmp_path)) == {}  # a new MLflow run, not a silenced tracker
    assert not (tmp_path / "trackers.json").exists()
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and all(line.startswith("jdp: warning: ") for line in said), said
    assert f"{tmp_path / 'goodput.json'} is damaged" in said[0] and str(aside) in said[0]
    assert "trackers.json is damaged" in said[1] and "the run goes on without it" in said[1]
