"""`TrainConfig`'s checks: each invalid value raises `UsageError` with one line naming
the flag and the fix. They read a config by its fields and properties only."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from typing import Literal

from jdp.errors import UsageError
from jdp.mesh_spec import GROUP_AXIS, SHARDING_AXES, parse_axis_rules
from jdp.training.config_types import check_types

# The datasets known by name; --dataset also takes your own data by these prefixes
# (jdp.data.splits.custom reads them).
DatasetName = Literal[
    "cifar10", "digits", "fashion_mnist", "mnist", "numbers2words", "python_stdlib"
]
DATASET_PREFIXES = ("tfds:", "folder:", "npz:", "images:", "tokens:")
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max, which a test checks
HF_PREFIX = "hf:"  # --init-from hf:DIR, a Hugging Face GPT-2 (jdp.models.hf.PREFIX)


def check(config) -> None:
    """Raises `UsageError` naming the flag and the fix for the first invalid value."""
    check_types(config)
    _ = config.mesh_spec  # --mesh read and checked first (`TrainConfig.mesh_spec`)
    if not isinstance(config.optimizer, str):
        raise UsageError(
            "TrainConfig(optimizer=...) names a built-in optimizer; pass an Optax one as "
            "jdp.fit(config, optimizer=tx, lr_schedule=...)"
        )
    _check_dataset(config)
    for name in ("ckpt_dir", "log_dir", "init_from"):
        if getattr(config, name) is not None and not os.fspath(getattr(config, name)).strip():
            flag = f"--{name.replace('_', '-')}"  # a script's unset variable, never "none"
            raise UsageError(f"{flag} is empty; give a path, or leave {flag} out")
    for name, choices in _choices(type(config)).items():
        if getattr(config, name) not in choices:
            raise UsageError(
                f"unknown {name.replace('_', ' ')} {getattr(config, name)!r}; choose one "
                f"of: {', '.join(choices)}"
            )
    for name in ("batch_size", "steps"):
        if getattr(config, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    _check_numbers(config)
    _check_model_options(config)
    _check_flags_apply(config)
    if image_hw(config) and not config.dataset.startswith(("folder:", "images:", "tfds:")):
        raise UsageError(
            f"--image-size resizes a folder:PATH or images:PATH dataset's images; --dataset "
            f"{config.dataset} is not one"
        )
    if config.accumulate < 1:
        raise UsageError("--accumulate must be at least 1")
    if config.eval_every < 0:
        raise UsageError("--eval-every must be 0 (only at the end) or a positive step count")
    if config.ckpt_every < 0 or config.keep < 1:
        raise UsageError("--ckpt-every must be >= 0 and --keep at least 1")
    if config.ckpt_dir is None and (
        config.ckpt_every or config.no_resume or config.restart_from_scratch
    ):
        raise UsageError("--ckpt-every, --no-resume and --restart-from-scratch need --ckpt-dir DIR")
    if config.loader_workers < 0 or config.prefetch < 1:
        raise UsageError("--loader-workers must be >= 0 and --prefetch at least 1")
    if config.log_every < 1:
        raise UsageError("--log-every must be at least 1")
    _ = config.profile_window  # checks --profile-steps
    _check_steps_per_call(config)
    _check_groups(config)
    _check_layout(config)
    if config.check_replicas_every < 0:
        raise UsageError("--check-replicas-every must be >= 0 (0: off)")
    if config.ckpt_dir is None and (config.best_metric or config.best_mode != "auto"):
        raise UsageError("--best-metric and --best-mode choose a checkpoint: give --ckpt-dir DIR")
    if config.seq_len < 0 or config.vocab_size < 0:
        raise UsageError("--seq-len and --vocab-size must be >= 0 (0: the default)")
    if config.early_stop_patience < 0:
        raise UsageError("--early-stop-patience must be >= 0 (0: off)")
    if config.early_stop_patience and not config.eval_every:
        raise UsageError(
            "--early-stop-patience counts evaluations; add --eval-every N to evaluate "
            "during the run"
        )
    if config.lr_reference_batch < 1:
        raise UsageError("--lr-reference-batch must be at least 1")
    parts = config.lr_boundaries.split(",") if config.lr_boundaries else []
    if any(not part.strip().isdigit() for part in parts):  # "5,,10" is a typo, not 5,10
        raise UsageError(f"--lr-boundaries {config.lr_boundaries!r}: write steps, e.g. 200,300")
    if config.warmup_steps < 0:
        raise UsageError("--warmup-steps must be >= 0")
    if config.epochs < 0:
        raise UsageError("--epochs must be >= 0 (0: train for --steps)")
    if config.eval_only and config.ckpt_dir is None:
        raise UsageError("--eval-only evaluates a checkpoint; give --ckpt-dir DIR")
    if config.init_from is not None and config.eval_only:
        raise UsageError("--init-from starts training; with --eval-only give --ckpt-dir only")


def _check_dataset(config) -> None:
    for prefix in DATASET_PREFIXES:
        if config.dataset.startswith(prefix):
            if not config.dataset[len(prefix) :]:
                raise UsageError(f"--dataset {config.dataset}: give a name or path after it")
            return
    if config.dataset not in typing.get_args(DatasetName):
        raise UsageError(
            f"unknown dataset {config.dataset!r}; choose one of: "
            f"{', '.join(typing.get_args(DatasetName))}, or tfds:NAME (any TFDS dataset), "
            "folder:PATH or images:PATH (images in class folders), npz:FILE (arrays like x_train, "
            "y_train) or tokens:PATH (a token corpus)"
        )


def _check_numbers(config) -> None:
    """Real-valued flags: finite (NaN and inf pass ``x > 0``) and in their range. The
    learning rates are float32 in the step: past its largest, one is inf there."""
    ranges = {  # flag: (lowest, lowest allowed?, highest, highest allowed?)
        "lr": (0.0, False, FLOAT32_MAX, True),
        "outer_lr": (0.0, False, FLOAT32_MAX, True),
        "outer_momentum": (0.0, True, 1.0, False),
        "momentum": (0.0, True, 1.0, False),
        "beta1": (0.0, True, 1.0, False),
        "beta2": (0.0, True, 1.0, False),
        "end_lr": (0.0, True, FLOAT32_MAX, True),
        "weight_decay": (0.0, True, math.inf, False),
        "clip_norm": (0.0, True, math.inf, False),
        "lr_decay_factor": (0.0, False, math.inf, False),
        "max_skipped_fraction": (0.0, False, 1.0, True),
        "validation_fraction": (0.0, True, 1.0, False),
        "label_smoothing": (0.0, True, 1.0, False),
        "startup_timeout": (0.0, False, math.inf, False),
        "heartbeat_timeout": (0.0, False, math.inf, False),
        "stall_timeout": (0.0, True, math.inf, False),
        "ckpt_every_minutes": (0.0, True, math.inf, False),
    }
    for name, (low, low_in, high, high_in) in ranges.items():
        value = getattr(config, name)
        above = value >= low if low_in else value > low
        below = value <= high if high_in else value < high
        if not (above and below):  # also false for NaN
            span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            raise UsageError(f"--{name.replace('_', '-')} must be in {span}, got {value}")
    if 0 < config.stall_timeout < 1:
        # The watchdog looks every 0.1 s at its finest, and a healthy run's slower step, log
        # line or garbage collection outlasts a shorter limit: every run would end stalled.
        raise UsageError(
            f"--stall-timeout {config.stall_timeout:g} is under 1 s, shorter than a healthy "
            "run's pauses; give seconds (the default is 600), or 0 to turn the watchdog off"
        )
    if not 0 <= config.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32), got {config.seed}")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if type(value) is int and field.name != "seed" and value >= 2**31:
            raise UsageError(
                f"--{field.name.replace('_', '-')} {value} is past 2**31 - 1, the most the "
                "run's int32 counts hold (the step, a token id)"
            )


def _check_steps_per_call(config) -> None:
    """A number of steps a call need not divide the periods: a shorter call closes a call's
    gap up to one (`jdp.data.loader.call_steps`)."""
    if config.steps_per_call != "auto" and config.steps_per_call < 1:
        raise UsageError("--steps-per-call must be at least 1")


def _check_layout(config) -> None:
    """Sharded layouts run under jit, without DiLoCo groups."""
    parse_axis_rules(config.axis_rules)
    axes = config.mesh_spec.sizes
    sharded = [f"{a}={axes[a]}" for a in SHARDING_AXES if axes.get(a, 1) != 1]
    if config.shard_optimizer:
        sharded.append("--shard-optimizer")
    if not sharded:
        return
    if config.backend == "pmap":
        raise UsageError(
            f"{', '.join(sharded)} lay the state out over the mesh, which backend pmap "
            "cannot (it replicates the state); run with --backend jit"
        )
    if GROUP_AXIS in axes:
        raise UsageError(
            f"DiLoCo groups train replicated parameters; drop {', '.join(sharded)} or the "
            "group axis"
        )


def _check_groups(config) -> None:
    """DiLoCo's flags need a group axis; its interval whole calls of the step."""
    if config.sync_every < 0:
        raise UsageError(f"--sync-every must be >= 0, got {config.sync_every}")
    if not config.mesh_spec.has(GROUP_AXIS):
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        given = [
            f"--{name.replace('_', '-')}"
            for name in _diloco_fields(config)
            if getattr(config, name) != defaults[name]
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} set DiLoCo's groups, and --mesh {config.mesh} has none; "
                "add a group axis, e.g. --mesh group=2,data=4"
            )
        return
    if config.backend == "pmap":
        raise UsageError(
            "DiLoCo groups (a group axis) run with --backend jit; pmap maps over one axis"
        )
    if config.eval_every % config.resolved_sync_every:
        raise UsageError(
            f"--eval-every {config.eval_every} is not a multiple of --sync-every "
            f"{config.resolved_sync_every}: evaluation uses the synchronised parameters, which "
            "change only when the groups synchronise"
        )
    if config.steps_per_call != "auto" and config.resolved_sync_every % config.steps_per_call:
        raise UsageError(
            f"--sync-every {config.resolved_sync_every} is not a multiple of --steps-per-call "
            f"{config.steps_per_call}: the groups synchronise between calls"
        )


def _diloco_fields(config) -> list[str]:
    return [f.name for f in dataclasses.fields(config) if f.metadata["section"].name == "diloco"]


def _choices(cls) -> dict[str, tuple[str, ...]]:
    """The fields whose type is a ``Literal``, and their choices."""
    hints = typing.get_type_hints(cls)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }


# The flags that only some optimizers and schedules read: given (away from its default)
# with another, a flag would be dropped in silence.
_READ_BY = {
    "momentum": ("optimizer", ("momentum", "nesterov", "lars")),
    "beta1": ("optimizer", ("adam", "adamw", "lamb")),
    "beta2": ("optimizer", ("adam", "adamw", "lamb")),
    "end_lr": ("schedule", ("cosine", "linear")),
    "decay_steps": ("schedule", ("cosine", "linear")),
    "lr_boundaries": ("schedule", ("piecewise",)),
    "lr_decay_factor": ("schedule", ("piecewise",)),
}


def _check_flags_apply(config) -> None:
    """A flag that nothing in the run reads is one line naming who reads it."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    for name, (chooser, readers) in _READ_BY.items():
        value, chosen = getattr(config, name), getattr(config, chooser)
        if value != defaults[name] and chosen not in readers:
            raise UsageError(
                f"--{name.replace('_', '-')} {value} is read by --{chooser} "
                f"{', '.join(readers)}; drop it for --{chooser} {chosen}"
            )
    if (config.init_from or "").startswith(HF_PREFIX) and config.model != "gpt":
        raise UsageError(f"--init-from {config.init_from} loads GPT-2's weights; use --model gpt")
    language = config.model == "gpt" or config.dataset == "python_stdlib"
    if config.early_stop_patience and config.early_stop_metric == "accuracy" and language:
        raise UsageError(
            "--early-stop-metric accuracy: a language model's evaluation gives loss, "
            "token_accuracy and bits per byte, no accuracy; use --early-stop-metric loss"
        )
    if config.seq_len and not (language or config.dataset.startswith("tokens:")):
        raise UsageError(
            f"--seq-len {config.seq_len} is a language model's window (--model gpt, a token "
            f"corpus); drop it for --model {config.model} on {config.dataset}"
        )
    _check_readers(config, defaults)


def _check_readers(config, defaults: dict) -> None:
    """The flags read only by a token corpus, a model with attention, a run that skips
    updates, a loader on the host, or early stopping: given without it, one line."""
    given = lambda name: getattr(config, name) != defaults[name]  # noqa: E731
    corpus = config.dataset.startswith("tokens:") or config.dataset == "python_stdlib"
    for name in ("vocab_size", "token_dtype"):
        if given(name) and not corpus:
            raise UsageError(
                f"--{name.replace('_', '-')} {getattr(config, name)} reads a token corpus "
                f"(--dataset tokens:PATH); drop it for --dataset {config.dataset}"
            )
    if given("attention") and config.model not in ("gpt", "seq2seq"):
        raise UsageError(
            f"--attention {config.attention} is for --model gpt and seq2seq; drop it for "
            f"--model {config.model}"
        )
    if given("max_skipped_fraction") and not (
        config.nan_policy == "skip" or config.precision == "fp16"
    ):
        raise UsageError(
            f"--max-skipped-fraction {config.max_skipped_fraction:g} bounds the updates that "
            "--precision fp16 or --nan-policy skip skip; add one, or drop it"
        )
    if config.data_on_device == "on" and config.loader_workers:
        raise UsageError(
            f"--loader-workers {config.loader_workers} read batches on the host, and "
            "--data-on-device on gathers them on the devices; drop one (auto chooses)"
        )
    if given("early_stop_metric") and not config.early_stop_patience:
        raise UsageError(
            f"--early-stop-metric {config.early_stop_metric} is what --early-stop-patience "
            "watches; add --early-stop-patience N, or drop it"
        )


def _check_model_options(config) -> None:
    """The language model's own flags with another model: one line, not a silent no-op."""
    own = {
        "--remat": config.remat != "none",
        "--unroll-layers": config.unroll_layers,
        "--fp8": config.fp8,
        f"--loss-chunks {config.loss_chunks}": config.loss_chunks != 1,
        f"--model-size {config.model_size}": config.model_size not in ("small", "standard"),
    }
    for name in ("layers", "heads", "width", "hidden"):
        own[f"--{name} {getattr(config, name)}"] = bool(getattr(config, name))
        if getattr(config, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (0: --model-size's)")
    own[f"--dropout {config.dropout}"] = config.dropout is not None
    for flag, given in own.items():
        if given and config.model != "gpt":
            raise UsageError(f"{flag} is for --model gpt; drop it for --model {config.model}")
    if config.attention == "cudnn" and config.precision == "fp32":
        raise UsageError(
            "--attention cudnn is cuDNN's fused kernel, which takes bf16 or fp16; "
            "add --precision bf16, or use --attention auto or xla"
        )
    if config.dropout is not None and not 0 <= config.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {config.dropout}")
    if config.loss_chunks < 1:
        raise UsageError(f"--loss-chunks must be at least 1, got {config.loss_chunks}")
    if config.eval_batches < 0:
        raise UsageError("--eval-batches must be >= 0 (0: the whole split)")
    if config.decay_steps < 0:
        raise UsageError("--decay-steps must be >= 0 (0: --steps)")


def image_hw(config) -> tuple[int, int] | None:
    """``--image-size`` as ``(height, width)``, or None."""
    if not config.image_size:
        return None
    parts = config.image_size.replace("x", ",").split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise UsageError(f"--image-size {config.image_size!r}: give H,W, e.g. 64,64")
    height, width = int(parts[0]), int(parts[1])
    rows = -(-config.batch_size // int(os.environ.get("JDP_NUM_PROCESSES") or 1))  # a host's
    batch, memory = rows * height * width * 3, _host_bytes()
    if height * width > MAX_PIXELS or (memory and batch > memory):
        raise UsageError(
            f"--image-size {height},{width}: a process's {rows} such crops of a batch are "
            f"{batch / 2**30:,.1f} GiB of pixels (this host has {memory / 2**30:,.1f} GiB, and "
            f"no crop may pass {MAX_PIXELS:,} pixels); give a smaller --image-size"
        )
    return height, width


# The most pixels an image may have: Pillow's default limit (twice its
# MAX_IMAGE_PIXELS, which a test holds equal), past which it refuses to decode one.
MAX_PIXELS = 178_956_970


def _host_bytes() -> int:
    """This machine's memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
