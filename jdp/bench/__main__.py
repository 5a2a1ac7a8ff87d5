"""``python -m jdp.bench``: figures measured side by side in one process run.

``input``: how fast the loader makes batches (with and without Grain workers),
how fast the train step consumes them on the same batch shape, and the share of
a real training run's loop spent waiting for input.

``checkpoint``: how long the training loop is blocked by an async save and by a
synchronous save of the same state, and how long a restore takes.

``step``: jdp's train step (both backends) against the best of two hand-written
``jit`` data-parallel steps, over four model sizes and three meshes (`jdp.bench.step`).

``dispatch``: one model in detail: several steps per call, host dispatch time
per step, and the collectives of the step as jdp emits it.

``scaling``: examples/s of one train step and global batch on 1, 2, 4 and 8
devices, as a table and a PNG.

``logging``: the step loop with metrics written every step (JSONL and
TensorBoard) against no logging, in interleaved rounds.

``multihost``: for each model of the ``step`` sweep, the same train step and
global batch in 1 process x 1 device and in 2 processes x 1 device (started by
``jdp.launch``), with the gradient all-reduce alone timed three ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec

from jdp.bench.step import (
    CASES,
    bench_step,
    case_run,
    check_cases,
    first_batch,
    hand_loop,
    hand_written_step,
    interleaved_rates,
    jdp_loop,
    ratios_to_best,
)
from jdp.checkpoint import Checkpointer
from jdp.config import TrainConfig
from jdp.data.pipeline import TrainReader, host_batches, train_batches
from jdp.errors import UsageError
from jdp.loop import build, fit, setup_devices
from jdp.mesh import DATA_AXIS, batch_sharded, make_mesh, process_rows
from jdp.metrics import Console, MetricLogger, Throughput, open_writers
from jdp.models import check_model
from jdp.state import create_train_state
from jdp.step import pack_leaf_bytes, pmean_bucketed


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


def bench_checkpoint(mesh_spec: str, *, size_mb: int, repeats: int) -> list[str]:
    """Times async and synchronous saves of an Adam state of ``size_mb`` MB of params."""
    setup_devices(mesh_spec)
    mesh = make_mesh(mesh_spec)
    width = 4096
    rows = max(1, size_mb * 2**20 // (4 * width * 4))
    params = {f"layer{i}": jnp.zeros((rows, width)) for i in range(4)}
    state = create_train_state(params, optax.adam(1e-3), mesh)
    # Random values everywhere, moments included: Orbax compresses, and zeros would
    # make the files (and the saves) unrealistically small.
    leaves, treedef = jax.tree.flatten(state.replace(rng=jax.random.key_data(state.rng)))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    leaves = [
        jax.jit(
            lambda key, leaf: jax.random.normal(key, leaf.shape, leaf.dtype),
            out_shardings=leaf.sharding,
        )(key, leaf)
        if leaf.ndim == 2
        else leaf
        for key, leaf in zip(keys, leaves, strict=True)
    ]
    state = jax.tree.unflatten(treedef, leaves)
    state = state.replace(rng=jax.random.wrap_key_data(state.rng))
    megabytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20
    blocked, total = {}, {}
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as root:
        for mode in ("sync", "async"):
            directory = os.path.join(root, mode)
            with Checkpointer(directory, keep=1, async_save=mode == "async") as checkpoints:
                saves = iter(range(1, repeats + 2))

                def save(checkpoints=checkpoints, saves=saves):
                    checkpoints.save(state.replace(step=jnp.int32(next(saves))), loader_step=0)

                save()  # first save compiles and creates directories
                checkpoints.wait()
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    save()
                    returned = time.perf_counter()
                    checkpoints.wait()
                    times.append((returned - started, time.perf_counter() - started))
                blocked[mode] = statistics.median(t[0] for t in times)
                total[mode] = statistics.median(t[1] for t in times)
        with Checkpointer(directory) as checkpoints:
            restores = []
            for _ in range(repeats):
                started = time.perf_counter()
                checkpoints.restore(state)
                restores.append(time.perf_counter() - started)
    lines = [
        f"jdp.bench checkpoint: TrainState of {megabytes:,.0f} MB (params + Adam moments), "
        f"mesh {mesh_spec} ({mesh.devices.size} x {jax.devices()[0].device_kind}), "
        f"median of {repeats}",
        f"  synchronous save: loop blocked {blocked['sync']:.3f} s",
        f"  async save:       loop blocked {blocked['async']:.3f} s "
        f"({blocked['async'] / blocked['sync']:.1%} of synchronous), "
        f"committed after {total['async']:.3f} s",
        f"  restore (latest, onto the mesh): {statistics.median(restores):.3f} s",
    ]
    return lines


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
    optimizer = run.config.make_optimizer(run.config.make_schedule())
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
        sys.executable, "-m", "jdp.launch", "--nproc", str(nproc),
        "--devices-per-process", "1", "--",
        sys.executable, "-m", "jdp.bench", "multihost-worker", "--out", out, "--case", case,
        "--batch-size", str(batch_size), "--seconds", str(seconds),
    ]  # fmt: skip
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
    lines = []

    def emit(line: str) -> None:
        lines.append(line)
        on_line(line)

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


def bench_scaling(config: TrainConfig, *, steps: int, out: str) -> list[str]:
    """Examples/s of one train step and global batch on 1, 2, 4 and 8 devices; writes a PNG."""
    setup_devices("data=8")  # the largest mesh first: devices are set up once per process
    sizes = [size for size in (1, 2, 4, 8) if size <= len(jax.devices())]
    rates = []
    for size in sizes:
        run = build(dataclasses.replace(config, mesh=f"data={size}"), Console(enabled=False))
        batch = first_batch(run, config.batch_size)
        rates.append(_steps_per_sec(run, batch, steps) * config.batch_size)
    device = jax.devices()[0]
    kind = device.device_kind + (" (simulated devices)" if device.platform == "cpu" else "")
    _plot_scaling(sizes, rates, out, f"{config.model}, global batch {config.batch_size}, {kind}")
    lines = [
        f"jdp.bench scaling: {config.model} on {config.dataset}, global batch "
        f"{config.batch_size}, {steps} steps timed per mesh, {kind}",
        f"  {'devices':>7}{'examples/s':>14}{'/ 1 device':>12}",
    ]
    lines += [
        f"  {size:>7}{rate:>14,.0f}{rate / rates[0]:>11.2f}x"
        for size, rate in zip(sizes, rates, strict=True)
    ]
    lines.append(f"  plot: {out}")
    return lines


def _plot_scaling(sizes: list[int], rates: list[float], out: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, rates, marker="o", label=label)
    ax.plot(sizes, [rates[0] * size for size in sizes], "--", color="gray", label="linear scaling")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.minorticks_off()
    ax.set(
        xlabel="devices on the data axis",
        ylabel="examples / s",
        title="Throughput against devices (measured)",
        ylim=(0, max(max(rates), rates[0] * sizes[-1]) * 1.1),
    )
    ax.yaxis.set_major_formatter("{x:,.0f}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


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


def _collectives(lowered: jax.stages.Lowered) -> dict[str, Any]:
    """All-reduce ops and bytes, and all-gathers, in the step as jdp emits it.

    Read from the program before XLA's passes: XLA's CPU backend widens bf16
    all-reduces to f32 when it compiles; GPU and TPU keep them.
    """
    text = lowered.as_text()
    reduces = re.findall(r'"stablehlo\.all_reduce"\(.*?\}\) : \(([^)]*)\) ->', text, re.S)
    nbytes = 0
    for operands in reduces:
        for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", operands):
            count = math.prod(int(d) for d in dims.split("x") if d)
            bits = int(re.search(r"\d+", dtype).group())  # f32, bf16, i1, f8E4M3FN, ui32
            nbytes += count * max(1, bits // 8)
    return {
        "all_reduce_ops": len(reduces),
        "all_reduce_bytes": nbytes,
        "all_gather_ops": len(re.findall(r'"stablehlo\.all_gather"', text)),
    }


def bench_dispatch(
    config: TrainConfig, *, round_seconds: float, rounds: int, calls: Sequence[int]
) -> list[str]:
    """One model in detail: steps per call, host dispatch per step, collective volume."""
    run = build(config, Console(enabled=False))
    mesh, size = run.mesh, config.batch_size
    batch = first_batch(run, size)
    if jax.tree.leaves(run.state.model_state):
        raise UsageError(
            f"bench dispatch compares with a hand-written step without model state, and "
            f"--model {config.model} keeps BatchNorm statistics; use mlp, seq2seq or gpt"
        )
    optimizer = config.make_optimizer(config.make_schedule())
    # name -> (step, steps per call); the batch each takes, by steps per call.
    stepped = {"jdp, jit": (run.train_step, 1)}
    feeds = {1: batch}
    for k in calls:
        if k > 1:
            variant = dataclasses.replace(config, steps_per_call=k, steps=k * config.steps)
            stepped[f"jdp, jit, {k} steps per call"] = (
                build(variant, Console(enabled=False)).train_step,
                k,
            )
            feeds[k] = jax.device_put(
                jax.tree.map(lambda x, k=k: jnp.stack([x] * k), batch),
                batch_sharded(mesh, stacked=True),
            )
    hand = {
        f"hand-written jit step, {name}": hand_loop(
            hand_written_step(run.model, optimizer, mesh, packed=packed), run, batch
        )
        for name, packed in (("per leaf", False), ("raveled", True))
    }
    arms = hand | {
        name: jdp_loop(step, run, feeds[k], optimizer, per_call=k)
        for name, (step, k) in stepped.items()
    }
    rates = interleaved_rates(arms, rounds=rounds, round_seconds=round_seconds, rows=size)
    _, ratios = ratios_to_best(rates, list(hand))

    dispatch = {}
    for name, (step, per_call) in stepped.items():
        raw = step._fn  # the compiled call, without jdp's wait on the previous one
        params = jax.tree.map(jnp.copy, run.state.params)
        state = create_train_state(params, optimizer, mesh, rng=jax.random.key(0))
        times = []
        for _ in range(50):
            started = time.perf_counter()
            state, metrics = raw(state, feeds[per_call])
            times.append(time.perf_counter() - started)
            jax.block_until_ready(metrics)
        dispatch[name] = statistics.median(times) / per_call

    grad_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(run.state.params))
    volume = {}
    for dtype in ("fp32", "bf16"):
        variant = build(dataclasses.replace(config, reduce_dtype=dtype), Console(enabled=False))
        volume[dtype] = _collectives(variant.train_step.lower(variant.state, batch))

    kind = mesh.devices.flat[0].device_kind
    lines = [
        f"jdp.bench dispatch: {config.model} {config.model_size} on {config.dataset}, "
        f"mesh {config.mesh} ({mesh.devices.size} x {kind}), global batch {size}, "
        f"{config.optimizer}, {rounds} interleaved rounds of ~{round_seconds:g} s per arm "
        "(median)",
        f"  {'':<34}{'examples/s':>12}{'/ best hand':>14}{'dispatch ms/step':>18}",
    ]
    for name, values in rates.items():
        shown = f"{dispatch[name] * 1e3:>18.3f}" if name in dispatch else f"{'':>18}"
        rate = statistics.median(values)
        lines.append(f"  {name:<34}{rate:>12,.0f}{ratios[name]:>13.3f}x{shown}")
    for dtype, found in volume.items():
        lines.append(
            f"  collectives, {dtype} all-reduce: {found['all_reduce_ops']} all-reduce op(s), "
            f"{found['all_reduce_bytes']:,} bytes = {found['all_reduce_bytes'] / grad_bytes:.3f}"
            f" x the fp32 gradients ({grad_bytes:,} bytes); all-gathers: {found['all_gather_ops']}"
        )
    return lines


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


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
    saves = commands.add_parser("checkpoint", help="async vs synchronous save, restore time")
    saves.add_argument("--mesh", default="data=8")
    saves.add_argument("--size-mb", type=int, default=128, help="parameter megabytes")
    saves.add_argument("--repeats", type=int, default=3)
    cases = ",".join(CASES)
    multihost = commands.add_parser(
        "multihost", help="each model in 1 process x 1 device vs 2 processes x 1 device"
    )
    worker = commands.add_parser("multihost-worker", help=argparse.SUPPRESS)
    worker.add_argument("--case", required=True, choices=list(CASES))
    worker.add_argument("--out", required=True)
    for command in (multihost, worker):
        command.add_argument("--batch-size", type=int, default=128)
        command.add_argument(
            "--seconds", type=float, default=2.0, help="seconds timed per measurement"
        )
    multihost.add_argument("--cases", default=cases, help=f"comma-separated, from: {cases}")
    steps = commands.add_parser(
        "step", help="jdp's step vs the best hand-written one, over model sizes and meshes"
    )
    steps.add_argument("--cases", default=cases, help=f"comma-separated, from: {cases}")
    steps.add_argument("--meshes", default="data=1,data=2,data=8", help="comma-separated")
    steps.add_argument("--batch-size", type=int, default=128)
    steps.add_argument("--rounds", type=int, default=7)
    steps.add_argument(
        "--round-seconds", type=float, default=0.5, help="time of one arm's round, about"
    )
    dispatch = commands.add_parser(
        "dispatch", help="one model: steps per call, host dispatch per step, collective volume"
    )
    dispatch.add_argument("--mesh", default="data=8")
    dispatch.add_argument("--model", default="mlp", help="one without BatchNorm: mlp, seq2seq, gpt")
    dispatch.add_argument("--model-size", default="small")
    dispatch.add_argument(
        "--dataset", default=None, help="default: digits, or numbers2words for seq2seq and gpt"
    )
    dispatch.add_argument("--batch-size", type=int, default=128)
    dispatch.add_argument("--rounds", type=int, default=9)
    dispatch.add_argument(
        "--round-seconds", type=float, default=1.0, help="time of one arm's round, about"
    )
    dispatch.add_argument(
        "--steps-per-call", default="1,4,8", help="comma-separated values to compare"
    )
    scaling = commands.add_parser("scaling", help="examples/s against 1, 2, 4, 8 devices, PNG")
    scaling.add_argument("--model", default="mlp")
    scaling.add_argument("--dataset", default="digits")
    scaling.add_argument("--data-dir", default=None)
    scaling.add_argument("--batch-size", type=int, default=128)
    scaling.add_argument("--steps", type=int, default=200, help="train steps timed per mesh")
    scaling.add_argument("--out", default="scaling.png", help="PNG to write")
    logs = commands.add_parser("logging", help="step loop with metrics every step vs none")
    logs.add_argument("--mesh", default="data=8")
    logs.add_argument("--model", default="mlp")
    logs.add_argument("--batch-size", type=int, default=128)
    logs.add_argument("--steps", type=int, default=300, help="steps per round and arm")
    logs.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    try:
        if args.command == "step":
            bench_step(
                _names(args.cases),
                _names(args.meshes),
                batch_size=args.batch_size,
                rounds=args.rounds,
                round_seconds=args.round_seconds,
                on_line=lambda line: print(line, flush=True),
            )
            return 0
        if args.command == "dispatch":
            sequences = check_model(args.model).data == "sequence"
            config = TrainConfig(
                mesh=args.mesh,
                model=args.model,
                model_size=args.model_size,
                dataset=args.dataset or ("numbers2words" if sequences else "digits"),
                batch_size=args.batch_size,
            )
            calls = sorted({1, *(int(part) for part in _names(args.steps_per_call))})
            lines = bench_dispatch(
                config, round_seconds=args.round_seconds, rounds=args.rounds, calls=calls
            )
            print("\n".join(lines))
            return 0
        if args.command == "scaling":
            config = TrainConfig(
                model=args.model,
                dataset=args.dataset,
                data_dir=args.data_dir,
                batch_size=args.batch_size,
            )
            print("\n".join(bench_scaling(config, steps=args.steps, out=args.out)))
            return 0
        if args.command == "logging":
            config = TrainConfig(mesh=args.mesh, model=args.model, batch_size=args.batch_size)
            print("\n".join(bench_logging(config, steps=args.steps, rounds=args.rounds)))
            return 0
        if args.command == "multihost-worker":
            multihost_worker(
                args.case, batch_size=args.batch_size, seconds=args.seconds, out=args.out
            )
            return 0
        if args.command == "multihost":
            bench_multihost(
                _names(args.cases),
                batch_size=args.batch_size,
                seconds=args.seconds,
                on_line=lambda line: print(line, flush=True),
            )
            return 0
        if args.command == "checkpoint":
            print(
                "\n".join(bench_checkpoint(args.mesh, size_mb=args.size_mb, repeats=args.repeats))
            )
            return 0
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
