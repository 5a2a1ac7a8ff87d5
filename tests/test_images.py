"""Streamed images (`jdp.data.formats.images`): a JPEG tree and its packed form read alike, in
jdp's order; Inception crops drawn from (seed, step, example), the same on every
topology; evaluation counts each image once; resume is bitwise; memory stays flat."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from closeness import EARLY_STEPS, assert_drift_within, assert_sequences_close
from helpers import assert_bitwise_equal, run_cli, run_python, saved_arrays, subprocess_env

import jdp
from jdp.bench.images import write_tree
from jdp.data.formats.images import ImageTransform, Normalize
from jdp.data.loader.readers import EvalReader, TrainReader
from jdp.mesh import MASK_KEY


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A tree of JPEGs of ImageNet's sizes (train 48, test 12, 3 classes) and its pack."""
    root = tmp_path_factory.mktemp("images")
    write_tree(str(root / "tree"), {"train": 48, "test": 12}, classes=3)
    packed = jdp.data.pack(root / "tree", root / "packed", shard_bytes=1 << 20)
    assert set(packed) == {"train", "test"} and packed["train"]["shards"] > 1
    return root / "tree", root / "packed"


def _batches(split, steps, rows=slice(None), batch_size=16):
    reader = TrainReader(split, batch_size=batch_size, seed=3, rows=rows)
    return [reader(step) for step in range(steps)]


def test_a_packed_tree_holds_the_same_images_in_the_same_order(tree):
    folder, packed = (jdp.data.from_images(path / "train", image_size=(32, 32)) for path in tree)
    assert folder.classes == packed.classes == ("class_000", "class_001", "class_002")
    everything = np.arange(len(folder))
    read = folder.read(everything), packed.read(everything)
    assert list(read[0]["image"]) == list(read[1]["image"])  # the files' bytes, unchanged
    np.testing.assert_array_equal(read[0]["label"], read[1]["label"])
    # Training batches: the same images, crops and flips, bit for bit (4 steps: 1+ epochs).
    for one, other in zip(_batches(folder, 4), _batches(packed, 4), strict=True):
        assert one["image"].dtype == np.uint8 and one["image"].shape == (16, 32, 32, 3)
        np.testing.assert_array_equal(one["image"], other["image"])
        np.testing.assert_array_equal(one["label"], other["label"])


def test_crops_do_not_depend_on_the_topology(tree):
    split = jdp.data.from_images(tree[1] / "train", image_size=(24, 24))
    whole = _batches(split, 3)
    for processes in (2, 8):  # each process reads its rows: together, the whole batch
        size = 16 // processes
        parts = [_batches(split, 3, slice(p * size, (p + 1) * size)) for p in range(processes)]
        for step, batch in enumerate(whole):
            joined = np.concatenate([part[step]["image"] for part in parts])
            np.testing.assert_array_equal(joined, batch["image"])
    # Steps read in bulk (--steps-per-call) are the steps read one by one.
    reader = TrainReader(split, batch_size=16, seed=3, rows=slice(None))
    for one, bulk in zip(whole, reader.steps(0, 3), strict=True):
        np.testing.assert_array_equal(one["image"], bulk["image"])
    # Another seed draws other crops of other images.
    other = TrainReader(split, batch_size=16, seed=4, rows=slice(None))(0)
    assert not np.array_equal(other["image"], whole[0]["image"])


def test_inception_crops_keep_to_their_area_and_aspect_ratio():
    transform = ImageTransform()
    rng = np.random.default_rng(0)
    height, width = 350, 400
    for uniforms in transform.draw(rng, 500).uniforms:
        left, top, right, bottom = transform.random_box((height, width), uniforms)
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        w, h = right - left, bottom - top
        # Rounding each side to a pixel moves the area by at most (w + h + 1) pixels
        # and the ratio by about 1/h + 1/w of itself.
        slack = (w + h + 1) / (height * width)
        assert 0.08 - slack <= w * h / (height * width) <= 1.0 + slack
        assert 3 / 4 * (1 - 1 / h - 1 / w) <= w / h <= 4 / 3 * (1 + 1 / h + 1 / w)
    # No attempt fits (the whole area at the widest ratio, in a tall image): the centre.
    tall = (400, 100)
    assert transform.random_box(tall, np.array([[1.0, 1.0, 0.5, 0.5]] * 10)) is None
    assert transform.center_box(tall) == (6, 156, 93, 243)  # 87.5% of the shorter side
    assert transform.center_box((350, 400)) == (47, 22, 353, 328)


def test_evaluation_reads_each_image_once_as_a_centre_crop(tree):
    split = jdp.data.from_images(tree[0] / "test", image_size=(32, 32))
    batches = [EvalReader(split, batch_size=8, rows=slice(None))(n) for n in range(2)]
    assert sum(batch[MASK_KEY].sum() for batch in batches) == len(split) == 12
    first = split.transform(split.read(np.arange(8))["image"])  # no draws: the centre
    np.testing.assert_array_equal(batches[0]["image"], first)
    again = EvalReader(split, batch_size=8, rows=slice(4, 8))(0)  # a process's rows
    np.testing.assert_array_equal(again["image"], first[4:8])


def test_images_reach_the_devices_as_uint8_and_are_normalised_there():
    transform = ImageTransform()
    pixels = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    (x,) = jax.jit(Normalize("image", transform.mean, transform.std))({"image": pixels})
    want = (pixels / 255.0 - np.array(transform.mean)) / np.array(transform.std)
    # float32 arithmetic on values up to |2.7|: a few ulps.
    np.testing.assert_allclose(np.asarray(x), want, rtol=0, atol=8 * 2.7 * 1.2e-7)


def _fit(dataset, mesh, tmp_path, **more):
    config = jdp.TrainConfig(
        dataset=f"images:{dataset}",
        model="cnn",
        image_size="32,32",
        mesh=mesh,
        batch_size=16,
        steps=6,
        warmup_steps=3,
        eval_every=0,
        log_every=1,
        log_dir=str(tmp_path),
        **more,
    )
    result = jdp.fit(config)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in records if r["kind"] == "train"]


@pytest.mark.slow
def test_a_streamed_run_on_data8_matches_data1_and_the_packed_form_bitwise(tree, tmp_path):
    one, one_log = _fit(tree[0], "data=1", tmp_path / "1")
    eight, eight_log = _fit(tree[0], "data=8", tmp_path / "8", data_ledger="bytes")
    packed, packed_log = _fit(tree[1], "data=8", tmp_path / "p", data_ledger="bytes")
    assert_sequences_close(
        [r["loss"] for r in eight_log], [r["loss"] for r in one_log], rtol=EARLY_STEPS
    )
    assert_drift_within(eight.state.params, one.state.params)
    assert [r["data_ledger"] for r in eight_log] == [r["data_ledger"] for r in one_log]
    # The packed form: the same bytes, so the same digests and the same run, bit for bit.
    assert [r["data_ledger_bytes"] for r in packed_log] == [
        r["data_ledger_bytes"] for r in eight_log
    ]
    assert [r["loss"] for r in packed_log] == [r["loss"] for r in eight_log]
    jax.tree.map(np.testing.assert_array_equal, packed.state.params, eight.state.params)


def test_a_damaged_image_is_one_line_and_exit_2(tree, tmp_path):
    bad = tmp_path / "bad"
    write_tree(str(bad), {"train": 6, "test": 2}, classes=2)
    broken = bad / "train" / "class_001" / "000001.jpg"
    broken.write_bytes(b"\xff\xd8 not a JPEG")
    packed = run_python("-m", "jdp.data", "pack", bad, "--out", tmp_path / "out")
    assert packed.returncode == 2, packed.stderr
    assert f"cannot read image {broken} (not an image Pillow" in packed.stderr
    assert not (tmp_path / "out" / "train" / "images.json").exists()  # no half a pack
    # A header that reads and data cut short: caught as it is decoded, in one line.
    whole = (bad / "train" / "class_000" / "000000.jpg").read_bytes()
    with pytest.raises(jdp.UsageError, match=r"cannot decode an image of the batch \(image file"):
        ImageTransform(size=(16, 16))(np.array([whole[: len(whole) // 2]], object))
    packed = tmp_path / "packed"
    jdp.data.pack(tree[0] / "test", packed)
    np.save(packed / "labels.npy", np.full(12, 3, np.int32))  # 3 classes: 0, 1, 2
    with pytest.raises(jdp.UsageError, match="labels outside its 3 classes"):
        jdp.data.from_images(packed)
    trained = run_cli(
        "--dataset",
        f"images:{bad}",
        *"--image-size 16,16 --steps 4 --batch-size 6 --mesh data=2".split(),
        *"--model cnn".split(),
    )
    assert trained.returncode == 2, trained.stderr
    assert trained.stderr.strip().splitlines()[-1] == (
        f"jdp.train: error: cannot read image {broken} (not an image Pillow or libjpeg-turbo "
        "reads); remove or replace it"
    )


def _bomb_png(height: int, width: int) -> bytes:
    """A PNG whose header states ``height`` x ``width`` pixels, with no pixels after it:
    what a decompression bomb's header says, without its gigabytes."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_images_that_would_be_dropped_or_break_are_named(tmp_path, capsys):
    root = tmp_path / "tree"
    write_tree(str(root), {"train": 4, "test": 2}, classes=2)
    # A class folder only under test/: its images would leave the test split in silence.
    (root / "test" / "class_009").mkdir()
    shutil.copy(root / "test" / "class_000" / "000000.jpg", root / "test" / "class_009")
    for read in (
        lambda: jdp.data.pack(root, tmp_path / "p"),
        lambda: jdp.data.from_images(root / "test", classes=("class_000", "class_001")),
    ):
        with pytest.raises(
            jdp.UsageError,
            match=r"test has class folders the training split "
            r"lacks \(class_009\): their images would be left out",
        ):
            read()
    shutil.rmtree(root / "test" / "class_009")
    # Files that are not images by their names: left out, counted in one warning.
    folder = root / "train" / "class_000"
    (folder / "notes.txt").write_text("taken on a Tuesday")
    (folder / ".DS_Store").write_bytes(b"\0")
    assert len(jdp.data.from_images(root / "train")) == 4
    warning = capsys.readouterr().err.strip().splitlines()
    assert warning == [
        f"jdp: warning: left out 1 file of {root / 'train'}'s class folders that "
        f"are not images by their names ({folder / 'notes.txt'}, ...; jdp reads "
        ".png, .jpg, .jpeg, .bmp, .gif, .tif, .tiff, .webp)"
    ], warning
    # Names that are not image files, and a name that is not UTF-8 (read as it is).
    for make, needle in [
        (lambda p: p.mkdir(), "x.jpg is not a file"),
        (lambda p: p.symlink_to(tmp_path / "gone"), "x.jpg is a broken link"),
    ]:
        make(folder / "x.jpg")
        with pytest.raises(jdp.UsageError, match=needle):
            jdp.data.from_images(root / "train")
        (os.rmdir if (folder / "x.jpg").is_dir() else os.remove)(folder / "x.jpg")
    odd = os.path.join(os.fsencode(folder), b"\xff.jpg")
    shutil.copy(folder / "000000.jpg", odd)
    split = jdp.data.from_images(root / "train", image_size=(8, 8))
    assert len(split) == 5 and split.transform(split.read(np.arange(5))["image"]).shape[0] == 5
    # A decompression bomb's header, and data cut short, name their file.
    with open(odd, "wb") as file:
        file.write(_bomb_png(20_000, 20_000))
    with pytest.raises(jdp.UsageError, match=r"\\xff.jpg \(.*400000000 pixels\) exceeds limit"):
        split.read(np.arange(5))
    whole = (folder / "000000.jpg").read_bytes()
    with open(odd, "wb") as file:
        file.write(whole[: len(whole) // 2])
    with pytest.raises(jdp.UsageError, match=r"cannot decode .*class_000/\\xff.jpg \(image file"):
        split.transform(split.read(np.arange(5))["image"])
    os.remove(odd)
    # A pack the packer did not finish (images.json is written last).
    jdp.data.pack(root, tmp_path / "packed")
    os.remove(tmp_path / "packed" / "train" / "images.json")
    with pytest.raises(jdp.UsageError, match="train is a pack that is not complete"):
        jdp.data.from_images(tmp_path / "packed" / "train")


def _cli(dataset, ckpt_dir):
    # ResNet-20's batch norm is ResNet-50's at a fraction of the compile (the layers' count
    # is not this test's point: the statistics' and the workers' state on a kill is).
    flags = [
        "--dataset",
        f"images:{dataset}",
        *"--model resnet20 --model-size small --image-size 32,32".split(),
        *"--mesh data=4 --batch-size 8 --steps 16 --warmup-steps 4".split(),
        *"--ckpt-every 4 --eval-every 0 --loader-workers 1 --ckpt-dir".split(),
        str(ckpt_dir),
    ]
    return [sys.executable, "-m", "jdp.train", *flags]


# The scheduled lane: per change, tests/test_checkpoint.py kills and resumes bitwise, and
# tests/test_streams.py a run on streamed batches; tests/test_replay.py resumes BatchNorm.
@pytest.mark.slow
@pytest.mark.scheduled
def test_kill_9_and_resume_is_bitwise_with_batchnorm_and_workers(tree, tmp_path):
    reference = subprocess.run(
        _cli(tree[1], tmp_path / "whole"),
        capture_output=True,
        text=True,
        timeout=400,
        env=subprocess_env(),
    )
    assert reference.returncode == 0, reference.stderr
    process = subprocess.Popen(
        _cli(tree[1], tmp_path / "killed"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "killed" / "8").is_dir():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint at step 8"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run ended before it was killed"
    resumed = subprocess.run(
        _cli(tree[1], tmp_path / "killed"),
        capture_output=True,
        text=True,
        timeout=400,
        env=subprocess_env(),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"^jdp: resuming from step \d+ in ", resumed.stdout, re.M)
    assert_bitwise_equal(
        saved_arrays(tmp_path / "killed", 16), saved_arrays(tmp_path / "whole", 16)
    )


# A training process's memory before the run and the most it holds while it reads a
# whole epoch of the split, read each step (`jdp.bench.corpus.status`): the growth
# includes starting the devices and compiling (a few hundred MB for this cnn).
_MEASURE = """
import json, sys
import jdp
from jdp.actions import Callback
from jdp.bench.corpus import status
figures = {"before": status()["VmRSS"]}
def sample(progress):
    figures["most"] = max(figures.get("most", 0), status()["VmRSS"])
config = jdp.TrainConfig(dataset="images:" + sys.argv[1], model="cnn", image_size="16,16",
                         mesh="data=2", batch_size=64, steps=int(sys.argv[2]), eval_every=0)
jdp.fit(config, callbacks=[Callback(sample, every=1)])
print(json.dumps(figures))
"""


def _padded_jpeg(path, index: int, size: int) -> None:
    """A smooth 1500 x 1100 picture (other for each ``index``) as a JPEG of ``size`` bytes:
    after its start, application segments (APP15) of random bytes, which decoders read
    past. Noise of that size took 13 ms to decode at the scale a small crop needs; this
    takes 2 ms, and reads the same bytes."""
    from PIL import Image

    y, x = np.mgrid[0:1100, 0:1500]
    pixels = np.stack([x * 255 // 1500, y * 255 // 1100, (x + y + 32 * index) % 256], axis=-1)
    encoded = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(encoded, format="JPEG", quality=95)
    picture, rng = encoded.getvalue(), np.random.default_rng(index)
    missing = size - len(picture)
    count = -(-missing // 65_000)  # segments of at most 65,535 bytes, their marker apart
    lengths = [missing // count] * (count - 1) + [missing - missing // count * (count - 1)]
    # Each: the marker, then a length that counts its own two bytes and the data's.
    segments = [b"\xff\xef" + (n - 2).to_bytes(2, "big") + rng.bytes(n - 4) for n in lengths]
    path.write_bytes(picture[:2] + b"".join(segments) + picture[2:])


# The scheduled lane: a size, not a path; per change the packed shards are read by
# test_a_streamed_run_on_data8_matches_data1_and_the_packed_form_bitwise.
@pytest.mark.slow
@pytest.mark.scheduled
def test_a_5_gb_split_trains_an_epoch_in_flat_memory(tmp_path):
    """5.2 GB of encoded images (8 distinct JPEGs of 1.95 MB, hard-linked 2,688 times,
    then packed into array_record shards: 5.2 GB on disk) train for a whole epoch
    while the process grows by less than 1 GiB: the split is read per batch, never held."""
    sources = [tmp_path / f"source{index}.jpg" for index in range(8)]
    for index, source in enumerate(sources):
        _padded_jpeg(source, index, 1_950_000)
    tree, packed = tmp_path / "tree", tmp_path / "packed"
    try:
        for split, count in (("train", 2688), ("test", 8)):
            for index in range(count):
                folder = tree / split / f"class_{index % 2}"
                folder.mkdir(parents=True, exist_ok=True)
                os.link(sources[index % 8], folder / f"{index:05d}.jpg")
        facts = jdp.data.pack(tree, packed)
        assert facts["train"]["bytes"] >= 5e9 and facts["train"]["shards"] >= 5
        done = run_python("-c", _MEASURE, packed, 2688 // 64, timeout=900, devices=2)
        assert done.returncode == 0, done.stderr
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        assert figures["most"] - figures["before"] < 2**30, figures
    finally:
        shutil.rmtree(packed, ignore_errors=True)


@pytest.mark.slow
def test_the_trained_model_names_image_files_as_evaluation_saw_them(tree, tmp_path):
    """load_model reads a streamed run's facts: centre crops of image files, normalised by
    the model; its predictions on the test files give the run's own test accuracy."""
    config = jdp.TrainConfig(
        dataset=f"images:{tree[1]}",
        model="cnn",
        image_size="32,32",
        mesh="data=2",
        batch_size=16,
        steps=8,
        warmup_steps=2,
        ckpt_dir=str(tmp_path / "run"),
    )
    result = jdp.fit(config)
    loaded = jdp.load_model(tmp_path / "run")
    files = sorted((tree[0] / "test").glob("*/*.jpg"))
    found = loaded.predict([str(path) for path in files])
    labels = [int(path.parent.name.split("_")[1]) for path in files]
    right = sum(int(got) == want for got, want in zip(found.labels, labels, strict=True))
    # The same 12 crops and model as the run's evaluation: its accuracy, to a twelfth.
    assert right / len(files) == pytest.approx(result.test_accuracy, abs=1e-6)
    # And its loss: a mean of 12 cross-entropies of about 1, each from a float32 softmax
    # computed apart (in numpy here, in the step there): a few ulps of 1 each.
    picked = found.probabilities[np.arange(len(files)), labels]
    assert -np.log(picked).mean() == pytest.approx(result.test_loss, rel=1e-5)


def _tfds_images(name, data_dir, splits):
    """TFDS's own ``name`` builder (imagenette, imagenet2012), its download replaced by
    JPEGs of ImageNet's sizes (``splits``: name -> count); prepared as array_record,
    offline."""
    import io

    import tensorflow_datasets as tfds

    from jdp.bench.images import imagenet_jpeg

    rng = np.random.default_rng(1)
    written = {split: [imagenet_jpeg(rng, i % 3) for i in range(n)] for split, n in splits.items()}

    class Generated(tfds.builder_cls(name), skip_registration=True):
        def _split_generators(self, dl_manager):
            return {split: self._generate(split) for split in splits}

        def _generate(self, split):
            for index, data in enumerate(written[split]):
                example = {"image": io.BytesIO(data), "label": index % 3}
                if "file_name" in self.info.features:  # imagenet2012's
                    example["file_name"] = f"{split}_{index:05d}.JPEG"
                yield index, example

    Generated.name = name

    Generated(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return written


@pytest.mark.parametrize("name, classes", [("imagenette", 10), ("imagenet2012", 1000)])
@pytest.mark.slow
def test_tfds_image_datasets_stream_their_jpegs_undecoded(name, classes, tmp_path):
    written = _tfds_images(name, tmp_path, {"train": 24, "validation": 8})
    split = jdp.data.from_tfds_images(name, "train", data_dir=str(tmp_path), image_size=(32, 32))
    assert len(split) == 24 and len(split.classes) == classes and split.labels is None
    batch = split.read(np.arange(24))
    # TFDS keeps the files' bytes (in its own shuffled order) and the labels with them.
    assert sorted(batch["image"]) == sorted(written["train"])
    for data, label in zip(batch["image"], batch["label"], strict=True):
        assert label == written["train"].index(data) % 3
    crops = TrainReader(split, batch_size=8, seed=0, rows=slice(None))(0)["image"]
    assert crops.shape == (8, 32, 32, 3) and crops.dtype == np.uint8
    # On the command line: tfds:NAME streams a dataset of images of many sizes, its
    # validation split evaluated (imagenet2012 and imagenette have no test split).
    result = run_cli(
        "--dataset",
        f"tfds:{name}",
        "--data-dir",
        tmp_path,
        *"--image-size 32,32 --model cnn --mesh data=2 --batch-size 8".split(),
        *"--steps 4 --eval-every 2 --loader-workers 1".split(),
    )
    assert result.returncode == 0, result.stderr
    assert "(24 train / 8 validation)" in result.stdout, result.stdout
    assert re.search(r"step 4: val_loss=\S+ val_accuracy=", result.stdout), result.stdout


# The scheduled lane: per change, the recipe's smoke form (tests/test_recipes.py) runs the
# same path on JPEGs; this is the check that it learns.
@pytest.mark.slow
@pytest.mark.scheduled
def test_the_imagenet_recipe_learns_from_jpegs_on_the_cpu_mesh(tmp_path):
    """The recipe's optimizer, schedule, label smoothing, weight decay and bf16, at a
    quarter of ResNet-50's width on 32 px crops of 4 classes of JPEGs, 40 steps: ResNet-50
    in bf16 with smoothed labels learns from JPEGs (at full width it took a test 48 s
    more of CI to say the same)."""
    write_tree(str(tmp_path / "images"), {"train": 128, "test": 32}, classes=4)
    result = run_cli(
        *"--recipe imagenet-resnet50 --dataset".split(),
        f"images:{tmp_path / 'images'}",
        *"--model-size small --image-size 32,32 --epochs 0 --steps 40".split(),
        *"--batch-size 32 --warmup-steps 4 --loader-workers 0".split(),
        *"--eval-every 0 --mesh data=8".split(),
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    loss = float(re.search(r"test_loss=([\d.]+)", summary).group(1))
    # Knowing nothing, a model's smoothed cross-entropy over 4 classes is ln 4 = 1.386
    # at best; seen 0.87. A model that learned nothing stays above 1.3.
    assert loss < 1.2, summary


@pytest.mark.slow
def test_two_processes_read_their_rows_and_train_as_one(tree, tmp_path):
    """Each process decodes only its rows of each global batch; together they train on
    the very bytes and crops one process does (the byte ledger), to float rounding, and
    evaluate each test image once."""
    flags = [
        "--dataset",
        f"images:{tree[1]}",
        *"--model cnn --image-size 32,32 --mesh data=4 --batch-size 16".split(),
        *"--steps 6 --warmup-steps 3 --log-every 1 --data-ledger bytes".split(),
        *"--loader-workers 1".split(),
    ]
    one = run_cli(*flags, "--log-dir", tmp_path / "one", devices=4)
    assert one.returncode == 0, one.stderr
    launch = [
        *"-m jdp.launch --nproc 2 --devices-per-process 2 --".split(),
        sys.executable,
        "-m",
        "jdp.train",
        *flags,
        "--log-dir",
        tmp_path / "two",
    ]
    two = run_python(*launch, timeout=300)
    assert two.returncode == 0, two.stderr

    def logged(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    train = [[r for r in logged(name) if r["kind"] == "train"] for name in ("one", "two")]
    assert [r["data_ledger_bytes"] for r in train[1]] == [r["data_ledger_bytes"] for r in train[0]]
    assert_sequences_close(
        [r["loss"] for r in train[1]], [r["loss"] for r in train[0]], rtol=EARLY_STEPS
    )
    accuracy = [
        re.search(r"test_accuracy=([\d.]+)", out).group(1) for out in (one.stdout, two.stdout)
    ]
    assert accuracy[0] == accuracy[1]  # of 12 images: a difference would be a twelfth
