"""Built-in models, and users' Linen and NNX modules through `from_linen` / `from_nnx`."""

import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_drift_within
from flax import nnx

import jdp
from jdp.data.formats import numbers2words
from jdp.models import (
    DATA_AXIS,
    GPT,
    ResNet,
    classification,
    from_linen,
    from_nnx,
    get_model,
    translate,
)
from jdp.models.registry import MODELS

ROWS = 32


def _data(seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(ROWS, 4, 4, 2)).astype(np.float32)
    # A learnable rule: the class follows the two channels' means.
    means = images.mean(axis=(1, 2))
    labels = (means[:, 0] > 0).astype(np.int32) + (means[:, 1] > 0.2).astype(np.int32)
    return {"image": images, "label": labels}


class LinenNet(nn.Module):
    """Conv, BatchNorm over the global batch, dropout; records its dropout mask in ``probe``."""

    rate: float

    @nn.compact
    def __call__(self, x, *, train=False):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)  # BatchNorm supplies the offset
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.8, axis_name=DATA_AXIS if train else None
        )(x)
        x = nn.relu(x).mean(axis=(1, 2))
        mask = nn.Dropout(self.rate, deterministic=not train)(jnp.ones(8))
        probe = self.variable("probe", "mask", jnp.zeros, (8,))
        if train:
            probe.value = mask
        return nn.Dense(3)(x * mask[None])


class Probe(nnx.Variable):
    """Model state that is neither a parameter nor BatchNorm statistics."""


class NNXNet(nnx.Module):
    def __init__(self, rate: float, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(2, 8, (3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.8, axis_name=DATA_AXIS, rngs=rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)
        self.probe = Probe(jnp.zeros(8))

    def __call__(self, x):
        x = nnx.relu(self.norm(self.conv(x))).mean(axis=(1, 2))
        mask = self.dropout(jnp.ones(8))
        if not self.dropout.deterministic:
            self.probe[...] = mask
        return self.head(x * mask[None])


def _model(api: str, rate: float) -> jdp.models.Model:
    if api == "linen":
        return from_linen(LinenNet(rate), classification())
    return from_nnx(NNXNet(rate, rngs=nnx.Rngs(0)), classification())


def _train(model, mesh, backend, steps=3, optimizer=None):
    optimizer = optimizer or optax.adam(1e-2)
    params, model_state = jax.jit(model.init)(jax.random.key(0), _data())
    state = jdp.create_train_state(
        params, optimizer, mesh, model_state=model_state, rng=jax.random.key(1)
    )
    step = jdp.make_train_step(
        model.loss_fn, optimizer, mesh, backend=backend, has_model_state=True
    )
    history = []
    for seed in range(steps):
        state, metrics = step(state, jdp.shard_batch(_data(seed), mesh))
        probe = state.model_state["probe"]
        history.append(
            (
                float(metrics["loss"]),
                np.asarray(probe["mask"] if isinstance(probe, dict) else probe),
            )
        )
    return state, history


def _assert_replicas_agree(tree):
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_batchnorm_model_on_8_devices_matches_one_device(api, mesh8, mesh1, backend):
    """Dropout off: 8 replicas on a global batch train exactly as 1 device on it."""
    state8, _ = _train(_model(api, 0.0), mesh8, backend)
    state1, _ = _train(_model(api, 0.0), mesh1, backend)
    # Adam over two summation orders: equal to rounding, as a whole tree (closeness.py).
    for tree8, tree1 in ((state8.params, state1.params), (state8.model_state, state1.model_state)):
        assert_drift_within(jax.device_get(tree8), jax.device_get(tree1))
    stats = state8.model_state["norm" if api == "nnx" else "batch_stats"]
    assert jax.tree.leaves(stats) and not all(
        np.allclose(leaf, 0) or np.allclose(leaf, 1) for leaf in jax.tree.leaves(stats)
    ), "BatchNorm statistics never moved"
    _assert_replicas_agree((state8.params, state8.model_state))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_dropout_differs_per_replica_and_per_step(api, mesh8, backend):
    state, history = _train(_model(api, 0.5), mesh8, backend, steps=2)
    first, second = history[0][1], history[1][1]
    # The recorded mask is averaged over the 8 replicas: one mask for all would keep
    # every entry at 0 or 2 (kept and scaled by 1 / (1 - rate)).
    assert not np.all(np.isin(first, [0.0, 2.0])), first
    assert not np.array_equal(first, second)
    _assert_replicas_agree((state.params, state.model_state))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_model_with_dropout_learns_and_evaluates(api, mesh8, backend):
    model = _model(api, 0.2)
    state, history = _train(model, mesh8, backend, steps=30, optimizer=optax.adam(3e-2))
    assert history[-1][0] < 0.7 * history[0][0]
    eval_step = jdp.make_eval_step(model.metrics_fn, mesh8, backend=backend, has_model_state=True)
    batch = _data(0) | {"mask": np.ones(ROWS, np.float32)}
    result = jdp.evaluate(eval_step, state, [jdp.shard_batch(batch, mesh8)])
    assert result["count"] == ROWS and set(result) == {"loss", "accuracy", "count"}
    assert result["accuracy"] > 0.6


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_evaluation_uses_running_averages_and_no_dropout(api, mesh8, backend):
    """Eval mode: an example's loss is the same alone as in a batch, and on every call."""
    model = _model(api, 0.5)
    state, _ = _train(model, mesh8, backend, steps=3)
    params, model_state = jax.device_get((state.params, state.model_state))
    metrics = jax.jit(model.metrics_fn)
    batch = _data(5)
    together = metrics(params, model_state, batch)["loss"]
    np.testing.assert_array_equal(metrics(params, model_state, batch)["loss"], together)
    alone = metrics(params, model_state, jax.tree.map(lambda x: x[3:4], batch))["loss"]
    np.testing.assert_allclose(alone[0], together[3], rtol=1e-5)


def test_user_model_errors_name_the_fix(mesh8):
    with pytest.raises(jdp.UsageError, match=r"reads batch key\(s\) 'image' .* 'source'"):
        from_linen(nn.Dense(3), classification()).init(jax.random.key(0), {"source": np.ones(2)})
    # What the signature cannot map is refused when the model is wrapped, before any trace.
    with pytest.raises(jdp.UsageError, match=r"Dense.__call__ takes no keyword 'train' \(it takes"):
        from_linen(nn.Dense(3), classification(), train_arg="train")
    with pytest.raises(jdp.UsageError, match=r"takes \(inputs\) and jdp would pass 2 argument"):
        from_linen(nn.Dense(3), classification(), inputs=("image", "mask"))


@pytest.mark.parametrize("name", ["seq2seq", "gpt"])
def test_transformers_compute_in_the_parameters_dtype(name):
    split = _sequence_split()
    model = get_model(name, split)
    batch = split.read(np.arange(4))
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    half = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float16), params)
    outputs, _ = jax.eval_shape(lambda p: model.apply(p, {}, batch, train=False), half)
    assert outputs.dtype == jnp.float16


def test_linen_without_train_flag_or_model_state(mesh8):
    model = from_linen(nn.Dense(3), classification(), inputs="x", train_arg=None)
    batch = {"x": np.ones((8, 5), np.float32), "label": np.zeros(8, np.int32)}
    params, model_state = jax.jit(model.init)(jax.random.key(0), batch)
    assert model_state == {} and params["kernel"].shape == (5, 3)
    state = jdp.create_train_state(params, optax.sgd(0.5), mesh8)
    step = jdp.make_train_step(model.loss_fn, optax.sgd(0.5), mesh8, has_model_state=True)
    state, first = step(state, jdp.shard_batch(batch, mesh8))
    state, second = step(state, jdp.shard_batch(batch, mesh8))
    assert float(second["loss"]) < float(first["loss"])


def _sequence_split(rows=16):
    return numbers2words.SequenceSplit(
        *numbers2words.encode(np.arange(100, 100 + rows), 7), vocab=numbers2words.VOCAB
    )


# The sequence models and ResNets compile for 8-11 s each: the fast lane keeps mlp and cnn.
_SLOW_TO_COMPILE = {"gpt", "resnet18", "resnet20", "resnet50", "seq2seq"}


# ResNet-50's step is scheduled: per change the ImageNet recipe's smoke form trains it on
# image files (tests/test_recipes.py).
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=[pytest.mark.slow] * (n in _SLOW_TO_COMPILE)
            + [pytest.mark.scheduled] * (n == "resnet50"),
        )
        for n in sorted(MODELS)
    ],
)
def test_every_builtin_model_takes_a_step(name, mesh8):
    split = _sequence_split() if "sequence" in MODELS[name].data else None
    if split is None:
        images = np.random.default_rng(0).integers(0, 255, (16, 8, 8, 1), np.uint8)
        split = jdp.Split(images, np.arange(16, dtype=np.int32) % 10, num_classes=10)
    model = get_model(name, split)
    batch = jax.tree.map(np.asarray, split.read(np.arange(16)))
    if "image" in batch:
        batch["image"] = split.transform(batch["image"])
    params, model_state = jax.jit(model.init)(jax.random.key(0), batch)
    optimizer = optax.adam(1e-3)
    state = jdp.create_train_state(params, optimizer, mesh8, model_state=model_state)
    step = jdp.make_train_step(model.loss_fn, optimizer, mesh8, has_model_state=True)
    state, metrics = step(state, jdp.shard_batch(batch, mesh8))
    assert np.isfinite(float(metrics["loss"])) and "accuracy" in metrics


# In a process at XLA's defaults (the suite compiles at LLVM's level 0, conftest.py): each
# model a run builds, its parameters made on the mesh by their program at `INIT_OPTIONS`,
# against a plain `jax.jit(model.init)`, replicated and sharded.
_INIT_AT_DEFAULTS = """
import sys
import jax, numpy as np
import jdp
from jdp.models.model import INIT_OPTIONS, init_options
from jdp.models.registry import model_of_run
from jdp.data.formats import numbers2words

for name in sys.argv[1:]:
    if name == "gpt":
        numbers = numbers2words.encode(np.arange(100, 116), 7)
        split = numbers2words.SequenceSplit(*numbers, vocab=numbers2words.VOCAB)
    else:
        images = np.random.default_rng(0).integers(0, 255, (16, 8, 8, 1), np.uint8)
        split = jdp.Split(images, np.arange(16, dtype=np.int32) % 10, num_classes=10)
    model = model_of_run({"model": name}, split)
    batch = jax.tree.map(np.asarray, split.read(np.arange(16)))
    if "image" in batch:
        batch["image"] = split.transform(batch["image"])
    plain = jax.tree.leaves(jax.jit(model.init)(jax.random.key(0), batch))
    for mesh in (jdp.make_mesh("data=8"), jdp.make_mesh("data=2,fsdp=4")):
        assert init_options(model.init_options, mesh) == INIT_OPTIONS
        made = jax.tree.leaves(model.init_on_mesh(jax.random.key(0), batch, mesh)[:2])
        for got, want in zip(made, plain, strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want), name
    print(name, "the same bits")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "models",
    [
        ["mlp", "cnn", "gpt"],
        # ResNet-20's layers are the CNN's (convolutions, BatchNorm, a dense head), more
        # of them: its check takes as long as the other three's together.
        pytest.param(["resnet20"], marks=pytest.mark.scheduled),
    ],
    ids=",".join,
)
def test_parameters_made_by_a_quicker_compile_are_the_same_bits(models):
    from tools.readme import row_env

    result = subprocess.run(
        [sys.executable, "-c", _INIT_AT_DEFAULTS, *models],
        capture_output=True,
        text=True,
        timeout=240,
        env=row_env("--xla_force_host_platform_device_count=8"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("the same bits") == len(models)


def test_a_model_of_yours_makes_its_parameters_at_xlas_defaults():
    from jdp.models.model import init_options

    model = from_linen(nn.Dense(3), classification(), inputs="x", train_arg=None)
    assert model.init_options is None and init_options(model.init_options, None) is None


def _count(module, *inputs):
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes["params"]))


def test_standard_sizes_are_the_published_ones():
    tokens = jnp.zeros((1, 8), jnp.int32)
    gpt2 = GPT(vocab_size=50257, **MODELS["gpt"].sizes["standard"])
    assert _count(gpt2, tokens) == 124_439_808  # GPT-2 small
    image = jnp.zeros((1, 32, 32, 3))
    resnet18 = ResNet(num_classes=10, **MODELS["resnet18"].sizes["standard"])
    assert _count(resnet18, image) == 11_173_962  # ResNet-18 for CIFAR-10
    resnet20 = ResNet(num_classes=10, **MODELS["resnet20"].sizes["standard"])
    assert 0.26e6 < _count(resnet20, image) < 0.28e6  # He et al.: 0.27M
    resnet50 = ResNet(num_classes=1000, **MODELS["resnet50"].sizes["standard"])
    # torchvision's resnet50(): sum(p.numel() for p in model.parameters()).
    assert _count(resnet50, jnp.zeros((1, 224, 224, 3))) == 25_557_032


def test_numbers2words_is_generated_by_seed():
    train, test = numbers2words.generate("train"), numbers2words.generate("test")
    assert (len(train), len(test)) == (20_000, 2_000)
    assert not set(map(tuple, train.source)) & set(map(tuple, test.source))
    # Dealt from one shuffled pool: the two splits' lengths follow one distribution.
    lengths = [np.bincount((s.source != 0).sum(1), minlength=8)[1:] / len(s) for s in (train, test)]
    np.testing.assert_allclose(lengths[0], lengths[1], atol=0.03)
    np.testing.assert_array_equal(numbers2words.generate("test").target, test.target)
    assert not np.array_equal(numbers2words.generate("test", seed=1).source, test.source)
    source, target = numbers2words.encode(np.array([123, 7]), 7)
    assert train.decode(source[0]) == "1 2 3"
    assert train.decode(target[0]) == "one two three"
    assert train.decode(target[1]) == "seven"


# seq2seq's in the scheduled lane: the gpt's takes the same metric and `translate` per change.
@pytest.mark.parametrize(
    "name, steps", [pytest.param("seq2seq", 60, marks=pytest.mark.scheduled), ("gpt", 16)]
)
@pytest.mark.slow
def test_exact_match_is_greedy_decoding(name, steps):
    """The eval's exact-match accuracy counts the sequences a greedy decoder gets right."""
    # The gpt at batch 64: about a fifth of its sequences right after 16 steps, in half
    # the time of the default 128. The run's own evaluation is not what is compared.
    config = jdp.TrainConfig(
        mesh="data=1",
        model=name,
        dataset="numbers2words",
        steps=steps,
        warmup_steps=10,
        batch_size=64 if name == "gpt" else 128,
        eval_batches=1,
    )
    result = jdp.fit(config)
    test = numbers2words.generate("test")
    rows = np.arange(512)
    batch = test.read(rows)
    model = get_model(name, test)
    params, model_state = jax.device_get((result.state.params, result.state.model_state))
    per_example = jax.jit(model.metrics_fn)(params, model_state, batch)["accuracy"]

    decoded = translate(model, params, model_state, batch, bos=test.bos, eos=test.eos)

    def until_eos(tokens):
        tokens = np.asarray(tokens).tolist()
        return tokens[: tokens.index(test.eos) + 1] if test.eos in tokens else tokens

    right = [until_eos(decoded[i]) == until_eos(batch["target"][i]) for i in range(len(rows))]
    np.testing.assert_array_equal(np.asarray(per_example, bool), right)
    # Partly trained: some sequences right and some wrong, so both outcomes are compared.
    print(f"{name}: {np.mean(right):.3f} exact after {steps} steps")
    assert 0.0 < np.mean(right) < 1.0, np.mean(right)


@pytest.mark.slow
def test_fit_trains_and_resumes_an_nnx_model(tmp_path):
    """Your model through the whole loop: nnx.List's integer keys survive an Orbax round trip."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)])
            self.norm = nnx.BatchNorm(32, axis_name=DATA_AXIS, rngs=rngs)

        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            return self.layers[1](nnx.relu(self.norm(self.layers[0](x))))

    config = jdp.TrainConfig(
        mesh="data=8", steps=40, warmup_steps=5, ckpt_dir=str(tmp_path), ckpt_every=20
    )
    first = jdp.fit(config, model=from_nnx(Net(nnx.Rngs(0)), classification()))
    assert first.test_accuracy > 0.5
    # Resume from step 20 (the step-40 save set aside), on a model built from another seed:
    # the second half of the run must come out bitwise the same.
    shutil.rmtree(tmp_path / "40")
    resumed = jdp.fit(config, model=from_nnx(Net(nnx.Rngs(1)), classification()))
    assert resumed.steps == 40 and int(resumed.state.step) == 40
    assert resumed.test_accuracy == first.test_accuracy
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(resumed.state.params),
        jax.device_get(first.state.params),
    )


def test_label_smoothing_is_szegedy_et_als():
    logits = jnp.array([[2.0, 0.5, -1.0], [0.0, 0.0, 3.0]])
    batch = {"label": jnp.array([0, 1])}
    smoothed = jdp.models.classification(smoothing=0.1).loss(logits, batch)
    log_p = jax.nn.log_softmax(logits)
    target = np.full((2, 3), 0.1 / 3) + 0.9 * np.eye(3)[[0, 1]]
    np.testing.assert_allclose(smoothed, -(target * log_p).sum(-1), rtol=1e-6)
    plain = jdp.models.classification().loss(logits, batch)
    np.testing.assert_allclose(plain, -log_p[np.arange(2), [0, 1]], rtol=1e-6)
    with pytest.raises(jdp.UsageError, match="--label-smoothing is for the image classifiers"):
        get_model("seq2seq", _sequence_split(), label_smoothing=0.1)
    with pytest.raises(jdp.UsageError, match=r"--label-smoothing must be in \[0, 1\), got 1"):
        jdp.TrainConfig(label_smoothing=1.0)
