"""``python -m jdp.replay RUN_DIR --step N``: a logged step computed again bit for bit from
the checkpoint before it (or the run's start), checked against the run's losses and data
ledger on the way, and written out; on a run with corrupted examples, it names them."""

import json
import shutil
import sys

import numpy as np
import pytest
from helpers import run_cli, run_python, run_tool

from jdp.data.loader.readers import global_batch_indices
from jdp.errors import UsageError

BATCH, EXAMPLES, CKPT_EVERY = 32, 256, 10
CORRUPTED = [3, 77, 150, 201]  # inputs scaled 30x and labels flipped: a loss spike


def _data(path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    x[CORRUPTED] *= 30.0
    y[CORRUPTED] = 1 - y[CORRUPTED]
    np.savez(path, x_train=x, y_train=y, x_test=x[:64], y_test=y[:64])
    return x


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 30-step run logging every step, saving every 10 (all three kept)."""
    root = tmp_path_factory.mktemp("replay")
    x = _data(root / "data.npz")
    result = run_cli(
        "--dataset",
        f"npz:{root / 'data.npz'}",
        *"--model mlp --mesh data=2 --batch-size".split(),
        BATCH,
        *"--steps 30 --warmup-steps 2 --log-every 1 --eval-every 0".split(),
        "--log-dir",
        root / "log",
        "--ckpt-dir",
        root / "ckpt",
        "--ckpt-every",
        CKPT_EVERY,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root, x


def _logged(log_dir):
    with open(log_dir / "metrics.jsonl") as file:
        return {r["step"]: r for r in map(json.loads, file) if r["kind"] == "train"}


def _spiking_step():
    """The first step between checkpoints, past the first, whose batch holds a corrupted
    example."""
    for step in range(CKPT_EVERY + 2, 30):
        batch = global_batch_indices(0, step - 1, BATCH, EXAMPLES)
        if step % CKPT_EVERY and set(CORRUPTED) & set(batch.tolist()):
            return step, batch
    raise AssertionError("no step holds a corrupted example")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replay_reproduces_the_step_and_names_the_corrupted_examples(run, tmp_path):
    root, x = run
    step, indices = _spiking_step()
    out = tmp_path / "out"
    result = run_tool("jdp.replay", root / "log", "--step", step, "--out", out, "--top", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "step.json").read_text())
    logged = _logged(root / "log")
    began = step - step % CKPT_EVERY
    assert summary["started_from"] == began
    assert summary["checked_steps"] == list(range(began + 1, step + 1))
    assert summary["loss"] == logged[step]["loss"]  # bit for bit, as JSON keeps a float32
    assert f"jdp.replay: step {step} from checkpoint {began}: loss" in result.stdout
    # The corrupted examples of the batch are the largest losses, in the file and named.
    spiked = sorted(set(CORRUPTED) & set(indices.tolist()))
    named = [entry["index"] for entry in summary["largest_losses"]]
    assert sorted(named[: len(spiked)]) == spiked
    for index in spiked:
        assert f"  example {index}: loss" in result.stdout
    assert {"Dense_0/kernel", "Dense_0/bias"} <= summary["grad_norms"].keys()
    assert all(norm > 0 for norm in summary["update_norms"].values())
    batch = np.load(out / "batch.npz")
    np.testing.assert_array_equal(batch["index"], indices)
    np.testing.assert_array_equal(batch["batch.x"], x[indices])
    # The float32 pass's mean agrees with the step's loss: 32 terms, each to 1.2e-7.
    np.testing.assert_allclose(batch["loss"].mean(), summary["loss"], rtol=32 * 1.2e-7)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replay_before_any_checkpoint_starts_from_the_runs_initialisation(run, tmp_path):
    root, _ = run
    result = run_tool("jdp.replay", root / "log", "--step", 4, "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "step.json").read_text())
    assert summary["started_from"] == 0 and summary["checked_steps"] == [1, 2, 3, 4]
    assert summary["loss"] == _logged(root / "log")[4]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("field", ["loss", "batch_digest"])
def test_a_step_that_does_not_replay_is_one_line(run, tmp_path, field):
    root, _ = run
    log = tmp_path / "log"
    shutil.copytree(root / "log", log)
    lines = (log / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    target = next(r for r in records if r["kind"] == "train" and r["step"] == 23)
    target[field] = target[field] * 1.5 if field == "loss" else "0" * 16
    (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_tool("jdp.replay", log, "--step", 25, "--out", tmp_path / "out")
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    what = "loss is" if field == "loss" else "global batch is not the one the run logged"
    assert line.startswith(f"jdp.replay: error: step 23's {what}"), line


@pytest.mark.slow
def test_bad_replays_are_one_line(run, tmp_path):
    root, _ = run
    for args, needle in (
        ((tmp_path, "--step", 3), "holds no config.json and metrics.jsonl"),
        ((root / "log", "--step", 31), "--step 31: the run has steps 1 to 30"),
        ((root / "log", "--step", 3, "--ckpt-dir", tmp_path / "gone"), "which is not here"),
        ((root / "log", "--step", 3, "--top", -3), "--top -3: give how many examples"),
        # Refused before the replay's work, not after it.
        ((root / "log", "--step", 3, "--out", root / "data.npz"), "is a file, not a directory"),
    ):
        result = run_tool("jdp.replay", *args)
        assert result.returncode == 2, result.stderr[-2000:]
        (line,) = result.stderr.strip().splitlines()
        assert needle in line, line


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_two_process_run_replays_on_two_processes_and_says_where_it_ran(tmp_path):
    launch = ["-m", "jdp.launch", "--nproc", "2", "--devices-per-process", "2", "--"]
    train = [
        sys.executable,
        *"-m jdp.train --mesh data=-1 --steps 12 --log-every 1".split(),
        *"--ckpt-every 5 --eval-every 0 --log-dir".split(),
        tmp_path / "log",
        "--ckpt-dir",
        tmp_path / "ckpt",
    ]
    assert run_python(*launch, *train, timeout=240).returncode == 0
    replay = [sys.executable, "-m", "jdp.replay", tmp_path / "log", "--step", 9]
    result = run_python(*launch, *replay, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] jdp.replay: step 9 from checkpoint 5: loss" in result.stdout
    assert "the logged loss and batch of 4 steps reproduced bit for bit" in result.stdout
    # On 1 process of 8 devices the gradients sum in another order: one line says where.
    alone = run_python(
        "-m",
        "jdp.replay",
        tmp_path / "log",
        "--step",
        9,
        "--out",
        tmp_path / "alone",
        devices=8,
        timeout=240,
    )
    assert alone.returncode == 1, alone.stderr[-3000:]
    assert alone.stderr.strip().endswith(
        "(the run ran on 4 cpu devices in 2 processes, this replay on 8 in 1: replay where "
        "it ran, under python -m jdp.launch --nproc 2 for several processes)"
    )


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_batchnorm_model_after_a_longer_resume_replays(tmp_path):
    """The cnn's BatchNorm averages over the data axis; the run was resumed with more
    --steps, which moved its schedule: replay takes the config that trained the step."""
    flags = [
        *"--model cnn --mesh data=2 --batch-size 32 --warmup-steps 2".split(),
        *"--log-every 1 --eval-every 0 --ckpt-every 5 --log-dir".split(),
        tmp_path / "log",
        "--ckpt-dir",
        tmp_path / "ckpt",
    ]
    assert run_cli(*flags, "--steps", "10", timeout=240).returncode == 0
    assert run_cli(*flags, "--steps", "20", timeout=240).returncode == 0
    result = run_tool("jdp.replay", tmp_path / "log", "--step", 13, "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "step.json").read_text())
    assert summary["started_from"] == 10 and summary["checked_steps"] == [11, 12, 13]
    assert summary["loss"] == _logged(tmp_path / "log")[13]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_run_of_several_steps_per_call_replays_its_calls(run, tmp_path):
    """A run scanning 4 steps a call, closing its calls' gaps to the periods (log every 6,
    save every 8) with shorter calls, replays call by call as it ran: its logged steps
    bit for bit, a step inside a call from the call's own metrics and the state before
    it from the call's first steps, in a call of 4 and in a shorter one."""
    root, _ = run
    flags = [
        "--dataset",
        f"npz:{root / 'data.npz'}",
        *"--model mlp --mesh data=2 --batch-size".split(),
        BATCH,
        *"--steps 16 --warmup-steps 2 --eval-every 0 --ckpt-every 8".split(),
    ]
    for calls, every in ((1, 1), (4, 6)):
        where = tmp_path / str(calls)
        result = run_cli(
            *flags,
            *f"--steps-per-call {calls} --log-every {every}".split(),
            "--log-dir",
            where / "log",
            "--ckpt-dir",
            where / "ckpt",
            timeout=240,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    single, scanned = _logged(tmp_path / "1" / "log"), _logged(tmp_path / "4" / "log")
    assert sorted(scanned) == [6, 12]  # calls 1-4, 5-6, 7-8, 9-12, 13-16
    # The MLP's scanned steps are bitwise its single steps: a step inside a call of 4, or
    # the first of a shorter call, is the single-step run's logged loss, as are the logged
    # steps.
    assert all(scanned[step]["loss"] == single[step]["loss"] for step in scanned)
    for step, start, checked in ((14, 8, [12]), (7, 0, [6])):
        out = tmp_path / f"out-{step}"
        result = run_tool("jdp.replay", tmp_path / "4" / "log", "--step", step, "--out", out)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((out / "step.json").read_text())
        assert summary["started_from"] == start and summary["checked_steps"] == checked
        assert summary["loss"] == single[step]["loss"]
        assert all(norm > 0 for norm in summary["update_norms"].values())


@pytest.mark.slow
def test_a_diloco_run_is_refused_in_one_line(tmp_path):
    result = run_cli(
        *"--mesh group=2,data=2 --steps 4 --log-every 1 --eval-every 0".split(),
        "--log-dir",
        tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    replay = run_tool("jdp.replay", tmp_path, "--step", 2)
    assert replay.returncode == 2
    assert replay.stderr.strip() == (
        "jdp.replay: error: the run trained DiLoCo groups (--mesh group=2,data=2), whose "
        "synchronisations replay does not repeat"
    )


def test_the_runs_files_damaged_are_one_line_or_left_out_with_a_warning(tmp_path, capsys):
    from jdp.replay import _run_files

    (tmp_path / "config.json").write_text('{"steps": 3')  # cut short
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError, match=r"^cannot read .*config.json \(.*\); replay reads"):
        _run_files(str(tmp_path))
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(UsageError, match=r"config\.json is not the object of settings"):
        _run_files(str(tmp_path))
    (tmp_path / "config.json").write_text('{"steps": 3}')
    records = [
        "[1, 2]",
        '{"kind": "train", "loss": 1.0}',
        '{"kind": "train", "step": 2}',
        '{"kind": "train", "st',
    ]  # an array, a record without its step, one cut short
    (tmp_path / "metrics.jsonl").write_text("\n".join(records))
    saved, logged = _run_files(str(tmp_path))
    assert saved == {"steps": 3} and list(logged) == [2]
    (said,) = capsys.readouterr().err.splitlines()
    assert said.endswith("metrics.jsonl are not jdp's records (line 1, 2); left out"), said
