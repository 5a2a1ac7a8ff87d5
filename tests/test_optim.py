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


class _Images:
    """What `get_model` reads of an image split."""

    kind, label_key, input_key, num_classes = "image", "label", "image", 10


class _Words:
    kind, vocab = "sequence", tuple(range(23))


class _Text:
    kind, input_key, tokenizer, seq_len, vocab_size = "text", "tokens", None, 16, 61


# Each built-in model at its small size, the gpt scanned and unrolled: its sample batch.
BUILT_IN = {
    "mlp": (_Images, {"image": (1, 8, 8, 1)}, {}),
    "cnn": (_Images, {"image": (1, 8, 8, 1)}, {}),
    "resnet20": (_Images, {"image": (1, 8, 8, 3)}, {}),
    "resnet50": (_Images, {"image": (1, 32, 32, 3)}, {}),
    "seq2seq": (_Words, {"source": (1, 6), "target": (1, 7)}, {}),
    "gpt": (_Text, {"tokens": (1, 17)}, {}),
    "gpt-unrolled": (_Text, {"tokens": (1, 17)}, {"unroll": True}),
}


@pytest.mark.parametrize("name", BUILT_IN)
def test_weight_decay_reaches_the_weight_matrices_and_embeddings_alone(name):
    """Listed by name for every built-in model: scanned layers stack each bias and
    LayerNorm scale on a ``layers`` axis and attention's biases are (heads, width), so
    a rule by rank decayed them (813,568 of the small gpt's 813,824 parameters)."""
    from jdp.models.registry import get_model

    split, shapes, options = BUILT_IN[name]
    model = get_model(name.split("-")[0], split(), "small", **options)
    batch = {
        key: jax.ShapeDtypeStruct(shape, jnp.int32 if key != "image" else jnp.float32)
        for key, shape in shapes.items()
    }
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    mask = decay_mask(params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    decided = jax.tree.leaves(mask)
    names = [jax.tree_util.keystr(path).rsplit("'", 2)[-2] for path, _ in leaves]
    decayed = {n for n, on in zip(names, decided, strict=True) if on}
    spared = {n for n, on in zip(names, decided, strict=True) if not on}
    assert decayed == ({"kernel", "embedding"} & set(names)), (decayed, spared)
    assert spared == (set(names) - {"kernel", "embedding"}), (decayed, spared)
    if name.startswith("gpt"):  # the same parameters decayed, scanned or not
        count = sum(
            np.size(leaf) for leaf, on in zip(jax.tree.leaves(params), decided, strict=True) if on
        )
        biases = sum(
            np.size(leaf)
            for leaf, on in zip(jax.tree.leaves(params), decided, strict=True)
            if not on
        )
        assert (count, biases) == (GPT_SMALL_DECAYED, GPT_SMALL_SPARED)


# gpt small on 61 tokens and 16 positions (4 layers of width 128, 4 heads, hidden 512):
# decayed, the token and position tables and each layer's q, k, v, out and two
# feed-forward kernels, 61*128 + 16*128 + 4 * (4*128*128 + 2*128*512); spared, each
# layer's 4 + 2 biases and two LayerNorms, and the final LayerNorm, 4 * (4*128 + 512 +
# 128 + 4*128) + 2*128 (the head shares the token table).
GPT_SMALL_DECAYED = 61 * 128 + 16 * 128 + 4 * (4 * 128 * 128 + 2 * 128 * 512)
GPT_SMALL_SPARED = 4 * (4 * 128 + 512 + 128 + 4 * 128) + 2 * 128


def test_decay_mask_reads_names_through_nnx_variables_and_linen_boxes():
    """An NNX state's leaves sit under each Variable's ``value``, a boxed Linen tree's
    under ``Partitioned``: the name is the parameter's, so a 2-D bias is spared there
    too (the rank rule would decay it)."""
    import flax.linen as nn
    from flax import nnx

    class Stacked(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.ones((2, 3, 4)))
            self.bias = nnx.Param(jnp.zeros((2, 4)))  # a bias per stacked layer
            self.scale = nnx.Param(jnp.ones((2, 4)))

    for tree in (
        nnx.state(Stacked(), nnx.Param),
        {
            "kernel": nn.Partitioned(jnp.ones((2, 3)), ("a", "b")),
            "bias": nn.Partitioned(jnp.zeros((2, 3)), ("a", "b")),
        },
    ):
        flat = jax.tree_util.tree_flatten_with_path(decay_mask(tree))[0]
        named = {jax.tree_util.keystr(path): on for path, on in flat}
        assert [key for key, on in named.items() if on] == [
            key for key in named if "kernel" in key
        ], named
    # A name that says neither, or PyTorch's ``weight`` (a norm's scale too): the rank.
    assert decay_mask({"w2": jnp.ones((2, 3)), "v": jnp.ones(3)}) == {"w2": True, "v": False}
    assert decay_mask({"weight": jnp.ones(3)}) == {"weight": False}


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            dict(optimizer="adam", weight_decay=0.1, beta2=0.95),
            "adam (b1 0.9, b2 0.95), lr 0.003 = 0.003 peak, cosine schedule to 0 at step 400, "
            "40 warmup steps, weight decay 0.1 as L2, added to the gradient (decoupled: "
            "--optimizer adamw)",
        ),
        (
            dict(optimizer="adamw", weight_decay=0.1, end_lr=3e-4, decay_steps=300, clip_norm=1),
            "adamw (b1 0.9, b2 0.999), lr 0.003 = 0.003 peak, cosine schedule to 0.0003 at step "
            "300, 40 warmup steps, weight decay 0.1 decoupled, gradients clipped at global norm 1",
        ),
        (
            dict(optimizer="sgd", schedule="constant"),
            "sgd, lr 0.003 = 0.003 peak, constant schedule, 40 warmup steps",
        ),
    ],
)
def test_the_first_lines_say_the_optimizer_whole(flags, said):
    """What the run's first lines say of the optimizer: each setting that changes it, and
    whether weight decay is decoupled (AdamW's) or L2 (Adam's, added to the gradient)."""
    from jdp.training.optimizer import describe

    assert describe(jdp.TrainConfig(**flags)) == said
