"""What a run says while it runs (compiling, progress off a terminal) and the history
it returns, curve by curve."""

import dataclasses
import fcntl
import os
import struct
import termios

import numpy as np
import pytest

import jdp
from jdp.report import console as console_module


@pytest.mark.slow
def test_a_run_says_it_compiles_and_how_long_it_took(capsys):
    config = jdp.TrainConfig(
        mesh="data=2", steps=20, warmup_steps=2, validation_fraction=0.2, eval_every=10
    )
    result = jdp.fit(config, console=jdp.Console(enabled=True, interactive=False))
    lines = capsys.readouterr().out.splitlines()
    assert "jdp: compiling the train step" in lines
    compiled = [line for line in lines if line.startswith("jdp: compiled and ran the first call")]
    assert len(compiled) == 1 and lines.index(compiled[0]) > lines.index(
        "jdp: compiling the train step"
    )
    history = result.history
    assert history.steps("val/loss") == [10, 20] and len(history["val_loss"]) == 2
    assert history["val/accuracy"] == [r["accuracy"] for r in history if r["kind"] == "val"]
    assert history["test/accuracy"] == [result.test_accuracy]  # the test split, at the end
    assert history["loss"] == history["train/loss"] == history["train_loss"]
    assert set(history.curves()) >= {"train/loss", "train/lr", "val/loss", "test/loss"}
    assert (history[0]["kind"], history[0]["step"]) == ("val", 10)  # still the list of records
    with pytest.raises(KeyError, match="no curve 'val/perplexity'; the run logged: val/accuracy"):
        history["val/perplexity"]


def test_off_a_terminal_progress_is_said_at_least_every_so_many_seconds(capsys, monkeypatch):
    console = jdp.Console(enabled=True, interactive=False)
    console.start_progress(1000)
    console.advance(20, loss="1.0")  # 2% of the run, within the interval: silent
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(console_module, "_LOG_SECONDS", 0.0)
    console.advance(20, loss="0.9")
    assert capsys.readouterr().out.startswith("step 40/1000 loss=0.9 eta=")


def test_a_resumed_run_counts_the_runs_steps_not_this_starts(capsys, monkeypatch):
    """Resumed at step 2000 of 2600 (an elastic restart), the lines say step 2060/2600,
    as its evaluations do, not 60/600."""
    monkeypatch.setattr(console_module, "_LOG_SECONDS", 0.0)
    console = jdp.Console(enabled=True, interactive=False)
    console.start_progress(2600, 2000)
    console.advance(60, loss="0.5")
    assert capsys.readouterr().out.startswith("step 2060/2600 loss=0.5")


def test_the_eta_is_the_pace_after_the_first_call_which_compiled(capsys, monkeypatch):
    """A 20 s compile in the first call, then 0.1 s a step: 5,000 steps left are about 500 s,
    not the 28 hours the first call's pace says (the line after it says none)."""
    now = [0.0]
    monkeypatch.setattr(console_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(console_module, "_LOG_SECONDS", 0.0)
    console = jdp.Console(enabled=True, interactive=False)
    console.start_progress(5001)
    now[0] = 20.0
    console.advance(1, loss="2.0")
    assert capsys.readouterr().out == "step 1/5001 loss=2.0\n"  # no pace yet: no eta
    now[0] = 21.0
    console.advance(10, loss="1.9")
    assert capsys.readouterr().out == "step 11/5001 loss=1.9 eta=499s\n"


def test_a_terminal_without_a_size_gets_lines_not_a_bar():
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as stream:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            assert stream.isatty() and not console_module.has_size(stream)
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            assert console_module.has_size(stream)
    finally:
        os.close(leader)
        os.close(follower)


def test_the_display_reads_the_loss_only_for_a_line_it_prints(capsys):
    import types

    from jdp.actions import Progress
    from jdp.training.run_actions import Display

    class Loss:  # a device value whose every read is counted
        reads = 0

        def __init__(self, value):
            self.value = value

        def __array__(self, dtype=None, copy=None):
            Loss.reads += 1
            return np.asarray(self.value, dtype)

    console = jdp.Console(enabled=True, interactive=False)
    display = Display(console, types.SimpleNamespace(latest=None), every=20)
    progress = Progress(step=0, steps=1000, state=None)
    display(progress)
    console.start_progress(1000)
    for step in range(1, 121):
        progress.after_call(step, 1, None, {"loss": Loss(1.0 / step)})
        display(progress)
    # Shown: step 20's loss after step 21 ... step 100's after 101 (the line at 10% of
    # the run); only that one is read, and printed.
    assert Loss.reads == 1
    assert capsys.readouterr().out.startswith("step 100/1000 loss=0.0100 eta=")


def _finished(parts: dict, examples_per_sec: float = 1e4):
    from jdp.training.results import FitResult

    goodput = {"wall": sum(parts.values()), "goodput": 0.0, "parts": parts}
    return FitResult(
        state=None,
        steps=100,
        train_loss=0.1,
        test_loss=0.1,
        test_accuracy=0.9,
        examples_per_sec=examples_per_sec,
        input_wait=0.0,
        wall_seconds=9.0,
        goodput=goodput,
    )


@pytest.mark.parametrize(
    ("parts", "rate", "flags", "said"),
    [
        (
            {"startup": 6.0, "compile": 2.0, "step": 0.5},
            1e4,
            {},
            "start-up 6.0 s, compiling 2.0 s, training steps 0.5 s (what examples/s measures); "
            "most of it went to start-up: more --steps amortise it",
        ),
        (
            {"startup": 1.0, "input": 5.0, "step": 3.0},
            1e4,
            {},
            "most of it went to waiting for batches: --loader-workers 2 (or more), "
            "or --data-on-device on",
        ),
        (
            {"startup": 1.0, "step": 9.0},
            1e5,
            {"steps_per_call": 1},
            "training steps of 1.28 ms each, short enough that the host's dispatch of each "
            "call is a share of them: --steps-per-call auto chooses",
        ),
        (
            {"startup": 1.0, "step": 9.0},
            1e5,
            {},
            "training steps of 1.28 ms each, short enough that the host's dispatch of each "
            "call is a share of them (--steps-per-call auto's line says how many",
        ),
        (
            {"startup": 1.0, "step": 9.0},
            1e5,
            {"steps_per_call": 4},
            "most of it went to training steps, the model's own compute",
        ),
        ({"startup": 1.0, "step": 9.0}, 1e4, {}, "training steps, the model's own compute"),
    ],
)
def test_the_last_lines_say_what_limited_the_run_and_the_flag_that_helps(parts, rate, flags, said):
    """From the run's own ledger: examples/s counts the steady steps alone, which in a short
    run are a few percent of it; the line says where the rest went."""
    from jdp.training.limits import what_limited

    line = what_limited(jdp.TrainConfig(**flags), _finished(parts, rate))
    wall = sum(parts.values())
    assert line.startswith(f"jdp: where the {wall:.1f} s from the process's start went: ")
    assert said in line, line
    preempted = dataclasses.replace(_finished(parts, rate), preempted="jdp.train: SIGTERM ...")
    assert what_limited(jdp.TrainConfig(), preempted) is None


def test_a_run_with_no_timed_step_reports_no_rate():
    """One step is one call, which compiles: no step is timed, so no rate is made up."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    train = jdp.data.from_arrays(x, (x[:, 0] > 0).astype(np.int32))
    config = jdp.TrainConfig(mesh="data=2", steps=1, batch_size=16, warmup_steps=0)
    result = jdp.fit(config, train=train, console=jdp.Console(enabled=False))
    assert np.isnan(result.examples_per_sec) and " examples/s=nan " in result.summary_line()
