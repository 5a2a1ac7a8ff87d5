"""``python -m jdp.bench input --images``: the streamed image pipeline at ImageNet's shape.

It writes JPEGs of ImageNet's sizes (260-440 x 300-500 px, about 400 x 350 on
average, quality 90) as a class-folder tree, then measures, in one run:

- each JPEG decoder it can import (Pillow, simplejpeg, OpenCV) decoding them whole,
  images/s on one core: why `jdp.data.formats.images` decodes JPEGs with simplejpeg;
- the loader's decoded, Inception-cropped and flipped 224 px images/s with 0 Grain
  workers (one core) and with ``--workers``;
- a ResNet-50 run on the CPU mesh streaming them: its images/s and the share of
  its loop spent waiting for input;
- how many host cores one accelerator would need at ``--accelerator-rate`` images/s.
"""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np

# NVIDIA's published ResNet-50 training rate on one A100 with DALI (images/s): the
# default figure a host must feed; an H100 trains faster, so needs more.
A100_DALI_RATE = 2470.0


def imagenet_jpeg(rng: np.random.Generator, label: int, quality: int = 90) -> bytes:
    """One JPEG of ImageNet's size whose stripes' frequency says its class, with noise
    that makes it compress like a photograph (about 80 KB at quality 90)."""
    from PIL import Image

    height, width = int(rng.integers(260, 441)), int(rng.integers(300, 501))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    period = 6.0 + 3.0 * label
    pixels = np.stack([np.sin((x + k * y) / period + k) * 80 + 128 for k in range(3)], -1)
    pixels += rng.normal(0, 18, pixels.shape).astype(np.float32)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def write_tree(root: str, counts: dict[str, int], classes: int, seed: int = 0) -> int:
    """``root/SPLIT/class_K/N.jpg`` for each split's count, classes in turn; returns the
    bytes written."""
    rng = np.random.default_rng(seed)
    total = 0
    for split, count in counts.items():
        for index in range(count):
            label = index % classes
            folder = os.path.join(root, split, f"class_{label:03d}")
            os.makedirs(folder, exist_ok=True)
            data = imagenet_jpeg(rng, label)
            with open(os.path.join(folder, f"{index:06d}.jpg"), "wb") as handle:
                handle.write(data)
            total += len(data)
    return total


def decoders() -> dict:
    """The JPEG decoders importable here: name -> bytes -> RGB uint8 array."""
    found = {}
    from PIL import Image

    found["Pillow"] = lambda data: np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    try:
        import simplejpeg

        found["simplejpeg"] = lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ImportError:
        pass
    try:
        import cv2

        found["OpenCV"] = lambda data: cv2.imdecode(np.frombuffer(data, np.uint8), 1)
    except ImportError:
        pass
    return found


def decode_rates(blobs: list[bytes], rounds: int = 3) -> dict[str, float]:
    """Images/s of each decoder on one core: the best of ``rounds`` interleaved passes."""
    best = dict.fromkeys(decoders(), 0.0)
    for _ in range(rounds):
        for name, decode in decoders().items():
            started = time.perf_counter()
            for data in blobs:
                decode(data)
            best[name] = max(best[name], len(blobs) / (time.perf_counter() - started))
    return best


def loader_rate(split, *, batch_size: int, workers: int, batches: int) -> float:
    """Training images/s the loader makes (read, decoded, cropped), once its workers
    have started (`jdp.bench.common.worker_window`)."""
    from jdp.bench.common import batches_per_sec, worker_window
    from jdp.data.loader import TrainReader, host_batches

    reader = TrainReader(split, batch_size=batch_size, seed=0, rows=slice(None))
    stream = host_batches(reader, start=0, stop=None, workers=workers)
    warm, timed = worker_window(workers, batches)
    return batches_per_sec(stream, timed, warm=warm) * batch_size


def bench_images(args) -> list[str]:
    from jdp.data.formats import from_images
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.loop import fit

    root = args.dir or tempfile.mkdtemp(prefix="jdp-images-")
    try:
        size = write_tree(root, {"train": args.image_count, "test": args.batch_size}, classes=10)
        train = os.path.join(root, "train")
        walked = sorted(os.walk(train))
        blobs = [pathlib.Path(d, name).read_bytes() for d, _, names in walked for name in names]
        rates = decode_rates(blobs)
        split = from_images(train)
        per_core = loader_rate(split, batch_size=args.batch_size, workers=0, batches=args.batches)
        with_workers = loader_rate(
            split, batch_size=args.batch_size, workers=args.workers, batches=args.batches
        )
        config = TrainConfig(
            model="resnet50",
            model_size=args.model_size,
            dataset=f"images:{root}",
            mesh=args.mesh,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup_steps=1,
            eval_every=0,
            loader_workers=args.workers,
            precision="bf16",
        )
        result = fit(config, console=Console(enabled=False))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    fastest = max(rates, key=rates.get)
    lines = [
        f"jdp.bench input --images: {len(blobs)} JPEGs of ImageNet's sizes "
        f"({size / len(blobs) / 1e3:.0f} KB each on average, quality 90), 224 px crops",
        "  decoding whole images, one core: "
        + ", ".join(f"{name} {rate:,.0f}/s" for name, rate in rates.items())
        + f"; fastest {fastest} ({rates[fastest] / rates['Pillow']:.2f}x Pillow)",
        f"  loader (read, decode, Inception crop, flip), 0 workers: {per_core:,.0f} images/s "
        f"per core; {args.workers} Grain workers: {with_workers:,.0f} images/s "
        f"({os.cpu_count()} cores here)",
        f"  resnet50 {args.model_size} bf16, mesh {args.mesh}, batch {args.batch_size}, "
        f"{args.steps} steps: {result.examples_per_sec:,.1f} images/s, input waiting "
        f"{result.input_wait:.1%} of the loop",
        f"  one accelerator at {args.accelerator_rate:,.0f} images/s needs "
        f"{args.accelerator_rate / per_core:.1f} cores like this one at the rate measured",
    ]
    return lines


def add_arguments(parser) -> None:
    parser.add_argument(
        "--images",
        action="store_true",
        help="measure streamed JPEGs at ImageNet's shape instead (resnet50)",
    )
    parser.add_argument("--image-count", type=int, default=512, help="with --images: JPEGs")
    parser.add_argument(
        "--accelerator-rate",
        type=float,
        default=A100_DALI_RATE,
        help="with --images: images/s one accelerator trains (default: "
        "NVIDIA's ResNet-50 figure for one A100 with DALI)",
    )
    parser.add_argument("--dir", help="with --images: where to write them (default: a temp dir)")


def run(args) -> None:
    """``input --images``: the defaults of a ResNet-50 on a CPU, where unset."""
    args.steps = args.steps or 6
    args.batches = args.batches or 8
    args.model_size = args.model_size or "standard"
    args.batch_size = 32 if args.batch_size == 128 else args.batch_size
    print("\n".join(bench_images(args)))
