"""Predict on what the user has: image files after a folder run, by class name, with the
run's preprocessing, and folders of mixed sizes through --image-size."""

import re

import numpy as np
import pytest
from helpers import run_cli
from PIL import Image

import jdp

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _digit_folders(root, *, sizes=(16,)):
    """The digits as grey PNGs in class folders named by word, train/ and test/: each
    image upscaled from 8x8 to one of ``sizes`` (cycled)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    files = {}
    for rank, index in enumerate(order):
        part = "test" if rank < 300 else "train"
        size = sizes[rank % len(sizes)]
        pixels = (digits.images[index] * 15).astype(np.uint8)
        folder = root / part / NAMES[digits.target[index]]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{index}.png"
        Image.fromarray(pixels).resize((size, size), Image.Resampling.NEAREST).save(path)
        files[path] = NAMES[digits.target[index]]
    return files


@pytest.mark.slow
def test_a_folder_runs_model_names_the_class_of_new_image_files(tmp_path):
    files = _digit_folders(tmp_path / "digits")
    ckpt = tmp_path / "run"
    result = run_cli(
        "--dataset",
        f"folder:{tmp_path / 'digits'}",
        *"--mesh data=2 --steps 200 --ckpt-dir".split(),
        ckpt,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"test_accuracy=([\d.]+)", result.stdout).group(1))
    loaded = jdp.load_model(ckpt)
    tests = [(path, name) for path, name in files.items() if path.parent.parent.name == "test"]
    found = loaded.predict([path for path, _ in tests])
    # The same images, preprocessing and model as the run's evaluation: its accuracy exactly.
    right = sum(got == want for got, (_, want) in zip(found.names, tests, strict=True))
    assert right / len(tests) == pytest.approx(accuracy, abs=5e-5)
    assert np.allclose(found.probabilities.sum(-1), 1.0, atol=1e-5)
    # A new JPEG of another size: decoded, resized and scaled as training read the folder.
    sure = next(
        i
        for i, (_, want) in enumerate(tests)
        if found.names[i] == want and found.probabilities[i].max() > 0.9
    )
    path, want = tests[sure]
    Image.open(path).resize((24, 24), Image.Resampling.BILINEAR).convert("RGB").save(
        tmp_path / "new.jpg", quality=95
    )
    assert loaded.predict(str(tmp_path / "new.jpg")).names == [want]
    # Raw arrays as the folder holds them: the same answer as their files.
    raw = np.stack([np.asarray(Image.open(p))[..., None] for p, _ in tests[:8]])
    assert loaded.predict(raw).names == found.names[:8]


@pytest.mark.slow
def test_a_folder_of_mixed_sizes_trains_with_image_size(tmp_path):
    _digit_folders(tmp_path / "mixed", sizes=(16, 20))
    flags = ["--dataset", f"folder:{tmp_path / 'mixed'}", "--mesh", "data=2", "--steps", "20"]
    refused = run_cli(*flags, timeout=180)
    assert refused.returncode == 2 and "(--image-size H,W)" in refused.stderr
    result = run_cli(*flags, "--image-size", "16,16", timeout=180)
    assert result.returncode == 0, result.stderr


def test_image_size_is_for_folders_and_says_its_form():
    with pytest.raises(jdp.UsageError, match=r"--image-size resizes a folder:PATH or images:PATH"):
        jdp.TrainConfig(image_size="16,16")
    with pytest.raises(jdp.UsageError, match=r"--image-size '16': give H,W"):
        jdp.TrainConfig(dataset="folder:x", image_size="16")
