"""``--attention blocked`` (`jdp.models.blocked`): XLA's attention's results and gradients,
with a fused kernel's memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.models.blocked import blocked_attention
from jdp.models.transformer import GPT, stack_layers
from tests.test_lm_model import SMALL, _loss, _tokens, _unrolled_params


def _inputs(queries=12, keys=12):
    q, k, v = jax.random.normal(jax.random.key(1), (3, 3, max(queries, keys), 4, 8))
    return q[:, :queries], k[:, :keys], v[:, :keys]


@pytest.mark.parametrize("causal, masked", [(True, False), (False, True), (True, True)])
def test_blocked_attention_gives_xlas_results_and_gradients(causal, masked):
    """Blocks of 5 queries over 12 (the last one padded), a row that sees no key (XLA
    averages the values there) and rows that see 7 and 3."""
    q, k, v = _inputs()
    mask = None
    if masked:
        mask = (jnp.arange(12)[None, :] < jnp.asarray([12, 7, 0])[:, None])[:, None, None, :]

    def xla(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, implementation="xla"
        )

    def blocked(q, k, v):
        return blocked_attention(q, k, v, mask=mask, is_causal=causal, block=5)

    def loss(attend):
        return lambda *qkv: jnp.sum(jnp.sin(attend(*qkv)))

    # fp32 sums of 12 terms and a softmax taken in another order (per block, with the
    # log-sum-exp kept): rounding of a few EPS32 (1.2e-7) per term, inside rtol 1e-5
    # (84 EPS32) and atol 1e-6 near zero.
    np.testing.assert_allclose(blocked(q, k, v), xla(q, k, v), rtol=1e-5, atol=1e-6)
    got = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_blocked_attention_takes_fewer_keys_than_queries():
    q, k, v = _inputs(queries=12, keys=7)
    expected = jax.nn.dot_product_attention(q, k, v, implementation="xla")
    np.testing.assert_allclose(blocked_attention(q, k, v, block=4), expected, rtol=1e-5, atol=1e-6)


def test_blocked_attention_keeps_no_scores_for_the_backward_pass():
    """gpt's step with ``--attention blocked`` needs at least each layer's ``rows x heads
    x T x T`` fp32 softmax less than with XLA's, which keeps it (the compiler's memory
    analysis, on this CPU); and the same gradients."""
    config = SMALL | {"max_len": 128}
    rows, length = 4, config["max_len"]
    tokens = _tokens(rows, length + 1)
    params = stack_layers(_unrolled_params(), SMALL["layers"])
    params["Embed_1"]["embedding"] = jnp.zeros((length, SMALL["width"]))  # positions
    steps = {
        how: jax.jit(jax.grad(_loss(GPT(**config, attention=how)))) for how in ("xla", "blocked")
    }

    def temporaries(how):
        return steps[how].lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    scores = config["layers"] * rows * config["heads"] * length * length * 4
    assert temporaries("xla") - temporaries("blocked") >= scores
    # As above, over 3 layers: rtol 1e-5, atol 1e-6 near zero.
    got, expected = (steps[how](params, tokens) for how in ("blocked", "xla"))
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6), got, expected)


def test_blocked_attention_differentiates_inside_a_shard_map():
    """jdp's step takes gradients inside `jax.shard_map`, where the backward pass's sums
    over blocks must be as varying over the data axis as the keys they sum."""
    q, k, v = _inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("data",))
    spec = jax.P("data")

    def grads(q, k, v):
        loss = lambda *qkv: jnp.sum(jnp.sin(blocked_attention(*qkv, is_causal=True, block=5)))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    sharded = jax.shard_map(grads, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3)
    # Each row's gradient is its own: the same operations on the same values.
    for got, expected in zip(jax.jit(sharded)(q, k, v), grads(q, k, v), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
