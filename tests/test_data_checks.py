"""Wrong data is named before step 1, never trained on: labels outside the classes,
non-finite inputs, empty splits and class folders, splits of another shape."""

import numpy as np
import pytest
from helpers import run_cli

import jdp

QUIET = jdp.Console(enabled=False)


def _arrays(rows=64, features=4, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    return x, np.arange(rows) % classes


def _fit(train, test=None, validation=None, **overrides):
    config = jdp.TrainConfig(**({"mesh": "data=2", "steps": 4, "batch_size": 16} | overrides))
    # The refusals come before the model is built or a step compiled.
    return jdp.fit(config, train=train, test=test, validation=validation, console=QUIET)


def test_a_negative_label_is_refused_not_trained_as_the_last_class():
    x, y = _arrays()
    y[17] = -1
    with pytest.raises(
        jdp.UsageError, match=r"^label -1 of example 17 of the train split is not a class"
    ):
        _fit(jdp.data.from_arrays(x, y, num_classes=10))
    # Labels all below 0: no count of classes is read from them (it would be 0 or less).
    with pytest.raises(jdp.UsageError, match=r"\(labels are class indices from 0\); 64 label"):
        _fit(jdp.data.from_arrays(x, -3 - y % 2))


def test_a_test_label_outside_the_training_classes_is_refused():
    x, y = _arrays()
    test_y = y.copy()
    test_y[5] = 12
    with pytest.raises(
        jdp.UsageError,
        match=r"^label 12 of example 5 of the test split is not a class of the training split "
        r"\(its labels are 0 to 9, num_classes 10\); 1 label\(s\) are outside",
    ):
        _fit(jdp.data.from_arrays(x, y), jdp.data.from_arrays(x, test_y))
    # A training split without classes 5-9: its labels run to 4, the test split's to 9.
    with pytest.raises(jdp.UsageError, match=r"^label 5 of example 5 of the validation split"):
        _fit(jdp.data.from_arrays(x, y % 5), validation=jdp.data.from_arrays(x, y))


def test_a_label_of_num_classes_given_through_fit_is_refused():
    x, y = _arrays()
    y[3] = 12
    with pytest.raises(jdp.UsageError, match=r"^label 12 of example 3 of the train split"):
        _fit(jdp.data.from_arrays(x, y, num_classes=10))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("split", ["train", "test"])
def test_non_finite_inputs_are_named_by_split_and_example(split, value):
    x, y = _arrays()
    bad = x.copy()
    bad[41, 2] = value
    given = {"train": (bad, x), "test": (x, bad)}[split]
    with pytest.raises(
        jdp.UsageError, match=rf"^example 41 of the {split} split has {value} in 'image'"
    ):
        _fit(jdp.data.from_arrays(given[0], y), jdp.data.from_arrays(given[1], y))


def test_empty_splits_are_refused():
    x, y = _arrays()
    with pytest.raises(jdp.UsageError, match=r"^the train split has no examples; give it"):
        _fit(jdp.data.from_arrays(x[:0], y[:0], num_classes=10))
    with pytest.raises(jdp.UsageError, match=r"^the test split has no examples; give the test"):
        _fit(jdp.data.from_arrays(x, y), jdp.data.from_arrays(x[:0], y[:0], num_classes=10))


def test_a_split_of_another_shape_is_refused_before_step_1():
    x, y = _arrays()
    with pytest.raises(
        jdp.UsageError,
        match=r"^'image' of the test split is 5 per example and the training split's is 4",
    ):
        _fit(jdp.data.from_arrays(x, y), jdp.data.from_arrays(np.zeros((8, 5), np.float32), y[:8]))


def test_an_empty_class_folder_is_refused(tmp_path):
    from PIL import Image

    for name in ("cat", "dog", "eel"):
        (tmp_path / name).mkdir()
    for name in ("cat", "dog"):
        Image.new("L", (8, 8)).save(tmp_path / name / "1.png")
    (tmp_path / "eel" / "notes.txt").write_text("no images here")
    with pytest.raises(jdp.UsageError, match=r"class folder .*eel has no images"):
        jdp.data.from_folder(tmp_path)


def test_the_cli_names_bad_data_in_an_npz_in_one_line(tmp_path):
    x, y = _arrays(classes=5)
    file = tmp_path / "mine.npz"
    test_y = np.arange(len(y)) % 10  # a test split with classes 5-9 the training split lacks
    np.savez(file, x_train=x, y_train=y, x_test=x, y_test=test_y)
    result = run_cli("--dataset", f"npz:{file}", "--mesh", "data=2", "--steps", "2", timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("jdp.train: error: label 5 of example 5 of the test split")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_map_that_makes_nan_is_named_by_step_and_row_not_blamed_on_the_lr():
    x, y = _arrays()

    def spoil(example, rng):  # the user's per-example function, wrong for label 3
        return example | {"image": example["image"] * (np.nan if example["label"] == 3 else 1)}

    with pytest.raises(
        jdp.NonFiniteError,
        match=r"^loss is nan at step 20: the batch of step 1 has a value that is not finite "
        r"in 'image' at row \d+ of this process's rows \(after the split's map",
    ):
        _fit(jdp.data.from_arrays(x, y, map=spoil), steps=40)


def _save(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    ("make", "flags", "message"),
    [
        (
            lambda p: _save(
                p,
                x_train=np.zeros((64, 4), np.float32),
                y_train=np.arange(64) % 3,
                x_test=np.zeros((8, 4), np.float32),
            ),
            [],
            "{file} has x_test and no y_test; save both (inputs and labels) for each split",
        ),
        (
            lambda p: p.write_text("x,y\n1,2\n") and p,
            [],
            "{file} is not a NumPy .npz file (not the zip archive numpy.savez writes)",
        ),
        (
            lambda p: _save(
                p, x_train=np.array([{"a": 1}] * 64, dtype=object), y_train=np.arange(64) % 3
            ),
            [],
            "cannot read {file} as a NumPy .npz file (it holds Python objects, which jdp "
            "never unpickles; save numeric arrays)",
        ),
        (
            lambda p: _save(
                p,
                x_train=np.zeros((64, 4), np.float32),
                y_train=np.where(np.arange(64) == 0, 10**8, np.arange(64) % 3),
                x_test=np.zeros((8, 4), np.float32),
                y_test=np.arange(8) % 3,
            ),
            [],
            "the training split's labels run to 100000000 (num_classes 100000001) but take 4 "
            "values: a classifier would have 100,000,001 outputs; number the classes 0 to K-1",
        ),
        # 20M features a row: an MLP of 10 billion parameters, 41 GB a device.
        (
            lambda p: _save(
                p,
                x_train=np.zeros((2, 20_000_000), np.uint8),
                y_train=np.arange(2),
                x_test=np.zeros((2, 20_000_000), np.uint8),
                y_test=np.arange(2),
            ),
            ["--batch-size", "2"],
            "the model has 10.2 billion parameters, 41.0 GB a device on "
            "this mesh; with their gradients that is more than the ",
        ),
        # One uint8 255 (an "ignore" value) among 0..2: not a 256-way classifier in silence.
        (
            lambda p: _save(
                p,
                x_train=np.zeros((64, 4), np.float32),
                y_train=np.where(np.arange(64) == 5, 255, np.arange(64) % 3).astype(np.uint8),
                x_test=np.zeros((8, 4), np.float32),
                y_test=np.arange(8) % 3,
            ),
            [],
            "labels 'y': label 255 (1 example) stands far above the others (up to 2), which "
            "would make 256 classes; drop or relabel those examples",
        ),
    ],
    ids=["half-keras", "text", "objects", "label-ids", "huge-model", "far-label"],
)
def test_bad_npz_files_are_one_line_naming_the_fix(tmp_path, make, flags, message):
    file = make(tmp_path / "mine.npz")
    result = run_cli(
        "--dataset", f"npz:{file}", *"--mesh data=2 --steps 2".split(), *flags, timeout=180
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jdp.train: error: "), result.stderr
    assert message.format(file=file) in lines[0], lines[0]


def test_a_validation_fraction_that_leaves_too_few_to_train_names_the_largest():
    result = run_cli(*"--mesh data=2 --validation-fraction 0.999 --steps 2".split(), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "jdp.train: error: --validation-fraction 0.999 leaves 1 of 1438 examples to train on, "
        "fewer than the global batch 128; hold out a smaller fraction (at most 0.91 here)"
    )


def test_an_npz_validation_split_may_be_named_val(tmp_path):
    """x_val/y_val (as jdp's own val/loss names it) is the validation split, not left out."""
    from jdp.data.splits.custom import load_named

    file = tmp_path / "mine.npz"
    x, y = np.zeros((12, 4), np.float32), np.arange(12) % 3
    np.savez(file, x_train=x, y_train=y, x_test=x[:4], y_test=y[:4], x_val=x[:6], y_val=y[:6])
    assert [len(load_named(f"npz:{file}", name)) for name in ("train", "validation")] == [12, 6]
    np.savez(file, x_train=x, y_train=y, x_val=x[:6], y_val=y[:6], x_valid=x, y_valid=y)
    with pytest.raises(jdp.UsageError, match="validation split named both _val and _valid"):
        load_named(f"npz:{file}", "validation")
    with pytest.raises(jdp.UsageError, match="stands far above the others"):
        jdp.data.from_arrays(x, np.where(np.arange(12) == 0, 200, y))
    assert jdp.data.from_arrays(x, np.where(np.arange(12) == 0, 200, y), num_classes=201)
