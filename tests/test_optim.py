import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.optim import decay_mask, scale_lr

PEAK, WARMUP, TOTAL = 0.1, 10, 110


def _value(schedule, count):
    return float(schedule(count))


@pytest.mark.parametrize("name", ["constant", "cosine", "linear", "piecewise"])
def test_warmup_is_linear_from_zero_to_peak(name):
    schedule = jdp.make_schedule(
        name, PEAK, warmup_steps=WARMUP, total_steps=TOTAL, boundaries=[60, 90]
    )
    assert _value(schedule, 0) == 0.0
    assert _value(schedule, WARMUP // 2) == pytest.approx(PEAK / 2)
    assert _value(schedule, WARMUP) == pytest.approx(PEAK)


def test_cosine_decay_closed_form():
    schedule = jdp.make_schedule("cosine", PEAK, warmup_steps=WARMUP, total_steps=TOTAL)
    for count in (WARMUP, 35, 60, 85, TOTAL):
        progress = (count - WARMUP) / (TOTAL - WARMUP)
        expected = PEAK * 0.5 * (1 + math.cos(math.pi * progress))
        assert _value(schedule, count) == pytest.approx(expected, abs=1e-7)


def test_linear_decay_closed_form():
    schedule = jdp.make_schedule(
        "linear", PEAK, warmup_steps=WARMUP, total_steps=TOTAL, end_lr=0.01
    )
    for count in (WARMUP, 60, TOTAL):
        expected = PEAK + (0.01 - PEAK) * (count - WARMUP) / (TOTAL - WARMUP)
        assert _value(schedule, count) == pytest.approx(expected, rel=1e-6)


def test_constant_after_warmup():
    schedule = jdp.make_schedule("constant", PEAK, warmup_steps=WARMUP, total_steps=TOTAL)
    assert _value(schedule, 50) == pytest.approx(PEAK)
    assert _value(jdp.make_schedule("constant", PEAK), 0) == pytest.approx(PEAK)


def test_piecewise_multiplies_at_each_boundary():
    schedule = jdp.make_schedule(
        "piecewise", PEAK, warmup_steps=WARMUP, total_steps=TOTAL, boundaries=[60, 90]
    )
    assert _value(schedule, 59) == pytest.approx(PEAK)
    assert _value(schedule, 60) == pytest.approx(PEAK * 0.1)
    assert _value(schedule, 90) == pytest.approx(PEAK * 0.01)


def test_noam_peaks_at_warmup_steps():
    schedule = jdp.make_schedule("noam", PEAK, warmup_steps=WARMUP)
    values = [_value(schedule, count) for count in range(200)]
    # Update k = count + 1; the peak is the warmup_steps-th update.
    assert int(np.argmax(values)) + 1 == WARMUP
    assert max(values) == pytest.approx(PEAK)
    assert _value(schedule, 4 * WARMUP - 1) == pytest.approx(PEAK / 2)  # 1/sqrt(k) after


def test_noam_with_d_model_is_the_papers_formula():
    d_model, warmup, factor = 128, 4000, 1.0
    schedule = jdp.make_schedule("noam", factor, warmup_steps=warmup, d_model=d_model)
    for k in (1, 100, 4000, 10000):
        expected = factor * d_model**-0.5 * min(k**-0.5, k * warmup**-1.5)
        assert _value(schedule, k - 1) == pytest.approx(expected, rel=1e-5)


def test_lr_scaling_rules():
    assert scale_lr(0.1, 1024, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 1024, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 1024, "none") == 0.1
    assert scale_lr(0.1, 64, "linear", reference_batch=128) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: jdp.make_schedule("exponential", 0.1), "unknown schedule 'exponential'"),
        (lambda: jdp.make_optimizer("adagrad"), "unknown optimizer 'adagrad'"),
        (
            lambda: jdp.make_schedule("cosine", 0.1, warmup_steps=200, total_steps=100),
            "warmup \\(200 steps\\) is longer than training \\(100 steps\\)",
        ),
        (lambda: jdp.make_schedule("noam", 0.1), "noam schedule needs --warmup-steps"),
        (lambda: scale_lr(0.1, 8, "cubic"), "unknown lr scaling rule"),
        (
            lambda: jdp.make_schedule("piecewise", 0.1, warmup_steps=10, boundaries=[5]),
            "must increase and come after warmup",
        ),
    ],
)
def test_bad_optimizer_input(call, needle):
    with pytest.raises(jdp.UsageError, match=needle):
        call()


def _params():
    return {
        "dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4,))},
        "norm": {"scale": jnp.ones((4,))},
    }


def test_decay_mask_spares_biases_and_norm_scales():
    mask = decay_mask(_params())
    assert mask == {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False}}


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adam", "adamw", "lamb", "lars"])
def test_weight_decay_leaves_masked_leaves_untouched(name):
    params = _params()
    optimizer = jdp.make_optimizer(name, 0.1, weight_decay=0.5)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["dense"]["bias"], params["dense"]["bias"])
    np.testing.assert_array_equal(new["norm"]["scale"], params["norm"]["scale"])
    assert float(jnp.max(new["dense"]["kernel"])) < 1.0  # decayed


def test_clipping_bounds_the_global_norm():
    params = _params()
    optimizer = jdp.make_optimizer("sgd", 1.0, clip_norm=0.5)
    grads = jax.tree.map(lambda p: 10.0 * jnp.ones_like(p), params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(0.5, rel=1e-5)


def test_a_user_transformation_is_accepted_as_is():
    mine = optax.chain(optax.scale_by_rms(), optax.scale(-0.01))
    assert jdp.make_optimizer(mine) is mine
