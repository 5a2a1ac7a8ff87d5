"""``python -m jdp.bench diloco``: synchronous data parallelism against DiLoCo with
several synchronisation intervals, on the same model, data and steps.

For each workload and arm: the final test metric, the bytes per step that cross
between the two halves of the devices (the groups; for synchronous training the
same halves of its ``data=8`` mesh), read from the compiled programs, and
examples/s. With ``--processes 2`` each half is one process (started by
``jdp.launch``, gloo between them), where crossing is what costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from collections.abc import Callable

from jdp.bench.common import counts, names, report_lines
from jdp.bench.step import first_batch
from jdp.collectives import bytes_across
from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS, make_mesh
from jdp.report.console import Console
from jdp.training.config import TrainConfig
from jdp.training.loop import fit
from jdp.training.run import build

# Workload -> the run both arms make (steps, batch and schedule as `jdp.train` has them).
WORKLOADS = {
    "mlp": TrainConfig(model="mlp", dataset="digits", steps=400, batch_size=128),
    "gpt": TrainConfig(model="gpt", dataset="numbers2words", steps=400, batch_size=128),
}
# Synchronous training's mesh, and DiLoCo's: the same 8 devices in 2 groups of 4.
SYNC_MESH, GROUPS_MESH = "data=8", "group=2,data=4"
_SUMMARY = re.compile(
    r"jdp\.train: steps=\d+ .*?test_loss=(?P<loss>[\d.na]+) test_accuracy=(?P<accuracy>[\d.na]+) "
    r"examples/s=(?P<rate>\d+)"
)


def _arm(config: TrainConfig, sync_every: int | None) -> TrainConfig:
    if sync_every is None:
        return dataclasses.replace(config, mesh=SYNC_MESH)
    return dataclasses.replace(config, mesh=GROUPS_MESH, sync_every=sync_every)


def crossing_bytes(config: TrainConfig) -> float:
    """Bytes per step, per device, of the collectives that cross between the two halves
    of the devices: the train step's, plus the synchronisation's over its interval."""
    run = build(config, Console(enabled=False))
    halves = make_mesh(GROUPS_MESH)  # device i of either mesh is the same device
    step = run.train_step.lower(run.state, first_batch(run, config.batch_size))
    total = float(bytes_across(step.compile().as_text(), halves, GROUP_AXIS))
    if run.sync_step is not None:
        sync = run.sync_step.lower(run.state).compile().as_text()
        total += bytes_across(sync, halves, GROUP_AXIS) / run.sync_step.every
    return total


def _in_process(config: TrainConfig) -> tuple[float, float]:
    result = fit(config, console=Console(enabled=False))
    return result.test_accuracy, result.examples_per_sec


def _two_processes(config: TrainConfig) -> tuple[float, float]:
    """The arm as ``jdp.launch --nproc 2`` runs it: its summary line's figures."""
    flags = [
        "--mesh",
        config.mesh,
        "--model",
        config.model,
        "--dataset",
        config.dataset,
        "--steps",
        str(config.steps),
        "--batch-size",
        str(config.batch_size),
    ]
    if config.sync_every:
        flags += ["--sync-every", str(config.sync_every)]
    command = [
        sys.executable,
        *"-m jdp.launch --nproc 2 --devices-per-process 4 --".split(),
        sys.executable,
        "-m",
        "jdp.train",
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    match = _SUMMARY.search(result.stdout)
    if result.returncode or not match:
        raise RuntimeError(f"2-process run failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return float(match.group("accuracy")), float(match.group("rate"))


def bench_diloco(
    workloads: list[str],
    intervals: list[int],
    *,
    steps: int | None,
    processes: int,
    on_line: Callable[[str], None] = print,
) -> list[str]:
    """The table, one row per workload and arm, printed as each row is measured."""
    lines, emit = report_lines(on_line)
    train = _two_processes if processes == 2 else _in_process
    where = "2 processes x 4 devices (gloo)" if processes == 2 else "1 process x 8 devices"
    emit(
        f"jdp.bench diloco: sync ({SYNC_MESH}) vs DiLoCo ({GROUPS_MESH}, Nesterov outer lr 0.7 "
        f"momentum 0.9), {where}"
    )
    emit(
        f"  {'workload':<22} {'arm':<14} {'test acc':>9} {'bytes across/step':>18} "
        f"{'x sync':>7} {'examples/s':>11} {'x sync':>7}"
    )
    for name in workloads:
        config = WORKLOADS[name]
        if steps:
            config = dataclasses.replace(config, steps=steps)
        label = f"{config.model} on {config.dataset}"
        base_bytes = base_rate = None
        for sync_every in [None, *intervals]:
            arm = _arm(config, sync_every)
            nbytes = crossing_bytes(arm)
            accuracy, rate = train(arm)
            base_bytes = nbytes if base_bytes is None else base_bytes
            base_rate = rate if base_rate is None else base_rate
            emit(
                f"  {label:<22} {'sync' if sync_every is None else f'DiLoCo H={sync_every}':<14} "
                f"{accuracy:>9.4f} {nbytes:>18,.0f} {nbytes / base_bytes:>7.3f} "
                f"{rate:>11,.0f} {rate / base_rate:>7.3f}"
            )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="mlp,gpt", help="of: " + ", ".join(WORKLOADS))
    parser.add_argument("--sync-every", default="1,10,50", help="DiLoCo's intervals H")
    parser.add_argument("--steps", type=int, default=None, help="steps of every arm (default: 400)")
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))


def run(args: argparse.Namespace) -> None:
    workloads = names(args.workloads)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise UsageError(
            f"unknown workload {', '.join(unknown)}; choose from: {', '.join(WORKLOADS)}"
        )
    intervals = counts(args.sync_every, "--sync-every")
    bench_diloco(workloads, intervals, steps=args.steps, processes=args.processes)
