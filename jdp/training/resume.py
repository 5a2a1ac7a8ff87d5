"""Resuming a run: the state and step a run continues from, read through the
checkpoint's typed `jdp.checkpoint.Record`, and what a resume may not change."""

from __future__ import annotations

import dataclasses

from jdp.checkpoint import Checkpointer, Record
from jdp.checkpoint.record import RunSettings
from jdp.diloco import group_count
from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS
from jdp.report.console import Console
from jdp.state import TrainState
from jdp.training.config import TrainConfig
from jdp.training.optimizer import config_optimizer


def resume(
    config: TrainConfig,
    checkpoints: Checkpointer,
    state: TrainState,
    console: Console,
    recorded: dict | None = None,
) -> tuple[TrainState, int, dict]:
    """The state and first step to continue from, and the data ledger through that step
    (`jdp.data.splits.ledger`): a restored checkpoint's, or the fresh ones (and {}).
    ``recorded``: the run's settings as its checkpoints record them."""
    existing = checkpoints.steps()
    if existing and config.no_resume:
        raise UsageError(
            f"--no-resume: {checkpoints.directory} already holds checkpoints (latest step "
            f"{existing[-1]}); remove them, or choose an empty --ckpt-dir"
        )

    def same_run(meta: dict) -> None:
        record = Record.read(meta)
        _same_groups(state, record, config.mesh, checkpoints.directory)
        conflicts = config.resume_conflicts(record.run.as_ran, recorded)
        if not config.allow_new_data:
            _same_data(record.config, recorded or {}, checkpoints.directory)
        if conflicts:
            raise UsageError(
                f"{checkpoints.directory} holds a run made with other settings: "
                f"{'; '.join(conflicts)}; rerun with its flags, or choose another --ckpt-dir"
            )

    restored = checkpoints.restore(state, check=same_run) if existing else None
    if restored is None:
        _none_whole(config, checkpoints, console)
        return state, 0, {}
    state, record = restored[0], Record.read(restored[1])
    start = record.loader_step
    _say_how_steps_changed(config, record.config, start, checkpoints.directory, console)
    console.line(f"jdp: resuming from step {record.step} in {checkpoints.directory}")
    if config.init_from:  # the same command restarts a preempted run: it resumes
        console.line(
            f"jdp: --init-from {config.init_from} starts a new run only; this one goes on "
            f"from its checkpoint's parameters, not those"
        )
    return state, start, record.ledger


def _none_whole(config: TrainConfig, checkpoints: Checkpointer, console: Console) -> None:
    """Where no checkpoint is whole but damaged ones were set aside, step 0 would start the
    run over in silence: refused, unless asked for (``--restart-from-scratch``)."""
    damaged = checkpoints.damaged_steps()
    if not damaged or config.no_resume:
        if config.restart_from_scratch:
            raise UsageError(
                f"--restart-from-scratch: no damaged checkpoint is set aside in "
                f"{checkpoints.directory}, so there is nothing to start over from; drop the flag"
            )
        return
    steps = ", ".join(map(str, damaged))
    where = (
        f"{checkpoints.directory} holds no whole checkpoint (damaged ones set aside: steps {steps})"
    )
    if not config.restart_from_scratch:
        raise UsageError(
            f"{where}; pass --restart-from-scratch to train from step 0 there, "
            "or choose another --ckpt-dir"
        )
    console.line(f"jdp: --restart-from-scratch: {where}; training from step 0")


def _same_data(saved: dict, recorded: dict, directory: str) -> None:
    """UsageError when a split the run trained on (or chose its best by) has changed
    since the checkpoint was written (`jdp.data.splits.fingerprints`); a checkpoint written
    before fingerprints were recorded resumes as before."""
    before, now = RunSettings(saved).fingerprint, RunSettings(recorded).fingerprint
    for name in ("train", "validation"):
        if before.get(name) and now.get(name) and before[name] != now[name]:
            raise UsageError(
                f"{directory} holds a run trained on other data: the {name} split is not the "
                f"one its checkpoints recorded; resume on that data, pass --allow-new-data to "
                "go on with this run on this data, or start a new run from its parameters "
                "with --init-from"
            )
        if bool(before.get(name)) != bool(now.get(name)) and before and now:
            had = "had" if before.get(name) else "had no"
            raise UsageError(
                f"{directory} holds a run that {had} a {name} split, and this one "
                f"{'has none' if before.get(name) else 'has one'}; resume on the same "
                "splits, or pass --allow-new-data"
            )


def _same_groups(state: TrainState, record: Record, mesh: str, directory: str) -> None:
    """A checkpoint holds one state per DiLoCo group: it resumes only with as many
    (counted from the arrays, whatever the specs wrote, -1 included)."""
    saved, groups = record.groups, group_count(state)
    if groups != saved:
        held = f"{saved} DiLoCo groups (--mesh {record.run.mesh})" if saved else "no DiLoCo groups"
        wanted = f"{GROUP_AXIS}={saved}, any data size" if saved else f"no {GROUP_AXIS} axis"
        raise UsageError(
            f"{directory} holds a run of {held}, and --mesh {mesh} has "
            f"{groups or 'none'}; resume it on a mesh with {wanted}, or choose another --ckpt-dir"
        )


def _say_how_steps_changed(
    config: TrainConfig, saved: dict, start: int, directory: str, console: Console
) -> None:
    """A resumed run may train longer than the run that saved; the schedule's horizon moves."""
    before = RunSettings(saved).steps or config.steps
    if before == config.steps:
        return
    if config.steps <= start:
        raise UsageError(
            f"{directory} holds step {start}, and --steps is {config.steps}; raise --steps "
            f"above {start} to train on, or use --eval-only to evaluate it"
        )
    line = f"jdp: --steps {config.steps} (was {before})"
    if "lr" in saved:  # the built-in schedule, whose horizon is --steps
        was = dataclasses.replace(config, steps=before)
        now_lr, was_lr = (float(config_optimizer(c)[0](start)) for c in (config, was))
        line += (
            f": the {config.schedule} schedule now spans {config.steps} steps; at step {start} "
            f"its learning rate is {now_lr:.4g} (it was {was_lr:.4g})"
        )
    console.line(line)
