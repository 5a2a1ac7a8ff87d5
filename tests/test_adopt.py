"""A script written for ``jax.pmap`` adopted with `jdp.data_parallel_step`
(examples/from_pmap): the change is a few lines, the numbers are the script's own,
its state checkpoints and resumes bitwise, and an axis name the step does not bind,
or an output that differs between replicas, is one line that names the fix."""

import difflib
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_sequences_close, relative_distance
from helpers import assert_trees_close, subprocess_env

import jdp

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "from_pmap"
STEPS = 8  # past the warmup (a tenth of the run) and into the cosine: every part of the step

pytestmark = pytest.mark.slow


def _script(name):
    spec = importlib.util.spec_from_file_location(f"from_pmap_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def before():
    return _script("before")


@pytest.fixture(scope="module")
def after():
    return _script("after")


@pytest.fixture(scope="module")
def pmap_run(before, devices):
    """The script as written, on jax.pmap over the 8 devices."""
    return before.train(STEPS, devices=devices)


def _diff() -> list[str]:
    before, after = ((EXAMPLE / f"{n}.py").read_text().splitlines() for n in ("before", "after"))
    lines = difflib.unified_diff(before, after, "before.py", "after.py", lineterm="")
    return list(lines)[2:]  # the hunks, without the files' header


def test_adopting_writes_seven_lines_and_the_guide_shows_each():
    written = [line for line in _diff() if line.startswith("+") and line[1:].strip()]
    deleted = [line for line in _diff() if line.startswith("-") and line[1:].strip()]
    assert len(written) <= 10, written  # the limit: at most 10 lines changed
    assert len(deleted) <= 10, deleted
    guide = (ROOT / "docs" / "adopt.md").read_text()
    shown = re.search(r"```diff\n(.*?)```", guide, re.S).group(1).splitlines()
    assert shown == _diff(), "docs/adopt.md's diff is not examples/from_pmap's"
    assert f"{len(written)} lines written and {len(deleted)} deleted" in guide


# The 8 replicas of the adopted step see the rows each pmap replica saw, and reduce the
# gradients, BatchNorm's statistics and the metrics over the same axis: one XLA program
# in place of another, so equal to float32 rounding (tests/closeness.py: SGD with momentum
# is linear in the gradient; 8 replica means summed in another order move a coordinate
# by about 8 EPS32 relative, element by element safe at rtol 1e-5 over a few steps).
@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_adopted_on_data8_gives_the_pmap_runs_numbers(after, pmap_run, backend):
    state, history = after.train(STEPS, mesh="data=8", backend=backend)
    expected_state, expected_history = pmap_run
    assert int(state.step) == int(expected_state.step) == STEPS
    assert_sequences_close([h["loss"] for h in history], [h["loss"] for h in expected_history])
    for part in ("params", "batch_stats"):
        assert_trees_close(getattr(state, part), getattr(expected_state, part))
    assert relative_distance(state.opt_state, expected_state.opt_state) < 1e-5
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))


def test_adopted_on_one_device_is_the_pmap_run_bitwise(before, after, devices):
    state, history = after.train(STEPS, mesh="data=1")
    expected_state, expected_history = before.train(STEPS, devices=devices[:1])
    got = jax.tree.leaves((state, history))
    want = jax.tree.leaves((expected_state, expected_history))
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        # On one device Flax's jax_utils.unreplicate leaves pmap's device axis in place.
        b = b[0] if b.shape == (1, *a.shape) else b
        np.testing.assert_array_equal(a, b)


def test_the_scripts_state_saves_restores_and_continues_bitwise(after, tmp_path):
    mesh = jdp.make_mesh("data=8")
    step = jdp.data_parallel_step(after.train_step, mesh, axis_name="batch")

    def run(state, data, steps):
        for _ in range(steps):
            state, _ = step(state, jdp.shard_batch(next(data), mesh))
        return state

    fresh = after.create_train_state(jax.random.key(0), STEPS)
    whole = run(fresh, after.batches(128), STEPS)
    data = after.batches(128)
    halfway = run(after.create_train_state(jax.random.key(0), STEPS), data, STEPS // 2)
    with jdp.Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(halfway, loader_step=STEPS // 2)
    like = run(after.create_train_state(jax.random.key(0), STEPS), after.batches(128), 1)
    with jdp.Checkpointer(tmp_path) as checkpoints:
        restored, meta = checkpoints.restore(like)
    assert int(restored.step) == meta["step"] == STEPS // 2
    assert restored.apply_fn is like.apply_fn  # the script's own state, its static fields kept
    resumed = run(restored, data, STEPS - STEPS // 2)
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_an_axis_the_step_does_not_bind_is_named_with_the_fix(after, mesh8, backend):
    batch = next(after.batches(64))
    state = after.create_train_state(jax.random.key(0), STEPS)
    step = jdp.data_parallel_step(after.train_step, mesh8, backend=backend)  # no axis_name
    with pytest.raises(jdp.UsageError) as raised:
        step(state, batch)
    assert str(raised.value) == (
        "the step reduces over axis 'batch', which is not bound here (the replicas are "
        "'data'); pass axis_name='batch' to jdp.data_parallel_step"
    )


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_jdps_own_step_names_a_models_axis_it_does_not_bind(after, mesh8, backend):
    """The script's model (BatchNorm over ``axis_name="batch"``) in jdp's own
    `make_train_step`, whose replicas are ``data``: a bare AssertionError inside Flax's
    normalization under jit, ``NameError`` under pmap, before."""
    model = after.Net()

    def loss_fn(params, batch_stats, batch, rng):
        variables = {"params": params, "batch_stats": batch_stats}
        logits, updates = model.apply(variables, batch["image"], train=True, mutable=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, {}, updates["batch_stats"]

    optimizer = optax.sgd(0.1)
    variables = model.init(jax.random.key(0), jnp.ones((1, 64)), train=False)
    step = jdp.make_train_step(
        loss_fn, optimizer, mesh8, backend=backend, has_model_state=True, has_aux=True
    )
    state = jdp.create_train_state(
        variables["params"], optimizer, mesh8, model_state=variables["batch_stats"]
    )
    with pytest.raises(jdp.UsageError, match="reduces over axis 'batch'") as raised:
        step(state, jdp.shard_batch(next(after.batches(64)), mesh8))
    assert "nn.BatchNorm(axis_name='data')" in str(raised.value)
    assert "jdp.data_parallel_step(train_step, mesh, axis_name='batch')" in str(raised.value)


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_an_output_that_differs_between_replicas_is_refused(mesh8, backend):
    def train_step(state, batch):
        return state + jax.lax.pmean(jnp.mean(batch["x"]), "batch"), jnp.mean(batch["x"])

    step = jdp.data_parallel_step(train_step, mesh8, axis_name="batch", backend=backend)
    rows = {"x": np.arange(64, dtype=np.float32)}
    with pytest.raises(jdp.UsageError, match="an output of train_step differs between replicas"):
        step(jnp.zeros(()), rows)


TWO_PROCESSES = """
import json, sys
import jax, numpy as np
import jdp
sys.path.insert(0, sys.argv[1])
import after

jdp.distributed.initialize()
mesh = jdp.make_mesh("data=-1")
rows = jdp.mesh.process_rows(mesh, 128)  # this process's rows of each global batch
for backend in ("jit", "pmap"):
    state = after.create_train_state(jax.random.key(0), {steps})
    step = jdp.data_parallel_step(after.train_step, mesh, axis_name="batch", backend=backend)
    data, losses = after.batches(128), []
    for _ in range({steps}):
        batch = {{name: rows_of[rows] for name, rows_of in next(data).items()}}
        state, metrics = step(state, jdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    params = {{str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(state.params))}}
    if jax.process_index() == 0:
        np.savez(f"{{sys.argv[2]}}/{{backend}}.npz", **params)
        print(backend, json.dumps(losses))
"""


def test_two_processes_run_the_adopted_step_on_both_backends(after, tmp_path):
    """2 processes x 4 devices, each loading its own rows, against one process's 8 devices:
    the all-reduce runs over loopback TCP in another order (tests/closeness.py)."""
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESSES.format(steps=STEPS))
    launcher = [sys.executable, "-m", "jdp.launch", "--nproc", "2", "--devices-per-process", "4"]
    result = subprocess.run(
        [*launcher, "--", sys.executable, str(script), str(EXAMPLE), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected_state, expected_history = after.train(STEPS, mesh="data=8")
    for backend in ("jit", "pmap"):
        line = next(line for line in result.stdout.splitlines() if f"] {backend} [" in line)
        losses = json.loads(line.split(f"{backend} ", 1)[1])
        assert_sequences_close(losses, [h["loss"] for h in expected_history])
        saved = np.load(tmp_path / f"{backend}.npz")
        params = [saved[str(i)] for i in range(len(saved.files))]
        assert_trees_close(params, jax.tree.leaves(expected_state.params))


def test_an_nnx_module_and_its_optimizer_are_the_state_as_they_are(mesh8, mesh1):
    """An NNX script's step takes its module and optimizer themselves (NNX objects are
    pytrees): BatchNorm over ``axis_name="batch"``, 8 replicas against one device's
    float32 rounding, on both backends."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 1, rngs=rngs)
            self.norm = nnx.BatchNorm(1, axis_name="batch", rngs=rngs)

        def __call__(self, x):
            return self.norm(self.dense(x))

    def train_step(state, batch):
        model, optimizer = state
        loss_fn = lambda model: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, jax.lax.pmean(grads, axis_name="batch"))
        return (model, optimizer), jax.lax.pmean(loss, axis_name="batch")

    def run(mesh, backend):
        model = Net(nnx.Rngs(0))
        state = (model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
        step = jdp.data_parallel_step(train_step, mesh, axis_name="batch", backend=backend)
        rng, losses = np.random.default_rng(0), []
        for _ in range(3):
            x, y = rng.normal(size=(64, 4)), rng.normal(size=(64, 1))
            batch = {"x": x.astype(np.float32), "y": y.astype(np.float32)}
            state, loss = step(state, jdp.shard_batch(batch, mesh))
            losses.append(float(loss))
        return state[0], losses

    model, losses = run(mesh1, "jit")
    for backend in ("jit", "pmap"):
        got, got_losses = run(mesh8, backend)
        assert isinstance(got, Net)
        assert_sequences_close(got_losses, losses)
        assert_trees_close(nnx.state(got), nnx.state(model))
