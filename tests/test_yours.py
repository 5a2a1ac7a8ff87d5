"""The user's path: their own data, models and optimizer through `jdp.fit` and the CLI,
and the trained model back (`load_model`, `predict`, ``--eval-only``, ``--init-from``)."""

import dataclasses
import json
import os
import re
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_drift_within
from flax import nnx
from helpers import run_cli, run_python

import jdp

QUIET = jdp.Console(enabled=False)
TEST_SIZE = 297  # not a multiple of any batch or device count


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(1).permutation(len(digits.target))
    images = digits.images.astype(np.uint8)[..., None]  # values 0..16
    return images, digits.target, order[TEST_SIZE:], order[:TEST_SIZE]


def _config(**overrides):
    settings = dict(mesh="data=8", steps=40, warmup_steps=4, batch_size=64, lr=1e-2)
    return jdp.TrainConfig(**(settings | overrides))


def _fit(config, **given):
    return jdp.fit(config, console=QUIET, **given)


def _summary(result) -> dict[str, str]:
    """The summary line's ``name=value`` pairs."""
    line = result.stdout.strip().splitlines()[-1]
    return dict(re.findall(r"(\w+)=(\S+)", line))


class _StopAt:
    """An action that stops the run at one step (the run then evaluates and saves)."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self, progress) -> None:
        if progress.step == self.step:
            progress.stop(f"stopped at step {self.step} for the test")


def _check_source(tmp_path, train, test, cli_dataset, *cli_flags):
    """A source of data trains the same on 8 devices as on 1, evaluates every test example
    once, resumes bitwise through fit, and trains, resumes and evaluates through the CLI."""
    one = _fit(_config(mesh="data=1"), train=train, test=test)
    eight = _fit(_config(), train=train, test=test)
    assert_drift_within(eight.state.params, one.state.params)
    assert eight.test_accuracy > 0.5
    evaluations = [record for record in eight.history if record["kind"] == "eval"]
    assert evaluations[-1]["count"] == len(test)  # each example once, the padding none
    # Bitwise resume through fit: stopped (and saved) at 20, then on to 40, equals 40 straight.
    ckpt = str(tmp_path / "fit")
    _fit(_config(ckpt_dir=ckpt), train=train, test=test, callbacks=[_StopAt(20)])
    resumed = _fit(_config(ckpt_dir=ckpt), train=train, test=test)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, eight.state.params)
    # The CLI: a run, raised --steps resumes it, --eval-only reads the same figure.
    flags = ["--dataset", cli_dataset, *cli_flags, "--batch-size", "64", "--warmup-steps", "4"]
    flags += ["--ckpt-dir", str(tmp_path / "cli")]
    first = run_cli(*flags, "--steps", "20", timeout=240)
    assert first.returncode == 0, first.stderr
    longer = run_cli(*flags, "--steps", "40", timeout=240)
    assert longer.returncode == 0, longer.stderr
    assert "resuming from step 20" in longer.stdout and "--steps 40 (was 20)" in longer.stdout
    evaluated = run_cli(*flags, "--eval-only", timeout=240)
    assert evaluated.returncode == 0, evaluated.stderr
    assert _summary(evaluated)["test_accuracy"] == _summary(longer)["test_accuracy"]
    assert _summary(evaluated)["step"] == "40"


@pytest.mark.slow
def test_numpy_arrays_with_their_own_names_train_through_fit_and_the_cli(tmp_path):
    images, labels, train_rows, test_rows = _digits()

    def split(rows):
        return jdp.data.from_arrays(
            {"pixels": images[rows], "digit": labels[rows]},
            input_key="pixels",
            label_key="digit",
            transform=jdp.data.Transform(scale=16.0),
        )

    # On the command line: a .npz file named as Keras's mnist.npz is.
    file = tmp_path / "digits.npz"
    np.savez(
        file,
        x_train=images[train_rows],
        y_train=labels[train_rows],
        x_test=images[test_rows],
        y_test=labels[test_rows],
    )
    _check_source(tmp_path, split(train_rows), split(test_rows), f"npz:{file}")


@pytest.mark.slow
def test_a_tfds_builder_of_ones_own_trains_through_fit_and_the_cli(tmp_path):
    from user_dataset import MyDigits

    data_dir = tmp_path / "tfds"
    data_dir.mkdir()
    builder = MyDigits(data_dir=str(data_dir), file_format="array_record")
    scale = jdp.data.Transform(scale=16.0)
    train = jdp.data.from_tfds(builder, "train", transform=scale)  # prepared here
    test = jdp.data.from_tfds(builder, "test", transform=scale)
    assert (train.input_key, train.label_key, train.num_classes) == ("pixels", "digit", 10)
    assert train.features["weight"].dtype == np.float32  # every numeric feature, its name kept
    # The CLI reads it from the data directory, without the builder's code.
    _check_source(tmp_path, train, test, "tfds:my_digits", "--data-dir", str(data_dir))


@pytest.mark.slow
def test_an_image_folder_trains_through_fit_and_the_cli(tmp_path):
    from PIL import Image

    images, labels, train_rows, test_rows = _digits()
    names = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    root = tmp_path / "images"
    for part, rows in (("train", train_rows), ("test", test_rows)):
        for row in rows:
            folder = root / part / names[labels[row]]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[row, :, :, 0] * 15).save(folder / f"{row}.png")
    train = jdp.data.from_folder(root / "train")
    test = jdp.data.from_folder(root / "test", classes=train.classes)
    assert train.classes == tuple(sorted(names)) and train.features["image"].shape[1:] == (8, 8, 1)
    assert len(test) == TEST_SIZE
    _check_source(tmp_path, train, test, f"folder:{root}")


def test_bad_folders_and_files_are_one_line(tmp_path):
    from PIL import Image

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    Image.new("L", (8, 8)).save(tmp_path / "a" / "1.png")
    Image.new("L", (9, 8)).save(tmp_path / "b" / "1.png")
    with pytest.raises(jdp.UsageError, match=r"images differ in size: .* pass image_size="):
        jdp.data.from_folder(tmp_path)
    assert jdp.data.from_folder(tmp_path, image_size=(8, 8)).features["image"].shape == (2, 8, 8, 1)
    (tmp_path / "b" / "2.png").write_bytes(b"not an image")
    with pytest.raises(jdp.UsageError, match=r"cannot read image .*2.png"):
        jdp.data.from_folder(tmp_path, image_size=(8, 8))
    with pytest.raises(jdp.UsageError, match=r"unknown dataset 'mydata'.* npz:FILE"):
        jdp.TrainConfig(dataset="mydata")
    result = run_cli("--dataset", f"npz:{tmp_path}/missing.npz", "--steps", "2", timeout=120)
    assert result.returncode == 2 and "cannot read" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(jdp.UsageError, match="no TFDS dataset 'nothing_here'"):
        jdp.data.from_tfds("nothing_here", data_dir=str(tmp_path))
    with pytest.raises(jdp.UsageError, match="feature is named 'mask'"):
        jdp.data.from_arrays({"image": np.zeros((4, 2)), "mask": np.zeros(4)})


def test_a_per_example_function_draws_the_same_on_any_mesh(mesh8, mesh1):
    """``map(example, rng)``: the rng follows the example's place in the global batch."""
    x = np.arange(64, dtype=np.float32)[:, None]

    def jitter(example, rng):
        noise = 0.0 if rng is None else rng.normal()
        return {"x": example["x"] + np.float32(noise), "label": example["label"]}

    split = jdp.data.from_arrays({"x": x, "label": np.zeros(64, np.int64)}, map=jitter)
    batches = []
    for mesh in (mesh8, mesh1):
        with jdp.train_batches(split, mesh, batch_size=16, seed=3) as loader:
            batches.append([np.asarray(next(loader)["x"]) for _ in range(3)])
    np.testing.assert_array_equal(batches[0], batches[1])
    assert not np.allclose(np.round(batches[0][0]), batches[0][0])  # noise was drawn
    evaluated = next(iter(jdp.eval_batches(split, mesh8, batch_size=16)))
    np.testing.assert_array_equal(np.asarray(evaluated["x"])[:, 0], np.arange(16))  # none here


@pytest.mark.slow
def test_a_validation_split_chooses_the_best_checkpoint_and_the_test_is_reported(tmp_path):
    images, labels, train_rows, test_rows = _digits()
    train = jdp.data.from_arrays(
        images[train_rows], labels[train_rows], transform=jdp.data.Transform(scale=16.0)
    )
    test = jdp.data.from_arrays(
        images[test_rows], labels[test_rows], transform=jdp.data.Transform(scale=16.0)
    )
    config = _config(
        validation_fraction=0.2, eval_every=10, ckpt_every=10, ckpt_dir=str(tmp_path), keep=1
    )
    result = _fit(config, train=train, test=test)
    kinds = [record["kind"] for record in result.history if record["kind"] != "train"]
    assert kinds == ["val", "val", "val", "val", "eval"]  # the test split once, at the end
    validations = [r for r in result.history if r["kind"] == "val"]
    assert validations[-1]["count"] == round(0.2 * len(train_rows))
    best = max(validations, key=lambda record: (record["accuracy"], record["step"]))
    loaded = jdp.load_model(tmp_path, "best")
    assert loaded.step == best["step"] and loaded.metrics["accuracy"] == best["accuracy"]
    assert result.validation["accuracy"] == validations[-1]["accuracy"]
    with pytest.raises(jdp.UsageError, match="no checkpoint of step 7"):
        jdp.load_model(tmp_path, 7)


@pytest.mark.slow
def test_the_best_checkpoint_is_the_best_evaluation_between_saves(tmp_path):
    """Evaluated every 4 steps, saved every 40: each evaluation better than all before
    it is saved too (Keras' save_best_only), so "best" is the best evaluation's step,
    whichever steps the schedule saves. At lr 1.0 Adam overshoots: the validation
    accuracy peaks early (0.26 at step 12 here, 0.22 at the end)."""
    images, labels, train_rows, _ = _digits()
    train = jdp.data.from_arrays(
        images[train_rows], labels[train_rows], transform=jdp.data.Transform(scale=16.0)
    )
    config = _config(
        validation_fraction=0.2, eval_every=4, ckpt_every=40, lr=1.0, ckpt_dir=str(tmp_path), keep=1
    )
    result = _fit(config, train=train)
    accuracies = {r["step"]: r["accuracy"] for r in result.history if r["kind"] == "val"}
    best = max(accuracies, key=lambda step: (accuracies[step], -step))  # the first of ties
    assert accuracies[best] > accuracies[40], accuracies  # the case: a peak between saves
    loaded = jdp.load_model(tmp_path, "best")
    assert loaded.step == best and loaded.metrics["accuracy"] == accuracies[best], accuracies
    # The last step, due to a save on the schedule (40) but evaluated only at the end (every
    # 6 steps): saved once, at the end, with that evaluation, which may be the best.
    _fit(dataclasses.replace(config, eval_every=6, ckpt_dir=str(tmp_path / "end")), train=train)
    last = jdp.load_model(tmp_path / "end")
    assert last.step == 40 and last.metrics["accuracy"] > 0, last.metrics


@pytest.mark.slow
def test_an_optax_optimizer_of_ones_own_logs_its_lr_and_resumes_bitwise(tmp_path):
    sgd = optax.sgd(0.1, momentum=0.9)
    config = _config(steps=40, log_every=10)
    straight = _fit(config, optimizer=sgd, lr_schedule=0.1)
    logged = [record["lr"] for record in straight.history if record["kind"] == "train"]
    assert logged == pytest.approx([0.1] * 4)
    ckpt = str(tmp_path / "run")
    _fit(_config(steps=40, ckpt_dir=ckpt), optimizer=sgd, lr_schedule=0.1, callbacks=[_StopAt(20)])
    resumed = _fit(_config(steps=40, ckpt_dir=ckpt), optimizer=sgd, lr_schedule=0.1)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, straight.state.params)
    recorded = jdp.load_model(ckpt).config
    assert recorded["optimizer"].startswith("yours") and "lr" not in recorded
    assert "momentum" not in recorded and recorded["lr_schedule"] == 0.1
    # An optimizer made with optax.inject_hyperparams says its learning rate itself.
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    said = _fit(_config(steps=20, log_every=10), optimizer=injected)
    assert [r["lr"] for r in said.history if r["kind"] == "train"] == pytest.approx([0.1] * 2)
    jax.tree.map(
        np.testing.assert_array_equal,
        said.state.params,
        _fit(_config(steps=20), optimizer=sgd).state.params,
    )
    with pytest.raises(jdp.UsageError, match=r"pass an Optax one as\s+jdp.fit"):
        jdp.TrainConfig(optimizer=sgd)


@pytest.mark.slow
def test_a_batchnorm_model_comes_back_and_predicts_its_reported_accuracy(tmp_path):
    # The digits CNN: BatchNorm in a model that compiles in a second or two.
    ckpt = str(tmp_path / "cnn")
    config = _config(model="cnn", steps=30, warmup_steps=6, ckpt_dir=ckpt, lr=3e-3)
    result = _fit(config)
    assert result.test_accuracy > 0.4  # well above chance, for the fine-tuning's check below
    loaded = jdp.load_model(ckpt)
    assert "batch_stats" in loaded.model_state and loaded.step == 30
    test = jdp.load_split("digits", "test")
    logits = jdp.predict(
        loaded.model,
        loaded.params,
        test,
        model_state=loaded.model_state,
        mesh=jdp.make_mesh("data=8"),
        batch_size=config.batch_size,
    )
    assert logits.shape == (len(test), 10)
    accuracy = float(np.mean(np.argmax(logits, -1) == test.label))
    assert accuracy == result.test_accuracy  # exactly: the same programs, the same figure
    evaluated = run_cli("--eval-only", "--ckpt-dir", ckpt, "--mesh", "data=2", timeout=240)
    assert evaluated.returncode == 0, evaluated.stderr
    assert float(_summary(evaluated)["test_accuracy"]) == pytest.approx(
        result.test_accuracy, abs=5e-5
    )
    # --init-from: a new run from these weights (fine-tuning), the optimizer fresh.
    tuned = run_cli(
        *"--model cnn --init-from".split(),
        ckpt,
        *"--steps 2 --warmup-steps 0 --lr 1e-9 --batch-size 64".split(),
        timeout=240,
    )
    assert tuned.returncode == 0, tuned.stderr
    assert f"parameters and model state from {ckpt}" in tuned.stdout
    # At lr 1e-9 the parameters stay; BatchNorm's running statistics (momentum 0.9) move
    # 19% of the way to two batches' own: a few points of accuracy. A model that did not
    # come back would be at chance (0.1) after two such steps, over 0.3 below the loaded
    # one's (above 0.4, checked above).
    assert abs(float(_summary(tuned)["test_accuracy"]) - result.test_accuracy) < 0.1
    wrong = run_cli("--model", "mlp", "--init-from", ckpt, "--steps", "2", timeout=240)
    assert wrong.returncode == 2 and "holds another model than this run's" in wrong.stderr


@pytest.mark.slow
def test_a_finished_run_is_evaluated_not_rerun_and_short_runs_just_work(tmp_path):
    ckpt = str(tmp_path / "run")
    first = run_cli("--steps", "10", "--ckpt-dir", ckpt, timeout=240)  # default warmup 40
    assert first.returncode == 0, first.stderr
    assert "--warmup-steps 40 is longer than the run's 10 steps; warming up over 1" in first.stdout
    again = run_cli("--steps", "10", "--ckpt-dir", ckpt, timeout=240)
    assert again.returncode == 0, again.stderr
    assert "holds the finished run (step 10 of 10)" in again.stdout
    assert "train_loss=nan" not in again.stdout and "examples/s" not in again.stdout
    epochs = run_cli("--epochs", "2", "--batch-size", "256", timeout=240)
    assert epochs.returncode == 0, epochs.stderr
    assert "--epochs 2 of 1438 examples at batch 256 = 12 steps" in epochs.stdout
    both = run_cli("--epochs", "2", "--steps", "10", timeout=60)
    assert both.returncode == 2 and "give --epochs or --steps, not both" in both.stderr
    with open(os.path.join(ckpt, "10", "meta", "metadata")) as file:
        assert json.load(file)["config"]["data"]["num_classes"] == 10


NNX_BEFORE_FIT = r"""
import jax, numpy as np
from flax import nnx
import jdp

model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))  # JAX starts here, with one CPU device
before = np.asarray(model.kernel[...])
net = jdp.models.from_nnx(model, jdp.models.classification(),
                          inputs=lambda batch: (batch["image"].reshape(-1, 64),))
config = jdp.TrainConfig(mesh="data=8", steps=20, warmup_steps=2)
result = jdp.fit(config, model=net, console=jdp.Console(enabled=False))
after = np.asarray(model.kernel[...])
print(len(jax.devices()), bool(np.abs(after - before).max() > 0),
      bool(np.array_equal(after, np.asarray(result.state.params["kernel"]))))
"""


@pytest.mark.slow
def test_an_nnx_model_built_before_fit_trains_on_8_devices_and_comes_back_trained(tmp_path):
    result = run_python("-c", NNX_BEFORE_FIT, timeout=240)  # no XLA_FLAGS: one CPU device
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["8", "True", "True"]


# Flax's MNIST CNN as its Linen example wrote it (examples/mnist before it moved to
# NNX): no train keyword, no dropout, no BatchNorm.
class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


# Flax's NNX MNIST tutorial model, unmodified but for the first Linear's input size
# (8x8 digits pool to 2x2, not 28x28 to 7x7): Dropout gets ``rngs`` at call time,
# BatchNorm has no axis name.
class NNXCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(64 * 2 * 2, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


FLAX_STEPS, FLAX_BATCH = 300, 64


def _digit_splits():
    images, labels, train_rows, test_rows = _digits()
    x = images.astype(np.float32) / 16.0
    return (x[train_rows], labels[train_rows]), (x[test_rows], labels[test_rows])


def _plain_batches(x, y, steps, seed=0):
    """A plain loop's ``steps`` batches: a fresh permutation per epoch, drawn by NumPy."""
    rng, step = np.random.default_rng(seed), 0
    while True:
        for start in range(0, len(y) - FLAX_BATCH + 1, FLAX_BATCH):
            if step == steps:
                return
            if start == 0:
                order = rng.permutation(len(y))
            rows = order[start : start + FLAX_BATCH]
            yield x[rows], y[rows]
            step += 1


def _accuracy(logits, labels) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), -1) == labels))


def _flax_mnist(steps):
    """Flax's two MNIST models (Linen's example with its SGD, NNX's tutorial with its
    AdamW), each trained ``steps`` steps by a plain single-device loop as Flax writes it
    and by `jdp.fit` on 8 devices: {api: (the plain loop's test accuracy, jdp's)}. The NNX
    module given to `from_nnx` comes back trained: its own accuracy is jdp's figure."""
    (train_x, train_y), (test_x, test_y) = _digit_splits()
    train, test = jdp.data.from_arrays(train_x, train_y), jdp.data.from_arrays(test_x, test_y)
    config = _config(steps=steps, batch_size=FLAX_BATCH)
    reached = {}

    # Linen, as the example trains it: optax.sgd with momentum on a TrainState.
    sgd = optax.sgd(0.1, 0.9)
    cnn = LinenCNN()
    params = cnn.init(jax.random.key(0), jnp.ones([1, 8, 8, 1]))["params"]
    opt_state = sgd.init(params)

    @jax.jit
    def linen_step(params, opt_state, x, y):
        def loss_fn(params):
            logits = cnn.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in _plain_batches(train_x, train_y, steps):
        params, opt_state = linen_step(params, opt_state, x, y)
    plain = _accuracy(cnn.apply({"params": params}, test_x), test_y)
    model = jdp.models.from_linen(LinenCNN(), jdp.models.classification())
    result = _fit(config, model=model, train=train, test=test, optimizer=sgd, lr_schedule=0.1)
    reached["linen"] = (plain, result.test_accuracy)

    # NNX, as the tutorial trains it: nnx.Optimizer, train/eval views, rngs at call time.
    adamw = optax.adamw(0.005, 0.9)
    net = NNXCNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(net, adamw, wrt=nnx.Param)
    rngs = nnx.Rngs(0)
    train_view = nnx.view(net, deterministic=False, use_running_average=False)
    eval_view = nnx.view(net, deterministic=True, use_running_average=True)

    @nnx.jit
    def nnx_step(model, optimizer, rngs, x, y):
        def loss_fn(model, rngs):
            logits = model(x, rngs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = nnx.grad(loss_fn)(model, rngs)
        optimizer.update(model, grads)

    for x, y in _plain_batches(train_x, train_y, steps):
        nnx_step(train_view, optimizer, rngs, x, y)
    plain = _accuracy(eval_view(test_x, None), test_y)
    fresh = NNXCNN(rngs=nnx.Rngs(0))
    model = jdp.models.from_nnx(fresh, jdp.models.classification())
    result = _fit(config, model=model, train=train, test=test, optimizer=adamw, lr_schedule=0.005)
    trained = nnx.view(fresh, deterministic=True, use_running_average=True)  # back, trained
    assert _accuracy(trained(test_x, None), test_y) == result.test_accuracy
    reached["nnx"] = (plain, result.test_accuracy)
    print("reached (plain, jdp):", reached)
    return reached


@pytest.mark.slow
def test_flax_official_linen_and_nnx_mnist_models_train_through_fit():
    """Per change, the path of the scheduled test below at a tenth of its steps: both
    models, as Flax writes them, train on 8 devices through `jdp.fit` and learn (above the
    10% of a guess), and the NNX module comes back trained."""
    # 0.3 is three guesses' worth: at 30 steps both ways reached 0.42-0.60, and a model
    # that does not learn (its updates lost, its module not trained) stays near 0.1.
    for name, (plain, jdp_accuracy) in _flax_mnist(FLAX_STEPS // 10).items():
        assert plain > 0.3 and jdp_accuracy > 0.3, (name, plain, jdp_accuracy)


# The scheduled lane: the accuracy claim, 300 steps of four trainings (60 s); per change
# the test above takes the same path at 30 steps.
@pytest.mark.slow
@pytest.mark.scheduled
def test_flax_official_linen_and_nnx_mnist_models_train_as_a_plain_loop_does():
    """Both Flax APIs' MNIST models, as Flax writes them, reach on 8 devices through
    `jdp.fit` the accuracy a plain single-device loop reaches (within 1 point)."""
    for name, (plain, jdp_accuracy) in _flax_mnist(FLAX_STEPS).items():
        assert plain > 0.9, (name, plain)
        assert abs(jdp_accuracy - plain) <= 0.01, (name, plain, jdp_accuracy)
