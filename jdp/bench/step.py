"""``python -m jdp.bench step``: jdp's train step against the best hand-written one.

The sweep runs several model sizes on several meshes, because what a step adds
(or saves) depends on both: a trick that helps a 38k-parameter model can make a
10M-parameter one several times slower. For each case the hand-written arm is
the faster of two plain ``jit`` data-parallel steps, one all-reducing each
gradient leaf and one all-reducing the gradients raveled into one vector, so
jdp is held to the best a careful engineer writes, not to a weak baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec

from jdp.bench.common import names, report_lines
from jdp.data.pipeline import train_batches
from jdp.errors import UsageError
from jdp.mesh import DATA_AXIS, parse_mesh_spec
from jdp.models import MLP, Model, classification, from_linen
from jdp.report.console import Console
from jdp.state import create_train_state
from jdp.training.config import TrainConfig
from jdp.training.run import Run, Yours, build, setup_devices


@dataclasses.dataclass(frozen=True)
class Case:
    """A model of the sweep: a built-in one, or an MLP of the given hidden widths."""

    model: str
    dataset: str
    model_size: str = "small"
    hidden: tuple[int, ...] | None = None

    def model_for(self, run_split) -> Model | None:
        if self.hidden is None:
            return None  # the built-in config.model
        return from_linen(MLP(run_split.num_classes, self.hidden), classification())


# On the 64-pixel digits: 64*512 + 512*10 = 38k parameters; 64*768 + 768^2 + 768*10
# = 0.65M; 64*2304 + 2*2304^2 + 2304*10 = 10.8M. gpt small is 0.83M on numbers2words.
CASES: dict[str, Case] = {
    "mlp-38k": Case("mlp", "digits"),
    "mlp-0.7m": Case("mlp", "digits", hidden=(768, 768)),
    "mlp-10m": Case("mlp", "digits", hidden=(2304, 2304, 2304)),
    "gpt-small": Case("gpt", "numbers2words"),
}


def check_cases(cases: Sequence[str]) -> None:
    """UsageError naming the first unknown case and the known ones."""
    unknown = [name for name in cases if name not in CASES]
    if unknown:
        raise UsageError(f"unknown case {unknown[0]!r}; choose from: {', '.join(CASES)}")


def case_run(case: Case, mesh: str, batch_size: int, **overrides: Any) -> Run:
    """The run of one case on one mesh (devices must already be set up)."""
    config = TrainConfig(
        mesh=mesh, model=case.model, model_size=case.model_size, dataset=case.dataset,
        batch_size=batch_size, **overrides,
    )  # fmt: skip
    if case.hidden is None:
        return build(config, Console(enabled=False))
    from jdp.data.sources import load_split

    model = case.model_for(load_split(case.dataset, "train", config.data_dir))
    return build(config, Console(enabled=False), Yours(model=model))


def first_batch(run: Run, batch_size: int):
    """The global batch of step 0 (seed 0), placed on the run's mesh."""
    with train_batches(run.train, run.mesh, batch_size=batch_size, seed=0) as loader:
        return next(loader)


# The hand-written steps: each gradient leaf all-reduced, the gradients raveled into
# one vector and all-reduced, and (on one device) plain ``jit`` with no collective.
HAND_WRITTEN = ("per-leaf", "raveled", "one-device")


def hand_kinds(mesh) -> tuple[str, ...]:
    """The hand-written steps that apply on ``mesh``: one-device only on one device."""
    return HAND_WRITTEN if mesh.devices.size == 1 else HAND_WRITTEN[:2]


def hand_written_step(model: Model, optimizer: optax.GradientTransformation, mesh, *, kind: str):
    """The data-parallel step a careful engineer writes with plain JAX and Optax.

    ``jit`` over ``shard_map``: each replica's gradient of the model's loss (and
    its metrics, as jdp's step gets them from the same function) on its rows,
    ``pmean`` of the gradients, loss and metrics over ``data`` (``kind``
    "per-leaf": each leaf; "raveled": the gradients raveled into one vector),
    the Optax update; donated state. "one-device": ``jit`` of the gradient and
    the update alone, what one writes for one device (on XLA:CPU faster than a
    ``pmean`` over one device). It returns the averaged loss and metrics, as a
    training loop that reports them must (metrics it did not return, XLA would
    not compute). What it leaves out, jdp's step adds: the learning rate, the
    step count and a key per step and replica (and the gradient norm, with
    ``grad_norm``).
    """

    def update(params, opt_state, batch, average, vary=lambda params: params):
        def loss_fn(params):
            loss, metrics, _ = model.loss_fn(params, {}, batch, jax.random.key(0))
            return loss, metrics

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(vary(params))
        grads, loss, metrics = average(grads, loss, metrics)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    if kind == "one-device":
        return jax.jit(
            lambda params, opt_state, batch: update(params, opt_state, batch, lambda *t: t),
            donate_argnums=(0, 1),
        )

    def average(grads, loss, metrics):
        if kind == "raveled":
            vector, unravel = ravel_pytree(grads)
            vector, loss, metrics = lax.pmean((vector, loss, metrics), DATA_AXIS)
            return unravel(vector), loss, metrics
        return lax.pmean((grads, loss, metrics), DATA_AXIS)

    def replica(params, opt_state, batch):
        # Marked varying so the gradient stays this replica's until the pmean.
        vary = lambda params: lax.pcast(params, DATA_AXIS, to="varying")  # noqa: E731
        return update(params, opt_state, batch, average, vary)

    mapped = jax.shard_map(
        replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(DATA_AXIS)),
        out_specs=PartitionSpec(),
    )
    return jax.jit(mapped, donate_argnums=(0, 1))


def hand_loop(step, run: Run, batch) -> Callable[[int], None]:
    """``count -> None``: runs a hand-written step ``count`` times, going on from the last call."""
    carry = list(jax.tree.map(jnp.copy, (run.state.params, run.state.opt_state)))

    def loop(count: int) -> None:
        params, opt_state = carry
        previous = metrics = None
        for _ in range(count):
            params, opt_state, metrics = step(params, opt_state, batch)
            if previous is not None:  # at most two steps in flight: the CPU rendezvous hazard
                jax.block_until_ready(previous)
            previous = metrics
        jax.block_until_ready(metrics)
        carry[:] = params, opt_state

    return loop


def jdp_loop(step, run: Run, batch, optimizer, *, per_call: int = 1) -> Callable[[int], None]:
    """``count -> None``: runs jdp's step for ``count`` optimizer steps, going on from the last."""
    params = jax.tree.map(jnp.copy, run.state.params)
    carry = [create_train_state(params, optimizer, run.mesh, rng=jax.random.key(0))]

    def loop(count: int) -> None:
        state, metrics = carry[0], None
        for _ in range(count // per_call):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        carry[0] = state

    return loop


# By default arms run whole multiples of this many steps: any steps per call up to
# 8 divides it.
STEP_MULTIPLE = 8


def interleaved_rates(
    arms: dict[str, Callable[[int], None]],
    *,
    rounds: int,
    round_seconds: float,
    rows: int,
    multiple: int = STEP_MULTIPLE,
) -> dict[str, list[float]]:
    """Examples/s of each arm in each of ``rounds`` rounds, the arms' order alternating.

    Every arm runs the same number of steps a round (a multiple of ``multiple``),
    about ``round_seconds`` of the slowest arm (timed on a warm call), so small and
    large models get comparable statistics.
    """
    slowest = 0.0
    for arm in arms.values():
        arm(multiple)  # compile and settle
        started = time.perf_counter()
        arm(multiple)
        slowest = max(slowest, (time.perf_counter() - started) / multiple)
    calls = max(1, min(400 // multiple, round(round_seconds / slowest / multiple)))
    steps = calls * multiple
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(rounds):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for name in order:
            started = time.perf_counter()
            arms[name](steps)
            rates[name].append(steps * rows / (time.perf_counter() - started))
    return rates


def ratios_to_best(rates: dict[str, list[float]], baselines: Sequence[str]) -> tuple[str, dict]:
    """The fastest baseline (by median) and each arm's median per-round ratio to it.

    Ratios are taken within a round, between arms run next to each other, so the
    machine's drift between rounds cancels.
    """
    best = max(baselines, key=lambda name: statistics.median(rates[name]))
    return best, ratios_to(rates, best)


def ratios_to(rates: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Each arm's median per-round ratio to ``baseline``."""
    return {
        name: statistics.median(a / b for a, b in zip(values, rates[baseline], strict=True))
        for name, values in rates.items()
    }


# Rounds that only choose the faster hand-written step. Choosing the larger of two
# medians from the rounds that also give the ratios would bias the baseline up (the
# larger of two noisy estimates of nearly equal rates is high by part of the noise),
# so the ratios come from rounds run after the choice.
PILOT_ROUNDS = 6


def _params(run: Run) -> str:
    count = sum(np.size(leaf) for leaf in jax.tree.leaves(run.state.params))
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.0f}k"


def bench_step(
    cases: Sequence[str],
    meshes: Sequence[str],
    *,
    batch_size: int,
    rounds: int,
    round_seconds: float,
    grad_norm: bool = False,
    on_line: Callable[[str], None] = print,
) -> list[str]:
    """The sweep: for each case and mesh, the best hand-written step's examples/s and
    jdp's ``jit`` and ``pmap`` steps as ratios of it. Prints rows as they come.
    ``grad_norm``: jdp's steps also report the gradient norm (``--grad-norm``), which
    no hand-written step computes: what that option costs.

    Each cell runs in a process of its own (`measure_cell`), started as
    ``python -m jdp.train --mesh MESH`` starts: with the devices its mesh asks for
    (one on ``data=1``), so a cell measures the process a run on that mesh has,
    and no cell inherits another's heap. The process matters: with 8 simulated
    CPU devices, the per-leaf step on a one-device mesh (its ``pmean`` over one
    device) ran 2-4% faster than plain ``jit`` on the 38k MLP and 18-20% slower on
    the 10.8M one; in a process of one device, as ``--mesh data=1`` runs, it ran
    4-5% and 24% slower.
    """
    check_cases(cases)
    for mesh in meshes:
        parse_mesh_spec(mesh)
    lines, emit = report_lines(on_line)
    for index, (name, mesh) in enumerate(itertools.product(cases, meshes)):
        kind, row = _cell_in_own_process(
            name, mesh, batch_size=batch_size, rounds=rounds, round_seconds=round_seconds,
            grad_norm=grad_norm,
        )  # fmt: skip
        if index == 0:
            emit(
                f"jdp.bench step: global batch {batch_size}, adam, {rounds} interleaved rounds "
                f"of ~{round_seconds:g} s per arm after {PILOT_ROUNDS} that choose the "
                "hand-written step; median examples/s, median per-round ratios; each cell in "
                f"a process with its mesh's devices; {kind}"
                + ("; jdp with --grad-norm" if grad_norm else "")
            )
            emit(
                f"  {'model':<10}{'params':>8}  {'mesh':<8}{'hand-written ex/s':>19}  "
                f"{'best of':<11}{'itself':>10}{'jdp jit':>9}{'jdp pmap':>10}"
            )
        emit(row)
    return lines


# Seconds one cell may take; the slowest default cell (the 10.8M MLP on data=8) takes
# about a minute on the 2-core development machine.
CELL_TIMEOUT = 1800


def _cell_in_own_process(name: str, mesh: str, *, batch_size: int, rounds: int,
                         round_seconds: float, grad_norm: bool) -> tuple[str, str]:  # fmt: skip
    """``(device kind, row)`` of one cell, measured by ``python -m jdp.bench step --cell``."""
    command = [
        sys.executable, "-m", "jdp.bench", "step", "--cell", "--cases", name, "--meshes", mesh,
        "--batch-size", str(batch_size), "--rounds", str(rounds),
        "--round-seconds", str(round_seconds), *(["--grad-norm"] if grad_norm else []),
    ]  # fmt: skip
    try:  # a cell takes seconds to about a minute; a hung one must not hang the sweep
        result = subprocess.run(command, capture_output=True, text=True, timeout=CELL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise UsageError(
            f"the {name} cell on --mesh {mesh} took over {CELL_TIMEOUT} s and was stopped"
        ) from None
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if line.strip()] or [
            f"exit code {result.returncode}"
        ]
        reason = said[-1].removeprefix("jdp.bench: error: ")
        raise UsageError(f"the {name} cell on --mesh {mesh} failed: {reason}")
    cell = json.loads(result.stdout.strip().splitlines()[-1])
    return cell["kind"], cell["row"]


def measure_cell(name: str, mesh: str, *, batch_size: int, rounds: int, round_seconds: float,
                 grad_norm: bool = False) -> tuple[str, str]:  # fmt: skip
    """``(device kind, row)``: one case on one mesh, in this process, which must not have
    started JAX (its devices are set up for ``mesh``).

    The fastest hand-written step is chosen in `PILOT_ROUNDS` rounds of its own;
    ``rounds`` more rounds interleave it with jdp's two steps and with a second,
    separately compiled copy of itself. That copy's ratio ("itself") is what two
    identical programs read apart in that cell: the measurement's own noise.
    Many short rounds, each of whole steps, keep it small: the machine's load
    changes over seconds, and arms run next to each other share it.
    """
    setup_devices(mesh)
    case = CASES[name]
    run = case_run(case, mesh, batch_size, grad_norm=grad_norm)
    pmap = case_run(case, mesh, batch_size, backend="pmap", grad_norm=grad_norm)
    batch = first_batch(run, batch_size)
    optimizer = run.optimizer
    hand = {
        kind: hand_loop(hand_written_step(run.model, optimizer, run.mesh, kind=kind), run, batch)
        for kind in hand_kinds(run.mesh)
    }
    pilot = interleaved_rates(
        hand, rounds=PILOT_ROUNDS, round_seconds=round_seconds, rows=batch_size, multiple=1
    )
    best = max(hand, key=lambda name: statistics.median(pilot[name]))
    again = hand_written_step(run.model, optimizer, run.mesh, kind=best)
    arms = {
        best: hand[best],
        "again": hand_loop(again, run, batch),
        "jit": jdp_loop(run.train_step, run, batch, optimizer),
        "pmap": jdp_loop(pmap.train_step, pmap, batch, optimizer),
    }
    rates = interleaved_rates(
        arms, rounds=rounds, round_seconds=round_seconds, rows=batch_size, multiple=1
    )
    ratios = ratios_to(rates, best)
    row = (
        f"  {name:<10}{_params(run):>8}  {mesh:<8}"
        f"{statistics.median(rates[best]):>19,.0f}  {best:<11}{ratios['again']:>9.3f}x"
        f"{ratios['jit']:>8.3f}x{ratios['pmap']:>9.3f}x"
    )
    return jax.devices()[0].device_kind, row


def add_arguments(parser) -> None:
    cases = ",".join(CASES)
    parser.add_argument("--cases", default=cases, help=f"comma-separated, from: {cases}")
    parser.add_argument("--meshes", default="data=1,data=2,data=8", help="comma-separated")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--round-seconds", type=float, default=0.1, help="time of one arm's round, about"
    )
    parser.add_argument(
        "--grad-norm", action="store_true", help="jdp's steps also report the gradient norm"
    )
    # One cell in this process, printed as JSON: what the sweep starts for each cell.
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)


def run(args) -> None:
    if args.cell:
        (name,), (mesh,) = names(args.cases), names(args.meshes)
        kind, row = measure_cell(
            name, mesh, batch_size=args.batch_size, rounds=args.rounds,
            round_seconds=args.round_seconds, grad_norm=args.grad_norm,
        )  # fmt: skip
        print(json.dumps({"kind": kind, "row": row, "devices": jax.device_count()}))
        return
    bench_step(
        names(args.cases),
        names(args.meshes),
        batch_size=args.batch_size,
        rounds=args.rounds,
        round_seconds=args.round_seconds,
        grad_norm=args.grad_norm,
        on_line=lambda line: print(line, flush=True),
    )
