"""The lines a run says about what was built: where it runs, the model, data and
optimizer, the parameters' layout, and at the first step its FLOPs and run files.

``run.py`` builds and calls these at the points the lines belong; they decide
nothing, so a reader of `build` sees what it does and a reader here what it says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jdp import layout
from jdp.data.loader import BatchStream, EvalReader
from jdp.distributed import Cluster
from jdp.mesh import GROUP_AXIS, MODEL_AXIS, batch_split, data_size, group_size, is_sharded
from jdp.report.console import Console
from jdp.report.logger import MetricLogger
from jdp.report.run_info import write_run_info
from jdp.report.throughput import model_flops, peak_flops, step_flops
from jdp.training.config import TrainConfig
from jdp.training.optimizer import describe
from jdp.training.parts import Data, Run, Yours


def describe_run(
    config: TrainConfig,
    run: Run,
    logger: MetricLogger,
    lowered: jax.stages.Lowered,
    console: Console,
    *,
    scanned: bool,
) -> None:
    """The model's FLOPs per step and the peak MFU is measured against; XLA's count of
    the hardware's FLOPs in ``lowered``, the first call's program (``scanned``: of
    several steps, a loop whose body is one step); the run directory's facts."""
    devices = run.mesh.devices.size
    kind = run.mesh.devices.flat[0].device_kind
    flops = config.batch_size * example_flops(run)
    hardware = step_flops(lowered, devices, per_step_loops=int(scanned))
    peak = peak_flops(kind, config.precision)
    logger.throughput = dataclasses.replace(
        logger.throughput, flops_per_step=flops, peak_flops=peak * devices if peak else None
    )
    facts = {
        "mesh": dict(run.mesh.shape),
        "backend": config.backend,
        "flops_per_step": flops,
        "hardware_flops_per_step": hardware,
        "peak_flops_per_device": peak,
    }
    write_run_info(config.log_dir, run.recorded or dataclasses.asdict(config), facts)
    logger.describe(run.recorded or dataclasses.asdict(config), facts)  # to the trackers
    against = (
        f"MFU against {peak:.3g} {config.precision} FLOP/s per {kind}"
        if peak
        else f"no peak for {kind}"
    )
    xla = f"; XLA counts {hardware:.3g} on {devices} devices" if hardware else ""
    console.line(f"jdp: {flops:.3g} model FLOPs per step{xla}; {against}")


def example_flops(run: Run) -> float:
    """The model FLOPs of training on one example (`jdp.report.throughput.model_flops`)."""
    sample = EvalReader(run.train, batch_size=1, rows=slice(None))(0)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), sample)
    return model_flops(run.model, run.state.params, run.state.model_state, shapes)


def describe_optimizer(optimizer) -> str:
    """An Optax optimizer as far as it describes itself: its type, and its function's name."""
    update = getattr(optimizer, "update", None)
    where = getattr(update, "__qualname__", "").split(".<locals>")[0]
    return f"{type(optimizer).__name__}({where})" if where else type(optimizer).__name__


def say_where_it_runs(config: TrainConfig, console: Console, cluster: Cluster, mesh: Mesh) -> None:
    """The run's processes, when it has several; simulated devices, when there is no
    accelerator."""
    devices = mesh.devices.size
    if cluster.num_processes > 1:
        console.line(
            f"jdp: {cluster.num_processes} processes ({cluster.source}), coordinator "
            f"{cluster.coordinator}, {jax.local_device_count()} devices each"
        )
    if jax.default_backend() == "cpu" and devices > 1:
        console.line(
            f"jdp: no accelerator; mesh {config.mesh} runs on {devices} simulated CPU devices"
        )


def say_what_was_built(
    config: TrainConfig,
    console: Console,
    mesh: Mesh,
    model: str,
    dataset: str,
    data: Data,
    yours: Yours,
) -> None:
    """The model on the data, the mesh and the batch; DiLoCo's groups; the optimizer."""
    per_replica = config.batch_size // batch_split(mesh)
    sizes = " / ".join(
        f"{'batches of your own,' if isinstance(split, BatchStream) else len(split)} {name}"
        for name, split in (
            ("train", data.train),
            ("validation", data.validation),
            ("test", data.test),
        )
        if split is not None
    )
    console.line(
        f"jdp: {model} on {dataset} "
        f"({sizes}), mesh {dict(mesh.shape)}, "
        f"backend {config.backend}, global batch {config.batch_size} "
        f"({per_replica} per replica"
        + (f", {config.accumulate} micro-batches" if config.accumulate > 1 else "")
        + f"), {config.steps} steps"
    )
    if GROUP_AXIS in mesh.shape:
        groups = group_size(mesh)
        console.line(
            f"jdp: DiLoCo: {groups} groups of {data_size(mesh)} replicas, each on 1/{groups} of "
            f"every global batch; every {config.resolved_sync_every} steps the groups average "
            f"their parameters and {config.outer_optimizer} (lr {config.outer_lr:g}, momentum "
            f"{config.outer_momentum:g}) applies the change; evaluation and checkpoints' "
            "params are the synchronised parameters"
        )
        if jax.process_count() > 1:
            console.line(f"jdp: DiLoCo groups by process: {_groups_by_process(mesh)}")
    if yours.optimizer is not None:
        lr = (
            "lr as your lr_schedule gives it"
            if yours.lr_schedule is not None
            else "lr logged only if it was made with optax.inject_hyperparams (or pass "
            "fit(lr_schedule=...))"
        )
        console.line(
            f"jdp: your optimizer {describe_optimizer(yours.optimizer)}, {lr}; the config's "
            f"optimizer flags are unused; precision {config.precision} (all-reduce "
            f"{config.reduce_dtype})"
        )
        return
    console.line(
        f"jdp: {describe(config)}; precision {config.precision} (all-reduce {config.reduce_dtype})"
    )


def _groups_by_process(mesh: Mesh) -> str:
    """``group 0: process 0; group 1: process 1``: where each group's devices are."""
    per_group = [sorted({d.process_index for d in row.flat}) for row in mesh.devices]
    return "; ".join(
        f"group {g}: process {', '.join(map(str, processes))}"
        for g, processes in enumerate(per_group)
    )


def say_layout(
    config: TrainConfig, console: Console, mesh: Mesh, specs: Any, *, named: bool
) -> None:
    """Where the parameters went, when the mesh or --shard-optimizer splits anything."""
    if not (is_sharded(mesh) or config.shard_optimizer):
        return
    line = f"jdp: layout: {layout.describe(specs)}"
    if config.shard_optimizer:
        line += f"; optimizer state split over data ({data_size(mesh)})"
    console.line(line)
    if mesh.shape.get(MODEL_AXIS, 1) > 1 and MODEL_AXIS not in layout.split_counts(specs):
        why = (
            "its parameters carry no logical axis names (nn.with_logical_partitioning)"
            if not named
            else "no named dimension maps to it (see --axis-rules)"
        )
        console.line(
            f"jdp: nothing is split over the 'model' axis: {why}; its devices repeat the work"
        )
