"""The train step's call pays only for what the step uses: its program takes what it
changes, the key read, the loss scale only where fp16 or skipping moves it; the calls
in flight are bounded only where the CPU's collectives need it; a run's learning rate
is computed when it is read, equal to the step's own."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import init_params, regression_data, regression_loss

import jdp
from jdp.state import Placement
from jdp.step.contract import needs_bound
from jdp.training.optimizer import config_optimizer


def _leaves(*trees) -> int:
    return sum(len(jax.tree.leaves(tree)) for tree in trees)


@pytest.mark.parametrize("spec", ["data=1", "data=8"])
@pytest.mark.parametrize("fp16", [False, True])
def test_the_program_takes_only_what_the_step_changes(devices, spec, fp16):
    mesh, optimizer = jdp.make_mesh(spec), optax.adam(1e-2)
    precision = jdp.make_precision("fp16" if fp16 else "fp32")
    state = jdp.create_train_state(init_params(), optimizer, mesh, precision=precision)
    batch = jdp.shard_batch(regression_data(), mesh)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh, precision=precision, lr_schedule=lambda count: 0.1 * count
    )
    lowered = step.lower(state, batch)
    changed = _leaves(state.step, state.params, state.opt_state, state.model_state)
    scale = _leaves(state.loss_scale)  # its three: carried with fp16, else the skipped one read
    taken = changed + 1 + (scale if fp16 else 1) + _leaves(batch)  # 1: the key, read
    assert _leaves(lowered.args_info) == taken
    new, metrics = step(state, batch)
    assert _leaves(lowered.out_info) == changed + (scale if fp16 else 0) + len(metrics)
    # The state comes back whole: what the program did not take is the input's own.
    assert new.rng is state.rng and new.rng_impl == state.rng_impl
    assert (new.loss_scale is state.loss_scale) is not fp16
    assert int(new.step) == 1 and float(metrics["lr"]) == 0.0
    assert new.placement is state.placement and new.placement == Placement.of(new)


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
