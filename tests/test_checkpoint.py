"""Checkpoints: exact resume after SIGKILL or SIGTERM, damaged saves, another mesh, params."""

import os
import random
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
from closeness import assert_drift_within
from helpers import assert_bitwise_equal, run_cli, saved_arrays, subprocess_env

import jdp
from jdp.checkpoint import Checkpointer, load_params
from jdp.mesh import replicated

# Long enough (CNN, 8 simulated devices) that a kill lands mid-run.
_RUN = "--mesh data=8 --model cnn --steps 60 --warmup-steps 5 --batch-size 64 --ckpt-every 10"


def _cli(ckpt_dir, *extra):
    env = subprocess_env()
    command = [sys.executable, "-m", "jdp.train", *shlex.split(_RUN), "--ckpt-dir", str(ckpt_dir)]
    return command + list(extra), env


def _run(ckpt_dir, *extra, timeout=240):
    command, env = _cli(ckpt_dir, *extra)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def _start(ckpt_dir):
    command, env = _cli(ckpt_dir)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _wait_for(condition, process, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _steps_in(ckpt_dir):
    return {int(name) for name in os.listdir(ckpt_dir) if name.isdigit()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run's final checkpoint."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = _run(directory)
    assert result.returncode == 0, result.stderr
    return directory, saved_arrays(directory, 60)


@pytest.mark.parametrize("when", ["during an async save", "at a random step"])
@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(reference, tmp_path, when):
    process = _start(tmp_path)
    _wait_for(lambda: 10 in _steps_in(tmp_path), process)
    if when == "during an async save":
        _wait_for(lambda: any("tmp" in name for name in os.listdir(tmp_path)), process)
    else:
        time.sleep(random.uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert max(_steps_in(tmp_path)) < 60

    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"^jdp: resuming from step \d+ in ", resumed.stdout, re.M)
    assert "jdp: data on each device: train" in resumed.stdout  # the batches gathered there
    assert_bitwise_equal(saved_arrays(tmp_path, 60), reference[1])


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resumes_to_the_same_params(reference, tmp_path):
    process = _start(tmp_path)
    _wait_for(lambda: 10 in _steps_in(tmp_path), process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr  # saved, and not finished: 128 + SIGTERM
    match = re.search(
        r"^jdp\.train: SIGTERM at step (\d+); checkpoint saved in (.+); run", stdout, re.M
    )
    assert match, stdout
    step = int(match.group(1))
    assert 10 <= step < 60 and step in _steps_in(tmp_path)
    assert stdout.strip().splitlines()[-1] == match.group(0) + " the same command to resume"

    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"jdp: resuming from step {step} in " in resumed.stdout
    assert_bitwise_equal(saved_arrays(tmp_path, 60), reference[1])


@pytest.mark.slow
def test_damaged_and_partial_saves_are_skipped(reference, tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(reference[0], directory)
    # A save killed before its commit, and a committed one whose array files were cut short.
    partial = directory / "70.orbax-checkpoint-tmp-1700000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 100)
    for root, _, files in os.walk(directory / "60" / "state"):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) > 1000:
                with open(path, "r+b") as handle:
                    handle.truncate(os.path.getsize(path) // 2)

    result = _run(directory)
    assert result.returncode == 0, result.stderr
    assert "jdp: warning: checkpoint step 60 is damaged" in result.stderr
    assert "jdp: resuming from step 50 in " in result.stdout
    assert any(name.startswith("damaged-60-") for name in os.listdir(directory))
    assert_bitwise_equal(saved_arrays(directory, 60), reference[1])


# A short run of the same model, in this process: what the refusals are asked to resume.
# The refusals read the checkpoint's recorded settings, not its model's size: the MLP's
# two steps compile in a fraction of the CNN's time.
_SHORT = (
    "--mesh",
    "data=8",
    "--model",
    "mlp",
    "--batch-size",
    "64",
    "--steps",
    "2",
    "--warmup-steps",
    "1",
    "--ckpt-every",
    "1",
)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("short")
    result = run_cli(*_SHORT, "--ckpt-dir", directory)
    assert result.returncode == 0, result.stderr
    return directory


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--no-resume"], "--no-resume: "),
        (["--lr", "0.01"], "holds a run made with other settings: --lr 0.01 (was 0.003)"),
        (["--model", "cnn"], "--model cnn (was mlp)"),
    ],
)
def test_resume_refusals_are_one_line_and_exit_2(short_run, flags, needle):
    result = run_cli(*_SHORT, "--ckpt-dir", short_run, *flags)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def _mlp_state(mesh, seed=0):
    params = {
        "Dense_0": {"kernel": jnp.full((4, 8), 0.1), "bias": jnp.zeros(8)},
        "Dense_1": {"kernel": jnp.full((8, 3), -0.2), "bias": jnp.zeros(3)},
    }
    return jdp.create_train_state(params, optax.adam(1e-2), mesh, rng=jax.random.key(seed))


def _loss(params, batch, rng):
    hidden = jax.nn.relu(batch["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"][None])
    logits = hidden @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"][None]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batch(mesh):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    return jdp.shard_batch({"x": x, "y": rng.integers(0, 3, 16).astype(np.int32)}, mesh)


@pytest.mark.parametrize(
    ("spec", "backend"), [("data=4", "jit"), ("data=1", "jit"), ("data=8", "pmap")]
)
def test_restore_onto_another_mesh_and_backend(tmp_path, mesh8, spec, backend):
    step8 = jdp.make_train_step(_loss, optax.adam(1e-2), mesh8)
    state, _ = step8(_mlp_state(mesh8), _batch(mesh8))
    expected = jax.device_get(state)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, loader_step=1)

    mesh = jdp.make_mesh(spec)
    with Checkpointer(tmp_path) as checkpoints:
        restored, meta = checkpoints.restore(_mlp_state(mesh, seed=9))
    assert meta["loader_step"] == 1 and int(restored.step) == 1
    for got, want in zip(
        jax.tree.leaves(restored.params), jax.tree.leaves(expected.params), strict=True
    ):
        assert got.sharding == replicated(mesh)
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(restored.rng, expected.rng)
    # Training continues on the new mesh as it would have on the old one.
    step = jdp.make_train_step(_loss, optax.adam(1e-2), mesh, backend=backend)
    after, _ = step(restored, _batch(mesh))
    reference, _ = step8(state, _batch(mesh8))
    # An Adam step on another number of replicas sums in another order (closeness.py).
    assert_drift_within(jax.device_get(after.params), jax.device_get(reference.params))


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        (b"garbage{", "not JSON"),
        (None, "missing"),
        ("a folder", "unreadable ([Errno 21] Is a directory: '{record}')"),  # the reason said
    ],
)
def test_orbaxs_record_of_a_step_damaged_is_one_warning_and_the_step_restores(
    tmp_path, mesh8, capfd, caplog, damage, what
):
    """``_CHECKPOINT_METADATA`` holds Orbax's times of a step, which no restore uses: Orbax
    logged two ``ERROR:absl`` lines with the file's bytes each time it read it."""
    state = _mlp_state(mesh8)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, loader_step=3)
    record = tmp_path / "0" / "_CHECKPOINT_METADATA"
    record.unlink()
    if damage == "a folder":
        record.mkdir()
    elif damage is not None:
        record.write_bytes(damage)
    capfd.readouterr()
    with Checkpointer(tmp_path) as checkpoints:
        restored, meta = checkpoints.restore(_mlp_state(mesh8, seed=9))
    assert meta["loader_step"] == 3
    np.testing.assert_array_equal(restored.rng, jax.device_get(state.rng))
    assert capfd.readouterr().err.splitlines() == [
        f"jdp: warning: Orbax's record of the checkpoint in {record.parent} "
        f"(_CHECKPOINT_METADATA, its times) is {what.format(record=record)}; a restore checks "
        "jdp's own record and "
        "the arrays' digests instead"
    ]
    assert not [line for line in caplog.messages if "Metadata file" in line]


def test_a_different_model_is_named_leaf_by_leaf(tmp_path, mesh8):
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(_mlp_state(mesh8), loader_step=0)
    other = jdp.create_train_state(
        {"Dense_0": {"kernel": jnp.zeros((4, 16)), "bias": jnp.zeros(16)}}, optax.sgd(0.1), mesh8
    )
    with Checkpointer(tmp_path) as checkpoints, pytest.raises(jdp.UsageError) as error:
        checkpoints.restore(other)
    message = str(error.value)
    assert "params/Dense_0/kernel is (4, 8) float32, expected (4, 16) float32" in message
    assert "unexpected params/Dense_1/kernel" in message or "more" in message


def test_retention_keeps_the_latest_and_the_best(tmp_path, mesh8):
    state = _mlp_state(mesh8)
    accuracy = {2: 0.9, 4: 0.5, 6: 0.6}
    with Checkpointer(tmp_path, keep=2) as checkpoints:
        for step in range(1, 8):
            state = state.replace(step=jnp.int32(step))
            metrics = {"accuracy": accuracy[step]} if step in accuracy else None
            checkpoints.save(state, loader_step=step, metrics=metrics)
    with Checkpointer(tmp_path, keep=2) as checkpoints:
        assert checkpoints.steps() == [2, 6, 7]


def test_load_params(tmp_path, mesh8, mesh1):
    state = _mlp_state(mesh8)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, loader_step=0)
    for path in (tmp_path, tmp_path / "0"):
        params = load_params(path)
        assert jax.tree.structure(params) == jax.tree.structure(state.params)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    on_mesh = load_params(tmp_path, mesh=mesh8)
    assert jax.tree.leaves(on_mesh)[0].sharding == replicated(mesh8)
    with pytest.raises(jdp.UsageError, match="no checkpoint in"):
        load_params(tmp_path / "missing")


def test_async_save_keeps_the_state_it_was_given(tmp_path, mesh8):
    """The step donates its input: the save must own a copy before it returns."""

    def loss(params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)

    step = jdp.make_train_step(loss, optax.adam(1e-2), mesh8)
    params = {"w": jnp.full((4, 1 << 20), 0.1)}  # 16 MB, Adam state 32 MB more
    state = jdp.create_train_state(params, optax.adam(1e-2), mesh8)
    state, _ = step(state, _batch(mesh8))
    expected = jax.device_get(state)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, loader_step=1)
        for _ in range(3):  # donates the buffers of the state being written
            state, _ = step(state, _batch(mesh8))
        jax.block_until_ready(state)
    like = jdp.create_train_state(params, optax.adam(1e-2), mesh8)
    with Checkpointer(tmp_path) as checkpoints:
        restored, _ = checkpoints.restore(like)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_checkpoint_from_before_diloco_groups_resumes(tmp_path, mesh8, monkeypatch):
    """Before DiLoCo, jdp saved `TrainState` without its ``groups`` field, as the
    dataclass itself; such a checkpoint resumes, never set aside as damaged."""
    import flax.struct

    from jdp.checkpoint import checkpointer

    @flax.struct.dataclass
    class Before:  # TrainState's fields then
        step: jax.Array
        params: object
        opt_state: object
        model_state: object
        rng: jax.Array
        loss_scale: jdp.LossScale
        rng_impl: str = flax.struct.field(pytree_node=False, default="threefry2x32")

    state = jdp.create_train_state({"w": jnp.arange(3.0)}, optax.adam(0.1), mesh8)
    fields = ("step", "params", "opt_state", "model_state", "rng", "loss_scale")
    before = Before(**{name: getattr(state, name) for name in fields})
    with monkeypatch.context() as patch:
        patch.setattr(checkpointer, "_on_disk", lambda state: state)  # how it was written
        with Checkpointer(str(tmp_path)) as checkpointer:
            checkpointer.save(before, loader_step=0)
            checkpointer.wait()
    with Checkpointer(str(tmp_path)) as checkpointer:
        restored = checkpointer.restore(state)
    assert restored is not None and not any(
        p.name.startswith("damaged") for p in tmp_path.iterdir()
    )
    assert restored[0].groups is None
    np.testing.assert_array_equal(np.asarray(restored[0].params["w"]), np.arange(3.0))


def test_a_record_is_read_by_name_and_an_older_ones_gaps_as_that_jdp_ran():
    """Every reader of a recorded config reads it through `RunSettings`: the keys and
    what an older jdp did not record are named there alone."""
    from jdp.checkpoint.record import Record, RunSettings

    older = Record.read({"step": 5, "config": {"model": "gpt", "steps": 10}}).run
    assert (older.model, older.data, older.architecture) == ("gpt", {}, {})
    assert older.best == {"metric": "accuracy", "mode": "max"}  # kept by accuracy then
    assert older.as_ran["unroll_layers"] is True  # before scanned layers were recorded
    assert (older.chosen_warmup, older.special_tokens, older.mesh) == (None, None, "?")
    config = jdp.TrainConfig(warmup_steps=3, steps=30)
    recorded = RunSettings(
        {**vars(config), "warmup_steps_chosen_by_jdp": True, "data": {"kind": "image"}}
    )
    assert (recorded.chosen_warmup, recorded.data) == (3, {"kind": "image"})
    assert recorded.mesh == config.mesh
    assert not recorded.yours and RunSettings({"dataset": "yours"}).yours
    assert "unroll_layers" not in RunSettings({"model": "mlp"}).as_ran
