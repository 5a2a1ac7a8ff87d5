"""The language model's layers: scanned == unrolled, every remat policy == none, fused
attention == the reference, GPT-2 124M's parameter count and model FLOPs."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta

import jdp
from jdp.data.formats import numbers2words
from jdp.data.loader.readers import TrainReader
from jdp.errors import UsageError
from jdp.models.attention import Attention, implementation
from jdp.models.registry import get_model
from jdp.models.transformer import (
    GPT,
    Seq2SeqTransformer,
    flops_per_token,
    stack_layers,
)
from jdp.report.throughput import forward_flops, model_flops
from tests.helpers import assert_trees_close

SMALL = {"vocab_size": 61, "width": 32, "heads": 4, "layers": 3, "hidden": 64, "max_len": 16}


def _tokens(rows=4, length=16, vocab=61, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (rows, length)), jnp.int32)


def _loss(module):
    def loss(params, tokens):
        logits = module.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def _unrolled_params():
    variables = jax.jit(GPT(**SMALL, unroll=True).init)(jax.random.key(0), _tokens())
    return meta.unbox(variables["params"])


@pytest.mark.slow
def test_scanned_layers_equal_the_unrolled_loop():
    """The same parameters (stacked for the scan): the same loss and gradients."""
    unrolled = _unrolled_params()
    tokens = _tokens()
    # Jitted: one program each (the model dispatched op by op took seconds more).
    loss_u, grads_u = jax.jit(jax.value_and_grad(_loss(GPT(**SMALL, unroll=True))))(
        unrolled, tokens
    )
    scanned = stack_layers(unrolled, SMALL["layers"])
    loss_s, grads_s = jax.jit(jax.value_and_grad(_loss(GPT(**SMALL))))(scanned, tokens)
    # The same operations per layer; XLA fuses a loop's body and an unrolled layer
    # differently, so fp32 results differ by rounding, a few EPS32 (1.2e-7) per
    # operation over 3 layers: well inside rtol 1e-5 (84 EPS32), atol 1e-6 near zero.
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    assert_trees_close(grads_s, stack_layers(grads_u, SMALL["layers"]))


@pytest.mark.parametrize("policy", ["dots", "full", "attention"])
@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.slow
def test_every_remat_policy_gives_the_gradients_of_none(policy, unroll):
    params = _unrolled_params() if unroll else stack_layers(_unrolled_params(), SMALL["layers"])
    tokens = _tokens()
    expected = jax.jit(jax.grad(_loss(GPT(**SMALL, unroll=unroll))))(params, tokens)
    got = jax.jit(jax.grad(_loss(GPT(**SMALL, unroll=unroll, remat=policy))))(params, tokens)
    # Recomputation runs the forward pass's operations again on the same inputs: only
    # a different fusion can change a rounding (as above: rtol 1e-5, atol 1e-6).
    assert_trees_close(got, expected)


def test_remat_attention_keeps_no_scores_for_the_backward_pass():
    """``--remat attention``: the compiled step keeps none of XLA's attention scores, as
    cuDNN's kernel keeps none. Without it each layer keeps at least its softmax,
    ``rows x heads x T x T`` fp32 values, for the backward pass; with it the program
    needs at least that much less (the compiler's own memory analysis, on this CPU)."""
    config = SMALL | {"max_len": 128}
    rows, length = 4, config["max_len"]
    tokens = _tokens(rows, length + 1)
    params = stack_layers(_unrolled_params(), SMALL["layers"])
    params["Embed_1"]["embedding"] = jnp.zeros((length, SMALL["width"]))  # positions

    def temporaries(remat):
        step = jax.jit(jax.grad(_loss(GPT(**config, remat=remat))))
        return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    scores = config["layers"] * rows * config["heads"] * length * length * 4
    assert temporaries("none") - temporaries("attention") >= scores


def _reference_attention(params, queries, keys, *, causal, key_mask=None):
    """Attention written out: scores, masks, softmax, weighted values, projection."""

    def project(name, x):
        return (
            jnp.einsum("btd,dhk->bthk", x, params[name]["kernel"])
            + params[name]["bias"][None, None]
        )

    q, k, v = project("query", queries), project("key", keys), project("value", keys)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    allowed = jnp.ones(scores.shape, bool)
    if causal:
        allowed &= jnp.tril(jnp.ones(scores.shape[-2:], bool))[None, None]
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    attended = jnp.einsum("bhqs,bshk->bqhk", weights, v)
    out = jnp.einsum("bqhk,hkd->bqd", attended, params["out"]["kernel"])
    return out + params["out"]["bias"][None, None]


@pytest.mark.parametrize("causal, masked", [(True, False), (False, True), (True, True)])
def test_fused_attention_equals_the_reference(causal, masked):
    x = jax.random.normal(jax.random.key(1), (3, 12, 32))
    key_mask = jnp.arange(12)[None, :] < jnp.asarray([12, 7, 3])[:, None] if masked else None
    module = Attention(heads=4, implementation="xla")
    params = meta.unbox(module.init(jax.random.key(0), x, x)["params"])
    got = module.apply({"params": params}, x, x, causal=causal, key_mask=key_mask)
    expected = _reference_attention(params, x, x, causal=causal, key_mask=key_mask)
    # fp32 sums of 32 and 12 terms and a softmax, in another order: rounding of a few
    # EPS32 times the terms' count, inside rtol 1e-5 (84 EPS32), atol 1e-6 near zero.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_cudnn_attention_leaves_an_fp32_pass_to_xla():
    """cuDNN's kernel rejects fp32 queries ("Q must be fp16/bf16", seen on an H100):
    initializing a bf16 model with --attention cudnn runs one fp32 pass, which XLA's
    kernel takes; half precision keeps cuDNN's."""
    assert implementation("cudnn", jnp.float32, 64) == "xla"
    assert implementation("cudnn", jnp.bfloat16, 64) == "cudnn"
    assert implementation("xla", jnp.bfloat16, 64) == "xla"


def test_attention_reads_flax_multi_head_attention_parameters():
    """Checkpoints written with Flax's module restore: the same names, shapes and result."""
    import flax.linen as nn

    x = jax.random.normal(jax.random.key(1), (2, 10, 32))
    flax_module = nn.MultiHeadDotProductAttention(4)
    params = flax_module.init(jax.random.key(0), x, x)["params"]
    ours = Attention(heads=4).init(jax.random.key(0), x, x)["params"]
    shapes = jax.tree.map(jnp.shape, meta.unbox(ours))
    assert shapes == jax.tree.map(jnp.shape, params)
    causal = nn.make_causal_mask(jnp.ones((2, 10)))
    expected = flax_module.apply({"params": params}, x, x, mask=causal)
    got = Attention(heads=4).apply({"params": params}, x, x, causal=True)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class _Text:
    """What `get_model` reads of a token corpus's split."""

    kind, input_key, tokenizer, seq_len = "text", "tokens", None, 1024

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size


def _shapes(model, vocab_size, seq_len=1024):
    batch = {"tokens": jax.ShapeDtypeStruct((1, seq_len + 1), jnp.int32)}
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    return params, batch


def test_gpt2_124m_has_gpt2s_parameters():
    """GPT-2 small: 124,439,808 parameters with its 50,257 tokens; jdp pads the
    vocabulary to 50,304 (a multiple of 128), 47 rows of 768 more."""
    model = get_model("gpt", _Text(50257), "124m")
    params, _ = _shapes(model, 50257)
    count = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    assert params["Embed_0"]["embedding"].shape == (50304, 768)
    assert count == 124_439_808 + 47 * 768
    module = GPT(vocab_size=50257, width=768, heads=12, layers=12, hidden=3072, max_len=1024)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(meta.unbox(shapes))) == 124_439_808


def test_model_flops_of_gpt2_124m_at_1024_tokens():
    """PaLM's count by hand: 6 N with N the parameters but the 1024 x 768 position
    table, and 12 L T d for attention's two products (not halved for causality)."""
    parameters = 124_439_808 + 47 * 768
    weights = parameters - 1024 * 768  # 123,689,472
    by_hand = 6 * 123_689_472 + 12 * 12 * 1024 * 768  # 742,136,832 + 113,246,208
    assert weights == 123_689_472 and by_hand == 855_383_040
    assert flops_per_token(parameters, layers=12, width=768, seq_len=1024, max_len=1024) == (
        by_hand
    )
    model = get_model("gpt", _Text(50257), "124m")
    params, batch = _shapes(model, 50257)
    assert model.flops(params, batch) == by_hand * 1024
    # The products in the traced program, times 3, agree to within what the formula
    # counts and they do not: biases and LayerNorms (121,344 parameters, 0.1%).
    traced = 3 * forward_flops(lambda p, b: model.apply(p, {}, b, train=False)[0], params, batch)
    assert abs(traced / (by_hand * 1024) - 1) < 121_344 / weights * 1.01


def test_model_flops_of_a_model_without_a_formula_are_its_products_times_three():
    """The default MLP on digits: 64 x 512 and 512 x 10 multiply-adds per example."""
    train = jdp.load_split("digits", "train")
    model = get_model("mlp", train)
    batch = {
        "image": jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32),
        "label": jax.ShapeDtypeStruct((1,), jnp.int32),
    }
    params, state = jax.eval_shape(model.init, jax.random.key(0), batch)
    assert model_flops(model, params, state, batch) == 6 * (64 * 512 + 512 * 10)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"remat": "full"}, "--remat is for --model gpt"),
        ({"model_size": "124m"}, "--model-size 124m is for --model gpt"),
        ({"unroll_layers": True}, "--unroll-layers is for --model gpt"),
        ({"loss_chunks": 2}, "--loss-chunks 2 is for --model gpt"),
    ],
)
def test_the_language_model_flags_are_refused_for_other_models(flags, message):
    with pytest.raises(UsageError, match=message):
        jdp.TrainConfig(model="cnn", **flags)


@pytest.mark.slow
def test_loss_chunks_give_the_loss_metrics_and_gradients_of_the_whole_logits():
    """``--loss-chunks``: the loss, token accuracy and bits per byte, and the gradients,
    of the logits taken whole, for a chunk count that does not divide the 64 tokens (5:
    4 are taken) and one token a chunk; 0 chunks is refused, and so is a gpt on pairs."""
    params, tokens = _unrolled_params(), _tokens()
    batch = {"tokens": tokens}

    def loss(chunks):
        module = GPT(**SMALL, unroll=True, loss_chunks=chunks)
        objective = jdp.models.language_model(bits_per_byte=True, chunked=chunks > 1)
        model = jdp.models.from_linen(module, objective, inputs=lambda b: (b["tokens"][:, :-1],))
        return jax.jit(lambda p: model.loss_fn(p, {}, batch, jax.random.key(3))[:2])

    (whole, whole_metrics), whole_grads = jax.value_and_grad(loss(1), has_aux=True)(params)
    for chunks in (5, 64):
        (got, metrics), grads = jax.value_and_grad(loss(chunks), has_aux=True)(params)
        # The same products over the same tokens, in pieces: fp32 rounding apart (rtol
        # 1e-5 and atol 1e-6 near zero, as for remat above).
        np.testing.assert_allclose(got, whole, rtol=1e-5)
        bits, whole_bits = metrics["bits_per_byte"], whole_metrics["bits_per_byte"]
        np.testing.assert_allclose(bits, whole_bits, rtol=1e-5)
        assert metrics["token_accuracy"] == whole_metrics["token_accuracy"]
        assert_trees_close(grads, whole_grads)
    with pytest.raises(UsageError, match="--loss-chunks must be at least 1"):
        jdp.TrainConfig(model="gpt", loss_chunks=0)
    with pytest.raises(UsageError, match="--loss-chunks 2 is for a language model on a token"):
        get_model("gpt", jdp.load_split("numbers2words", "train"), loss_chunks=2)


@pytest.mark.slow
def test_loss_chunks_keep_one_chunks_logits_at_a_time():
    """With the logits taken in 8 chunks the compiled step keeps at least one whole fp32
    copy of them (``rows x length x vocab`` values) less: the compiler's own memory
    analysis, on this CPU."""
    config = SMALL | {"vocab_size": 4096, "max_len": 128}
    tokens = _tokens(8, 129, vocab=4096)
    params = meta.unbox(
        jax.eval_shape(GPT(**config).init, jax.random.key(0), tokens[:, :-1])["params"]
    )

    def temporaries(chunks):
        module = GPT(**config, loss_chunks=chunks)
        objective = jdp.models.language_model(chunked=chunks > 1)
        model = jdp.models.from_linen(module, objective, inputs=lambda b: (b["tokens"][:, :-1],))
        step = jax.jit(
            jax.grad(lambda p: model.loss_fn(p, {}, {"tokens": tokens}, jax.random.key(3))[0])
        )
        return step.lower(params).compile().memory_analysis().temp_size_in_bytes

    logits = 8 * 128 * 4096 * 4
    assert temporaries(1) - temporaries(8) >= logits


def test_a_gpt_checkpoint_from_before_scanned_layers_names_the_flag_to_resume_it():
    from jdp.checkpoint.record import RunSettings

    # Recorded before --unroll-layers existed, read as a resume reads it: as that jdp ran.
    saved = RunSettings({"model": "gpt", "steps": 10}).as_ran
    conflicts = jdp.TrainConfig(model="gpt", steps=10).resume_conflicts(saved)
    assert conflicts == ["--unroll-layers False (was True)"]
    assert jdp.TrainConfig(model="gpt", unroll_layers=True).resume_conflicts(saved) == []
    assert jdp.TrainConfig(model="mlp").resume_conflicts({"model": "mlp"}) == []


@pytest.mark.slow
def test_a_run_reports_the_model_flops_not_xlas_count_of_a_loop(tmp_path):
    import json

    config = jdp.TrainConfig(
        mesh="data=2",
        model="gpt",
        dataset="numbers2words",
        steps=2,
        batch_size=16,
        warmup_steps=1,
        log_dir=str(tmp_path),
    )
    jdp.fit(config, console=jdp.Console(enabled=False))
    facts = json.loads((tmp_path / "run.json").read_text())
    test = numbers2words.generate("test")
    model = get_model("gpt", test)
    batch = {key: value[:1] for key, value in test.read(np.arange(1)).items()}
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    assert facts["flops_per_step"] == pytest.approx(16 * model.flops(params, batch))
    # XLA counts a loop's body once: the scanned layers' step gets no hardware figure.
    assert facts["hardware_flops_per_step"] is None


@pytest.mark.slow
def test_a_gpt_checkpoint_of_unrolled_layers_starts_a_scanned_run(tmp_path):
    """--init-from a checkpoint written before scanned layers: its layers are stacked."""
    # One evaluation batch: the test reads parameters, not metrics.
    base = {
        "mesh": "data=2",
        "model": "gpt",
        "dataset": "numbers2words",
        "batch_size": 16,
        "warmup_steps": 1,
        "eval_batches": 1,
    }
    old = str(tmp_path / "old")
    jdp.fit(
        jdp.TrainConfig(**base, steps=2, unroll_layers=True, ckpt_dir=old),
        console=jdp.Console(enabled=False),
    )
    saved, _ = jdp.checkpoint.read_params(old)
    config = jdp.TrainConfig(**base, steps=1, init_from=old, lr=1e-12)
    result = jdp.fit(config, console=jdp.Console(enabled=False))
    # One step at lr 1e-12 moves nothing above rounding: the stacked layers are the saved ones.
    got = jax.device_get(result.state.params)
    assert_trees_close(got, stack_layers(jax.device_get(saved), 4), rtol=1e-6, atol=1e-9)


def test_the_docs_sizes_table_is_the_registrys():
    import pathlib

    from jdp.models.registry import MODELS

    text = (pathlib.Path(__file__).parents[1] / "docs" / "models.md").read_text()
    cells = r"\| (\d+) \| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| (\S+) \|$"
    rows = re.findall(r"^\| (`[^|]*) " + cells, text, re.M)
    documented = {}
    for names, *numbers in rows:
        for size in re.findall(r"`([^`]+)`", names):
            documented[size] = [float(n.replace(",", "")) for n in numbers]
    dropout = GPT.__dataclass_fields__["dropout"].default
    for size, options in MODELS["gpt"].sizes.items():
        expected = [options[k] for k in ("layers", "heads", "width", "hidden", "max_len")]
        assert documented[size] == [*expected, dropout], size


def test_shape_flags_with_loaded_weights_are_refused_and_width_sets_the_hidden_units():
    architecture = {
        "vocab_size": 64,
        "width": 32,
        "heads": 2,
        "layers": 1,
        "hidden": 128,
        "max_len": 1024,
        "dropout": 0.1,
    }
    with pytest.raises(UsageError, match="--layers: the loaded weights set the gpt's shape"):
        get_model("gpt", _Text(61), "small", architecture=architecture, shape={"layers": 2})
    get_model("gpt", _Text(61), "small", architecture=architecture, shape={"dropout": 0.0})
    model = get_model("gpt", _Text(61), "small", shape={"width": 64, "heads": 2})
    params, _ = _shapes(model, 61)
    assert params["blocks"]["FeedForward_0"]["Dense_0"]["kernel"].shape == (4, 64, 256)


def _dropout_steps(model, batch, mesh_spec, *, steps=3, accumulate=1, state=None, backend="jit"):
    """``steps`` train steps of ``model`` on ``batch`` over ``mesh_spec`` (from ``state``, a
    host copy of a train state, when given): their losses and host copies of the state
    after each."""
    # SGD, linear in the gradient: rounding stays rounding (Adam amplifies the coordinates
    # whose gradient is rounding away from zero to a step of the learning rate).
    mesh, optimizer = jdp.make_mesh(mesh_spec), optax.sgd(0.5)
    if state is None:
        params, model_state, specs = model.init_on_mesh(jax.random.key(0), batch, mesh)
        state = jdp.create_train_state(
            params,
            optimizer,
            mesh,
            model_state=model_state,
            rng=jax.random.key(7),
            param_specs=specs,
        )
    else:  # the run goes on with the same state on another mesh (data only: replicated)
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.P()))
    step = jdp.make_train_step(
        model.loss_fn, optimizer, mesh, has_model_state=True, accumulate=accumulate, backend=backend
    )
    losses, states = [], []
    for _ in range(steps):
        state, metrics = step(state, jdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
        states.append(jax.device_get(state))
    return losses, states


@pytest.mark.slow
def test_dropout_is_drawn_per_example_the_same_on_any_mesh():
    """A gpt with dropout: 1 device, 8, 2 x 4 micro-batches, and data x fsdp draw the same
    masks for the same examples (each row's from the step's key and its index in the
    global batch), so losses and parameters agree to rounding, as without dropout. With
    a key per replica, the first step's loss differed by about 1% between data=1 and 8.
    Element-wise tolerances as closeness.py derives them for SGD."""
    from closeness import EARLY_STEPS

    split = jdp.load_split("numbers2words", "train")
    model = get_model(
        "gpt", split, "small", shape={"layers": 1, "width": 32, "heads": 2, "dropout": 0.3}
    )
    assert model.row_keys
    reader = TrainReader(split, batch_size=32, seed=0, rows=slice(None))
    batch = {key: value for key, value in reader(0).items() if not key.startswith("_")}
    losses, states = _dropout_steps(model, batch, "data=1")
    for mesh_spec, accumulate in (("data=8", 1), ("data=2", 4), ("data=4,fsdp=2", 1)):
        other, other_states = _dropout_steps(model, batch, mesh_spec, accumulate=accumulate)
        assert np.allclose(other, losses, rtol=EARLY_STEPS, atol=0), (mesh_spec, other, losses)
        assert_trees_close(other_states[-1].params, states[-1].params, rtol=1e-5, atol=1e-6)
        if mesh_spec == "data=8":  # an elastic restart onto fewer devices: 2 steps on 8,
            halfway = other_states[1]  # then the third on 4, is the same run
    resumed, resumed_states = _dropout_steps(model, batch, "data=4", steps=1, state=halfway)
    assert np.allclose(resumed, losses[2:], rtol=EARLY_STEPS, atol=0), (resumed, losses)
    assert_trees_close(resumed_states[-1].params, states[-1].params, rtol=1e-5, atol=1e-6)
    # A Linen module of one's own that takes its rows (here jdp's seq2seq, small, with
    # dropout on its attention weights too): 8 devices under pmap against 1.
    module = Seq2SeqTransformer(
        vocab_size=len(split.vocab), width=32, heads=2, layers=1, hidden=64, dropout=0.3
    )
    pair = lambda b: (b["source"], b["target"][:, :-1])  # noqa: E731
    seq2seq = jdp.models.from_linen(module, jdp.models.sequence(), inputs=pair, rows_arg="rows")
    assert get_model("seq2seq", split, "small").row_keys  # as the built-in one is made
    one, _ = _dropout_steps(seq2seq, batch, "data=1", steps=2)
    eight, _ = _dropout_steps(seq2seq, batch, "data=8", steps=2, backend="pmap")
    assert np.allclose(eight, one, rtol=EARLY_STEPS, atol=0), (eight, one)
    # Dropout is on: the first step's loss is not the loss without it.
    params, model_state = jax.jit(model.init)(jax.random.key(0), batch)
    evaluate = jax.jit(lambda p, s, b: model.apply(p, s, b, train=False)[0])  # not op by op
    outputs = evaluate(params, model_state, batch)
    assert abs(float(model.objective.loss(outputs, batch).mean()) - losses[0]) > 1e-3


def test_token_accuracy_is_the_argmaxs_ties_and_all():
    """The language model's token accuracy gives argmax's answer without its reduce:
    right where the next token is the first of the largest logits."""
    metrics = jax.jit(jdp.models.language_model().metrics)  # a program, not op by op
    rng = np.random.default_rng(0)

    def check(logits, tokens):  # bf16 logits, as a bf16 model's, where ties are likelier
        expected = (np.argmax(logits, -1) == tokens[:, 1:]).mean(-1)
        figures = metrics(logits, {"tokens": tokens})
        assert np.array_equal(figures["token_accuracy"], expected), (figures, expected)
        return expected

    logits = rng.normal(size=(3, 16, 300)).astype(jnp.bfloat16)
    logits[:, :4, 7] = logits[:, :4, 3] = 9.0  # ties: 3 is argmax's
    tokens = rng.integers(0, 300, (3, 17))
    tokens[:, 1:9] = np.argmax(logits[:, :8], -1)
    tokens[:, 1:3] = 7
    assert 0.3 <= check(logits, tokens).min() < 0.5  # the ties at 7 are wrong, 3's right
    # Logits of four values over 50 tokens: ties everywhere, the label often among them.
    ties = rng.integers(0, 4, (4, 64, 50)).astype(jnp.bfloat16)
    tokens = rng.integers(0, 50, (4, 65))
    tokens[:, 1::2] = np.argmax(ties, -1)[:, ::2]  # half argmax's
    assert 0.5 <= check(ties, tokens).min() < 1
    # Rows of one value (the first token is right), of -inf and +inf alike, and NaN's
    # (nothing is right: no logit equals the maximum, where argmax takes the first NaN).
    flat = np.array([0, -np.inf, np.inf, np.nan], np.float32)[None, :, None].repeat(300, -1)
    for label, right in ((0, 0.75), (5, 0.0)):
        tokens = np.full((1, 5), label, np.int32)
        assert metrics(flat, {"tokens": tokens})["token_accuracy"].tolist() == [right], label
    # A negative label (no token is) is wrong, though the last logit is the largest.
    last = np.arange(300, dtype=np.float32)[None, None]
    tokens = np.array([[0, -1]], np.int32)
    assert metrics(last, {"tokens": tokens})["token_accuracy"].tolist() == [0.0]


def test_no_bias_leaves_every_bias_out_as_nanogpt_does():
    """``bias=False`` (``--no-bias``, nanoGPT's ``bias=False``): no bias in any dense layer
    or LayerNorm; the rest of the parameters as they were. The flag reaches the model,
    its name and a loaded run's rebuild."""
    from jdp.models.registry import gpt_shape

    tokens = jnp.zeros((2, 16), jnp.int32)

    def shapes(bias):
        module = GPT(vocab_size=64, width=32, heads=2, layers=2, hidden=64, max_len=16, bias=bias)
        params = jax.eval_shape(module.init, jax.random.key(0), tokens)["params"]
        leaves = jax.tree_util.tree_leaves_with_path(params)
        return {jax.tree_util.keystr(path): leaf.shape for path, leaf in leaves}

    with_bias, without = shapes(True), shapes(False)
    assert not [name for name in without if "bias" in name]
    assert without == {name: shape for name, shape in with_bias.items() if "bias" not in name}
    config = jdp.TrainConfig(model="gpt", bias=False)
    assert config.gpt_shape() == {"bias": False} and config.model_label.endswith("--no-bias")
    assert gpt_shape({"bias": False, "layers": 2}) == {"layers": 2, "bias": False}
    # The config's reading, for its lines (it imports no model), is the run's.
    assert gpt_shape(dataclasses.asdict(config)) == config.gpt_shape()
    from jdp.models.registry import _checked_shape

    with pytest.raises(UsageError, match="--no-bias shape the gpt; --model is mlp"):
        _checked_shape("mlp", {"bias": False}, {}, loaded=False)
    with pytest.raises(UsageError, match="--no-bias: the loaded weights set the gpt's shape"):
        _checked_shape("gpt", {"bias": False}, {}, loaded=True)


def test_fp16_attention_runs_on_the_cpu():
    """XLA's CPU dot has no fp16 x fp16 -> fp32, which fp16 attention asks for: the
    products are taken in fp32 there, of the same fp16 values."""
    attention = Attention(heads=2)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 8)), jnp.float16)
    params = jax.tree.map(lambda p: p.astype(jnp.float16), attention.init(jax.random.key(0), x, x))
    out = jax.jit(lambda p: attention.apply(p, x, x, causal=True))(params)
    assert out.dtype == jnp.float16 and bool(jnp.isfinite(out).all())
