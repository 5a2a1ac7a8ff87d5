"""``python -m jdp.replay RUN_DIR --step N``: a run's step N again, bit for bit, and what it held.

A run's global batch of step ``s`` depends only on ``(seed, s)``, and its checkpoints
restore exactly; so step ``N`` can be computed again. Replay builds the run from its
``config.json``, restores its latest checkpoint before ``N`` (or initialises it as
the run did, when none is left), trains on to ``N`` on the run's mesh, and checks
each step the run logged on the way: the loss bit for bit, and the data ledger's
digests (`jdp.data.splits.ledger`). Then it writes step ``N`` into ``OUT`` (default
``RUN_DIR/replay-N``): ``step.json`` (the loss, each parameter's gradient and update
norm, the examples by loss, largest first) and ``batch.npz`` (the global batch as
the model saw it, each row's example index and loss). The tool for "why did the loss
spike at step N".

The update norms are the run's own step's (parameters after less before). The
per-example losses and the gradient norms come from one more pass over the whole
global batch in float32 (with dropout, its own draws), whose mean loss agrees with
the step's to rounding in float32 (not under a bf16 compute policy).

A run of several processes replays under ``python -m jdp.launch`` with as many.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdp.checkpoint import Checkpointer, Record, read_record
from jdp.checkpoint.record import RunSettings
from jdp.data.loader import (
    calls_from,
    places_ahead,
    train_batches,
)
from jdp.data.splits import BATCH, TOTAL, Ledger
from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS
from jdp.replay_step import diagnose, norm, write
from jdp.report.console import Console
from jdp.report.writers import check_writable
from jdp.tool import command
from jdp.training.calls import call_bounds
from jdp.training.config import TrainConfig
from jdp.training.run import Run, build
from jdp.training.wiring import data_ledger


class ReplayMismatch(RuntimeError):
    """A replayed step is not what the run logged: its loss or its batch differ."""


@dataclasses.dataclass(frozen=True)
class Replayed:
    """What `replay` found: step ``step``'s loss, the logged steps it checked on the way
    (``checked``), the checkpoint it started from (0: the run's initialisation), the
    examples with the largest losses (``[(index, loss), ...]``) and where it wrote."""

    step: int
    loss: float
    checked: list[int]
    started_from: int
    largest: list[tuple[int, float]]
    out: str


def replay(
    run_dir: str,
    step: int,
    *,
    ckpt_dir: str | None = None,
    out: str | None = None,
    top: int = 10,
    console: Console | None = None,
) -> Replayed:
    """Replays step ``step`` of the run logged in ``run_dir`` (see the module's doc).

    Raises:
        UsageError: no such run or step, or a run replay cannot rebuild.
        ReplayMismatch: a logged loss or batch digest that the replay does not reproduce.
    """
    saved, logged = _run_files(run_dir)
    config = _config(saved, run_dir, ckpt_dir, step)
    console = console or Console(enabled=False)
    run = build(config, console, architecture=RunSettings(saved).architecture or None)
    out = out or os.path.join(run_dir, f"replay-{step}")
    if jax.process_index() == 0:  # before the steps are computed again, not after
        check_writable(out, "--out")
    _same_data(saved, run, run_dir)
    where = _topology(run_dir, run)
    state, start, base = _restore(run, step)
    if start >= step:  # a checkpoint's loader position past its step: not one to replay from
        raise UsageError(f"the checkpoint before step {step} resumes at step {start}")
    calls, bounds = config.steps_per_call, call_bounds(config)
    plan = list(calls_from(start, step, calls, bounds))  # the run's, through `step`'s
    end = sum(plan[-1])
    checked, place, steps = [], places_ahead(run.mesh), {calls: run.train_step}
    loader = train_batches(
        run.train,
        run.mesh,
        batch_size=config.batch_size,
        seed=config.seed,
        start_step=start,
        place=place,
        ledger=config.data_ledger,
        steps=end - start,
        steps_per_call=calls,
        bounds=bounds,
    )
    with loader as batches:
        ledger = data_ledger(config, run, batches, start, base)
        for first, ran in plan:  # replayed as the run made them
            batch = next(batches)
            if first + ran >= step:  # the call holding the step: before and after it
                inside = step - first
                before = _first_steps(run, state, batch, inside - 1)
                seen = diagnose(run, before, _one_step(batch, inside - 1, ran))
                after = None if inside == ran else _first_steps(run, state, batch, inside)
                before = jax.tree.map(jnp.copy, before.params)
            if ran not in steps:  # a shorter call, closing a gap up to a period
                steps[ran] = run.step_for(ran)
            state, metrics = steps[ran](state, batch)
            losses = np.atleast_1d(jax.device_get(metrics["loss"]))
            numbers = range(first + 1, min(first + ran, step) + 1)  # none past the step
            for number, value in zip(numbers, losses[: len(numbers)], strict=True):
                if number in logged:
                    _check(number, float(value), logged[number], ledger, where)
                    checked.append(number)
    after = state.params if after is None else after.params
    updates = jax.tree.map(lambda new, old: norm(new - old), after, before)
    loss = float(losses[inside - 1])
    largest = write(out, run, step, loss, seen, updates, start, checked, top)
    return Replayed(step, loss, checked, start, largest, out)


def _run_files(run_dir: str) -> tuple[dict, dict[int, dict]]:
    """The run's recorded config and its logged train records by step (a step logged by
    two attempts of a restarted run keeps the last)."""
    paths = [os.path.join(run_dir, name) for name in ("config.json", "metrics.jsonl")]
    if not all(os.path.isfile(path) for path in paths):
        raise UsageError(
            f"{run_dir} holds no config.json and metrics.jsonl; give the --log-dir of a run"
        )
    try:
        with open(paths[0]) as file:
            saved = json.load(file)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"cannot read {paths[0]} ({getattr(error, 'strerror', None) or error}); "
            "replay reads the config the run recorded there"
        ) from None
    if not isinstance(saved, dict):
        raise UsageError(f"{paths[0]} is not the object of settings a run records")
    logged, strange = {}, []
    with open(paths[1], errors="replace") as file:
        for number, line in enumerate(file, 1):
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line a kill cut short
            if not isinstance(record, dict):
                strange.append(number)
            elif record.get("kind") == "train":
                if isinstance(record.get("step"), int):
                    logged[record["step"]] = record
                else:
                    strange.append(number)
    if strange:
        print(
            f"jdp.replay: warning: {len(strange)} line(s) of {paths[1]} are not jdp's "
            f"records (line {', '.join(map(str, strange[:5]))}); left out",
            file=sys.stderr,
        )
    return saved, logged


def _config(saved: dict, run_dir: str, ckpt_dir: str | None, step: int) -> TrainConfig:
    """The config that trained ``step``, to replay with: as the first checkpoint at or
    after it recorded it (a resumed run's start may have changed ``--steps``, and with
    it the schedule), else the latest, else ``config.json``; no files of its own
    written."""
    ckpt_dir = ckpt_dir or RunSettings(saved).ckpt_dir
    if ckpt_dir and not os.path.isdir(ckpt_dir):
        raise UsageError(
            f"the run's checkpoints were in {ckpt_dir}, which is not here; give "
            "their directory with --ckpt-dir"
        )
    saved = _recorded(ckpt_dir, step) or saved
    if RunSettings(saved).yours:
        raise UsageError(
            f"{run_dir} trained your own model or data; replay rebuilds runs of the built-in ones"
        )
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    made_with = {name: value for name, value in saved.items() if name in fields}
    config = TrainConfig(
        **made_with
        | {
            "log_dir": None,
            "eval_only": False,
            "no_resume": False,
            "tracker": "none",
            "ckpt_dir": ckpt_dir,
        }
    )
    if config.mesh_spec.has(GROUP_AXIS):
        raise UsageError(
            f"the run trained DiLoCo groups (--mesh {config.mesh}), whose "
            "synchronisations replay does not repeat"
        )
    if not 1 <= step <= config.steps:
        raise UsageError(f"--step {step}: the run has steps 1 to {config.steps}")
    return config


def _recorded(ckpt_dir: str | None, step: int) -> dict:
    """The config recorded by the first whole checkpoint at or after ``step``, else by the
    latest; {} when there is none."""
    if not ckpt_dir:
        return {}
    steps = sorted(
        int(name)
        for name in os.listdir(ckpt_dir)
        if name.isdigit() and os.path.isdir(os.path.join(ckpt_dir, name, "state"))
    )
    chosen = next((saved for saved in steps if saved >= step), steps[-1] if steps else None)
    return read_record(os.path.join(ckpt_dir, str(chosen))).config if chosen is not None else {}


def _same_data(saved: dict, run: Run, run_dir: str) -> None:
    before = RunSettings(saved).fingerprint.get("train")
    now = RunSettings(run.recorded).fingerprint.get("train")
    if before and now and before != now:
        raise UsageError(
            f"the training data here is not the data {run_dir}'s run trained "
            "on (its fingerprint differs); replay on that data"
        )


def _topology(run_dir: str, run: Run) -> str:
    """Where the run ran against where this replay runs, in words, for a mismatch."""
    try:
        with open(os.path.join(run_dir, "run.json")) as file:
            facts = json.load(file)
        ran = (facts["devices"], facts["processes"], facts["device_kinds"])
    except (OSError, ValueError, KeyError, TypeError):
        return "another topology, device kind or jdp version than the run's?"
    here = (jax.device_count(), jax.process_count(), sorted({d.device_kind for d in jax.devices()}))
    if ran == here:
        return "the same devices and processes; another jdp or JAX version than the run's?"
    return (
        f"the run ran on {ran[0]} {'/'.join(ran[2])} devices in {ran[1]} processes, this "
        f"replay on {here[0]} in {here[1]}: replay where it ran, under python -m "
        f"jdp.launch --nproc {ran[1]} for several processes"
    )


def _restore(run: Run, step: int) -> tuple:
    """The state before ``step``: the latest checkpoint before it, else the run's start
    as ``build`` made it; its step and its data ledger."""
    if not run.config.ckpt_dir:
        return run.state, 0, {}
    with Checkpointer(run.config.ckpt_dir, keep=max(run.config.keep, 1)) as checkpoints:
        restored = checkpoints.restore(run.state, at_most=step - 1)
    if restored is None:
        return run.state, 0, {}
    record = Record.read(restored[1])
    return restored[0], record.loader_step, record.ledger


def _check(step: int, loss: float, record: dict, ledger: Ledger | None, where: str) -> None:
    logged = record.get("loss")
    if logged is not None and loss != logged:
        raise ReplayMismatch(
            f"step {step}'s loss is {loss!r} replayed and {logged!r} logged: the run's "
            f"steps are not reproduced here ({where})"
        )
    if ledger is not None and BATCH in record:
        digests = ledger.at(step)
        if (digests[BATCH], digests[TOTAL]) != (record[BATCH], record.get(TOTAL)):
            raise ReplayMismatch(
                f"step {step}'s global batch is not the one the run logged (data ledger "
                f"{digests[TOTAL]}, logged {record.get(TOTAL)}): the data changed since"
            )


def _one_step(batch, index: int, calls: int):
    """Step ``index``'s batch of a call's ``batch`` (stacked when ``calls`` > 1)."""
    return batch if calls == 1 else jax.tree.map(lambda x: x[index], batch)


def _first_steps(run: Run, state, stacked, count: int):
    """The state after the first ``count`` steps of a call of the run's (``stacked``, its
    batches), from a copy of ``state``: the steps scanned as the run's call scans them
    (one step alone compiles as the run's single step)."""
    if count == 0:
        return state
    step = run.step_for(count)
    first = jax.jit(
        lambda batch: jax.tree.map(lambda x: x[:count] if count > 1 else x[0], batch),
        out_shardings=step.batch_sharding,
    )
    return step(jax.tree.map(jnp.copy, state), first(stacked))[0]


@command("jdp.replay")
def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="jdp.replay", description=description)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's --log-dir")
    parser.add_argument("--step", type=int, required=True, help="the step to replay")
    parser.add_argument("--ckpt-dir", help="the run's checkpoints (default: as it recorded)")
    parser.add_argument(
        "--out", help="where to write step.json and batch.npz (default: RUN_DIR/replay-N)"
    )
    parser.add_argument("--top", type=int, default=10, help="examples to name by loss")
    args = parser.parse_args(argv)
    if args.top < 0:
        print(
            f"jdp.replay: error: --top {args.top}: give how many examples to name, 0 or more",
            file=sys.stderr,
        )
        return 2
    try:
        replayed = replay(
            args.run_dir, args.step, ckpt_dir=args.ckpt_dir, out=args.out, top=args.top
        )
    except UsageError as error:
        print(f"jdp.replay: error: {error}", file=sys.stderr)
        return 2
    except ReplayMismatch as error:
        print(f"jdp.replay: error: {error}", file=sys.stderr)
        return 1
    if jax.process_index() == 0:
        _say(replayed)
    return 0


def _say(replayed: Replayed) -> None:
    source = (
        f"checkpoint {replayed.started_from}"
        if replayed.started_from
        else "the run's initialisation"
    )
    checked = (
        f"; the logged loss and batch of {len(replayed.checked)} steps reproduced bit for bit"
        if replayed.checked
        else "; no step on the way was logged"
    )
    print(f"jdp.replay: step {replayed.step} from {source}: loss {replayed.loss:.6g}{checked}")
    for index, loss in replayed.largest:
        print(f"  example {index}: loss {loss:.6g}")
    print(f"jdp.replay: wrote {os.path.join(replayed.out, 'step.json')} and batch.npz")


if __name__ == "__main__":
    sys.exit(main())
