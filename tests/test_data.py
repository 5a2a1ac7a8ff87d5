import jax
import numpy as np
import pytest

import jdp
from jdp.data.digits import TEST_SIZE
from jdp.data.pipeline import eval_batches, global_batch_indices, train_batches
from jdp.data.sources import Split, load_split


def _split(rows=100):
    images = np.arange(rows, dtype=np.float32).reshape(rows, 1, 1, 1)
    return Split(images, np.arange(rows, dtype=np.int32), num_classes=rows)


def test_one_epoch_sees_every_example_once():
    indices = np.concatenate([global_batch_indices(0, step, 10, 100) for step in range(10)])
    assert sorted(indices) == list(range(100))


def test_batches_straddle_epochs_without_losing_examples():
    indices = np.concatenate([global_batch_indices(3, step, 30, 100) for step in range(10)])
    for epoch in range(3):
        assert sorted(indices[epoch * 100 : (epoch + 1) * 100]) == list(range(100))


def test_order_depends_on_seed_and_epoch():
    first = global_batch_indices(0, 0, 100, 100)
    assert not np.array_equal(first, global_batch_indices(1, 0, 100, 100))
    assert not np.array_equal(first, global_batch_indices(0, 1, 100, 100))
    np.testing.assert_array_equal(first, global_batch_indices(0, 0, 100, 100))


def test_global_batches_do_not_depend_on_the_mesh(mesh8, mesh1):
    split = _split()
    on8 = train_batches(split, mesh8, batch_size=16, seed=5)
    on1 = train_batches(split, mesh1, batch_size=16, seed=5)
    for _ in range(15):
        a, b = next(on8), next(on1)
        np.testing.assert_array_equal(jax.device_get(a["label"]), jax.device_get(b["label"]))


def test_start_step_resumes_the_same_stream(mesh8):
    split = _split()
    full = train_batches(split, mesh8, batch_size=16, seed=2)
    seen = [jax.device_get(next(full)["label"]) for _ in range(9)]
    resumed = train_batches(split, mesh8, batch_size=16, seed=2, start_step=6)
    for expected in seen[6:]:
        np.testing.assert_array_equal(jax.device_get(next(resumed)["label"]), expected)


def test_batch_larger_than_split(mesh8):
    with pytest.raises(jdp.UsageError, match="larger than the training split"):
        next(train_batches(_split(10), mesh8, batch_size=16, seed=0))


def test_eval_batches_pad_and_mask(mesh8):
    batches = list(eval_batches(_split(37), mesh8, batch_size=16))
    assert len(batches) == 3
    masks = np.concatenate([jax.device_get(batch["mask"]) for batch in batches])
    labels = np.concatenate([jax.device_get(batch["label"]) for batch in batches])
    assert masks.sum() == 37
    assert sorted(labels[masks == 1]) == list(range(37))


def test_bundled_digits_prepare_offline(tmp_path):
    train = load_split("digits", "train", str(tmp_path))
    test = load_split("digits", "test", str(tmp_path))
    assert len(test) == TEST_SIZE and len(train) + len(test) == 1797
    assert train.image.shape[1:] == (8, 8, 1) and train.image.dtype == np.float32
    assert train.image.min() >= 0.0 and train.image.max() <= 1.0
    assert set(np.unique(train.label)) == set(range(10))
    assert (tmp_path / "digits" / "1.0.0").is_dir()
    assert any(path.suffix != ".json" for path in (tmp_path / "digits" / "1.0.0").iterdir())


def test_unknown_dataset():
    with pytest.raises(jdp.UsageError, match="unknown dataset 'imagenet'; choose one of: digits"):
        load_split("imagenet", "train")
