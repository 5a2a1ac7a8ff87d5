"""Several optimizer steps per call: the same result as single steps, batches stacked."""

import jax
import numpy as np
import optax
import pytest
from closeness import assert_drift_within
from helpers import init_params, regression_data, regression_loss, run_cli

import jdp


def _single_steps(mesh, backend, batches, optimizer):
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh, backend=backend, lr_schedule=lambda c: c
    )
    losses = []
    for batch in batches:
        state, metrics = step(state, jdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("spec", ["data=8", "data=1"])
def test_k_steps_per_call_equal_k_single_steps(devices, backend, spec):
    mesh = jdp.make_mesh(spec)
    optimizer = optax.adam(1e-2)
    batches = [regression_data(seed) for seed in range(8)]
    single, single_losses = _single_steps(mesh, backend, batches, optimizer)

    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh, backend=backend, steps_per_call=4, lr_schedule=lambda c: c
    )
    losses, counts = [], []
    for first in (0, 4):
        stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *batches[first : first + 4])
        state, metrics = step(state, jdp.shard_batch(stacked, mesh, stacked=True))
        assert metrics["loss"].shape == (4,)
        losses += jax.device_get(metrics["loss"]).tolist()
        counts += jax.device_get(metrics["lr"]).tolist()
    assert int(state.step) == 8
    assert counts == [0, 1, 2, 3, 4, 5, 6, 7]  # one metric value per step, in order
    # A scanned step is another compiled program: Adam's results agree to rounding
    # (closeness.py). The losses are means of 64 non-negative terms: 64 * 1.2e-7 apart
    # at most, plus the parameters' drift, second order in the loss.
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    assert_drift_within(jax.device_get(state.params), jax.device_get(single.params))


def test_steps_per_call_must_be_positive(mesh8):
    with pytest.raises(jdp.UsageError, match="steps_per_call must be at least 1"):
        jdp.make_train_step(regression_loss, optax.sgd(0.1), mesh8, steps_per_call=0)


def test_loader_stacks_consecutive_steps(mesh8):
    split = jdp.load_split("digits", "train")
    with jdp.train_batches(split, mesh8, batch_size=64, seed=3, start_step=4) as single:
        singles = [jax.device_get(next(single)) for _ in range(8)]
    with jdp.train_batches(
        split, mesh8, batch_size=64, seed=3, start_step=4, steps_per_call=4
    ) as stacked:
        calls = [jax.device_get(next(stacked)) for _ in range(2)]
        assert stacked.position == 12
    for call, first in zip(calls, (0, 4), strict=True):
        for key in ("image", "label"):
            assert call[key].shape[0] == 4
            np.testing.assert_array_equal(
                call[key], np.stack([b[key] for b in singles[first : first + 4]])
            )


def _cli(*flags):
    return run_cli("--mesh", "data=8", "--steps", "80", *flags)


@pytest.mark.slow
def test_cli_steps_per_call_prints_the_same_run():
    import re

    summary = re.compile(r"train_loss=(\S+) test_loss=(\S+) test_accuracy=(\S+)")
    single = _cli("--eval-every", "40")
    several = _cli("--eval-every", "40", "--steps-per-call", "8")
    assert single.returncode == 0 and several.returncode == 0, several.stderr
    assert summary.search(several.stdout).groups() == summary.search(single.stdout).groups()
    assert "step 40: test_loss=" in several.stdout

    refused = _cli("--eval-every", "30", "--steps-per-call", "8")
    assert refused.returncode == 2
    assert "--eval-every 30 is not a multiple of --steps-per-call 8" in refused.stderr


def test_flops_per_step_do_not_grow_with_steps_per_call(mesh8):
    # MFU uses the lowered call's FLOPs as one step's: XLA counts a scan's body once.
    from jdp.report.throughput import step_flops

    optimizer = optax.sgd(0.1)
    flops = {}
    for k in (1, 4):
        state = jdp.create_train_state(init_params(), optimizer, mesh8)
        step = jdp.make_train_step(regression_loss, optimizer, mesh8, steps_per_call=k)
        batch = regression_data()
        if k > 1:
            batch = jax.tree.map(lambda x, k=k: np.stack([x] * k), batch)
        lowered = step.lower(state, jdp.shard_batch(batch, mesh8, stacked=k > 1))
        flops[k] = step_flops(lowered, 8, per_step_loops=int(k > 1))
    assert flops[4] == pytest.approx(flops[1], rel=0.01)


def test_a_stack_of_the_wrong_length_is_refused(mesh8):
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh8)
    step = jdp.make_train_step(regression_loss, optimizer, mesh8, steps_per_call=4)
    batch = jax.tree.map(lambda x: np.stack([x] * 3), regression_data())
    with pytest.raises(jdp.UsageError, match="steps_per_call=4 takes that many batches"):
        step(state, jdp.shard_batch(batch, mesh8, stacked=True))
