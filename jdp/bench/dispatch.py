"""``python -m jdp.bench dispatch``: one model in detail: several steps per call, host
dispatch time per step, and the collectives of the step as jdp emits it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jdp.bench.arms import (
    hand_kinds,
    hand_loop,
    hand_written_step,
    interleaved_rates,
    jdp_loop,
    ratios_to_best,
)
from jdp.bench.common import add_run_flags, config_from, counts
from jdp.bench.step import first_batch
from jdp.errors import UsageError
from jdp.mesh import batch_sharded
from jdp.models.registry import check_model
from jdp.report.console import Console
from jdp.state import create_train_state
from jdp.training.config import TrainConfig
from jdp.training.run import build


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


def _dispatch_seconds(step, run, batch) -> float:
    """Median seconds the host spends in one call of ``step`` (not waiting for it)."""
    raw = step.unbounded  # the compiled call, without jdp's wait on the previous one
    params = jax.tree.map(jnp.copy, run.state.params)
    state = create_train_state(params, run.optimizer, run.mesh, rng=jax.random.key(0))
    times = []
    for _ in range(50):
        started = time.perf_counter()
        state, metrics = raw(state, batch)
        times.append(time.perf_counter() - started)
        jax.block_until_ready(metrics)
    return statistics.median(times)


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
    optimizer = run.optimizer
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
        f"hand-written jit step, {kind.replace('-', ' ')}": hand_loop(
            hand_written_step(run.model, optimizer, mesh, kind=kind), run, batch
        )
        for kind in hand_kinds(mesh)
    }
    arms = hand | {
        name: jdp_loop(step, run, feeds[k], optimizer, per_call=k)
        for name, (step, k) in stepped.items()
    }
    rates = interleaved_rates(arms, rounds=rounds, round_seconds=round_seconds, rows=size)
    _, ratios = ratios_to_best(rates, list(hand))

    dispatch = {
        name: _dispatch_seconds(step, run, feeds[per_call]) / per_call
        for name, (step, per_call) in stepped.items()
    }

    volume = {}
    for dtype in ("fp32", "bf16"):
        variant = build(dataclasses.replace(config, reduce_dtype=dtype), Console(enabled=False))
        volume[dtype] = _collectives(variant.train_step.lower(variant.state, batch))
    return _report(config, run, rounds, round_seconds, rates, ratios, dispatch, volume)


def _report(config, run, rounds, round_seconds, rates, ratios, dispatch, volume) -> list[str]:
    mesh, size = run.mesh, config.batch_size
    grad_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(run.state.params))

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, mesh="data=8", model_size=True, dataset=True, dataset_default=None)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--round-seconds", type=float, default=1.0, help="time of one arm's round, about"
    )
    parser.add_argument(
        "--steps-per-call", default="1,4,8", help="comma-separated values to compare"
    )


def run(args: argparse.Namespace) -> None:
    sequences = "sequence" in check_model(args.model).data
    dataset = args.dataset or ("numbers2words" if sequences else "digits")
    config = config_from(args, dataset=dataset)
    calls = sorted({1, *counts(args.steps_per_call, "--steps-per-call")})
    lines = bench_dispatch(
        config, round_seconds=args.round_seconds, rounds=args.rounds, calls=calls
    )
    print("\n".join(lines))
