"""A run built from its config, once: devices, mesh, data, model, optimizer, state, steps.

`build` is the one place that turns a `TrainConfig` into the objects a run
uses; `jdp.fit` and the benchmarks take them from the `Run` it returns. The
lines that say what it built are in ``messages.py``, what it takes and returns
(`Data`, `Yours`, `Run`) in ``parts.py``, the config's optimizer in ``optimizer.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jdp import distributed
from jdp.checkpoint import read_params, read_record, step_directory
from jdp.checkpoint.params import saved_param_names
from jdp.checkpoint.record import (
    ARCHITECTURE,
    DATA_FACTS,
    DATA_FINGERPRINT,
    SPECIAL_TOKENS,
    WARMUP_CHOSEN,
    YOURS,
)
from jdp.data.formats import is_corpus, load_corpus
from jdp.data.loader import BatchStream, EvalReader, check_train_batch, place, state_bytes
from jdp.data.splits import Split, check_splits, data_facts, fingerprint, holdout, load_named
from jdp.diloco import Outer, outer_from_flags
from jdp.errors import UsageError
from jdp.mesh import (
    GROUP_AXIS,
    MeshSpec,
    batch_split,
    check_batch_size,
    check_spec_fits_batch,
    make_mesh,
    simulate_cpu_devices,
)
from jdp.mesh import parse_axis_rules as parse_rules
from jdp.models import hf
from jdp.models.registry import check_model, context, model_of_run
from jdp.models.summary import summary
from jdp.models.transformer import stack_layers
from jdp.precision import make_precision
from jdp.replica import check_accumulate
from jdp.report.console import Console
from jdp.report.trackers import check_trackers
from jdp.report.writers import check_writable
from jdp.rngs import run_keys
from jdp.state import create_train_state
from jdp.step import make_eval_step, make_sync_step
from jdp.training.config import OPTIMIZER, TrainConfig, fields_of
from jdp.training.config_checks import image_hw
from jdp.training.messages import (
    describe_optimizer,
    say_layout,
    say_what_was_built,
    say_where_it_runs,
)
from jdp.training.messages import describe_run as describe_run  # importable here, as before
from jdp.training.optimizer import config_optimizer
from jdp.training.optimizer import peak_lr as peak_lr  # importable here, as before
from jdp.training.parts import Data, Run, Yours
from jdp.training.steps import built_calls, step_maker

# Beyond this, simulated CPU devices take minutes and gigabytes to create.
MAX_SIMULATED_DEVICES = 1024


def setup_devices(spec: MeshSpec | str, *, processes: int = 1) -> None:
    """Before JAX starts: on a CPU-only machine, simulate the devices the mesh asks of a process."""
    spec = spec if isinstance(spec, MeshSpec) else MeshSpec.parse(spec)
    wanted = spec.devices
    if wanted and wanted > processes and wanted % processes == 0:
        if wanted // processes > MAX_SIMULATED_DEVICES:
            raise UsageError(
                f"--mesh {spec.text} asks for {wanted // processes} devices per process; jdp "
                f"simulates at most {MAX_SIMULATED_DEVICES} CPU devices (each costs memory "
                "and start-up time); use a smaller mesh"
            )
        simulate_cpu_devices(wanted // processes)


def load_data(config: TrainConfig, given: Data | None = None) -> Data:
    """The run's splits: ``given`` (`jdp.fit`'s), else ``--dataset``'s; a held-out validation;
    all checked (`jdp.data.check_splits`)."""
    if given is not None:
        data = given
    elif is_corpus(config.dataset):
        splits = load_corpus(
            config.dataset,
            seq_len=config.seq_len or context(config.model, config.model_size),
            data_dir=config.data_dir,
            vocab_size=config.vocab_size or None,
            dtype=config.token_dtype or None,
        )
        data = Data(splits["train"], splits["validation"], splits["test"])
    else:
        data = Data(
            *(
                load_named(config.dataset, split, config.data_dir, image_size=image_hw(config))
                for split in ("train", "validation", "test")
            )
        )
    for name, split in (("validation", data.validation), ("test", data.test)):
        if isinstance(split, BatchStream):
            raise UsageError(
                f"jdp.data.from_batches is for training; give the {name} split as a split "
                "(jdp.data.from_arrays, from_indexable, ...), which evaluation reads whole"
            )
    streamed = isinstance(data.train, BatchStream)
    if streamed and (config.validation_fraction or config.epochs):
        raise UsageError(
            "--validation-fraction and --epochs need a training split of known "
            "size; with batches of your own give validation= and --steps"
        )
    if config.validation_fraction:
        if data.validation is not None:
            raise UsageError(
                "the data has a validation split already; drop --validation-fraction, or "
                "give no validation split"
            )
        train, validation = _held_out(config, data.train)
        data = dataclasses.replace(data, train=train, validation=validation)
    check_splits({"train": data.train, "validation": data.validation, "test": data.test})
    return data


def _held_out(config: TrainConfig, train: Split) -> tuple[Split, Split]:
    """``(train, validation)``: ``--validation-fraction`` of ``train`` held out, leaving
    at least a global batch to train on."""
    rest, validation = holdout(train, config.validation_fraction, config.seed)
    if len(rest) < config.batch_size:
        most = (len(train) - config.batch_size) / len(train)
        fix = f"at most {math.floor(most * 1000) / 1000:g}" if most > 0 else "none"
        raise UsageError(
            f"--validation-fraction {config.validation_fraction:g} leaves {len(rest)} of "
            f"{len(train)} examples to train on, fewer than the global batch "
            f"{config.batch_size}; hold out a smaller fraction ({fix} here)"
        )
    return rest, validation


def resolve(
    config: TrainConfig, train_examples: int, console: Console, *, own_optimizer: bool
) -> TrainConfig:
    """``--epochs`` as steps; the default warmup clamped to a tenth of a shorter run, with a
    line each (a warmup you chose longer than the run is refused by the schedule). A run
    resumed with the default warmup keeps the one jdp chose when it started (`_warmup_kept`):
    raising ``--steps`` continues the run, the warmup it went through unchanged."""
    if config.epochs:
        steps = math.ceil(config.epochs * train_examples / config.batch_size)
        console.line(
            f"jdp: --epochs {config.epochs} of {train_examples} examples at batch "
            f"{config.batch_size} = {steps} steps"
        )
        config = dataclasses.replace(config, steps=steps)
    if config.mesh_spec.has(GROUP_AXIS) and not config.sync_every:
        # Recorded as it runs: a resume that names the default agrees with it.
        config = dataclasses.replace(config, sync_every=config.resolved_sync_every)
    default = TrainConfig.__dataclass_fields__["warmup_steps"].default
    kept = _warmup_kept(config) if not own_optimizer and config.warmup_steps == default else None
    if kept is not None:
        console.line(f"jdp: --warmup-steps {kept}, as the run in {config.ckpt_dir} started with")
        config = dataclasses.replace(config, warmup_steps=kept)
    elif not own_optimizer and config.warmup_steps == default and default > config.steps:
        warmup = config.steps // 10
        console.line(
            f"jdp: --warmup-steps {config.warmup_steps} is longer than the run's "
            f"{config.steps} steps; warming up over {warmup} steps (a tenth) instead"
        )
        config = dataclasses.replace(config, warmup_steps=warmup)
    return config


def _warmup_kept(config: TrainConfig) -> int | None:
    """The warmup recorded with ``--ckpt-dir``'s latest checkpoint, when jdp chose it (the
    default cut to a tenth of a shorter run); None when there is none to resume."""
    if not config.ckpt_dir or config.no_resume:
        return None
    try:
        saved = read_record(step_directory(os.path.abspath(config.ckpt_dir))).run
    except (UsageError, OSError):
        return None  # nothing to resume, or a resume that says why itself
    return saved.chosen_warmup


def recorded_config(
    config: TrainConfig,
    yours: Yours,
    train: Split,
    *,
    chose_warmup: bool = False,
    fingerprints: dict | None = None,
    architecture: dict | None = None,
) -> dict:
    """The config as checkpoints and run files record it: what the user brought is named
    ``yours`` and the config fields it replaced are left out, never logged as if used."""
    recorded = dataclasses.asdict(config)
    if yours.optimizer is not None:
        for name in _OPTIMIZER_FIELDS:
            recorded.pop(name)
        recorded["optimizer"] = f"yours: {describe_optimizer(yours.optimizer)}"
        recorded["lr_schedule"] = "yours" if callable(yours.lr_schedule) else yours.lr_schedule
    if yours.model is not None:
        recorded["model"] = YOURS
        recorded.pop("model_size")
    if yours.data is not None:
        recorded["dataset"] = YOURS
    recorded[DATA_FACTS] = data_facts(train)
    if chose_warmup:
        recorded[WARMUP_CHOSEN] = True
    if fingerprints:
        recorded[DATA_FINGERPRINT] = fingerprints
    if architecture:
        recorded[ARCHITECTURE] = architecture
    if weights := hf.directory_of(config.init_from):  # for jdp.export to write them back
        recorded[SPECIAL_TOKENS] = hf.special_tokens(weights)
    return recorded


def fingerprints(config: TrainConfig, data: Data) -> dict[str, str]:
    """The fingerprints of the splits a run's training depends on (the training split,
    and the validation split that chooses its best checkpoint), when it saves any."""
    if not config.ckpt_dir:
        return {}
    splits = {"train": data.train, "validation": data.validation}
    return {name: fingerprint(split) for name, split in splits.items() if split is not None}


# The config fields that make the built-in optimizer and schedule.
_OPTIMIZER_FIELDS = fields_of(section=OPTIMIZER)


def build(
    config: TrainConfig,
    console: Console,
    yours: Yours | None = None,
    *,
    architecture: dict | None = None,
) -> Run:
    """Sets up devices, mesh, data, model, optimizer and steps; says what it built.

    ``yours`` brings a model, data or an optimizer in place of the config's (see `fit`);
    ``architecture`` the built-in gpt's shape where weights set it (a checkpoint's, or
    ``--init-from hf:DIR``'s).

    Raises:
        UsageError: a mesh, batch size, dataset or model that cannot work here.
    """
    check_trackers(config.tracker, config.log_dir)  # before the data: a typo fails at once
    yours = yours or Yours()
    model = yours.model
    if model is None and (weights := hf.directory_of(config.init_from)) and not config.seq_len:
        positions = hf.read_architecture(weights)["max_len"]  # windows of GPT-2's context
        config = dataclasses.replace(config, seq_len=positions)
    data, architecture, problem = _checked_data(config, yours, architecture)
    mesh = _mesh(config, console, str(problem) if problem else None)
    if problem:
        raise problem
    train, validation, test = data.train, data.validation, data.test
    given = config
    config = resolve(config, len(train), console, own_optimizer=yours.optimizer is not None)
    if jax.process_index() == 0:  # now, not after the model is made
        for flag, directory in (("--log-dir", config.log_dir), ("--ckpt-dir", config.ckpt_dir)):
            if directory:
                check_writable(directory, flag)
    name = config.model_label if model is None else "your model"
    name = name if architecture is None else f"{config.model} of {config.init_from or 'weights'}"
    if model is None:
        model = model_of_run(dataclasses.asdict(config) | {ARCHITECTURE: architecture}, train)

    init_rng, train_rng = run_keys(config.seed)
    sample = EvalReader(train, batch_size=1, rows=slice(None))(0)
    rules = parse_rules(config.axis_rules)
    params, model_state, specs = model.init_on_mesh(init_rng, sample, mesh, rules=rules)
    schedule, optimizer = _optimizer(config, yours)
    precision = make_precision(config.precision, reduce=config.reduce_dtype)
    if config.init_from:  # before the optimizer's state is made from the parameters
        params, model_state = _initial(config.init_from, params, model_state, architecture)
        console.line(f"jdp: parameters and model state from {config.init_from}")
    outer = _outer(config, mesh)
    state = create_train_state(
        params,
        optimizer,
        mesh,
        rng=train_rng,
        model_state=model_state,
        precision=precision,
        outer=outer,
        param_specs=None if outer else specs,
        shard_optimizer=config.shard_optimizer,
    )
    splits = dict(train=train, validation=validation, test=test)
    train, validation, test = place(
        config.data_on_device,
        splits,
        mesh,
        say=console.line,
        state_bytes=state_bytes(state),
        workers=config.loader_workers,
    ).values()
    step_for = step_maker(config, model, optimizer, mesh, precision, schedule)
    train_step = step_for(built_calls(config))
    eval_step = make_eval_step(model.metrics_fn, mesh, backend=config.backend, has_model_state=True)
    sync_step = make_sync_step(outer, mesh) if outer is not None else None
    num_params = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    dataset = "your data" if yours.data is not None else config.dataset
    say_what_was_built(
        config, console, mesh, f"{name} ({num_params:,} params)", dataset, data, yours
    )
    say_layout(config, console, mesh, specs, named=model.names is not None)
    if config.summary:
        table = summary(
            model,
            sample,
            mesh,
            optimizer=optimizer,
            rules=rules,
            shard_optimizer=config.shard_optimizer,
        )
        console.line(str(table))
    return Run(
        config,
        mesh,
        train,
        test,
        model,
        state,
        train_step,
        eval_step,
        schedule,
        optimizer,
        validation,
        recorded_config(
            config,
            yours,
            train,
            chose_warmup=config.warmup_steps != given.warmup_steps,
            fingerprints=fingerprints(config, data),
            architecture=architecture,
        ),
        sync_step,
        step_for,
    )


def _optimizer(config: TrainConfig, yours: Yours) -> tuple:
    """(the learning-rate schedule, the optimizer): yours where you gave one, a constant
    rate where you gave a number, else the config's."""
    if yours.optimizer is None:
        return config_optimizer(config)
    schedule = yours.lr_schedule
    if isinstance(schedule, int | float):
        schedule = optax.constant_schedule(float(schedule))
    return schedule, yours.optimizer


def _checked_data(
    config: TrainConfig, yours: Yours, architecture: dict | None
) -> tuple[Data | None, dict | None, UsageError | None]:
    """The run's data and gpt's shape where weights set it, checked against the model
    before the processes join (a process that cannot read its data stops every
    process at start-up, not a collective's timeout later); or the problem."""
    data = None
    try:
        data = load_data(config, yours.data)
        if yours.model is None:  # a model that cannot read the data, before the data's size
            check_model(config.model, config.model_size, data.train.kind)
            loaded = hf.architecture_for(config.init_from, config.model, data.train)
            architecture = loaded or architecture
        check_train_batch(data.train, config.batch_size)
        return data, architecture, None
    except UsageError as error:
        return data, architecture, error


def _outer(config: TrainConfig, mesh: Mesh) -> Outer | None:
    """DiLoCo's outer loop from the flags, when the mesh has groups."""
    if GROUP_AXIS not in mesh.shape:
        return None
    return outer_from_flags(
        config.outer_optimizer,
        sync_every=config.resolved_sync_every,
        lr=config.outer_lr,
        momentum=config.outer_momentum,
    )


def _mesh(config: TrainConfig, console: Console, error: str | None = None) -> Mesh:
    """Joins the run's processes (telling them ``error``, when this one cannot run), sets
    up devices, and makes a mesh the batch fits."""
    cluster = distributed.initialize(
        config.coordinator,
        config.num_processes,
        config.process_id,
        startup_timeout=config.startup_timeout,
        heartbeat_timeout=config.heartbeat_timeout,
        settings=config.shared_settings(),
        error=error,
    )
    check_spec_fits_batch(config.mesh_spec, config.batch_size)  # before devices are made for it
    setup_devices(config.mesh_spec, processes=cluster.num_processes)
    mesh = make_mesh(config.mesh_spec)
    check_batch_size(config.batch_size, mesh)
    replicas = batch_split(mesh)
    check_accumulate(config.batch_size // replicas, config.accumulate, replicas)
    say_where_it_runs(config, console, cluster, mesh)
    return mesh


def _initial(path: str, params, model_state, architecture: dict | None):
    """``--init-from``'s parameters laid out as ``params``: GPT-2's weights (``hf:DIR``),
    or a checkpoint's, a language model's unrolled layers (``Block_0``, ...: written
    before scanned layers) stacked for the scan."""
    if hf.directory_of(path) is not None:
        if "blocks" not in params:
            raise UsageError(f"--init-from {path} loads scanned layers; drop --unroll-layers")
        weights = hf.read_weights(hf.directory_of(path), architecture)
        return jax.device_put(weights, jax.tree.map(lambda x: x.sharding, params)), model_state
    if "blocks" in params and "Block_0" in saved_param_names(path):
        saved, model_state = read_params(path)
        stacked = stack_layers(saved, len([name for name in saved if name.startswith("Block_")]))
        shapes = jax.tree.map(lambda x: x.shape, (params, model_state))
        if jax.tree.map(lambda x: x.shape, (stacked, model_state)) != shapes:
            raise UsageError(
                f"--init-from {path} holds another model than this run's; start from a "
                "checkpoint of the same model"
            )
        return jax.device_put(stacked, jax.tree.map(lambda x: x.sharding, params)), model_state
    return read_params(path, like=(params, model_state))
