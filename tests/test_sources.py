"""Catalog datasets read through TFDS's own builders, prepared from generated images.

TFDS's MNIST and CIFAR-10 builders need TensorFlow to parse their downloads, so
the tests prepare the same builders (same name, version, features and file
layout) from generated examples with PNGs encoded by Pillow; jdp then reads them
back exactly as it reads a real ``tfds build`` output: ``tfds.data_source`` over
array_record, no TensorFlow.
"""

import os
import shlex

import numpy as np
import pytest
import tensorflow_datasets as tfds
from catalog import prepare as _prepare

import jdp
from jdp.data.formats import builders
from jdp.data.splits.sources import load_split


@pytest.fixture(scope="module")
def prepared_mnist(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("catalog")
    splits = _prepare(
        tfds.image_classification.MNIST, data_dir, {"train": 300, "test": 70}, (28, 28, 1)
    )
    return data_dir, splits


def _sorted_by_content(images, labels):
    order = np.lexsort(images.reshape(len(images), -1).T)
    return images[order], labels[order]


def test_mnist_reads_back_exactly(prepared_mnist):
    data_dir, splits = prepared_mnist
    for split, (images, labels) in splits.items():
        loaded = load_split("mnist", split, str(data_dir))
        assert loaded.image.dtype == np.uint8 and loaded.image.shape == images.shape
        assert loaded.num_classes == 10
        # TFDS stores examples in its own (hashed) order; compare as sets of (image, label).
        got, expected = (
            _sorted_by_content(loaded.image, loaded.label),
            _sorted_by_content(images, labels),
        )
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_a_split_is_read_once_a_process_until_its_files_change(prepared_mnist, monkeypatch):
    data_dir, _ = prepared_mnist
    reads, read = [], builders._read_examples
    monkeypatch.setattr(
        builders, "_read_examples", lambda *args: (reads.append(args), read(*args))[1]
    )
    first, again = (load_split("mnist", "test", str(data_dir)) for _ in range(2))
    assert len(reads) <= 1  # one read (none where an earlier test read it)
    np.testing.assert_array_equal(again.image, first.image)
    first.image[0] = 0  # each split's arrays are its own, as read
    assert again.image[0].any() and load_split("mnist", "test", str(data_dir)).image[0].any()
    (record,) = data_dir.glob("mnist/*/mnist-test.array_record*")
    stat = record.stat()
    os.utime(record, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # prepared again, say
    count = len(reads)
    np.testing.assert_array_equal(load_split("mnist", "test", str(data_dir)).image, again.image)
    assert len(reads) == count + 1


def test_cifar10_reads_back_with_its_augmenting_transform(tmp_path):
    splits = _prepare(
        tfds.image_classification.Cifar10, tmp_path, {"train": 100, "test": 30}, (32, 32, 3)
    )
    train = load_split("cifar10", "train", str(tmp_path))
    test = load_split("cifar10", "test", str(tmp_path))
    assert len(train) == 100 and len(test) == 30
    assert train.image.shape[1:] == (32, 32, 3) and train.image.dtype == np.uint8
    np.testing.assert_array_equal(
        _sorted_by_content(test.image, test.label)[0], _sorted_by_content(*splits["test"])[0]
    )
    assert train.transform.augments and not load_split("digits", "test").transform.augments


def test_unprepared_catalog_dataset_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "_reachable", lambda host: False)
    with pytest.raises(jdp.UsageError) as error:
        load_split("fashion_mnist", "train", str(tmp_path))
    message = str(error.value)
    assert "'fashion_mnist' is not prepared in " + str(tmp_path) in message
    assert f"python -m jdp.data prepare fashion_mnist --data-dir {tmp_path}" in message
    assert "\n" not in message


def test_missing_data_dir(tmp_path):
    with pytest.raises(jdp.UsageError, match="does not exist; create it"):
        load_split("digits", "train", str(tmp_path / "missing"))


def test_unknown_split(tmp_path):
    with pytest.raises(jdp.UsageError, match="has no split 'validation'; it has: "):
        load_split("digits", "validation", str(tmp_path))


@pytest.mark.skipif(builders._reachable("storage.googleapis.com"), reason="the network is up")
def test_cli_unprepared_dataset_offline_is_one_line_and_exit_2(tmp_path):
    from helpers import run_cli as _run

    result = _run("--dataset", "mnist", "--data-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert f"'mnist' is not prepared in {tmp_path}" in line and "jdp.data prepare mnist" in line


@pytest.mark.slow
def test_cli_trains_on_a_prepared_catalog_dataset(prepared_mnist):
    from helpers import run_cli as _run

    data_dir, _ = prepared_mnist
    result = _run(
        "--dataset",
        "mnist",
        "--data-dir",
        str(data_dir),
        *shlex.split("--steps 3 --warmup-steps 1 --batch-size 64"),
    )
    assert result.returncode == 0, result.stderr
    assert "on mnist (300 train / 70 test)" in result.stdout
