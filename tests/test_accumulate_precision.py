"""Gradient accumulation, mixed precision, loss scaling and the step's optimizer metrics."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BATCH, assert_trees_close, init_params, regression_data, regression_loss

import jdp


def _run(mesh, backend, batches, *, optimizer=None, **step_kwargs):
    optimizer = optimizer or optax.sgd(0.05, momentum=0.9)
    precision = step_kwargs.get("precision")
    state = jdp.create_train_state(init_params(), optimizer, mesh, precision=precision)
    step = jdp.make_train_step(regression_loss, optimizer, mesh, backend=backend, **step_kwargs)
    history = []
    for batch in batches:
        state, metrics = step(state, jdp.shard_batch(batch, mesh))
        history.append(jax.device_get(metrics))
    return state, history


def test_accumulating_k_micro_batches_equals_one_big_step(mesh8, backend):
    batches = [regression_data(seed) for seed in range(4)]
    whole, whole_metrics = _run(mesh8, backend, batches)
    accumulated, acc_metrics = _run(mesh8, backend, batches, accumulate=4)
    assert_trees_close(jax.device_get(accumulated.params), jax.device_get(whole.params))
    for a, b in zip(acc_metrics, whole_metrics, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def _all_reduce_lines(hlo):
    return [line for line in hlo.splitlines() if " all-reduce(" in line]


def _while_bodies(hlo):
    names = re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)
    bodies = []
    for name in names:
        match = re.search(rf"^%?{re.escape(name)} .*?\n}}", hlo, re.S | re.M)
        bodies.append(match.group(0) if match else "")
    return bodies


def _compiled_hlo(mesh, **step_kwargs):
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(regression_loss, optimizer, mesh, **step_kwargs)
    return step.lower(state, jdp.shard_batch(regression_data(), mesh)).compile().as_text()


def test_accumulation_all_reduces_once_per_update_not_per_micro_batch(mesh8):
    single = _compiled_hlo(mesh8)
    accumulated = _compiled_hlo(mesh8, accumulate=4)
    assert len(_all_reduce_lines(accumulated)) == len(_all_reduce_lines(single))
    bodies = _while_bodies(accumulated)
    assert bodies, "expected the micro-batch scan to compile to a while loop"
    for body in bodies:
        assert "all-reduce" not in body


def test_accumulate_must_divide_the_per_replica_batch(mesh8):
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh8)
    step = jdp.make_train_step(regression_loss, optimizer, mesh8, accumulate=3)
    with pytest.raises(jdp.UsageError, match="accumulate 3 does not divide the per-replica batch"):
        step(state, jdp.shard_batch(regression_data(), mesh8))


def _all_reduce_types(mesh, **step_kwargs):
    """Operand types of the program's all-reduces, as jdp emits it (before XLA's passes).

    XLA's CPU backend widens a bf16 all-reduce to f32 when compiling; GPU and TPU
    keep it, so the emitted program is what to check.
    """
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(regression_loss, optimizer, mesh, **step_kwargs)
    text = step.lower(state, jdp.shard_batch(regression_data(), mesh)).as_text()
    return sorted(re.findall(r"\}\) : \((tensor<[^>]*>)\) -> ", text))


def test_bf16_reduction_all_reduces_gradients_in_bf16(mesh8):
    # On CPU the step packs small leaves into one buffer per dtype: the three
    # gradients (6x16 + 16 + 16x3 = 160 values) and the loss.
    fp32 = _all_reduce_types(mesh8)
    bf16 = _all_reduce_types(mesh8, precision=jdp.make_precision("fp32", reduce="bf16"))
    assert fp32 == ["tensor<161xf32>"]
    # The gradients go over the wire in bf16; the scalar loss stays fp32, alone.
    assert bf16 == sorted(["tensor<160xbf16>", "tensor<f32>"])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_low_precision_compute_keeps_fp32_master_params(mesh8, backend, name):
    precision = jdp.make_precision(name, init_scale=2.0**8)
    batches = [regression_data()] * 3
    state, history = _run(mesh8, backend, batches, precision=precision)
    for leaf in jax.tree.leaves(state.params):
        assert leaf.dtype == jnp.float32
    reference, _ = _run(mesh8, backend, batches)
    # 3 SGD steps computed in 8-bit (bf16) or 11-bit (fp16) mantissas: each value is
    # off by up to 2**-8 = 3.9e-3 relatively, a dozen ulps at most along the chain.
    assert_trees_close(
        jax.device_get(state.params), jax.device_get(reference.params), rtol=5e-2, atol=5e-3
    )
    assert history[-1]["loss"] < history[0]["loss"]


def _poisoned(seed=0):
    """A batch whose first replica's rows overflow: that replica's gradient is inf."""
    batch = regression_data(seed)
    batch["x"][: BATCH // 8] = 1e30
    return batch


def test_nonfinite_gradient_on_one_replica_skips_the_update_everywhere(mesh8, backend):
    precision = jdp.make_precision("fp16", init_scale=2.0**8)
    optimizer = optax.adam(1e-2)
    state = jdp.create_train_state(init_params(), optimizer, mesh8, precision=precision)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh8, backend=backend, precision=precision
    )
    state, _ = step(state, jdp.shard_batch(regression_data(), mesh8))
    before = jax.device_get(state.params)
    before_opt = jax.device_get(state.opt_state)
    scale_before = float(state.loss_scale.scale)
    state, metrics = step(state, jdp.shard_batch(_poisoned(), mesh8))
    assert_trees_close(jax.device_get(state.params), before, rtol=0, atol=0)
    assert_trees_close(jax.device_get(state.opt_state), before_opt, rtol=0, atol=0)
    assert float(state.loss_scale.scale) == scale_before / 2
    assert int(metrics["skipped_steps"]) == 1
    assert float(metrics["loss_scale"]) == scale_before / 2
    assert int(state.step) == 2
    for leaf in jax.tree.leaves(state.params):
        first = np.asarray(leaf.addressable_shards[0].data)
        for shard in leaf.addressable_shards[1:]:
            np.testing.assert_array_equal(np.asarray(shard.data), first)
    # Training goes on after the skip.
    state, metrics = step(state, jdp.shard_batch(regression_data(1), mesh8))
    assert int(metrics["skipped_steps"]) == 1
    assert not np.allclose(jax.device_get(state.params)["w1"], before["w1"])


def test_loss_scale_grows_after_the_configured_good_steps(mesh8, backend):
    precision = jdp.make_precision("fp16", growth_interval=3, init_scale=2.0**6)
    batches = [regression_data(seed) for seed in range(7)]
    _, history = _run(mesh8, backend, batches, precision=precision)
    initial = precision.init_scale
    scales = [float(metrics["loss_scale"]) for metrics in history]
    assert scales == [
        initial,
        initial,
        2 * initial,
        2 * initial,
        2 * initial,
        4 * initial,
        4 * initial,
    ]
    assert int(history[-1]["skipped_steps"]) == 0


def test_step_reports_lr_and_grad_norm(mesh8, backend):
    schedule = jdp.make_schedule("cosine", 0.05, warmup_steps=2, total_steps=10)
    optimizer = jdp.make_optimizer("momentum", schedule, clip_norm=1.0)
    batches = [regression_data(seed) for seed in range(3)]
    _, history = _run(
        mesh8, backend, batches, optimizer=optimizer, lr_schedule=schedule, grad_norm=True
    )
    for count, metrics in enumerate(history):
        assert metrics["lr"] == pytest.approx(float(schedule(count)))
    expected_norm = optax.tree.norm(jax.grad(regression_loss)(init_params(), batches[0], None))
    assert history[0]["grad_norm"] == pytest.approx(float(expected_norm), rel=1e-5)


def test_reported_lr_follows_the_optimizer_count_across_a_skip(mesh8, backend):
    schedule = jdp.make_schedule("linear", 0.01, warmup_steps=4, total_steps=20)
    optimizer = jdp.make_optimizer("adam", schedule)
    precision = jdp.make_precision("fp16", init_scale=2.0**8)
    batches = [regression_data(0), _poisoned(), regression_data(1)]
    _, history = _run(
        mesh8, backend, batches, optimizer=optimizer, precision=precision, lr_schedule=schedule
    )
    assert int(history[1]["skipped_steps"]) == 1
    # The skipped step's loss is not finite; the lr computed with it still is.
    assert not np.isfinite(history[1]["loss"])
    assert history[1]["lr"] == pytest.approx(float(schedule(1)))
    # Step 3 makes the optimizer's second applied update: count 1, not 2.
    assert history[2]["lr"] == pytest.approx(float(schedule(1)))
