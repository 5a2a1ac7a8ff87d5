"""What a resume keeps and what it refuses (the warmup jdp chose, the data trained on), and
what a kill loses (saves by the clock)."""

import os
import sys

import numpy as np
import pytest

import jdp
from jdp.checkpoint import read_record, step_directory


def _lines(capsys):
    return capsys.readouterr().out.splitlines()


@pytest.mark.slow
def test_raising_steps_keeps_the_warmup_jdp_cut_for_a_short_run(tmp_path, capsys):
    console = jdp.Console(enabled=True, interactive=False)
    config = jdp.TrainConfig(mesh="data=2", steps=20, ckpt_dir=str(tmp_path))
    jdp.fit(config, console=console)
    assert (
        "jdp: --warmup-steps 40 is longer than the run's 20 steps; warming up over 2 "
        "steps (a tenth) instead" in _lines(capsys)
    )
    # The user never set the warmup: raising --steps continues the run, as the README says.
    # The same command restarts a preempted run: --init-from's weights give way, and it
    # says so.
    again = jdp.TrainConfig(
        mesh="data=2", steps=40, ckpt_dir=str(tmp_path), init_from=str(tmp_path)
    )
    result = jdp.fit(again, console=console)
    lines = _lines(capsys)
    assert f"jdp: --warmup-steps 2, as the run in {tmp_path} started with" in lines
    assert any(line.startswith("jdp: resuming from step 20") for line in lines), lines
    assert (
        f"jdp: --init-from {tmp_path} starts a new run only; this one goes on from its "
        "checkpoint's parameters, not those" in lines
    )
    assert result.steps == 40
    assert read_record(step_directory(str(tmp_path))).config["warmup_steps"] == 2
    # A warmup the user chose is theirs: another one is refused, as any other setting.
    with pytest.raises(jdp.UsageError, match=r"--warmup-steps 5 \(was 2\)"):
        jdp.fit(
            jdp.TrainConfig(mesh="data=2", steps=60, warmup_steps=5, ckpt_dir=str(tmp_path)),
            console=console,
        )


def _npz(path, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    np.savez(path, x_train=x, y_train=y, x_test=x[:32], y_test=y[:32])


@pytest.mark.slow
def test_a_resume_on_other_data_is_refused_unless_asked_for(tmp_path):
    from helpers import run_cli

    data, ckpt = tmp_path / "mine.npz", tmp_path / "run"
    flags = [
        "--dataset",
        f"npz:{data}",
        *"--mesh data=2 --batch-size 16 --warmup-steps 2 --ckpt-dir".split(),
        str(ckpt),
    ]
    _npz(data, seed=0)
    assert run_cli(*flags, "--steps", "10", timeout=180).returncode == 0
    _npz(data, seed=1)  # the same path, new contents
    result = run_cli(*flags, "--steps", "20", timeout=180)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"jdp.train: error: {ckpt} holds a run trained on other data: the train split is not "
        "the one its checkpoints recorded; resume on that data, pass --allow-new-data to go "
        "on with this run on this data, or start a new run from its parameters with --init-from"
    )
    result = run_cli(*flags, "--steps", "20", "--allow-new-data", timeout=180)
    assert result.returncode == 0, result.stderr
    assert "jdp: resuming from step 10" in result.stdout


@pytest.mark.slow
def test_fit_refuses_other_arrays_and_another_corpus(tmp_path):
    quiet = jdp.Console(enabled=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    config = jdp.TrainConfig(
        mesh="data=2", steps=4, batch_size=16, warmup_steps=1, ckpt_dir=str(tmp_path / "arrays")
    )
    jdp.fit(config, train=jdp.data.from_arrays(x, y), console=quiet)
    more = jdp.TrainConfig(**{**config.__dict__, "steps": 8})
    with pytest.raises(jdp.UsageError, match="holds a run trained on other data: the train"):
        jdp.fit(more, train=jdp.data.from_arrays(x[::-1].copy(), y[::-1].copy()), console=quiet)
    assert jdp.fit(more, train=jdp.data.from_arrays(x, y), console=quiet).steps == 8

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    np.save(corpus / "train.npy", rng.integers(0, 256, 5000).astype(np.uint16))
    np.save(corpus / "val.npy", rng.integers(0, 256, 1000).astype(np.uint16))
    lm = jdp.TrainConfig(
        mesh="data=2",
        steps=2,
        batch_size=4,
        warmup_steps=1,
        model="gpt",
        dataset=f"tokens:{corpus}",
        vocab_size=256,
        seq_len=16,
        ckpt_dir=str(tmp_path / "lm"),
    )
    jdp.fit(lm, console=quiet)
    np.save(corpus / "train.npy", rng.integers(0, 256, 5000).astype(np.uint16))  # regenerated
    with pytest.raises(jdp.UsageError, match="holds a run trained on other data: the train"):
        jdp.fit(jdp.TrainConfig(**{**lm.__dict__, "steps": 4}), console=quiet)


@pytest.mark.slow
def test_a_run_saves_by_the_clock_and_a_kill_loses_at_most_that(tmp_path):
    import signal
    import subprocess
    import time

    from helpers import run_cli, subprocess_env

    flags = [
        *"--mesh data=2 --steps 1000000 --ckpt-dir".split(),
        str(tmp_path),
        "--ckpt-every-minutes",
        "0.02",
    ]
    run = subprocess.Popen(
        [sys.executable, "-m", "jdp.train", *flags],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len([name for name in os.listdir(tmp_path) if name.isdigit()]) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.1)
    run.send_signal(signal.SIGKILL)
    run.communicate()
    saved = max(int(name) for name in os.listdir(tmp_path) if name.isdigit())
    # No --ckpt-every: the clock alone saved. The same command resumes from there.
    resumed = run_cli(*flags[:3], str(saved + 40), *flags[4:], timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert f"jdp: resuming from step {saved}" in resumed.stdout


@pytest.mark.slow
def test_two_processes_save_by_the_clock_at_one_step(tmp_path):
    from helpers import run_python

    result = run_python(
        *"-m jdp.launch --nproc 2 --devices-per-process 1 --".split(),
        sys.executable,
        *"-m jdp.train --mesh data=2 --steps 3000 --ckpt-dir".split(),
        str(tmp_path),
        *"--ckpt-every-minutes 0.02 --keep 100".split(),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    steps = sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit())
    # Saved by the clock (agreed every 20 steps) before the end, then at the end.
    assert len(steps) >= 2 and steps[-1] == 3000, steps
    assert all(step % 20 == 0 for step in steps), steps
