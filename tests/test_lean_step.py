"""The train step's call pays only for what the step uses: its program takes what it
changes, the key read only where the step draws, the loss scale only where fp16 or
skipping moves it; the calls
in flight are bounded only where the CPU's collectives need it; a run's learning rate
is computed when it is read, equal to the step's own."""

import dataclasses
import os
import sys

import jax
import numpy as np
import optax
import pytest
from helpers import init_params, regression_data, regression_loss

import jdp
from jdp.state import Placement
from jdp.step import lean
from jdp.step.contract import needs_bound
from jdp.training.optimizer import config_optimizer


def _leaves(*trees) -> int:
    return sum(len(jax.tree.leaves(tree)) for tree in trees)


def _drawing_loss(params, batch, rng):
    """`regression_loss` and a metric drawn from the step's key."""
    return regression_loss(params, batch, rng), {"u": jax.random.uniform(rng, ())}


@pytest.mark.parametrize("spec", ["data=1", "data=8"])
@pytest.mark.parametrize(("fp16", "draws"), [(False, False), (True, False), (False, True)])
def test_the_program_takes_only_what_the_step_changes(devices, spec, fp16, draws):
    mesh, optimizer = jdp.make_mesh(spec), optax.adam(1e-2)
    precision = jdp.make_precision("fp16" if fp16 else "fp32")
    state = jdp.create_train_state(init_params(), optimizer, mesh, precision=precision)
    batch = jdp.shard_batch(regression_data(), mesh)
    step = jdp.make_train_step(
        _drawing_loss if draws else regression_loss,
        optimizer,
        mesh,
        precision=precision,
        lr_schedule=lambda count: 0.1 * count,
        has_aux=draws,
    )
    lowered = step.lower(state, batch)
    changed = _leaves(state.step, state.params, state.opt_state, state.model_state)
    scale = _leaves(state.loss_scale)  # its three: carried with fp16, else the skipped one read
    taken = changed + draws + (scale if fp16 else 1) + _leaves(batch)  # the key, where drawn
    assert _leaves(lowered.args_info) == taken
    new, metrics = step(state, batch)
    assert _leaves(lowered.out_info) == changed + (scale if fp16 else 0) + len(metrics)
    # The state comes back whole: what the program did not take is the input's own.
    assert new.rng is state.rng and new.rng_impl == state.rng_impl
    assert (new.loss_scale is state.loss_scale) is not fp16
    assert int(new.step) == 1 and float(metrics["lr"]) == 0.0
    assert new.placement is state.placement and new.placement == Placement.of(new)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_a_step_without_the_key_is_bitwise_the_step_given_it(devices, monkeypatch, steps_per_call):
    """Where the outputs do not depend on the key, the program called without it is the
    traced program, bitwise; a batch of other rows traces again, as a step does."""
    mesh, optimizer, stacked = jdp.make_mesh("data=8"), optax.adam(1e-2), steps_per_call > 1

    def batch(rows: int):
        data = regression_data(seed=rows, rows=rows)
        if stacked:
            data = jax.tree.map(lambda x: np.stack([x] * steps_per_call), data)
        return jdp.shard_batch(data, mesh, stacked=stacked)

    def train():
        state = jdp.create_train_state(init_params(), optimizer, mesh)
        step = jdp.make_train_step(regression_loss, optimizer, mesh, steps_per_call=steps_per_call)
        taken = _leaves(step.lower(state, batch(64)).args_info)
        for rows in (64, 32, 64):
            state, metrics = step(state, batch(rows))
        return taken, jax.device_get((state, metrics))

    taken, without = train()
    monkeypatch.setattr(lean, "without_key", lambda *_: None)  # the program given the key
    taken_with_key, given = train()
    assert taken_with_key == taken + 1
    jax.tree.map(np.testing.assert_array_equal, without, given)


@pytest.mark.parametrize("spec", ["data=1", "data=8"])
def test_a_step_without_the_key_traces_the_loss_once(devices, spec):
    # The program without the key is made from the first call's own trace (a NumPy
    # batch, as a run on one device passes it, or one placed on the devices).
    traces = []

    def loss_fn(params, batch, rng):
        traces.append(batch["x"].shape)
        return regression_loss(params, batch, rng)

    mesh, optimizer = jdp.make_mesh(spec), optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(loss_fn, optimizer, mesh)
    batch = regression_data() if spec == "data=1" else jdp.shard_batch(regression_data(), mesh)
    for _ in range(2):
        state, _ = step(state, batch)
    assert len(traces) == 1
    taken = _leaves(state.step, state.params, state.opt_state, state.model_state, batch)
    assert _leaves(step.lower(state, batch).args_info) == taken  # no key


def test_a_step_without_the_key_traces_again_where_jax_would(devices):
    # Under another matmul precision, and after jax.clear_caches (a loss reading a
    # global that changed), the step is the one a fresh trace makes, as with the key.
    scale = [1.0]

    def loss_fn(params, batch, rng):
        return scale[0] * regression_loss(params, batch, rng)

    mesh, optimizer = jdp.make_mesh("data=1"), optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(loss_fn, optimizer, mesh)
    batch = jdp.shard_batch(regression_data(), mesh)
    state, _ = step(state, batch)
    with jax.default_matmul_precision("highest"):
        assert "HIGHEST" in step.lower(state, batch).as_text()
    assert "HIGHEST" not in step.lower(state, batch).as_text()
    _, once = step(jax.tree.map(np.copy, state), batch)
    scale[0] = 2.0
    jax.clear_caches()
    _, twice = step(state, batch)
    assert float(twice["loss"]) == 2 * float(once["loss"])  # a power of two: exact


def test_a_step_that_draws_only_at_other_shapes_says_so(devices):
    # Dropped at the first call's shapes, the key cannot come back at others' unasked.
    def loss_fn(params, batch, rng):
        loss = regression_loss(params, batch, rng)
        return loss + jax.random.uniform(rng, ()) if batch["x"].shape[0] > 4 else loss

    mesh, optimizer = jdp.make_mesh("data=8"), optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(loss_fn, optimizer, mesh)
    state, _ = step(state, jdp.shard_batch(regression_data(rows=32), mesh))
    with pytest.raises(jdp.UsageError, match="make the step again"):
        step(state, jdp.shard_batch(regression_data(rows=64), mesh))


def test_a_state_given_twice_is_refused_on_one_device(devices):
    # Unbounded there, the call itself says it in one line, and so does evaluation.
    mesh, optimizer = jdp.make_mesh("data=1"), optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(regression_loss, optimizer, mesh)
    batch = jdp.shard_batch(regression_data(), mesh)
    after, _ = step(state, batch)
    with pytest.raises(jdp.UsageError, match="pass on the state that step returned"):
        step(state, batch)
    evaluate = jdp.make_eval_step(lambda params, batch: {"y": batch["y"].sum(axis=1)}, mesh)
    with pytest.raises(jdp.UsageError, match="donated its arrays"):
        evaluate(state, batch)
    jax.block_until_ready(step(after, batch))


def test_calls_in_flight_are_bounded_only_on_several_cpu_devices(devices):
    assert needs_bound(jdp.make_mesh("data=8"))
    assert not needs_bound(jdp.make_mesh("data=1"))


# jdp's Python functions a step's call runs once it has compiled, on one CPU device and
# on several (the bound: a check of the state, the call, the array it waits on): each
# more costs a small model's call about a microsecond of the host's. (The optimizer's
# state comes back as named tuples, whose constructors are Python's own, as in any step.)
FRAMES = {"data=1": ["run"], "data=8": ["call", "refuse_donated", "run", "train_loss"]}


@pytest.mark.parametrize("spec", FRAMES)
def test_a_steps_call_runs_only_its_own_python_frames(devices, spec):
    mesh, optimizer = jdp.make_mesh(spec), optax.adam(1e-2)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(regression_loss, optimizer, mesh)
    batch = jdp.shard_batch(regression_data(), mesh)
    for _ in range(2):  # compiles, then a call waits on the one before last
        state, metrics = step(state, batch)
    frames = []
    ours = os.path.dirname(jdp.__file__)

    def record(frame, event, _):
        if event == "call" and frame.f_code.co_filename.startswith(ours):
            frames.append(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        state, metrics = step(state, batch)
    finally:
        sys.setprofile(None)
    assert frames == FRAMES[spec]
    jax.block_until_ready(metrics)


def test_a_runs_learning_rate_is_the_steps_own(devices):
    """The run's step returns no learning rate (one output less every call); the rate
    it logs, computed when read, is bitwise the one the step computes."""
    config = jdp.TrainConfig(mesh="data=2", steps=6, warmup_steps=3, log_every=1)
    result = jdp.fit(config, console=jdp.Console(enabled=False))
    logged = [record["lr"] for record in result.history if record["kind"] == "train"]
    schedule, optimizer = config_optimizer(dataclasses.replace(config, steps=6))
    mesh = jdp.make_mesh("data=2")
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(regression_loss, optimizer, mesh, lr_schedule=schedule)
    in_step = []
    for _ in range(6):
        state, metrics = step(state, jdp.shard_batch(regression_data(), mesh))
        in_step.append(float(metrics["lr"]))
    assert logged == in_step and len(set(logged)) > 2
    assert np.float32(logged[0]) == 0.0


def test_the_lowered_program_compiles_to_one_called_as_the_step_is(devices):
    mesh, optimizer = jdp.make_mesh("data=8"), optax.adam(1e-2)
    step = jdp.make_train_step(regression_loss, optimizer, mesh)
    batch = jdp.shard_batch(regression_data(), mesh)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    compiled = step.lower(state, batch).compile()
    assert "all-reduce" in compiled.as_text()  # the program's own attributes
    by_compiled, metrics = compiled(jax.tree.map(np.copy, state), batch)
    by_step, expected = step(state, batch)
    jax.tree.map(np.testing.assert_array_equal, by_compiled, by_step)
    assert float(metrics["loss"]) == float(expected["loss"])
