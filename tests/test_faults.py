"""Faults that used to pass silently: damaged checkpoint bytes, two runs on one directory,
non-finite settings and training. Each ends in one line (and a kept good state), never in
a wrong result."""

import gc
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    alive,
    children,
    cmdline,
    loader_workers,
    run_cli,
    run_main,
    saves_after,
    subprocess_env,
)

import jdp
from jdp.checkpoint import Checkpointer
from jdp.checkpoint.storage import _on_disk
from jdp.distributed.lock import LOCK_NAME
from jdp.distributed.ports import free_port
from tools.faults import bit_flips


def _two_checkpoints(directory, mesh):
    """Checkpoints of step 0 and step 1 (other parameters) in ``directory``; their states."""
    first = jdp.create_train_state(
        {"w": jnp.arange(512.0).reshape(8, 64), "b": jnp.ones(3)}, optax.adam(0.1), mesh
    )
    second = first.replace(step=first.step + 1, params=jax.tree.map(lambda x: x + 1, first.params))
    with Checkpointer(directory) as checkpoints:
        checkpoints.save(first, loader_step=0)
        checkpoints.save(second, loader_step=1)
    return first, second


def _restore(directory, like):
    with Checkpointer(directory) as checkpoints:
        state, meta = checkpoints.restore(like)
    return state, meta


@pytest.mark.slow
def test_single_bit_flips_are_detected_never_restored_silently():
    # Every flip either sets the checkpoint aside (detected) or fell in bytes that
    # nothing reads (the restored state equals the saved one bit for bit).
    outcomes = bit_flips(20, seed=0)
    assert outcomes["silent"] == 0, outcomes
    assert outcomes["detected"] + outcomes["unaffected"] == 20, outcomes
    # Each byte is as likely, and most of a checkpoint is array data that restore reads:
    # without the digests most of these flips restore silently (15 of 20 here).
    assert outcomes["detected"] >= 10, outcomes


def test_changed_array_bytes_name_the_leaf(tmp_path, mesh8, capfd):
    first, second = _two_checkpoints(tmp_path, mesh8)
    # Same-size damage that still decodes: the step-1 "w" leaf rewritten with other values.
    import orbax.checkpoint as ocp

    state_dir = tmp_path / "1" / "state"
    other = second.replace(params={"w": second.params["w"] * 2, "b": second.params["b"]})
    shutil.rmtree(state_dir)
    with ocp.StandardCheckpointer() as writer:
        writer.save(state_dir, _on_disk(other))  # as jdp writes a state
    _, meta = _restore(tmp_path, first)
    assert meta["step"] == 0
    err = capfd.readouterr().err
    assert "checkpoint step 1 is damaged (params/w does not match its digest)" in err, err
    assert any(name.startswith("damaged-1-") for name in os.listdir(tmp_path))


def test_a_changed_record_is_damage(tmp_path, mesh8, capfd):
    first, _ = _two_checkpoints(tmp_path, mesh8)
    path = tmp_path / "1" / "meta" / "metadata"
    record = json.loads(path.read_text())
    record["loader_step"] = 7  # still valid JSON: only the digest can tell
    path.write_text(json.dumps(record))
    _, meta = _restore(tmp_path, first)
    assert meta["step"] == 0
    assert "its record does not match its digest" in capfd.readouterr().err


def test_missing_array_metadata_is_damage_not_another_model(tmp_path, mesh8, capfd):
    first, _ = _two_checkpoints(tmp_path, mesh8)
    os.remove(tmp_path / "1" / "state" / "_METADATA")
    _, meta = _restore(tmp_path, first)
    assert meta["step"] == 0
    assert "checkpoint step 1 is damaged (its array metadata is missing)" in capfd.readouterr().err


def test_a_link_or_file_named_like_a_step_is_set_aside_never_resumed_or_deleted_for(
    tmp_path, mesh8, capfd
):
    first, _ = _two_checkpoints(tmp_path / "run", mesh8)
    _two_checkpoints(tmp_path / "other", mesh8)  # another run's checkpoints, step 1 the latest
    os.symlink(tmp_path / "other" / "1", tmp_path / "run" / "5")
    os.symlink(tmp_path / "gone", tmp_path / "run" / "6")  # a broken link
    (tmp_path / "run" / "9").write_text("not a checkpoint")
    with Checkpointer(tmp_path / "run", keep=2) as checkpoints:
        assert checkpoints.steps() == [0, 1]  # before: 9 counted as the latest
        _, meta = checkpoints.restore(first)
        assert meta["step"] == 1
        # --keep 2 deletes step 0, the oldest real one, not a link's target.
        checkpoints.save(first.replace(step=first.step + 2), loader_step=2)
    err = capfd.readouterr().err
    for name, what in (("5", "a link (its target untouched)"), ("9", "not a directory")):
        line = f"{tmp_path / 'run' / name} is named like a checkpoint but is {what}; moved to"
        assert line in err, err
    kept = sorted(os.listdir(tmp_path / "run"))
    assert [name for name in kept if name.isdigit()] == ["1", "2"], kept
    assert sum(name.startswith("stray-") for name in kept) == 3, kept
    assert sorted(n for n in os.listdir(tmp_path / "other") if n.isdigit()) == ["0", "1"]
    assert os.path.isdir(tmp_path / "other" / "1" / "state")


@pytest.mark.slow
def test_with_every_checkpoint_damaged_the_run_starts_over_only_when_told(tmp_path):
    flags = (
        "--mesh",
        "data=8",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        tmp_path,
    )
    assert run_cli(*flags).returncode == 0
    for step in ("2", "4"):
        (tmp_path / step / "meta" / "metadata").write_text("not json")
    refused = run_cli(*flags, "--steps", "6")
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2, refused.stderr
    assert "checkpoint step 4 is damaged (its record is unreadable" in err[0], err
    assert err[0].endswith("trying an older one") and err[1].endswith("no older one is left")
    assert err[2] == (
        f"jdp.train: error: {tmp_path} holds no whole checkpoint (damaged ones set aside: "
        "steps 2, 4); pass --restart-from-scratch to train from step 0 there, or choose "
        "another --ckpt-dir"
    )
    # Run again as it was, the damaged ones already aside: refused again, never step 0.
    again = run_cli(*flags, "--steps", "6")
    assert again.returncode == 2 and "holds no whole checkpoint" in again.stderr
    told = run_cli(*flags, "--steps", "6", "--restart-from-scratch")
    assert told.returncode == 0, told.stderr
    assert "jdp: --restart-from-scratch: " in told.stdout + told.stderr
    assert "steps=6" in told.stdout.splitlines()[-1]
    empty = run_cli(*flags[:-1], tmp_path / "empty", "--restart-from-scratch")
    assert empty.returncode == 2
    assert "no damaged checkpoint is set aside" in empty.stderr


def test_a_reader_passes_over_a_damaged_latest_checkpoint_and_leaves_it(tmp_path, mesh8, capfd):
    _two_checkpoints(tmp_path, mesh8)
    for name in os.listdir(tmp_path / "1" / "state" / "d"):
        os.truncate(tmp_path / "1" / "state" / "d" / name, 100)
    params = jdp.load_params(tmp_path)
    assert params["w"][0, 0] == 0  # step 0's, not step 1's
    err = capfd.readouterr().err
    assert f"checkpoint {tmp_path / '1'} is damaged (" in err and "reading step 0 instead" in err
    assert os.path.isdir(tmp_path / "1")  # a reader never moves a run's files
    with pytest.raises(jdp.UsageError, match=r"1 is damaged \(.*\); load another one$"):
        jdp.checkpoint.read_params(tmp_path, step=1)
    (tmp_path / "0" / "meta" / "metadata").write_text("[]")
    with pytest.raises(jdp.UsageError, match=r"no older checkpoint there is whole$"):
        jdp.load_params(tmp_path)


def test_a_lock_file_of_random_bytes_is_taken_over(tmp_path, capfd):
    (tmp_path / LOCK_NAME).write_bytes(bytes(range(256)) * 4)
    Checkpointer(tmp_path).close()
    err = capfd.readouterr().err
    assert "from a run that is gone (pid ? on ?, started ? (unreadable lock file))" in err, err


def test_one_owner_per_directory(tmp_path, mesh8, capfd):
    owner = Checkpointer(tmp_path)
    with pytest.raises(jdp.UsageError, match=f"in use by another run \\(pid {os.getpid()} on "):
        Checkpointer(tmp_path)
    owner.close()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # a clean end leaves no owner
    Checkpointer(tmp_path).close()
    assert "took over" not in capfd.readouterr().err
    # The lock file of a run that died: it names an owner, but nobody holds it.
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "gone", "pid": 1, "started": "then"}))
    Checkpointer(tmp_path).close()
    err = capfd.readouterr().err
    assert f"took over the lock on {tmp_path} from a run that is gone (pid 1 on gone" in err


@pytest.mark.slow
def test_a_second_run_on_a_live_directory_is_refused(tmp_path):
    flags = ["--mesh", "data=1", "--steps", "4000", "--ckpt-every", "50", "--ckpt-dir", tmp_path]
    first = subprocess.Popen(
        [sys.executable, "-m", "jdp.train", *map(str, flags)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        lock = tmp_path / LOCK_NAME
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        second = run_cli(*flags, "--seed", "1", timeout=120)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"is in use by another run (pid {first.pid} on " in lines[0]
        assert first.poll() is None  # the owner goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("lr", float("inf"), "--lr must be in (0, 3.40282e+38], got inf"),
        ("lr", float("nan"), "--lr must be in (0, 3.40282e+38], got nan"),
        ("momentum", -5.0, "--momentum must be in [0, 1), got -5.0"),
        ("weight_decay", float("nan"), "--weight-decay must be in [0, inf), got nan"),
        ("clip_norm", float("inf"), "--clip-norm must be in [0, inf)"),
        ("heartbeat_timeout", float("inf"), "--heartbeat-timeout must be in (0, inf)"),
        ("stall_timeout", 0.001, "--stall-timeout 0.001 is under 1 s, shorter than a healthy"),
        ("max_skipped_fraction", 0.0, "--max-skipped-fraction must be in (0, 1]"),
        ("seed", -1, "--seed must be in [0, 2**32), got -1"),
        ("seed", 10**23, "--seed must be in [0, 2**32)"),
        ("steps", 10**30, f"--steps {10**30} is past 2**31 - 1, the most the run's int32"),
        ("vocab_size", 10**10, "--vocab-size 10000000000 is past 2**31 - 1"),
        ("lr", 1e308, "--lr must be in (0, 3.40282e+38], got 1e+308"),  # inf in float32
        ("ckpt_dir", " ", "--ckpt-dir is empty; give a path, or leave --ckpt-dir out"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused(field, value, needle):
    with pytest.raises(jdp.UsageError) as error:
        jdp.TrainConfig(**{field: value})
    assert needle in str(error.value)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"momentum": 0.8},
            "--momentum 0.8 is read by --optimizer momentum, nesterov, lars; "
            "drop it for --optimizer adam",
        ),
        ({"optimizer": "sgd", "beta2": 0.95}, "--beta2 0.95 is read by --optimizer adam"),
        (
            {"schedule": "constant", "end_lr": 1e-4},
            "--end-lr 0.0001 is read by --schedule cosine, linear; drop it for --schedule constant",
        ),
        ({"schedule": "noam", "decay_steps": 5}, "--decay-steps 5 is read by --schedule cosine"),
        ({"lr_boundaries": "3"}, "--lr-boundaries 3 is read by --schedule piecewise"),
        (
            {
                "model": "gpt",
                "early_stop_patience": 2,
                "eval_every": 5,
                "early_stop_metric": "accuracy",
            },
            "--early-stop-metric accuracy: a language model's evaluation gives loss",
        ),
        (
            {"seq_len": 64},
            "--seq-len 64 is a language model's window (--model gpt, a token "
            "corpus); drop it for --model mlp on digits",
        ),
        (
            {"vocab_size": 100},
            "--vocab-size 100 reads a token corpus (--dataset tokens:PATH); drop it for "
            "--dataset digits",
        ),
        ({"token_dtype": "uint16"}, "--token-dtype uint16 reads a token corpus"),
        ({"attention": "blocked"}, "--attention blocked is for --model gpt and seq2seq; drop"),
        (
            {"max_skipped_fraction": 0.5},
            "--max-skipped-fraction 0.5 bounds the updates that --precision fp16 or "
            "--nan-policy skip skip",
        ),
        (
            {"data_on_device": "on", "loader_workers": 2},
            "--loader-workers 2 read batches on the host, and --data-on-device on gathers",
        ),
        (
            {"early_stop_metric": "accuracy"},
            "--early-stop-metric accuracy is what --early-stop-patience watches; add",
        ),
    ],
)
def test_a_flag_nothing_in_the_run_reads_is_refused(fields, needle):
    with pytest.raises(jdp.UsageError) as error:
        jdp.TrainConfig(**fields)
    assert needle in str(error.value)
    jdp.TrainConfig(model="gpt", seq_len=64, optimizer="nesterov", momentum=0.8)  # read: fine
    jdp.TrainConfig(dataset="tokens:corpus", vocab_size=100, token_dtype="uint16")
    jdp.TrainConfig(model="seq2seq", dataset="numbers2words", attention="blocked")
    jdp.TrainConfig(nan_policy="skip", max_skipped_fraction=0.5)
    jdp.TrainConfig(early_stop_metric="accuracy", early_stop_patience=2, eval_every=5)


def test_the_learning_rates_bound_is_float32s_largest():
    from jdp.training.config_checks import FLOAT32_MAX

    assert float(np.finfo(np.float32).max) == FLOAT32_MAX
    jdp.TrainConfig(lr=FLOAT32_MAX)  # a float32 still (a user's to regret)


def test_an_end_lr_above_the_peak_is_refused_before_training():
    from jdp.training.optimizer import config_optimizer

    config = jdp.TrainConfig(lr=0.003, end_lr=0.01)
    with pytest.raises(jdp.UsageError, match=r"--end-lr 0.01 is above the peak learning rate "):
        config_optimizer(config)
    # Scaled for the batch, the peak is higher: an end above --lr, below the peak, is fine.
    scaled = jdp.TrainConfig(lr=0.003, end_lr=0.005, lr_scaling="linear", batch_size=512)
    config_optimizer(scaled)


def test_a_recipe_setting_both_steps_and_epochs_is_refused(tmp_path):
    from jdp.training.recipes import load_recipe

    path = tmp_path / "both.toml"
    path.write_text("[recipe]\n[flags]\nsteps = 100\nepochs = 3\n")
    with pytest.raises(jdp.UsageError, match=r"\[flags\] sets both steps and epochs"):
        load_recipe(str(path))
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[recipe]\nmetric = "café"\n'.encode("latin-1"))
    with pytest.raises(jdp.UsageError, match=r"not UTF-8 text \(byte 22\); save it as UTF-8$"):
        load_recipe(str(latin))


def test_an_input_that_is_not_a_regular_file_is_refused_never_read(tmp_path):
    from jdp.data.splits.custom import from_npz
    from jdp.training.recipes import load_recipe

    os.mkfifo(tmp_path / "fifo.toml")  # a read would block until something writes
    for path in (str(tmp_path / "fifo.toml"), "/dev/zero"):  # ... or never end
        with pytest.raises(jdp.UsageError, match=r"is not a regular file \(a FIFO, a socket"):
            load_recipe(path)
        with pytest.raises(jdp.UsageError, match=r"^the \.npz file .* is not a regular file"):
            from_npz(path)


def test_a_path_that_is_something_else_is_named_for_what_it_is(tmp_path):
    import errno

    from jdp.errors import not_there
    from jdp.tool import os_line

    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "gone", tmp_path / "broken")
    assert not_there(str(tmp_path / "missing")) == "does not exist"
    assert not_there(str(tmp_path / "fifo")) == "is a FIFO, not a regular file"
    assert not_there(str(tmp_path), "a token file") == "is a directory, not a token file"
    assert not_there(str(tmp_path / "broken")) == "is a link to nothing"
    assert not_there("/dev/null") == "is a device, not a regular file"
    # A full disk met by a write to a file already open names where to free space.
    line, code = os_line(OSError(errno.ENOSPC, "No space left on device"))
    assert code == 1 and line == (
        "No space left on device; free space where the tool writes (its --out, --ckpt-dir, "
        "--log-dir) and run it again"
    )


def test_skip_nonfinite_keeps_the_state_and_counts(mesh8):
    def loss_fn(params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"]) ** 2) * batch["scale"][0]

    tx = optax.sgd(0.1)
    state = jdp.create_train_state({"w": jnp.ones((4, 1))}, tx, mesh8)
    step = jdp.make_train_step(loss_fn, tx, mesh8, skip_nonfinite=True)
    batch = {"x": np.ones((8, 4), np.float32), "scale": np.full((8,), np.nan, np.float32)}
    before = np.asarray(state.params["w"])
    state, metrics = step(state, jdp.shard_batch(batch, mesh8))
    assert int(metrics["skipped_steps"]) == 1 and int(state.step) == 1
    np.testing.assert_array_equal(np.asarray(state.params["w"]), before)
    batch["scale"] = np.ones((8,), np.float32)
    state, metrics = step(state, jdp.shard_batch(batch, mesh8))
    assert int(metrics["skipped_steps"]) == 1
    assert not np.array_equal(np.asarray(state.params["w"]), before)


# Plain SGD whose learning rate jumps by 1e12 at step 20: finite until then, then divergent.
_DIVERGES = [
    *("--mesh", "data=2", "--steps", "60", "--optimizer", "sgd", "--lr", "0.05"),
    *("--warmup-steps", "0", "--schedule", "piecewise", "--lr-boundaries", "20"),
    *("--lr-decay-factor", "1e12", "--ckpt-every", "10"),
]


def _all_finite_checkpoints(directory):
    import orbax.checkpoint as ocp

    steps = sorted(int(name) for name in os.listdir(directory) if name.isdigit())
    for step in steps:
        restored = ocp.StandardCheckpointer().restore(os.path.join(directory, str(step), "state"))
        for leaf in jax.tree.leaves(restored):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64))), step
    return steps


@pytest.mark.slow
def test_divergence_stops_the_run_and_keeps_the_finite_checkpoints(tmp_path):
    result = run_cli(*_DIVERGES, "--ckpt-dir", tmp_path)
    assert result.returncode == 1, (result.stdout, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    # Read with the display, every 20 steps: the first read after the jump at step 20.
    assert last.startswith("jdp.train: error: ") and " at step 40 (finite at step 20;" in last, (
        result.stderr
    )
    assert "--nan-policy stop); the checkpoints in " in last
    assert _all_finite_checkpoints(tmp_path) == [10, 20]


def test_nan_policy_ignore_trains_on_but_never_saves_a_nonfinite_state(tmp_path):
    result = run_cli(*_DIVERGES, "--nan-policy", "ignore", "--keep", "2", "--ckpt-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "jdp: warning: not saving step 30: " in result.stderr
    assert _all_finite_checkpoints(tmp_path) == [10, 20]  # --keep 2 rotated neither out


def test_a_last_gradient_that_was_not_finite_is_neither_saved_nor_passed(tmp_path, capfd):
    """The step reports no gradient norm by default: a call whose last gradient was not
    finite shows a finite loss, and its state is what tells, at saves and at the end."""
    from jdp.training.finite import GuardFinite

    mesh = jdp.make_mesh("data=8")
    state = jdp.create_train_state({"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}, optax.sgd(0.1), mesh)
    poisoned = jax.device_put(jnp.array([0.0, np.inf, 0.0, 0.0]), state.params["b"].sharding)
    broken = state.replace(params={**state.params, "b": poisoned})
    metrics = {"loss": jnp.float32(0.5)}  # finite: computed before the update
    on_disk, then, progress = saves_after(tmp_path, broken, state, metrics)
    assert (on_disk, then) == ([], [int(state.step)])  # saved under the state's own step
    assert "not saving step 2: its parameters or optimizer state are not finite" in (
        capfd.readouterr().err
    )
    guard = GuardFinite(every=1, skipping=False, max_skipped_fraction=0.25, ckpt_dir=None)
    guard.run(progress)  # the finite state
    progress.after_call(4, 2, broken, {"loss": jnp.array([0.5, 0.4])})
    guard.run(progress)  # between reads only the losses: the next loss is NaN
    progress.final = True  # at the end, the state itself
    expected = "not finite after step 4, though the loss is: a gradient was not finite"
    with pytest.raises(jdp.NonFiniteError, match=expected):
        guard.run(progress)
    # A gradient whose square overflows float32: Adam's second moment is infinite, its
    # update (mu / sqrt(nu)) zero, and the parameters and the loss stay finite.
    adam = jdp.create_train_state({"w": jnp.ones(4)}, optax.adam(0.1), mesh)
    huge = {"w": jnp.array([1e20, 0.0, 0.0, 0.0])}
    updates, opt_state = optax.adam(0.1).update(huge, adam.opt_state, adam.params)
    overflowed = adam.replace(params=optax.apply_updates(adam.params, updates), opt_state=opt_state)
    assert np.all(np.isfinite(np.asarray(overflowed.params["w"])))
    progress.after_call(6, 2, overflowed, {"loss": jnp.array([0.5, 0.4])})
    with pytest.raises(jdp.NonFiniteError, match="optimizer state are not finite after step 6"):
        guard.run(progress)


@pytest.mark.parametrize(
    "skipping", [["--nan-policy", "skip"], ["--precision", "fp16"]], ids=["skip", "fp16"]
)
@pytest.mark.slow
def test_skipping_stops_when_most_updates_are_skipped(tmp_path, skipping):
    result = run_cli(*_DIVERGES, "--steps", "100", *skipping, "--ckpt-dir", tmp_path)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "updates were skipped for a non-finite loss or gradient" in result.stderr
    _all_finite_checkpoints(tmp_path)


def _start_two(flags, extra_for_1=()):
    """Processes 0 and 1 of a run on loopback, started by hand (the second with extra flags)."""
    common = [*map(str, flags), "--coordinator", f"127.0.0.1:{free_port()}"]
    common += ["--num-processes", "2", "--startup-timeout", "60"]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "jdp.train", *common, "--process-id", str(index), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(devices=1),
        )
        for index, extra in ((0, ()), (1, extra_for_1))
    ]


def test_processes_with_different_flags_all_stop_naming_them():
    started = time.monotonic()
    processes = _start_two(["--mesh", "data=2", "--steps", "40"], ["--lr", "0.03", "--steps", "80"])
    outputs = [process.communicate(timeout=120) for process in processes]
    assert time.monotonic() - started < 60  # at start-up, not at a collective's timeout
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert (
            "the processes were started with different flags: --lr 0.03 in process 1, "
            in (lines[0])
        )
        assert (
            "0.003 in process 0; --steps 80 in process 1, 40 in process 0; start every"
            in (lines[0])
        )


def _launch_two(*flags, timeout=300):
    command = [
        sys.executable,
        *"-m jdp.launch --nproc 2 --devices-per-process 1 --".split(),
        sys.executable,
        *"-m jdp.train --mesh data=2".split(),
        *map(str, flags),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=subprocess_env()
    )


@pytest.mark.slow
def test_two_processes_agree_on_a_damaged_latest_checkpoint(tmp_path):
    flags = ["--steps", "40", "--warmup-steps", "5", "--ckpt-every", "20", "--ckpt-dir", tmp_path]
    first = _launch_two(*flags)
    assert first.returncode == 0, first.stderr
    os.remove(tmp_path / "40" / "state" / "_METADATA")
    started = time.monotonic()
    again = _launch_two(*flags)
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - started < 120  # no wait for a barrier's timeout
    assert "checkpoint step 40 is damaged (its array metadata is missing)" in again.stderr
    assert "jdp: resuming from step 20 in " in again.stdout
    assert 40 in {int(name) for name in os.listdir(tmp_path) if name.isdigit()}  # saved again


def _loss_vector(params, batch, rng):
    return (batch["x"] @ params["w"]).sum(axis=1)


def _loss_int(params, batch, rng):
    return jnp.mean(batch["x"] @ params["w"]).astype(jnp.int32)


def _aux_vector(params, batch, rng):
    out = batch["x"] @ params["w"]
    return jnp.mean(out**2), {"per_example": out.sum(axis=1)}


def _aux_named_loss(params, batch, rng):  # the cross-entropy of a loss with a penalty
    cross_entropy = jnp.mean((batch["x"] @ params["w"]) ** 2)
    return cross_entropy + 1e-4 * jnp.sum(params["w"] ** 2), {"loss": cross_entropy}


def _aux_missing(params, batch, rng):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


@pytest.mark.parametrize(
    ("loss_fn", "has_aux", "params", "needle"),
    [
        (_loss_vector, False, None, "loss_fn returned a loss of shape (1,); return one number"),
        (_loss_int, False, None, "loss_fn returned a int32 loss, which has no gradient"),
        (_aux_vector, True, None, "aux metric 'per_example' has shape (1,); aux holds scalars"),
        (_aux_missing, True, None, "with has_aux=True, loss_fn must return (loss, aux); it "),
        (_aux_vector, False, None, "loss_fn returned a 2-tuple; without has_aux it returns"),
        (
            _aux_named_loss,
            True,
            None,
            "aux metric 'loss' is a name the step reports itself (the "
            "whole objective loss_fn returns, penalties included), which yours would replace",
        ),
        (_aux_missing, False, {"w": jnp.ones((4, 1), jnp.int32)}, "parameter ['w'] is int32"),
    ],
)
def test_a_loss_without_a_useful_gradient_is_one_line(mesh8, loss_fn, has_aux, params, needle):
    params = params or {"w": jnp.ones((4, 1))}
    tx = optax.sgd(0.1)
    state = jdp.create_train_state(params, tx, mesh8)
    step = jdp.make_train_step(loss_fn, tx, mesh8, has_aux=has_aux)
    batch = jdp.shard_batch({"x": np.ones((8, 4), np.float32)}, mesh8)
    with pytest.raises(jdp.UsageError) as error:
        step(state, batch)
    assert needle in str(error.value)


def test_a_damaged_run_json_is_set_aside_and_begun_again(tmp_path, capfd):
    from jdp.report.run_info import write_run_info

    write_run_info(str(tmp_path), {"lr": 0.1}, {"mesh": {"data": 8}})
    (tmp_path / "run.json").write_text('{"started": "2026-')  # cut short
    write_run_info(str(tmp_path), {"lr": 0.1}, {"mesh": {"data": 8}})
    said = capfd.readouterr().err
    assert "run.json is damaged (not JSON" in said and "; set aside as " in said, said
    assert json.loads((tmp_path / "run.json").read_text())["mesh"] == {"data": 8}
    write_run_info(str(tmp_path), {"lr": 0.1}, {"mesh": {"data": 4}})
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["mesh"] == {"data": 8} and run["resumed"][0]["mesh"] == {"data": 4}
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


def test_a_mesh_too_large_is_refused_before_devices_are_made():
    result = run_cli("--mesh", "data=100000", timeout=60)
    assert result.returncode == 2 and "not divisible by the data axis (100000" in result.stderr
    result = run_cli("--mesh", "data=100000", "--batch-size", "100000", timeout=60)
    assert result.returncode == 2 and "jdp simulates at most 1024 CPU devices" in result.stderr


@pytest.mark.slow
def test_loader_workers_die_with_a_killed_trainer(tmp_path):
    trainer = subprocess.Popen(
        [
            sys.executable,
            *"-m jdp.train --mesh data=1 --steps 100000 --loader-workers 2".split(),
            "--log-dir",
            str(tmp_path),
            "--log-every",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists():  # training, so the workers run
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(2.0)  # well into training: workers busy or waiting for room in the queue
        workers = [pid for pid in children(trainer.pid) if alive(pid)]
        spawned = [pid for pid in workers if b"spawn_main" in cmdline(pid)]
        assert len(spawned) == 2, workers
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 20  # each worker looks for its parent once a second
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, [pid for pid in workers if alive(pid)]
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_while_waiting_on_a_stopped_loader_worker_saves_and_ends(tmp_path):
    """The loop waits for a batch that a stopped (SIGSTOP) worker never makes: a SIGTERM
    still ends the run within seconds, the last step's state saved (the state is whole
    between steps; the loader is not needed to save it)."""
    trainer = subprocess.Popen(
        [
            sys.executable,
            *"-m jdp.train --mesh data=1 --steps 100000 --loader-workers 1".split(),
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
            "--log-dir",
            str(tmp_path),
            "--log-every",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while '"step": 20,' not in _text(tmp_path / "metrics.jsonl"):  # training
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        (worker,) = loader_workers(trainer.pid)
        os.kill(worker, signal.SIGSTOP)
        time.sleep(2.0)  # the batches made before are used up: the loop waits
        started = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        out, err = trainer.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        trainer.kill()
    assert trainer.returncode == 143 and took < 15, (took, err[-2000:])
    saved = re.search(
        r"jdp.train: SIGTERM while waiting for data at step (\d+); checkpoint "
        "saved in",
        out,
    )
    assert saved, out[-2000:] + err[-2000:]
    assert str(int(saved[1])) in os.listdir(tmp_path / "ckpt")
    assert not alive(worker)


@pytest.mark.slow
def test_sigint_to_one_process_saves_in_every_process_at_one_step(tmp_path):
    logs = tmp_path / "logs"
    flags = ["--mesh", "data=2", "--steps", "100000", "--log-dir", logs, "--log-every", "1"]
    processes = _start_two([*flags, "--ckpt-dir", tmp_path])
    try:
        # Past start-up in both processes: a step logged (the processes step together).
        # A signal in start-up takes another path (nothing to save), whatever the pace.
        deadline = time.monotonic() + 120
        while not _text(logs / "metrics.jsonl").strip():
            assert all(p.poll() is None for p in processes) and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1)  # training
        started = time.monotonic()
        processes[1].send_signal(signal.SIGINT)  # to one process only
        outputs = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert time.monotonic() - started < 60  # no wait for a collective's or barrier's timeout
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        # The SIGINT reaches every process as the runtime's preemption notice (SIGTERM)
        assert process.returncode == 143, stderr[-2000:]
        assert "KeyboardInterrupt" not in stderr
    line = [text for text in outputs[0][0].splitlines() if "checkpoint saved in" in text]
    assert line, outputs[0][0][-2000:]
    steps = {int(name) for name in os.listdir(tmp_path) if name.isdigit()}
    assert len(steps) == 1 and f"at step {steps.pop()};" in line[0]


@pytest.mark.parametrize("leaver", [0, 1])
@pytest.mark.slow
def test_sigint_to_one_process_in_start_up_ends_every_process_at_once(leaver):
    processes = _start_two(["--mesh", "data=2", "--steps", "100000"])
    try:
        # Process 0 says where the run is once every process joined: the signal then finds
        # the other still in start-up too, seconds before a first step (timed by the
        # steps per call's choice before the loop).
        processes[0].stdout.readline()
        started = time.monotonic()
        processes[leaver].send_signal(signal.SIGINT)
        outputs = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    # Not at JAX's heartbeat timeout (60 s), nor aborted by its runtime (process 0 holds it).
    assert time.monotonic() - started < 30
    other = 1 - leaver
    stderrs = [stderr for _, stderr in outputs]
    assert [process.returncode for process in processes] == [130, 130], stderrs
    assert stderrs[leaver].strip().splitlines()[-1] == (
        "jdp.train: SIGINT outside training steps; nothing saved"
    ), stderrs[leaver]
    assert stderrs[other].strip().splitlines() == [
        f"jdp.train: process {leaver} of 2 ended on SIGINT outside training steps; this "
        "process ends too"
    ], stderrs[other]


def test_a_signal_while_jax_connects_arrives_once_the_block_ends():
    """`jdp.distributed.initialize` holds a SIGINT back while JAX connects: a Ctrl-C then
    ends the process once it has joined, and is told to the others."""
    from jdp.distributed.leaving import interrupt_held

    class Arrived(Exception):
        pass

    def arrive(number, frame):
        raise Arrived(signal.Signals(number).name)

    previous = signal.signal(signal.SIGINT, arrive)
    reached = []
    try:
        with pytest.raises(Arrived, match="SIGINT"), interrupt_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # bytecodes run here: a signal not held would arrive
            reached.append("the block's end")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["the block's end"]


def test_a_start_up_signal_that_lands_in_a_gc_callback_is_sent_again():
    """`jdp.train`'s start-up SIGINT can land while JAX's gc callback runs; Python prints
    the exception there as "Exception ignored" and goes on, and the run trained on as if
    no Ctrl-C had come. The signal is sent again and lands outside the callback."""
    from jdp import train

    sent = []

    def in_gc(phase, info):
        if phase == "start" and not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, in the callback

    hook = sys.unraisablehook
    run_main(train.main, "--help")  # main sets its hook, for the rest of the process
    assert getattr(sys.unraisablehook, "jdp_interrupts", False)
    previous = signal.signal(signal.SIGINT, train._interrupt)  # main's, in start-up
    gc.callbacks.append(in_gc)
    try:
        with pytest.raises(train._Interrupted, match="SIGINT"):
            gc.collect()
            time.sleep(5)  # the signal sent again lands here, once the callback has ended
    finally:
        gc.callbacks.remove(in_gc)
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
    assert sent == [signal.SIGINT]


def _text(path) -> str:
    """What ``path`` holds so far; empty while it does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_a_signal_at_start_up_or_without_a_ckpt_dir_is_one_line(tmp_path, signal_number):
    command = [sys.executable, "-m", "jdp.train", "--mesh", "data=1", "--steps", "100000"]
    # At start-up: as soon as the run says what it built, before its first step.
    early = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )
    early.stdout.readline()
    early.send_signal(signal_number)
    rest, stderr = early.communicate(timeout=120)  # the output after the first line
    name = signal.Signals(signal_number).name
    if "at step" in rest:  # it had reached its steps: then it stops as below
        assert "stopped without saving (no --ckpt-dir)" in rest + stderr, rest + stderr
    else:
        assert early.returncode == 128 + signal_number, stderr
        assert stderr.strip().splitlines()[-1] == (
            f"jdp.train: {name} outside training steps; nothing saved"
        ), stderr
    # Mid-run, without --ckpt-dir: the run stops at a step boundary and says so.
    late = subprocess.Popen(
        [*command, "--log-dir", str(tmp_path), "--log-every", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 120
    # A step's record, not the file: the file is opened before the loop takes signals over.
    while '"kind": "train"' not in _text(tmp_path / "metrics.jsonl"):
        assert late.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    late.send_signal(signal_number)
    stdout, stderr = late.communicate(timeout=120)
    assert late.returncode == 128 + signal_number, stderr  # stopped, not finished
    assert "Traceback" not in stderr
    assert f"jdp.train: {name} at step " in stdout
    assert stdout.strip().splitlines()[-1].endswith("stopped without saving (no --ckpt-dir)")


@pytest.mark.parametrize(
    ("flag", "path", "needle"),
    [
        ("--log-dir", "/proc/jdp-logs", "cannot write in --log-dir /proc/jdp-logs ("),
        ("--ckpt-dir", "/proc/jdp-ckpt", "cannot write in --ckpt-dir /proc/jdp-ckpt ("),
        ("--log-dir", "FILE", "is a file, not a directory"),
    ],
)
def test_an_unwritable_directory_is_one_line(tmp_path, flag, path, needle):
    if path == "FILE":
        path = tmp_path / "a-file"
        path.write_text("")
    result = run_cli(*"--mesh data=1 --steps 2 --warmup-steps 0".split(), flag, path, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def _train_with_file_limit(kib, *flags):
    """``jdp.train FLAGS`` under ``ulimit -f KIB``: a write past KIB KiB fails with EFBIG, as
    one past a disk's free space fails with ENOSPC (no root or tmpfs needed)."""
    command = f"ulimit -f {kib}; exec {sys.executable} -m jdp.train " + " ".join(map(str, flags))
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=240, env=subprocess_env()
    )


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line(tmp_path):
    prepared = run_cli("--mesh", "data=1", "--steps", "1", "--warmup-steps", "0")  # the data
    assert prepared.returncode == 0, prepared.stderr
    result = _train_with_file_limit(
        100, "--mesh", "data=1", "--steps", "40", "--ckpt-every", "10", "--ckpt-dir", tmp_path
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith(" ")]
    lines = [line for line in lines if "Warning" not in line]  # a library's own warnings
    assert lines == [
        f"jdp.train: error: could not write a checkpoint in {tmp_path} (File too large); no "
        "checkpoint there is complete; free space there, or choose another --ckpt-dir"
    ], result.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nproc", "2", "--grace", "-5", "--", "python"], "--grace must be a finite number"),
        (["--nproc", "2", "--port", "70000", "--", "python"], "--port must be in 1..65535"),
        (["--nproc", "2", "--", "/nonexistent"], "command not found: /nonexistent"),
    ],
)
def test_launcher_refuses_bad_settings_in_one_line(argv, needle):
    from helpers import run_python

    result = run_python("-m", "jdp.launch", *argv, timeout=60)
    assert result.returncode == 2
    assert needle in result.stderr.strip().splitlines()[-1], result.stderr


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--data-dir", "FILE"], "is a file, not a directory; create it"),
        (["--mesh", "data=-1,model=2"], "e.g. data=2,model=2, and jdp simulates the CPU devices"),
        (["--reduce-dtype", "fp16"], "unknown reduce dtype 'fp16'; choose one of: fp32, bf16"),
    ],
)
def test_more_bad_flags_are_one_line(tmp_path, flags, needle):
    file = tmp_path / "a-file"
    file.write_text("")
    result = run_cli(
        *[str(file) if flag == "FILE" else flag for flag in flags], devices=1, timeout=120
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_load_params_skips_incomplete_entries_and_checks_digests(tmp_path, mesh8):
    _, second = _two_checkpoints(tmp_path, mesh8)
    (tmp_path / "7").mkdir()  # emptied
    os.symlink(tmp_path / "gone", tmp_path / "9")  # a broken link
    np.testing.assert_array_equal(jdp.load_params(tmp_path)["w"], second.params["w"])
    only_broken = tmp_path / "only-broken"
    (only_broken / "7").mkdir(parents=True)
    os.symlink(tmp_path / "gone", only_broken / "9")
    with pytest.raises(jdp.UsageError, match=r"\(steps 7, 9 are incomplete\)"):
        jdp.load_params(only_broken)
    # Same-size damage that still decodes, in the params: named, never returned.
    import orbax.checkpoint as ocp

    other = second.replace(params={"w": second.params["w"] * 3, "b": second.params["b"]})
    shutil.rmtree(tmp_path / "1" / "state")
    with ocp.StandardCheckpointer() as writer:
        writer.save(tmp_path / "1" / "state", _on_disk(other))
    with pytest.raises(jdp.UsageError, match=r"is damaged \(params/w does not match its digest\)"):
        jdp.load_params(tmp_path / "1")
    # The latest of the directory is passed over to the one before (with a warning).
    np.testing.assert_array_equal(jdp.load_params(tmp_path)["w"], second.params["w"] - 1)


@pytest.mark.slow
def test_a_damaged_dataset_file_is_one_line(tmp_path):
    flags = ["--mesh", "data=1", "--steps", "1", "--warmup-steps", "0", "--data-dir", tmp_path]
    prepared = run_cli(*flags)
    assert prepared.returncode == 0, prepared.stderr
    (path,) = tmp_path.glob("digits/*/digits-train.array_record-*")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 40] = bytes(byte ^ 0x55 for byte in data[middle : middle + 40])
    path.write_bytes(data)
    result = run_cli(*flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "dataset 'digits' (train) in " in lines[0], result.stderr
    assert "is damaged (Corrupted Riegeli/records file" in lines[0]


def test_an_error_in_one_process_stops_every_process_at_start_up(tmp_path):
    missing = tmp_path / "not-here"
    started = time.monotonic()
    # Process 1's data is not there.
    processes = _start_two(["--mesh", "data=2", "--steps", "40"], ["--data-dir", str(missing)])
    outputs = [process.communicate(timeout=120) for process in processes]
    assert time.monotonic() - started < 60  # not a collective's timeout later
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert f"error: process 1: --data-dir {missing} does not exist" in lines[0]


@pytest.mark.slow
def test_a_full_log_dir_warns_once_and_training_goes_on(tmp_path):
    prepared = run_cli("--mesh", "data=1", "--steps", "1", "--warmup-steps", "0")  # the data
    assert prepared.returncode == 0, prepared.stderr
    result = _train_with_file_limit(  # 8 KiB: the metrics outgrow it within the run
        8,
        *"--mesh data=1 --steps 200 --warmup-steps 0 --log-dir".split(),
        tmp_path,
        "--log-every",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("jdp: warning:")]
    assert warnings == [
        "jdp: warning: metrics are no longer written: File too large; training goes on "
        "(free space in --log-dir to keep its files whole)"
    ], result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("jdp.train: steps=200 ")


def test_a_full_data_dir_while_preparing_is_one_line(tmp_path):
    result = _train_with_file_limit(
        8, "--mesh", "data=1", "--steps", "2", "--warmup-steps", "0", "--data-dir", tmp_path
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        f"jdp.train: error: could not prepare dataset 'digits' in {tmp_path} (File too large); "
        "free space there, or choose another --data-dir"
    ), result.stderr
    assert "Traceback" not in result.stderr


# The scheduled lane: each class's cases are the per-change tests' of its own module
# (tests/test_faults.py, test_lock.py, test_no_hangs.py, test_distributed.py, test_tools.py).
@pytest.mark.slow
@pytest.mark.scheduled
def test_faults_benchmark_runs_the_new_classes_with_nothing_silent_lost_or_hung():
    # One trial of each class: each class's cases are the tests' of its own module.
    flags = (
        "--kills 0 --flips 0 --data-faults 1 --lock-thefts 1 --directory-failures 1 "
        "--launcher-kills 1 --wrapped-stops 1 --tool-faults 1 --seed 1"
    )
    result = subprocess.run(  # the project's tools run from a checkout's root
        [sys.executable, "-m", "tools.faults", *shlex.split(flags)],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
    summary = dict(re.findall(r"^([a-z ]+): trials=\d+ (.+)$", result.stdout, re.M))
    assert summary == {
        "data faults": "named=1 silent=0 hang=0 other=0",
        "lock thefts": "kept=1 two-writers=0 lost=0 hang=0",
        "directory failures": "stopped=1 hang=0 other=0",
        "launcher kills": "ended=1 late=0 orphaned=0 lost=0",
        "wrapped stops": "saved=1 orphaned=0 lost=0 hang=0",
        "tool faults": "one-line=1 traceback=0 other=0",
    }, result.stdout
