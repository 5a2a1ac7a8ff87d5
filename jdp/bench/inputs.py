"""``python -m jdp.bench input``: how fast the loader makes batches (with and without
Grain workers), how fast the train step consumes them on the same batch shape, and
the share of a real training run's loop spent waiting for input. ``--images``: JPEGs
streamed at ImageNet's shape into ResNet-50 instead (`jdp.bench.images`)."""

from __future__ import annotations

import argparse

import jax

from jdp.bench import images
from jdp.bench.common import (
    add_run_flags,
    batches_per_sec,
    config_from,
    steps_per_sec,
    worker_window,
)
from jdp.data.loader import TrainReader, host_batches, on_host, train_batches
from jdp.mesh import process_rows
from jdp.report.console import Console
from jdp.training.config import TrainConfig
from jdp.training.loop import fit
from jdp.training.run import build


def bench_input(config: TrainConfig, *, workers: int, batches: int, steps: int) -> list[str]:
    """Measures the input pipeline against the train step; returns the report's lines."""
    run = build(config, Console(enabled=False))
    size = config.batch_size
    host = on_host(run.train)
    reader = TrainReader(host, batch_size=size, seed=config.seed, rows=process_rows(run.mesh, size))
    rows = []
    for count in sorted({0, workers}):
        warm, timed = worker_window(count, batches)
        stream = host_batches(reader, start=0, stop=None, workers=count)
        rate = batches_per_sec(stream, timed, warm=warm)
        by = f"{count} Grain workers" if count else "no workers"
        rows.append((f"loader, {by}: host batches", rate * size))
    arms = [("loader, no workers, batches placed on the mesh", host)]
    if run.train is not host:  # --data-on-device placed it
        arms.append(("loader, split on the devices, rows gathered there", run.train))
    for name, split in arms:
        with train_batches(split, run.mesh, batch_size=size, seed=config.seed) as loader:
            batch = next(loader)
            rows.append((name, batches_per_sec(loader, batches) * size))
    consumed = steps_per_sec(run, batch, steps) * size
    rows.append(("train step, same batch shape, no input", consumed))
    result = fit(config, console=Console(enabled=False))

    devices = run.mesh.devices.size
    kind = jax.devices()[0].device_kind
    lines = [
        f"jdp.bench input: {config.model} on {config.dataset}, mesh {config.mesh} "
        f"({devices} x {kind}), global batch {size}, backend {config.backend}"
    ]
    lines.append(f"  {'':<54}{'examples/s':>12}  {'/ train step':>12}")
    lines += [f"  {name:<54}{rate:>12,.0f}  {rate / consumed:>11.1f}x" for name, rate in rows]
    lines.append(
        f"  training run, {config.steps} steps: input waiting {result.input_wait:.1%} of loop "
        f"time ({result.examples_per_sec:,.0f} examples/s)"
    )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, mesh="data=8", dataset=True)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="length of the training run (default: 400; --images: 6)",
    )
    parser.add_argument("--workers", type=int, default=2, help="Grain workers to compare with 0")
    parser.add_argument(
        "--batches",
        type=int,
        default=None,
        help="batches timed per loader, at least 4 a worker, after 2 a worker "
        "(default: 1000; --images: 8)",
    )
    parser.add_argument("--step-repeats", type=int, default=200, help="train steps timed")
    parser.add_argument(
        "--model-size", default=None, help="with --images: resnet50's size (default: standard)"
    )
    images.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    if args.images:
        return images.run(args)
    steps, batches = args.steps or 400, args.batches or 1000
    config = config_from(args, steps=steps, warmup_steps=min(TrainConfig.warmup_steps, steps // 2))
    lines = bench_input(config, workers=args.workers, batches=batches, steps=args.step_repeats)
    print("\n".join(lines))
