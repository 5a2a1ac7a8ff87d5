"""``python -m jdp.bench multihost``: for each model of the ``step`` sweep, the same
train step and global batch in 1 process x 1 device and in 2 processes x 1 device
(started by ``jdp.launch``), with the gradient all-reduce alone timed three ways."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec

from jdp.bench.arms import jdp_loop
from jdp.bench.common import names, report_lines
from jdp.bench.step import CASES, case_run, check_cases, first_batch
from jdp.mesh import DATA_AXIS
from jdp.reduce import pack_leaf_bytes, pmean_bucketed


def _allreduce_seconds(tree, mesh, *, rounds: int) -> dict[str, float]:
    """Median seconds of one ``pmean`` over ``data`` of a replicated pytree, three ways.

    ``"jdp"``, as the train step reduces (`reduction_buckets`); ``"leaf"``, one
    buffer per leaf; ``"one"``, all leaves raveled into one buffer. The three are
    timed in turn, after a warm-up that lets each program set up its collectives.
    """

    def vary(x):
        return jax.tree.map(lambda leaf: lax.pcast(leaf, DATA_AXIS, to="varying"), x)

    def mean(x, how):
        if how == "jdp":
            return pmean_bucketed(x, vary=vary, pack_leaf_bytes=pack_leaf_bytes(mesh))
        if how == "one":
            vector, unravel = ravel_pytree(x)
            return unravel(lax.pmean(vary(vector), DATA_AXIS))
        return lax.pmean(vary(x), DATA_AXIS)

    reduces = {
        how: jax.jit(
            jax.shard_map(
                lambda x, how=how: mean(x, how),
                mesh=mesh,
                in_specs=PartitionSpec(),
                out_specs=PartitionSpec(),
            )
        )
        for how in ("jdp", "leaf", "one")
    }
    times: dict[str, list[float]] = {how: [] for how in reduces}
    for _ in range(5):  # warm-up
        for reduce in reduces.values():
            jax.block_until_ready(reduce(tree))
    for _ in range(rounds):  # a count, not a deadline: every process must join each one
        for how, reduce in reduces.items():
            started = time.perf_counter()
            jax.block_until_ready(reduce(tree))
            times[how].append(time.perf_counter() - started)
    return {how: statistics.median(values) for how, values in times.items()}


def multihost_worker(case: str, *, batch_size: int, seconds: float, out: str) -> None:
    """One process of a ``multihost`` measurement; process 0 writes the figures as JSON."""
    run = case_run(CASES[case], "data=-1", batch_size)
    batch = first_batch(run, batch_size)
    hlo = run.train_step.lower(run.state, batch).compile().as_text()
    # What the step reduces: the gradients (shaped as the params) and the metrics.
    reduced = (run.state.params, jnp.zeros((3,), jnp.float32))
    reduce_seconds = _allreduce_seconds(reduced, run.mesh, rounds=20)
    optimizer = run.optimizer
    loop = jdp_loop(run.train_step, run, batch, optimizer)
    loop(8)  # compile and settle
    started = time.perf_counter()
    loop(8)
    steps = int(min(400, max(8, seconds * 8 / (time.perf_counter() - started))))
    # Every process must run as many steps: process 0's count for all.
    steps = int(multihost_utils.broadcast_one_to_all(np.int32(steps)))
    started = time.perf_counter()
    loop(steps)
    rate = steps / (time.perf_counter() - started)
    if jax.process_index() == 0:
        figures = {
            "processes": jax.process_count(),
            "params": sum(leaf.size for leaf in jax.tree.leaves(run.state.params)),
            "examples_per_sec": rate * batch_size,
            "step_seconds": 1 / rate,
            "allreduce_seconds": reduce_seconds,
            "allreduce_ops": len(re.findall(r"\sall-reduce(?:-start)?\(", hlo)),
        }
        with open(out, "w") as file:
            json.dump(figures, file)


def _launch_worker(nproc: int, case: str, *, batch_size: int, seconds: float, out: str) -> dict:
    command = [
        sys.executable,
        *"-m jdp.launch --nproc".split(),
        str(nproc),
        *"--devices-per-process 1 --".split(),
        sys.executable,
        *"-m jdp.bench multihost-worker --out".split(),
        out,
        "--case",
        case,
        "--batch-size",
        str(batch_size),
        "--seconds",
        str(seconds),
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, errors = launcher.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # the launcher stops its processes
        _, errors = launcher.communicate()
    if launcher.returncode or not os.path.exists(out):
        raise RuntimeError(f"{nproc}-process worker failed:\n{errors[-3000:]}")
    with open(out) as file:
        return json.load(file)


def bench_multihost(
    cases: Sequence[str], *, batch_size: int, seconds: float, on_line=print
) -> list[str]:
    """Each case in 1 process x 1 device and 2 x 1 (gloo on loopback); the report's lines."""
    check_cases(cases)
    lines, emit = report_lines(on_line)

    emit(
        f"jdp.bench multihost: global batch {batch_size}, 1 device per process, gloo on "
        f"loopback, {jax.devices()[0].device_kind}; all-reduce of the gradients alone (median)"
    )
    emit(
        f"  {'model':<10}{'params':>8}{'1 process ex/s':>16}{'2 processes ex/s':>18}{'2 / 1':>7}"
        f"{'step ms':>9}{'ops':>5}   all-reduce ms: {'jdp':>6}{'per leaf':>10}{'one buffer':>12}"
    )
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as root:
        for case in cases:
            one, two = (
                _launch_worker(
                    nproc,
                    case,
                    batch_size=batch_size,
                    seconds=seconds,
                    out=os.path.join(root, f"{case}-{nproc}.json"),
                )
                for nproc in (1, 2)
            )
            params = two["params"]
            shown = f"{params / 1e6:.2f}M" if params >= 1e6 else f"{params / 1e3:.0f}k"
            reduce_ms = {how: two["allreduce_seconds"][how] * 1e3 for how in ("jdp", "leaf", "one")}
            emit(
                f"  {case:<10}{shown:>8}{one['examples_per_sec']:>16,.0f}"
                f"{two['examples_per_sec']:>18,.0f}"
                f"{two['examples_per_sec'] / one['examples_per_sec']:>6.2f}x"
                f"{two['step_seconds'] * 1e3:>9.2f}{two['allreduce_ops']:>5}"
                f"   {'':>14}{reduce_ms['jdp']:>6.2f}{reduce_ms['leaf']:>10.2f}"
                f"{reduce_ms['one']:>12.2f}"
            )
    return lines


def add_arguments(parser: argparse.ArgumentParser, *, worker: bool = False) -> None:
    cases = ",".join(CASES)
    if worker:
        parser.add_argument("--case", required=True, choices=list(CASES))
        parser.add_argument("--out", required=True)
    else:
        parser.add_argument("--cases", default=cases, help=f"comma-separated, from: {cases}")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds timed per measurement")


def run(args: argparse.Namespace) -> None:
    on_line = lambda line: print(line, flush=True)  # noqa: E731
    bench_multihost(
        names(args.cases), batch_size=args.batch_size, seconds=args.seconds, on_line=on_line
    )


def run_worker(args: argparse.Namespace) -> None:
    multihost_worker(args.case, batch_size=args.batch_size, seconds=args.seconds, out=args.out)
