import collections
import sys
import textwrap
import time
import types
from importlib.machinery import ModuleSpec

import jax
import numpy as np
import pytest
from helpers import run_python

import jdp
from jdp.data.formats.digits import TEST_SIZE
from jdp.data.formats.transforms import Augmentation, Transform
from jdp.data.loader.pipeline import (
    TRAIN_CHUNK,
    EvalReader,
    Loader,
    TrainReader,
    eval_batches,
    train_batches,
)
from jdp.data.loader.readers import _AUGMENT_STREAM, global_batch_indices
from jdp.data.loader.workers import check_main_guard
from jdp.data.splits.sources import Split, load_split
from jdp.mesh import rows_by_process

# A split whose image is its example id, so batches show which examples they hold.
_IDS = Transform(scale=1.0)
_AUGMENTED = Transform(scale=1.0, crop_padding=2, flip=True)


def _split(rows=100, transform=_IDS):
    images = np.arange(rows, dtype=np.float32).reshape(rows, 1, 1, 1)
    return Split(images, np.arange(rows, dtype=np.int32), num_classes=rows, transform=transform)


def _image_split(rows=40, transform=_AUGMENTED):
    images = np.random.default_rng(0).integers(0, 256, (rows, 6, 6, 3), dtype=np.uint8)
    return Split(images, np.arange(rows, dtype=np.int32), num_classes=rows, transform=transform)


def _labels(loader, steps):
    with loader:
        return [jax.device_get(next(loader)["label"]) for _ in range(steps)]


def _two_processes(mesh, batch_size):
    """Two processes' rows, as if devices 0-3 and 4-7 of the mesh lived in separate hosts."""
    first_half = {device.id for device in mesh.devices.flat[: mesh.devices.size // 2]}
    rows = rows_by_process(mesh, batch_size, lambda device: 0 if device.id in first_half else 1)
    return [rows[0], rows[1]]


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


@pytest.mark.parametrize("layout", ["data=1", "data=8", "2 processes"])
def test_an_epoch_of_loaded_batches_is_the_dataset(layout, mesh8, mesh1):
    split, batch_size = _split(96), 16  # 6 steps make one epoch
    if layout == "2 processes":
        readers = [
            TrainReader(split, batch_size=batch_size, seed=4, rows=rows)
            for rows in _two_processes(mesh8, batch_size)
        ]
        assert [len(reader.indices(0)) for reader in readers] == [8, 8]
        ids = [np.concatenate([reader(step)["label"] for reader in readers]) for step in range(6)]
    else:
        mesh = mesh1 if layout == "data=1" else mesh8
        ids = _labels(train_batches(split, mesh, batch_size=batch_size, seed=4), 6)
    assert collections.Counter(np.concatenate(ids).tolist()) == collections.Counter(range(96))
    for step, batch_ids in enumerate(ids):
        np.testing.assert_array_equal(batch_ids, global_batch_indices(4, step, batch_size, 96))


def test_a_process_reads_the_rows_its_devices_hold_in_any_device_order(devices):
    """A mesh whose device order is not sorted by process: process 1's devices come
    first, so process 1 holds the first rows and process 0 the last ones."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(devices[4:] + devices[:4]), ("data",))
    process_of = lambda device: 0 if device.id < 4 else 1  # noqa: E731
    rows = rows_by_process(mesh, 16, process_of)
    assert rows == {1: slice(0, 8), 0: slice(8, 16)}
    # Read off the sharding independently: each device's rows lie in its process's.
    sharding = jdp.mesh.batch_sharded(mesh)
    for device, index in sharding.devices_indices_map((16,)).items():
        owned = rows[process_of(device)]
        assert owned.start <= index[0].start and index[0].stop <= owned.stop
    # Processes whose devices interleave hold rows no loader can read as one block.
    interleaved = Mesh(np.array([devices[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]), ("data",))
    with pytest.raises(ValueError, match="are not one contiguous block"):
        rows_by_process(interleaved, 16, process_of)


def test_global_batches_do_not_depend_on_the_mesh(mesh8, mesh1):
    on8 = _labels(train_batches(_split(), mesh8, batch_size=16, seed=5), 15)
    on1 = _labels(train_batches(_split(), mesh1, batch_size=16, seed=5), 15)
    for a, b in zip(on8, on1, strict=True):
        np.testing.assert_array_equal(a, b)


def test_augmentation_does_not_depend_on_the_topology(mesh8, mesh1):
    split = _image_split()
    batches = {}
    for name, mesh in (("data=8", mesh8), ("data=1", mesh1)):
        with train_batches(split, mesh, batch_size=16, seed=1) as loader:
            batches[name] = [jax.device_get(next(loader)["image"]) for _ in range(3)]
    halves = [
        TrainReader(split, batch_size=16, seed=1, rows=rows) for rows in _two_processes(mesh8, 16)
    ]
    for step in range(3):
        np.testing.assert_array_equal(batches["data=8"][step], batches["data=1"][step])
        joined = np.concatenate([reader(step)["image"] for reader in halves])
        np.testing.assert_array_equal(joined, batches["data=8"][step])
    plain = TrainReader(_image_split(transform=_IDS), batch_size=16, seed=1, rows=slice(None))
    assert not np.array_equal(plain(0)["image"], batches["data=1"][0])  # it did augment


def test_reading_steps_in_bulk_equals_reading_each_step():
    """The loader reads chunks of steps at once; each step's rows are what one step reads."""
    split, rows = _image_split(), slice(4, 12)
    bulk = TrainReader(split, batch_size=16, seed=5, rows=rows).steps(3, 20)  # over 8 epochs
    assert len(bulk) == 20
    for step, batch in enumerate(bulk, start=3):
        indices = global_batch_indices(5, step, 16, len(split))[rows]
        draw = _AUGMENTED.draw(np.random.default_rng((5, step, _AUGMENT_STREAM)), 16)
        expected = _AUGMENTED(split.image[indices], draw.take(rows))
        np.testing.assert_array_equal(batch["image"], expected)
        np.testing.assert_array_equal(batch["label"], split.label[indices])


def test_a_run_of_fewer_steps_than_a_chunk_makes_only_those(mesh8, monkeypatch):
    """A run that says how many steps it takes reads (and, on the devices, gathers)
    chunks of no more: a 3-step run no longer makes 64 steps' batches first."""
    counts, steps = [], TrainReader.steps
    monkeypatch.setattr(
        TrainReader,
        "steps",
        lambda self, first, count: (counts.append(count), steps(self, first, count))[1],
    )
    bounded = _labels(train_batches(_split(), mesh8, batch_size=16, seed=2, steps=3), 5)
    assert max(counts) == 3  # and past its steps the batches go on, the same:
    counts.clear()
    unbounded = _labels(train_batches(_split(), mesh8, batch_size=16, seed=2), 5)
    assert max(counts) == TRAIN_CHUNK
    for got, expected in zip(bounded, unbounded, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_start_step_resumes_the_same_stream(mesh8):
    seen = _labels(train_batches(_split(), mesh8, batch_size=16, seed=2), 9)
    resumed = train_batches(_split(), mesh8, batch_size=16, seed=2, start_step=6)
    assert resumed.position == 6
    for expected in seen[6:]:
        np.testing.assert_array_equal(jax.device_get(next(resumed)["label"]), expected)
    assert resumed.position == 9
    resumed.close()


def test_grain_workers_give_the_same_batches(mesh8):
    split = _image_split()
    in_thread = _labels(train_batches(split, mesh8, batch_size=16, seed=3), 5)
    with train_batches(split, mesh8, batch_size=16, seed=3, workers=2) as loader:
        batches = [jax.device_get(next(loader)) for _ in range(5)]
    plain = TrainReader(split, batch_size=16, seed=3, rows=slice(None))
    for step, batch in enumerate(batches):
        np.testing.assert_array_equal(batch["label"], in_thread[step])
        np.testing.assert_array_equal(batch["image"], plain(step)["image"])


# A script that starts loader workers at its top level, then under its main guard. Its
# batches (64 x 16 x 16 x 3 float32, 196 KiB) travel from the workers in shared memory.
_WORKERS_SCRIPT = """
    import numpy as np
    import jdp
    from jdp.data.loader.pipeline import train_batches
    from jdp.data.splits.sources import Split

    images = np.zeros((256, 16, 16, 3), np.uint8)
    split = Split(images, np.zeros(256, np.int32), num_classes=2)
    mesh = jdp.make_mesh("data=2")
    try:
        train_batches(split, mesh, batch_size=64, seed=0, workers=2)
        refused = None
    except jdp.UsageError as error:
        refused = error
    if __name__ == "__main__":
        print("refused:", refused)
        with train_batches(split, mesh, batch_size=64, seed=0, workers=2) as loader:
            rows = sum(len(next(loader)["label"]) for _ in range(12))
        print("rows:", rows)
"""


def test_loader_workers_refuse_an_unguarded_script_and_leave_no_shared_memory(tmp_path):
    # Workers import the script again: where it starts them outside its main guard each
    # worker would too, and fail, and the parent wait forever on it. And a closed
    # loader unlinks the shared memory of batches it placed ahead, which Python's
    # resource tracker would otherwise remove at exit, with a warning.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_WORKERS_SCRIPT))
    done = run_python(script, timeout=120, devices=2)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    line = (
        script.read_text()
        .splitlines()
        .index("    train_batches(split, mesh, batch_size=64, seed=0, workers=2)")
    )
    assert out[0] == (
        f"refused: loader workers are processes that import train.py again, and its line "
        f'{line + 1} would start them again in each; put that under if __name__ == "__main__":, '
        "or start no workers (loader_workers=0 in the config, --loader-workers 0, workers=0 in "
        "train_batches)"
    )
    assert out[1] == "rows: 768"
    assert "leaked shared_memory" not in done.stderr


def test_the_main_guard_check_reads_the_script_a_worker_would_run(tmp_path, monkeypatch):
    # In process: a fake main module runs each source at its top level, as a script does
    # (as __mp_main__ where a worker runs it again).
    def run(source, spec=None, name="__main__"):
        path = tmp_path / "script.py"
        path.write_text(source)
        main = types.ModuleType(name)
        main.__file__, main.__spec__ = str(path), spec and ModuleSpec(spec, None)
        main.check = check_main_guard
        monkeypatch.setitem(sys.modules, name, main)
        exec(compile(source, str(path), "exec"), vars(main))

    guarded = "if __name__ == '__main__':\n    check()\n"
    for source in (guarded, guarded.replace("__name__ == '__main__'", "'__main__' == __name__")):
        run(source)
    run("import sys\nif __name__ == '__main__' and len(sys.argv) > 0:\n    check()\n")
    run("check()\n", spec="trainer.__main__")  # python -m trainer: never imported again
    for source, line, name in [
        ("check()\n", 1, "__main__"),
        ("check()\n", 1, "__mp_main__"),  # in a worker
        ("if __name__ == '__main__':\n    pass\nelse:\n    check()\n", 4, "__mp_main__"),
    ]:
        with pytest.raises(jdp.UsageError, match=f"import script.py again, and its line {line} "):
            run(source, name=name)


def test_batches_arrive_sharded_on_data(mesh8):
    with train_batches(_image_split(), mesh8, batch_size=16, seed=0, prefetch=3) as loader:
        batch = next(loader)
    assert batch["image"].shape == (16, 6, 6, 3) and batch["image"].dtype == np.float32
    assert batch["image"].sharding.spec[0] == "data"
    assert len(batch["image"].addressable_shards) == 8


def test_loader_errors_reach_the_caller(mesh8):
    def broken(step):
        raise RuntimeError(f"bad record at step {step}")

    loader = Loader(broken, mesh8, start=3, stop=None)
    with pytest.raises(RuntimeError, match="bad record at step 3"):
        next(loader)
    with pytest.raises(StopIteration):
        next(loader)


def test_the_ledgers_marks_sum_alike_asked_each_step_or_once_and_are_never_all_held():
    from jdp.data.loader.pipeline import MARKS_HELD

    mesh1, steps = jdp.make_mesh("data=1"), MARKS_HELD + 100
    kwargs = dict(batch_size=16, seed=2, start_step=5, place=False, ledger="indices")
    each, once = (train_batches(_split(), mesh1, **kwargs) for _ in range(2))
    with each, once:
        for _ in range(steps):
            next(each), each.marks(), next(once)
            assert len(once._marks_given) < MARKS_HELD
        assert once.marks() == each.marks()
        assert once.marks()[0][3] == 5 + steps and once.marks()[2] == steps


def test_loader_counts_time_spent_waiting(mesh8):
    def slow(step):
        time.sleep(0.05)
        return {"label": np.zeros(8, np.int32)}

    with Loader(slow, mesh8, start=0, stop=4, prefetch=1) as loader:
        assert len(list(loader)) == 4
    assert loader.wait_seconds >= 0.1
    assert loader.position == 4


def test_batch_larger_than_split(mesh8):
    with pytest.raises(jdp.UsageError, match="larger than the training split"):
        train_batches(_split(10), mesh8, batch_size=16, seed=0)


def test_eval_batches_pad_and_mask(mesh8):
    batches = list(eval_batches(_split(37), mesh8, batch_size=16))
    assert len(batches) == 3
    masks = np.concatenate([jax.device_get(batch["mask"]) for batch in batches])
    labels = np.concatenate([jax.device_get(batch["label"]) for batch in batches])
    assert masks.sum() == 37
    assert sorted(labels[masks == 1]) == list(range(37))


def test_eval_over_two_processes_counts_every_example_once(mesh8):
    readers = [
        EvalReader(_split(37), batch_size=16, rows=rows) for rows in _two_processes(mesh8, 16)
    ]
    counted = collections.Counter()
    for number in range(len(readers[0])):
        for reader in readers:
            batch = reader(number)
            counted.update(batch["label"][batch["mask"] == 1].tolist())
    assert counted == collections.Counter(range(37))


def test_crop_and_flip_move_pixels_as_drawn():
    image = np.arange(16, dtype=np.uint8).reshape(1, 4, 4, 1)
    transform = Transform(scale=1.0, crop_padding=1, flip=True)
    centre = transform(image, Augmentation(np.array([[1, 1]]), np.array([False])))
    np.testing.assert_array_equal(centre, image)
    flipped = transform(image, Augmentation(np.array([[1, 1]]), np.array([True])))
    np.testing.assert_array_equal(flipped, image[:, :, ::-1])
    shifted = transform(image, Augmentation(np.array([[0, 2]]), np.array([False])))
    np.testing.assert_array_equal(shifted[0, 1:, :3, 0], image[0, :3, 1:, 0])
    assert (shifted[0, 0] == 0).all() and (shifted[0, :, 3] == 0).all()


def test_normalisation_per_channel():
    transform = Transform(mean=(0.5, 0.0), std=(0.5, 2.0))
    out = transform(np.full((1, 1, 1, 2), 255, np.uint8))
    np.testing.assert_allclose(out[0, 0, 0], [1.0, 0.5])


def test_bundled_digits_prepare_offline(tmp_path):
    train = load_split("digits", "train", str(tmp_path))
    test = load_split("digits", "test", str(tmp_path))
    assert len(test) == TEST_SIZE and len(train) + len(test) == 1797
    assert train.image.shape[1:] == (8, 8, 1) and train.image.dtype == np.uint8
    images = train.transform(train.image)
    assert images.dtype == np.float32 and images.min() >= 0.0 and images.max() == 1.0
    assert set(np.unique(train.label)) == set(range(10))
    assert (tmp_path / "digits" / "1.0.0").is_dir()
    assert any(path.suffix != ".json" for path in (tmp_path / "digits" / "1.0.0").iterdir())


def test_unknown_dataset():
    with pytest.raises(jdp.UsageError, match="unknown dataset 'imagenet'; choose one of: cifar10"):
        load_split("imagenet", "train")


def test_on_one_cpu_device_the_loader_hands_the_step_host_arrays(mesh1, mesh8):
    from jdp.data.loader.pipeline import places_ahead

    # One CPU device in one process: the step's call places a NumPy batch for less host
    # time than the loader's thread would; with several devices the loader places them.
    assert not places_ahead(mesh1) and places_ahead(mesh8)
    split = _image_split()
    kwargs = dict(batch_size=8, seed=3, start_step=2)
    with (
        train_batches(split, mesh1, place=False, **kwargs) as host,
        train_batches(split, mesh1, **kwargs) as placed,
    ):
        for _ in range(7):
            got, want = next(host), next(placed)
            assert all(isinstance(value, np.ndarray) for value in got.values())
            assert all(isinstance(value, jax.Array) for value in want.values())
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
