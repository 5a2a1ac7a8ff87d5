"""gpt's ``--fp8`` (`jdp.models.fp8`): FP8's rounding, its gradients, the same on any mesh."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import cli

from jdp.models.fp8 import BACKWARD, FORWARD, fp8_dot_general, round_to
from jdp.models.transformer import GPT

SMALL = {"vocab_size": 61, "width": 32, "heads": 4, "layers": 2, "hidden": 64, "max_len": 16}
MATMUL = (((1,), (0,)), ((), ()))  # rows x in, in x out


def test_fp8_rounds_within_its_three_mantissa_bits():
    """Scaled so that the largest magnitude is E4M3's 448, a normal value rounds to within
    half its spacing, 2^-4 of itself (3 mantissa bits), and one below E4M3's least normal
    (2^-6) to within half the subnormals' spacing, 2^-10, in the scaled units."""
    x = jax.random.normal(jax.random.key(0), (64, 64)) * jnp.logspace(-6, 2, 64)[None, :]
    rounded = round_to(x, FORWARD)
    scale = jnp.max(jnp.abs(x)) / 448
    error = jnp.abs(rounded - x) / scale
    assert bool(jnp.all(error <= 2.0**-4 * jnp.abs(x) / scale + 2.0**-10))
    largest = jnp.argmax(jnp.abs(x))
    assert rounded.ravel()[largest] == x.ravel()[largest]  # the largest is exact
    assert not bool(jnp.all(rounded == x))  # it rounds
    assert bool(jnp.all(round_to(jnp.zeros(3), FORWARD) == 0))


def test_fp8_products_and_their_gradients_round_their_operands():
    """The product of the E4M3-rounded operands; its gradients the products of the
    E5M2-rounded output gradient with the other operand rounded to E4M3."""
    lhs, rhs, grad = jax.random.normal(jax.random.key(1), (3, 8, 8))
    out, pullback = jax.vjp(lambda a, b: fp8_dot_general(a, b, MATMUL), lhs, rhs)
    a, b, g = round_to(lhs, FORWARD), round_to(rhs, FORWARD), round_to(grad, BACKWARD)
    # The same values multiplied: fp32 sums of 8 terms in another order at most, a few
    # EPS32 (1.2e-7) of the terms: rtol 1e-6 and atol 1e-6 near zero.
    np.testing.assert_allclose(out, a @ b, rtol=1e-6, atol=1e-6)
    grad_lhs, grad_rhs = pullback(grad)
    np.testing.assert_allclose(grad_lhs, g @ b.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad_rhs, a.T @ g, rtol=1e-6, atol=1e-6)


def test_fp8_scales_a_split_batch_by_its_whole_largest_value():
    """Inside jdp's step the rows split over ``data``; each shard scales by the largest
    magnitude of the whole batch, so every value rounds as on one device: bitwise."""
    x = jax.random.normal(jax.random.key(2), (8, 16)) * jnp.arange(1, 9)[:, None]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    split = jax.shard_map(
        lambda x: round_to(x, FORWARD), mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data")
    )
    np.testing.assert_array_equal(jax.jit(split)(x), round_to(x, FORWARD))


def test_gpt_with_fp8_trains_near_its_bf16_loss_and_evaluates_without_it():
    tokens = jax.random.randint(jax.random.key(3), (4, 17), 0, SMALL["vocab_size"])
    plain, fp8 = GPT(**SMALL, dropout=0.0), GPT(**SMALL, dropout=0.0, fp8=True)
    params = plain.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss(module, train):
        logits = module.apply({"params": params}, tokens[:, :-1], train=train)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    # Each product's operands carry at most 2^-4 of rounding each (E4M3's 3 mantissa
    # bits), so each product is within about 2^-3 of its value; the loss, a smooth
    # function of them, moves by less than that fraction of itself.
    assert loss(fp8, True) != loss(plain, True)
    assert abs(loss(fp8, True) - loss(plain, True)) < 2.0**-3 * loss(plain, True)
    assert loss(fp8, False) == loss(plain, False)  # evaluating: no FP8


def test_fp8_trains_gpt_from_the_command_line_and_is_refused_elsewhere(tmp_path):
    run = cli(
        "--model",
        "gpt",
        "--dataset",
        "numbers2words",
        "--fp8",
        "--steps",
        "3",
        "--mesh",
        "data=8",
        "--ckpt-dir",
        tmp_path / "ckpt",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"train_loss=\d", run.stdout), run.stdout[-1000:]
    refused = cli("--model", "mlp", "--fp8", "--steps", "1")
    assert refused.returncode == 2
    assert "--fp8 is for --model gpt" in refused.stderr


def test_gpt_with_fp8_on_8_devices_is_one_device_to_rounding():
    """The loss of gpt with FP8 products on 8 devices, each a slice of the rows, against
    the same batch whole on one. Each slice is scaled by the whole batch's largest value,
    so the two differ only where their sums do, in order: a sum of 64 terms (the model's
    longest, its hidden units) in another order differs by at most 64 roundings. Scaled
    by each slice's own largest instead, they differ by 2.3 in 595 (4e-3 of it)."""
    tokens = jax.random.randint(jax.random.key(4), (8, 17), 0, SMALL["vocab_size"])
    module = GPT(**SMALL, dropout=0.0, fp8=True)
    params = module.init(jax.random.key(0), tokens[:, :-1])["params"]

    def total(params, tokens):
        logits = module.apply({"params": params}, tokens[:, :-1], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum()

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    split = jax.shard_map(
        lambda p, t: jax.lax.psum(total(p, t), "data"),
        mesh=mesh,
        in_specs=(jax.P(), jax.P("data")),
        out_specs=jax.P(),
    )
    whole = float(jax.jit(total)(params, tokens))
    rounding = float(jnp.finfo(jnp.float32).eps) * abs(whole)
    assert abs(float(jax.jit(split)(params, tokens)) - whole) <= 64 * rounding
