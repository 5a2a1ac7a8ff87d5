"""``python -m jdp.bench``: figures measured side by side in one process run.

``input``: how fast the loader makes batches (with and without Grain workers),
how fast the train step consumes them on the same batch shape, and the share of
a real training run's loop spent waiting for input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Sequence

import jax

from jdp.config import TrainConfig
from jdp.data.pipeline import TrainReader, host_batches, train_batches
from jdp.errors import UsageError
from jdp.loop import build, fit
from jdp.mesh import process_rows
from jdp.metrics import Console


def _batches_per_sec(batches: Iterable, count: int) -> float:
    """Batches per second over ``count`` batches, after the first (start-up) one."""
    iterator = iter(batches)
    next(iterator)
    started = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return count / (time.perf_counter() - started)


def _steps_per_sec(run, batch, count: int) -> float:
    """Train steps per second on one batch fed again and again (no input cost)."""
    state = run.state
    for _ in range(3):  # compile and settle
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(count):
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    return count / (time.perf_counter() - started)


def bench_input(config: TrainConfig, *, workers: int, batches: int, steps: int) -> list[str]:
    """Measures the input pipeline against the train step; returns the report's lines."""
    run = build(config, Console(enabled=False))
    size = config.batch_size
    reader = TrainReader(
        run.train, batch_size=size, seed=config.seed, rows=process_rows(run.mesh, size)
    )
    rows = []
    for count in sorted({0, workers}):
        rate = _batches_per_sec(host_batches(reader, start=0, stop=None, workers=count), batches)
        rows.append((f"loader, {count} Grain workers: host batches", rate * size))
    with train_batches(run.train, run.mesh, batch_size=size, seed=config.seed) as loader:
        batch = next(loader)
        placed = _batches_per_sec(loader, batches)
    rows.append(("loader, 0 Grain workers, batches placed on the mesh", placed * size))
    consumed = _steps_per_sec(run, batch, steps) * size
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jdp.bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inputs = commands.add_parser("input", help="loader vs train step, input waiting in a run")
    inputs.add_argument("--mesh", default="data=8")
    inputs.add_argument("--model", default="mlp")
    inputs.add_argument("--dataset", default="digits")
    inputs.add_argument("--data-dir", default=None)
    inputs.add_argument("--batch-size", type=int, default=128)
    inputs.add_argument("--steps", type=int, default=400, help="length of the training run")
    inputs.add_argument("--workers", type=int, default=2, help="Grain workers to compare with 0")
    inputs.add_argument("--batches", type=int, default=1000, help="batches timed per loader")
    inputs.add_argument("--step-repeats", type=int, default=200, help="train steps timed")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(
            mesh=args.mesh,
            model=args.model,
            dataset=args.dataset,
            data_dir=args.data_dir,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup_steps=min(TrainConfig.warmup_steps, args.steps // 2),
        )
        lines = bench_input(
            config, workers=args.workers, batches=args.batches, steps=args.step_repeats
        )
    except UsageError as error:
        print(f"jdp.bench: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
