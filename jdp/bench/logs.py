"""``python -m jdp.bench logging``: the step loop with metrics written every step (JSONL
and TensorBoard) against no logging, in interleaved rounds."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax

from jdp.bench.common import add_run_flags, config_from
from jdp.bench.step import (
    first_batch,
)
from jdp.report.console import Console
from jdp.report.logger import MetricLogger
from jdp.report.throughput import Throughput
from jdp.report.trackers import open_writers
from jdp.training.config import TrainConfig
from jdp.training.run import build


def bench_logging(config: TrainConfig, *, steps: int, rounds: int) -> list[str]:
    """The step loop with metrics written every step vs none, in one run.

    The arms alternate in ABBA order, and each round's ratio compares arms run
    next to each other: this machine's speed drifts by more than the effect.
    """
    run = build(config, Console(enabled=False))
    batch = first_batch(run, config.batch_size)
    state = run.state
    for _ in range(3):  # compile and settle
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    ratios, rates = [], {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as log_dir:
        for round_ in range(rounds):
            measured = {}
            for logging in (False, True) if round_ % 2 == 0 else (True, False):
                logger = MetricLogger(
                    open_writers(log_dir) if logging else [],
                    every=1,
                    throughput=Throughput(config.batch_size),
                    enabled=logging,
                )
                started = time.perf_counter()
                for step in range(steps):
                    state, metrics = run.train_step(state, batch)
                    logger.record(step, metrics)
                jax.block_until_ready(metrics)
                logger.close()  # on the clock: every record is fetched and written
                measured[logging] = steps * config.batch_size / (time.perf_counter() - started)
                rates[logging].append(measured[logging])
            ratios.append(measured[True] / measured[False])
        with open(os.path.join(log_dir, "metrics.jsonl")) as file:
            written = sum(1 for _ in file)
    quartiles = statistics.quantiles(ratios, n=4)
    return [
        f"jdp.bench logging: {config.model} on {config.dataset}, mesh {config.mesh}, global "
        f"batch {config.batch_size}, {steps} steps per arm, {rounds} rounds (ABBA)",
        f"  logging off:        {statistics.median(rates[False]):>12,.0f} examples/s (median)",
        f"  logging every step: {statistics.median(rates[True]):>12,.0f} examples/s (median); "
        f"{written:,} records written to metrics.jsonl and TensorBoard",
        f"  every step / off, per round: median {statistics.median(ratios):.3f} "
        f"(quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f})",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, mesh="data=8")
    parser.add_argument("--steps", type=int, default=300, help="steps per round and arm")
    parser.add_argument("--rounds", type=int, default=30)


def run(args: argparse.Namespace) -> None:
    print("\n".join(bench_logging(config_from(args), steps=args.steps, rounds=args.rounds)))
