"""The parts of ``python -m jdp.bench gpu`` that measure the host and small models: the
JPEG loader on the machine's cores, the small-model sweep with its host overhead, and 20
steps on the accelerator against the same on its CPU."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.bench import peers
from jdp.bench.arms import interleaved_rates, jdp_loop, ratios_to, step_overhead, with_options
from jdp.bench.levers import LEVERS

# A part's ``sizes`` is a `jdp.bench.gpu.Sizes`, its ``report`` the run's `jdp.bench.gpu.Report`.
Sizes = Report = Any

SWEEP_CASES = ("mlp-38k", "mlp-0.7m", "mlp-10m", "gpt-small")
CORRECTNESS_STEPS = 20


# --- 4. the JPEG loader ----------------------------------------------------------------


def part_loader(sizes: Sizes, device_rate: float | None) -> dict[str, Any]:
    import pathlib

    from jdp.bench.common import worker_window
    from jdp.bench.images import decode_rates, loader_rate, write_tree
    from jdp.data.formats import from_images

    workers = max(1, min(8, (os.cpu_count() or 2) - 1))
    root = tempfile.mkdtemp(prefix="jdp-gpu-jpegs-")
    platforms = os.environ.get("JAX_PLATFORMS")
    # Grain's worker processes start JAX of their own: on the CPU, so that none of them
    # reaches for the accelerator this process holds.
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        size = write_tree(root, {"train": sizes.jpegs}, classes=10)
        train = os.path.join(root, "train")
        blobs = [pathlib.Path(d, n).read_bytes() for d, _, ns in sorted(os.walk(train)) for n in ns]
        decoders = decode_rates(blobs, rounds=2)
        split = from_images(train)
        batches = max(2, sizes.jpegs // sizes.jpeg_rows)
        one = loader_rate(split, batch_size=sizes.jpeg_rows, workers=0, batches=batches)
        many = loader_rate(split, batch_size=sizes.jpeg_rows, workers=workers, batches=batches)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if platforms is None:
            os.environ.pop("JAX_PLATFORMS")
        else:
            os.environ["JAX_PLATFORMS"] = platforms
    warm, timed = worker_window(workers, batches)
    result = {
        "jpegs": len(blobs),
        "mean_kb": size / len(blobs) / 1e3,
        "decoders": decoders,
        "per_core": one,
        "workers": workers,
        "with_workers": many,
        "warm_batches": warm,
        "timed_batches": timed,
        "cores": os.cpu_count(),
    }
    if device_rate:
        result["device_rate"] = device_rate
        result["cores_per_device"] = device_rate / one
    return result


# --- 5. the small-model sweep ------------------------------------------------------------


def peer_spec(case, run, batch, smoke: bool) -> dict[str, Any]:
    """What the PyTorch MLPs train for a sweep case: its layers, rows and Adam's rate."""
    from jdp.models.registry import MODELS

    return {
        "rows": int(batch["image"].shape[0]),
        "inputs": int(np.prod(batch["image"].shape[1:])),
        "hidden": list(case.hidden or MODELS[case.model].sizes[case.model_size]["hidden"]),
        "classes": run.train.num_classes,
        "lr": run.config.lr,
        "smoke": smoke,
    }


def part_sweep(
    sizes: Sizes, report: Report, end: float, on_line: Callable[[str], None]
) -> dict[str, Any]:
    from jdp.bench.arms import hand_loop, hand_written_step
    from jdp.bench.step import CASES, _params, case_run, first_batch
    from jdp.data.loader import on_host, places_ahead, train_batches
    from jdp.mesh import batch_sharded

    rows, results, skipped = sizes.sweep_rows, [], []
    for name in sizes.sweep_cases:
        if results and report.elapsed() > end:
            skipped.append(name)
            continue
        run = case_run(CASES[name], "data=1", rows)
        stacked = case_run(CASES[name], "data=1", rows, steps_per_call=4)
        batch = first_batch(run, rows)
        four = jax.device_put(
            jax.tree.map(lambda x: jnp.stack([x] * 4), batch), batch_sharded(run.mesh, stacked=True)
        )
        hand = hand_written_step(run.model, run.optimizer, run.mesh, kind="one-device")
        arms = {
            "hand-written": hand_loop(hand, run, batch),
            "jdp": jdp_loop(run.train_step, run, batch, run.optimizer),
            "jdp, 4 steps per call": jdp_loop(
                stacked.train_step, run, four, run.optimizer, per_call=4
            ),
        }
        if "sweep" in sizes.levers:
            arms |= lever_arms(run, stacked, batch, four)
        with contextlib.ExitStack() as stack:  # each step's batch as a run's loader gives it
            for arm, split in (
                ("fed from the host", on_host(run.train)),
                ("fed on the device", run.train),
            ):
                loader = train_batches(
                    split, run.mesh, batch_size=rows, seed=0, place=places_ahead(run.mesh)
                )
                loader = stack.enter_context(loader)
                arms[arm] = jdp_loop(run.train_step, run, loader, run.optimizer)
            # The same MLP in PyTorch (the gpt case has no PyTorch arm of its own).
            racing = [
                a for a in sizes.peers if a in peers.ARMS["sweep"] and CASES[name].model == "mlp"
            ]
            spec = peer_spec(CASES[name], run, batch, sizes.smoke) if racing else {}
            racers = peers.racing(racing, lambda arm, spec=spec: spec)
            built, failed = stack.enter_context(racers)
            rates = interleaved_rates(
                arms | built,
                rounds=sizes.sweep_rounds,
                round_seconds=sizes.round_seconds,
                rows=rows,
            )
            raced = peers.results(built, failed, rates)
        ratios = ratios_to(rates, "hand-written")
        results.append(
            {
                "case": name,
                "params": _params(run),
                "rows": rows,
                "rates": {arm: statistics.median(r) for arm, r in rates.items()},
                "ratios": ratios,
                "overhead": _overheads(run, hand, batch),
            }
        )
        if racing:
            results[-1]["peers"] = raced
        if "sweep" in sizes.levers:
            results[-1]["levers"] = {lever.name: lever.source for lever in LEVERS["sweep"]}
        for line in _sweep_lines(results[-1], "sweep" in sizes.levers):
            on_line(line)
        del run, stacked, arms
        gc.collect()
    return {"cases": results, "skipped_for_budget": skipped}


def _sweep_lines(result: dict[str, Any], levers: bool) -> list[str]:
    """What the sweep says of one cell as it ends: its rate and each arm's ratio."""
    ratios = result["ratios"]
    lines = [
        f"  sweep {result['case']} ({result['params']}): hand-written "
        f"{result['rates']['hand-written']:,.0f} examples/s; jdp "
        f"{ratios['jdp']:.3f}x, 4 steps per call {ratios['jdp, 4 steps per call']:.3f}x, "
        f"fed from the host {ratios['fed from the host']:.3f}x, fed on the device "
        f"{ratios['fed on the device']:.3f}x"
    ]
    if levers:
        each = (f"{lever.name} {ratios[f'jdp, {lever.name}']:.3f}x" for lever in LEVERS["sweep"])
        lines.append("    levers: " + ", ".join(each))
    return lines


def _overheads(run, hand, batch) -> dict[str, Any]:
    """Each step's host time a call (`step_overhead`): the hand-written step, with jdp's
    scalar arrays too, and jdp's."""
    from jdp.bench.arms import hand_written_with_scalars, jdp_scalars

    opt_state = run.optimizer.init(run.state.params)
    scalars = hand_written_with_scalars(run.model, run.optimizer)
    return {
        "hand-written": step_overhead(hand, (run.state.params, opt_state), batch),
        # A newer arm than the run's figures: if it fails, its error stands, not the case's.
        "hand-written, jdp's scalars": or_error(
            step_overhead, scalars, (run.state.params, opt_state, jdp_scalars()), batch
        ),
        "jdp": step_overhead(run.train_step.unbounded, run.state, batch, run.train_step.lower),
    }


def lever_arms(run, stacked, batch, four) -> dict[str, Callable[[int], None]]:
    """jdp's step compiled under each of the sweep's levers (`jdp.bench.levers`), one step
    a call (``run``'s step, ``batch``) or four (``stacked``'s, ``four``)."""
    from jdp.step.contract import bounded, train_loss

    arms = {}
    for lever in LEVERS["sweep"]:
        step, fed = (stacked, four) if lever.steps_per_call > 1 else (run, batch)
        program = bounded(with_options(step.train_step.lower, lever.options), train_loss)
        arms[f"jdp, {lever.name}"] = jdp_loop(
            program, run, fed, run.optimizer, per_call=lever.steps_per_call
        )
    return arms


def or_error(measure: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``measure(*args)``, or ``{"error": ...}`` if it raises."""
    try:
        return measure(*args)
    except Exception as error:  # whatever the device's runtime raises
        return {"error": f"{type(error).__name__}: {error}"[:300]}


# --- 6. correctness: the accelerator against its CPU --------------------------------------


# Seconds the correctness part waits for its CPU reference, after its own run.
REFERENCE_TIMEOUT = 600


def correctness_losses(steps: int, nudges: tuple[bool, ...] = (False,)) -> list[list[float]]:
    """For each of ``nudges``, the losses of ``steps`` steps of ``gpt`` small (fp32, XLA
    attention, exact fp32 matrix products) on this process's default platform; nudged,
    every initial parameter first moved to the next fp32 number above it (one unit in
    the last place: a rounding's difference). One step program serves all."""
    from jdp.data.loader import train_batches
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.run import build

    config = TrainConfig(
        mesh="data=1",
        model="gpt",
        model_size="small",
        dataset="numbers2words",
        batch_size=16,
        precision="fp32",
        attention="xla",
        steps=steps,
        warmup_steps=2,
        lr=1e-3,
    )
    runs = []
    with jax.default_matmul_precision("highest"):
        run = build(config, Console(enabled=False))
        with train_batches(run.train, run.mesh, batch_size=config.batch_size, seed=0) as loader:
            batches = [batch for _, batch in zip(range(steps), loader, strict=False)]
        for nudge in nudges:
            state, losses = jax.tree.map(jnp.copy, run.state), []
            if nudge:  # not a product by 1 + 2^-24: in fp32 that factor rounds to 1
                moved = jax.tree.map(lambda leaf: jnp.nextafter(leaf, jnp.inf), state.params)
                state = state.replace(params=moved)
            for batch in batches:
                state, metrics = run.train_step(state, batch)
                losses.append(float(metrics["loss"]))
            runs.append(losses)
    return runs


def start_cpu_reference(steps: int) -> subprocess.Popen:
    """``python -m jdp.bench gpu --cpu-reference STEPS`` started on the CPU platform,
    with this process's compiler setting; `part_correctness` reads what it prints."""
    command = [sys.executable, "-m", "jdp.bench", "gpu", "--cpu-reference", str(steps)]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    if jax.config.read("jax_disable_most_optimizations"):  # the smoke run's programs there
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    pipe = subprocess.PIPE
    return subprocess.Popen(command, stdout=pipe, stderr=pipe, text=True, env=env)


def part_correctness(steps: int, reference: subprocess.Popen) -> dict[str, Any]:
    """This platform's losses against the CPU ``reference`` process's
    (`start_cpu_reference`), with the tolerance derived there.

    Both runs compute in fp32 with exact products (no TF32), so they differ only in
    the order of their sums: differences of a few fp32 roundings that training then
    grows. The CPU process measures that growth: its own run against the same run
    with every parameter moved by one unit in its last place. The
    tolerance at each step is 100 times that difference (many roundings differ
    between two platforms, not one; a wrong gradient differs by orders more),
    and never below 64 roundings of the loss.
    """
    (accelerator,) = correctness_losses(steps)
    try:
        stdout, stderr = reference.communicate(timeout=REFERENCE_TIMEOUT)
    except subprocess.TimeoutExpired:
        reference.kill()
        reference.communicate()
        raise RuntimeError(f"the CPU reference took over {REFERENCE_TIMEOUT} s") from None
    if reference.returncode != 0:
        raise RuntimeError(f"the CPU reference failed: {stderr.strip()[-400:]}")
    cpu, nudged = json.loads(stdout.strip().splitlines()[-1])
    eps = float(np.finfo(np.float32).eps)
    tolerance = [max(100 * abs(a - b), 64 * eps * abs(a)) for a, b in zip(cpu, nudged, strict=True)]
    differences = [abs(a - b) for a, b in zip(accelerator, cpu, strict=True)]
    within = all(d <= t for d, t in zip(differences, tolerance, strict=True))
    return {
        "steps": steps,
        "accelerator": accelerator,
        "cpu": cpu,
        "cpu_nudged": nudged,
        "tolerance": tolerance,
        "differences": differences,
        "within": within,
        "worst": max(d / t for d, t in zip(differences, tolerance, strict=True)),
    }
