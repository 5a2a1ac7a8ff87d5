"""``python -m jdp.bench step``: jdp's train step against the best hand-written one.

The sweep runs several model sizes on several meshes, because what a step adds
(or saves) depends on both: a trick that helps a 38k-parameter model can make a
10M-parameter one several times slower. For each case the hand-written arm is
the faster of two plain ``jit`` data-parallel steps, one all-reducing each
gradient leaf and one all-reducing the gradients raveled into one vector, so
jdp is held to the best a careful engineer writes, not to a weak baseline.
Two more arms give jdp's ``jit`` step each step's batch as a run's loader makes it:
"fed host", read and placed by the host loader, and "on device", gathered on the
devices from the split placed there (`jdp.data.loader.on_device`; "-" where it stays on the
host): what the input costs the step. A last arm, "ahead", cycles through `AHEAD`
batches the device loader made before the rounds: a fresh batch each step, and no
input work while timed. The arms themselves (the hand-written steps,
the loops that run them and jdp's, the interleaved rounds) are in `jdp.bench.arms`;
here, the sweep's cases and cells.
"""

from __future__ import annotations

import argparse
import contextlib
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

from jdp.bench.arms import HAND_WRITTEN as HAND_WRITTEN
from jdp.bench.arms import STEP_MULTIPLE as STEP_MULTIPLE
from jdp.bench.arms import hand_kinds as hand_kinds
from jdp.bench.arms import hand_loop as hand_loop
from jdp.bench.arms import hand_written_step as hand_written_step
from jdp.bench.arms import interleaved_rates as interleaved_rates
from jdp.bench.arms import jdp_loop as jdp_loop
from jdp.bench.arms import ratios_to as ratios_to
from jdp.bench.arms import ratios_to_best as ratios_to_best
from jdp.bench.common import names, report_lines
from jdp.data.loader import on_host, places_ahead, train_batches
from jdp.errors import UsageError
from jdp.mesh import parse_mesh_spec
from jdp.models import MLP, Model, classification, from_linen
from jdp.report.console import Console
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
        mesh=mesh,
        model=case.model,
        model_size=case.model_size,
        dataset=case.dataset,
        batch_size=batch_size,
        **overrides,
    )
    if case.hidden is None:
        return build(config, Console(enabled=False))
    from jdp.data.splits import load_split

    model = case.model_for(load_split(case.dataset, "train", config.data_dir))
    return build(config, Console(enabled=False), Yours(model=model))


def first_batch(run: Run, batch_size: int):
    """The global batch of step 0 (seed 0), placed on the run's mesh."""
    with train_batches(run.train, run.mesh, batch_size=batch_size, seed=0) as loader:
        return next(loader)


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
            name,
            mesh,
            batch_size=batch_size,
            rounds=rounds,
            round_seconds=round_seconds,
            grad_norm=grad_norm,
        )
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
                f"{'fed host':>10}{'on device':>10}{'ahead':>8}  host us jdp/hand  ratio  itself"
            )
        emit(row)
    return lines


# Batches made before the rounds for the "ahead" arm: a step never sees one it ran just
# before, as in a run, and they take little memory on any case of the sweep.
AHEAD = 16


# Seconds one cell may take; the slowest default cell (the 10.8M MLP on data=8) takes
# about a minute on the 2-core development machine.
CELL_TIMEOUT = 1800


def _cell_in_own_process(
    name: str, mesh: str, *, batch_size: int, rounds: int, round_seconds: float, grad_norm: bool
) -> tuple[str, str]:
    """``(device kind, row)`` of one cell, measured by ``python -m jdp.bench step --cell``."""
    command = [
        sys.executable,
        *"-m jdp.bench step --cell --cases".split(),
        name,
        "--meshes",
        mesh,
        "--batch-size",
        str(batch_size),
        "--rounds",
        str(rounds),
        "--round-seconds",
        str(round_seconds),
        *(["--grad-norm"] if grad_norm else []),
    ]
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


def measure_cell(
    name: str,
    mesh: str,
    *,
    batch_size: int,
    rounds: int,
    round_seconds: float,
    grad_norm: bool = False,
) -> tuple[str, str]:
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
    host = on_host(run.train)
    with train_batches(
        run.train, run.mesh, batch_size=batch_size, seed=0, place=places_ahead(run.mesh)
    ) as loader:
        made = [next(loader) for _ in range(AHEAD)]
    with contextlib.ExitStack() as stack:
        fed = {  # the jit step given each step's batch as a run's loader makes it
            arm: jdp_loop(
                run.train_step,
                run,
                stack.enter_context(
                    train_batches(
                        split, run.mesh, batch_size=batch_size, seed=0, place=places_ahead(run.mesh)
                    )
                ),
                optimizer,
            )
            for arm, split in (("device", run.train), ("host", host))
        }
        arms = {
            best: hand[best],
            "again": hand_loop(again, run, batch),
            "jit": jdp_loop(run.train_step, run, batch, optimizer),
            "pmap": jdp_loop(pmap.train_step, pmap, batch, optimizer),
            **fed,
            "ahead": jdp_loop(run.train_step, run, itertools.cycle(made), optimizer),
        }
        rates = interleaved_rates(
            arms, rounds=rounds, round_seconds=round_seconds, rows=batch_size, multiple=1
        )
    ratios = ratios_to(rates, best)
    hosts = host_us(run, best, batch, rounds=min(HOST_ROUNDS, rounds))
    on = "device" if run.train is not host else "-"
    row = (
        f"  {name:<10}{_params(run):>8}  {mesh:<8}"
        f"{statistics.median(rates[best]):>19,.0f}  {best:<11}{ratios['again']:>9.3f}x"
        f"{ratios['jit']:>8.3f}x{ratios['pmap']:>9.3f}x{ratios['host']:>9.3f}x"
        + (f"{ratios['device']:>9.3f}x" if on == "device" else f"{on:>10}")
        + f"{ratios['ahead']:>7.3f}x"
        + f"{hosts['jdp']:>9.0f}/{hosts['hand']:<6.0f}{hosts['jdp/hand']:>5.3f}x"
        + f"{hosts['again/hand']:>7.3f}x"
    )
    return jax.devices()[0].device_kind, row


# Rounds of `host_us`: the arms' calls alternate, a round of each at a time, each round
# in another order (an arm's calls run slower just after another arm's, whose step left
# the host's caches cold), so a change in the machine's load reaches every arm alike; a
# round is at most `HOST_CALLS` calls, and fewer where the step is long (about
# `HOST_ROUND_SECONDS` of calls, at least `HOST_LEAST`), the first two of each not counted.
HOST_ROUNDS, HOST_CALLS, HOST_LEAST, HOST_ROUND_SECONDS = 15, 40, 6, 0.1


def host_us(run, kind: str, batch, *, rounds: int = HOST_ROUNDS) -> dict[str, float]:
    """The host's microseconds a call, dispatch alone (each call waits for the one before):
    jdp's step as a run calls it (``jdp``), the hand-written ``kind`` (``hand``) and a
    second, separately compiled copy of it (``again``); the median of the medians of
    ``rounds`` interleaved rounds (at most `HOST_ROUNDS`, as ``--rounds`` asks), and the
    medians of the rounds' ratios to ``hand``: ``jdp/hand`` and ``again/hand``, which
    is what two identical calls read apart, the measurement's own error."""
    calls, states = host_calls(run, {"hand": kind, "again": kind})
    for _ in range(2):  # a call of each compiles, then one is timed
        started = time.perf_counter()
        for arm, call in calls.items():
            states[arm] = jax.block_until_ready(call(states[arm], batch))[0]
    each = (time.perf_counter() - started) / len(calls)
    count = max(HOST_LEAST, min(HOST_CALLS, round(HOST_ROUND_SECONDS / each)))
    medians: dict[str, list[float]] = {arm: [] for arm in calls}
    arms = list(calls)
    for number in range(rounds):
        for arm in arms[number % len(arms) :] + arms[: number % len(arms)]:
            times = []
            for _ in range(count):
                begun = time.perf_counter()
                out = calls[arm](states[arm], batch)
                times.append(time.perf_counter() - begun)
                states[arm] = jax.block_until_ready(out)[0]
            medians[arm].append(statistics.median(times[2:]))
    us = {arm: 1e6 * statistics.median(values) for arm, values in medians.items()}
    for arm in ("jdp", "again"):
        per_round = [a / b for a, b in zip(medians[arm], medians["hand"], strict=True)]
        us[f"{arm}/hand"] = statistics.median(per_round)
    return us


def host_calls(run, hands: dict[str, str]) -> tuple[dict, dict]:
    """``(calls, states)``: jdp's step as a run calls it (``calls["jdp"]``) and, for each
    arm of ``hands`` (its name: its kind), a separately compiled hand-written step called
    the same way, ``call(state, batch) -> (state, metrics)``; each arm's own copy of the
    run's state."""
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    hand_state = (run.state.params, run.state.opt_state)
    calls, states = {"jdp": run.train_step}, {"jdp": copy(run.state)}
    for arm, kind in hands.items():
        step = hand_written_step(run.model, run.optimizer, run.mesh, kind=kind)
        calls[arm] = lambda state, batch, step=step: _split(step(*state, batch))
        states[arm] = copy(hand_state)
    return calls, states


def _split(out: tuple) -> tuple:
    """A hand-written step's ``(params, opt_state, metrics)`` as ``(state, metrics)``."""
    return out[:-1], out[-1]


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
            name,
            mesh,
            batch_size=args.batch_size,
            rounds=args.rounds,
            round_seconds=args.round_seconds,
            grad_norm=args.grad_norm,
        )
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
