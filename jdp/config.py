"""The typed, frozen run configuration and its command-line flags."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS, SHARDING_AXES, parse_axis_rules, parse_mesh_spec

# The choices of the fields that name things. Each registry it names agrees
# (tests/test_api.py): the step's backends, the built-in models and sizes, the
# datasets, optimizers, schedules, LR scaling rules and precisions.
Backend = Literal["jit", "pmap"]
ModelName = Literal["cnn", "gpt", "mlp", "resnet18", "resnet20", "seq2seq"]
ModelSize = Literal["small", "standard"]
# The datasets known by name; --dataset also takes your own data by these prefixes
# (jdp.data.custom reads them).
DatasetName = Literal["cifar10", "digits", "fashion_mnist", "mnist", "numbers2words"]
DATASET_PREFIXES = ("tfds:", "folder:", "npz:")
OptimizerName = Literal["sgd", "momentum", "nesterov", "adam", "adamw", "lamb", "lars"]
ScheduleName = Literal["constant", "cosine", "linear", "noam", "piecewise"]
LrScaling = Literal["none", "linear", "sqrt"]
PrecisionName = Literal["fp32", "bf16", "fp16"]
ReduceDtype = Literal["fp32", "bf16"]
EarlyStopMetric = Literal["loss", "accuracy"]
NanPolicy = Literal["stop", "skip", "ignore"]
OuterOptimizerName = Literal["nesterov", "sgd"]
# DiLoCo's synchronisation interval when a mesh has a group axis and --sync-every is 0.
DEFAULT_SYNC_EVERY = 50


def _flag(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Invalid values raise `UsageError`."""

    mesh: str = _flag(
        "data=-1",
        "device mesh, axes in this order: group, data (replicas), fsdp (parameters, gradients "
        "and optimizer state split, and the batch), model (tensor parallel: heads and MLP "
        "units split); e.g. data=8, data=-1 (all devices), fsdp=8, data=2,fsdp=4, "
        "data=4,model=2, or group=2,data=4 (DiLoCo: 2 groups of 4 replicas that synchronise "
        "every --sync-every steps)",
    )
    backend: Backend = _flag("jit", "step backend: jit (jit over shard_map) or pmap")
    model: ModelName = _flag(
        "mlp", "built-in model: mlp, cnn, resnet20, resnet18 (images), seq2seq or gpt (sequences)"
    )
    model_size: ModelSize = _flag(
        "small", "small (trains in minutes on a CPU) or standard (published)"
    )
    dataset: str = _flag(
        "digits",
        "digits (bundled), numbers2words (generated), mnist, fashion_mnist, cifar10, "
        "tfds:NAME (any TFDS dataset prepared as array_record), folder:PATH (images in "
        "class folders) or npz:FILE (NumPy arrays named like x_train, y_train, x_test, y_test)",
    )
    validation_fraction: float = _flag(
        0.0,
        "hold out this fraction of the training split (seeded) to validate on: it chooses the "
        "best checkpoint and early stopping, and the test split is only reported (0: none)",
    )
    data_dir: str | None = _flag(
        None, "TFDS data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)"
    )
    batch_size: int = _flag(128, "global batch size, split over the data axis")
    loader_workers: int = _flag(
        0, "Grain worker processes that load and augment batches (0: a thread of this process)"
    )
    prefetch: int = _flag(
        2, "batches (with --steps-per-call, calls' stacked batches) placed on the devices ahead"
    )
    steps: int = _flag(400, "number of training steps")
    epochs: int = _flag(
        0, "train for this many passes over the training split instead of --steps (0: off)"
    )
    optimizer: OptimizerName = _flag("adam", "sgd, momentum, nesterov, adam, adamw, lamb or lars")
    lr: float = _flag(3e-3, "base learning rate: the schedule's peak, before --lr-scaling")
    schedule: ScheduleName = _flag(
        "cosine", "after warmup: constant, cosine, linear, noam or piecewise"
    )
    warmup_steps: int = _flag(40, "steps of linear learning-rate warmup from 0")
    lr_scaling: LrScaling = _flag(
        "none", "scale --lr with the global batch: none, linear (Goyal et al.) or sqrt"
    )
    lr_reference_batch: int = _flag(256, "the batch size --lr was tuned for (for --lr-scaling)")
    lr_boundaries: str = _flag("", "piecewise schedule: comma-separated steps, e.g. 200,300")
    lr_decay_factor: float = _flag(0.1, "piecewise schedule: multiplier at each boundary")
    momentum: float = _flag(0.9, "momentum of momentum, nesterov and lars")
    weight_decay: float = _flag(0.0, "weight decay (biases and norm scales are spared)")
    clip_norm: float = _flag(0.0, "clip the gradients' global norm to this (0: off)")
    accumulate: int = _flag(1, "micro-batches per update (gradient accumulation)")
    steps_per_call: int = _flag(
        1, "optimizer steps per compiled call, scanned on the device (for small, fast steps)"
    )
    precision: PrecisionName = _flag(
        "fp32", "compute dtype: fp32, bf16 or fp16 (fp16 scales the loss)"
    )
    reduce_dtype: ReduceDtype = _flag("fp32", "gradient all-reduce dtype: fp32 or bf16")
    shard_optimizer: bool = _flag(
        False,
        "ZeRO-1: split the optimizer's state over the data axis (parameters stay as the mesh "
        "lays them out)",
    )
    axis_rules: str = _flag(
        "",
        "logical axis name -> mesh axis, over jdp's rules, e.g. mlp=model,embed=none "
        "(none: never split that dimension)",
    )
    sync_every: int = _flag(
        0,
        f"DiLoCo (a mesh with a group axis): steps between the groups' synchronisations "
        f"(0: {DEFAULT_SYNC_EVERY})",
    )
    outer_optimizer: OuterOptimizerName = _flag(
        "nesterov",
        "DiLoCo's outer optimizer: nesterov (Nesterov momentum) or sgd (heavy-ball momentum; "
        "local SGD is sgd with --outer-lr 1 --outer-momentum 0)",
    )
    outer_lr: float = _flag(0.7, "DiLoCo's outer learning rate")
    outer_momentum: float = _flag(0.9, "DiLoCo's outer momentum (0: none)")
    nan_policy: NanPolicy = _flag(
        "stop",
        "a non-finite loss or gradient: stop (the run, exit 1), skip (that update, as fp16 "
        "does) or ignore; a non-finite state is never saved",
    )
    max_skipped_fraction: float = _flag(
        0.25, "stop when more than this fraction of the steps were skipped (fp16 or skip)"
    )
    eval_every: int = _flag(0, "evaluate on the test split every N steps (0: only at the end)")
    ckpt_dir: str | None = _flag(
        None, "directory of Orbax checkpoints; a run resumes from the latest one in it"
    )
    ckpt_every: int = _flag(0, "save every N steps (0: only at the end and when preempted)")
    keep: int = _flag(3, "latest checkpoints to keep (the best by test accuracy is kept too)")
    no_resume: bool = _flag(False, "start fresh; refused when --ckpt-dir holds checkpoints")
    init_from: str | None = _flag(
        None,
        "start from the parameters (and model state) of another run's checkpoint: its "
        "--ckpt-dir or one step directory; the optimizer starts fresh (fine-tuning)",
    )
    eval_only: bool = _flag(
        False,
        "evaluate the latest checkpoint in --ckpt-dir (made with the flags it recorded) on the "
        "test split, and train nothing",
    )
    seed: int = _flag(0, "seed for initialisation and the data order")
    log_dir: str | None = _flag(
        None, "run directory: TensorBoard events, metrics.jsonl, config.json, run.json, profiles"
    )
    log_every: int = _flag(20, "write train metrics (loss, lr, examples/s, MFU) every N steps")
    grad_norm: bool = _flag(
        False,
        "report the gradients' global norm (grad_norm) each step: one more pass over the "
        "gradients, 4-7%% of a 10.8M-parameter MLP's step on the CPU",
    )
    profile_steps: str = _flag(
        "", "profile steps A:B (inclusive) into LOG_DIR/profile, e.g. 10:15 (needs --log-dir)"
    )
    coordinator: str | None = _flag(
        None, "multi-process run: HOST:PORT of process 0 (or $JDP_COORDINATOR)"
    )
    num_processes: int | None = _flag(
        None, "multi-process run: number of processes (or $JDP_NUM_PROCESSES)"
    )
    process_id: int | None = _flag(
        None, "multi-process run: this process, 0..N-1 (or $JDP_PROCESS_ID)"
    )
    startup_timeout: float = _flag(300.0, "seconds to wait for every process to start")
    heartbeat_timeout: float = _flag(
        60.0, "seconds after which a silent process counts as lost and the run stops"
    )
    check_replicas_every: int = _flag(
        0, "compare a checksum of the parameters on every device every N steps (0: off)"
    )
    early_stop_patience: int = _flag(
        0, "stop when --early-stop-metric has not improved for N evaluations (0: off)"
    )
    early_stop_metric: EarlyStopMetric = _flag(
        "loss", "test metric for --early-stop-patience: loss (lower wins) or accuracy (higher)"
    )

    def __post_init__(self):
        parse_mesh_spec(self.mesh)
        if not isinstance(self.optimizer, str):
            raise UsageError(
                "TrainConfig(optimizer=...) names a built-in optimizer; pass an Optax one as "
                "jdp.fit(config, optimizer=tx, lr_schedule=...)"
            )
        self._check_dataset()
        for name, choices in _choices().items():
            if getattr(self, name) not in choices:
                raise UsageError(
                    f"unknown {name.replace('_', ' ')} {getattr(self, name)!r}; choose one "
                    f"of: {', '.join(choices)}"
                )
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        self._check_numbers()
        if self.accumulate < 1:
            raise UsageError("--accumulate must be at least 1")
        if self.eval_every < 0:
            raise UsageError("--eval-every must be 0 (only at the end) or a positive step count")
        if self.ckpt_every < 0 or self.keep < 1:
            raise UsageError("--ckpt-every must be >= 0 and --keep at least 1")
        if self.ckpt_dir is None and (self.ckpt_every or self.no_resume):
            raise UsageError("--ckpt-every and --no-resume need --ckpt-dir DIR")
        if self.loader_workers < 0 or self.prefetch < 1:
            raise UsageError("--loader-workers must be >= 0 and --prefetch at least 1")
        if self.log_every < 1:
            raise UsageError("--log-every must be at least 1")
        _ = self.profile_window  # checks --profile-steps
        self._check_steps_per_call()
        self._check_groups()
        self._check_layout()
        if self.check_replicas_every < 0:
            raise UsageError("--check-replicas-every must be >= 0 (0: off)")
        if self.early_stop_patience < 0:
            raise UsageError("--early-stop-patience must be >= 0 (0: off)")
        if self.early_stop_patience and not self.eval_every:
            raise UsageError(
                "--early-stop-patience counts evaluations; add --eval-every N to evaluate "
                "during the run"
            )
        if self.lr_reference_batch < 1:
            raise UsageError("--lr-reference-batch must be at least 1")
        if any(not part.strip().isdigit() for part in self.lr_boundaries.split(",") if part):
            raise UsageError(f"--lr-boundaries {self.lr_boundaries!r}: write steps, e.g. 200,300")
        if self.warmup_steps < 0:
            raise UsageError("--warmup-steps must be >= 0")
        if self.epochs < 0:
            raise UsageError("--epochs must be >= 0 (0: train for --steps)")
        if self.eval_only and self.ckpt_dir is None:
            raise UsageError("--eval-only evaluates a checkpoint; give --ckpt-dir DIR")
        if self.init_from is not None and self.eval_only:
            raise UsageError("--init-from starts training; with --eval-only give --ckpt-dir only")

    def _check_dataset(self) -> None:
        for prefix in DATASET_PREFIXES:
            if self.dataset.startswith(prefix):
                if not self.dataset[len(prefix) :]:
                    raise UsageError(f"--dataset {self.dataset}: give a name or path after it")
                return
        if self.dataset not in typing.get_args(DatasetName):
            raise UsageError(
                f"unknown dataset {self.dataset!r}; choose one of: "
                f"{', '.join(typing.get_args(DatasetName))}, or tfds:NAME (any TFDS dataset), "
                "folder:PATH (images in class folders) or npz:FILE (arrays named like x_train, "
                "y_train)"
            )

    def _check_numbers(self) -> None:
        """Real-valued flags: finite (NaN and inf pass ``x > 0``) and in their range."""
        ranges = {  # flag: (lowest, lowest allowed?, highest, highest allowed?)
            "lr": (0.0, False, math.inf, False),
            "outer_lr": (0.0, False, math.inf, False),
            "outer_momentum": (0.0, True, 1.0, False),
            "momentum": (0.0, True, 1.0, False),
            "weight_decay": (0.0, True, math.inf, False),
            "clip_norm": (0.0, True, math.inf, False),
            "lr_decay_factor": (0.0, False, math.inf, False),
            "max_skipped_fraction": (0.0, False, 1.0, True),
            "validation_fraction": (0.0, True, 1.0, False),
            "startup_timeout": (0.0, False, math.inf, False),
            "heartbeat_timeout": (0.0, False, math.inf, False),
        }
        for name, (low, low_in, high, high_in) in ranges.items():
            value = getattr(self, name)
            above = value >= low if low_in else value > low
            below = value <= high if high_in else value < high
            if not (above and below):  # also false for NaN
                span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
                raise UsageError(f"--{name.replace('_', '-')} must be in {span}, got {value}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32), got {self.seed}")

    def _check_steps_per_call(self) -> None:
        calls = self.steps_per_call
        if calls < 1:
            raise UsageError("--steps-per-call must be at least 1")
        if calls == 1:
            return
        periodic = {
            "steps": self.steps,
            "eval-every": self.eval_every,
            "ckpt-every": self.ckpt_every,
            "check-replicas-every": self.check_replicas_every,
        }
        for flag, value in periodic.items():
            if value % calls:
                raise UsageError(
                    f"--{flag} {value} is not a multiple of --steps-per-call {calls}: a run "
                    f"evaluates and saves between calls; use a multiple of {calls}"
                )
        if self.profile_window:
            first, last = self.profile_window
            if (first - 1) % calls or last % calls:
                raise UsageError(
                    f"--profile-steps {self.profile_steps} must cover whole calls of "
                    f"--steps-per-call {calls}, e.g. {calls + 1}:{2 * calls}"
                )

    def _check_layout(self) -> None:
        """Sharded layouts run under jit, without DiLoCo groups."""
        parse_axis_rules(self.axis_rules)
        axes = dict(parse_mesh_spec(self.mesh))
        sharded = [f"{a}={axes[a]}" for a in SHARDING_AXES if axes.get(a, 1) != 1]
        if self.shard_optimizer:
            sharded.append("--shard-optimizer")
        if not sharded:
            return
        if self.backend == "pmap":
            raise UsageError(
                f"{', '.join(sharded)} lay the state out over the mesh, which backend pmap "
                "cannot (it replicates the state); run with --backend jit"
            )
        if GROUP_AXIS in axes:
            raise UsageError(
                f"DiLoCo groups train replicated parameters; drop {', '.join(sharded)} or the "
                "group axis"
            )

    def _check_groups(self) -> None:
        """DiLoCo's flags need a group axis; its interval whole calls of the step."""
        if self.sync_every < 0:
            raise UsageError(f"--sync-every must be >= 0, got {self.sync_every}")
        if GROUP_AXIS not in dict(parse_mesh_spec(self.mesh)):
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            given = [
                f"--{name.replace('_', '-')}"
                for name in DILOCO_FIELDS
                if getattr(self, name) != defaults[name]
            ]
            if given:
                raise UsageError(
                    f"{', '.join(given)} set DiLoCo's groups, and --mesh {self.mesh} has none; "
                    "add a group axis, e.g. --mesh group=2,data=4"
                )
            return
        if self.backend == "pmap":
            raise UsageError(
                "DiLoCo groups (a group axis) run with --backend jit; pmap maps over one axis"
            )
        if self.eval_every % self.resolved_sync_every:
            raise UsageError(
                f"--eval-every {self.eval_every} is not a multiple of --sync-every "
                f"{self.resolved_sync_every}: evaluation uses the synchronised parameters, which "
                "change only when the groups synchronise"
            )
        if self.resolved_sync_every % self.steps_per_call:
            raise UsageError(
                f"--sync-every {self.resolved_sync_every} is not a multiple of --steps-per-call "
                f"{self.steps_per_call}: the groups synchronise between calls"
            )

    @property
    def resolved_sync_every(self) -> int:
        """The steps between DiLoCo's synchronisations: ``--sync-every``, or its default."""
        return self.sync_every or DEFAULT_SYNC_EVERY

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """``--profile-steps A:B`` as ``(A, B)``, or None."""
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition(":")
        if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
            raise UsageError(
                f"--profile-steps {self.profile_steps!r}: write FIRST:LAST steps, e.g. 10:15"
            )
        if int(last) > self.steps:
            raise UsageError(
                f"--profile-steps {self.profile_steps} ends after --steps {self.steps}"
            )
        if self.log_dir is None:
            raise UsageError("--profile-steps needs --log-dir DIR (the trace goes in DIR/profile)")
        return int(first), int(last)

    def shared_settings(self) -> dict:
        """The flags every process of a run must agree on: all but where each one runs."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in _PER_PROCESS_FIELDS
        }

    def resume_conflicts(self, saved: dict, recorded: dict | None = None) -> list[str]:
        """Flags whose values differ from the run that wrote a checkpoint, as ``--flag X (was Y)``.

        A resumed run may change where and how it runs (mesh, backend, loader,
        checkpointing), never what it computes. ``recorded`` is this run's config
        as checkpoints record it (what the user brought in place of fields is
        recorded as theirs), by default the fields themselves.
        """
        recorded = dataclasses.asdict(self) if recorded is None else recorded
        fields = {field.name for field in dataclasses.fields(self)} | {"lr_schedule"}
        conflicts = []
        for name, value in recorded.items():
            if name in TOPOLOGY_FIELDS or name not in fields or name not in saved:
                continue
            if saved[name] != value:
                conflicts.append(f"--{name.replace('_', '-')} {value} (was {saved[name]})")
        return conflicts


# What a resumed run may change: where and how it runs, not what it computes.
TOPOLOGY_FIELDS = frozenset(
    {
        "mesh",
        "backend",
        "data_dir",
        "loader_workers",
        "prefetch",
        "eval_every",
        "shard_optimizer",
        "axis_rules",
    }
    | {"ckpt_dir", "ckpt_every", "keep", "no_resume"}
    | {"coordinator", "num_processes", "process_id", "startup_timeout", "heartbeat_timeout"}
    | {"check_replicas_every", "log_dir", "log_every", "grad_norm", "profile_steps"}
    | {"steps_per_call"}
    | {"early_stop_patience", "early_stop_metric", "max_skipped_fraction"}
    | {"steps", "epochs", "init_from", "eval_only"}  # steps: see jdp.loop's resume
)


# DiLoCo's flags, which only a mesh with a group axis takes.
DILOCO_FIELDS = ("sync_every", "outer_optimizer", "outer_lr", "outer_momentum")


# What may differ between the processes of one run: who each is, where it finds
# the data, how it loads it, and how long it waits for the others.
_PER_PROCESS_FIELDS = frozenset(
    {"coordinator", "num_processes", "process_id", "data_dir", "loader_workers", "prefetch"}
    | {"startup_timeout"}
)


def _choices() -> dict[str, tuple[str, ...]]:
    """The fields whose type is a ``Literal``, and their choices."""
    hints = typing.get_type_hints(TrainConfig)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }
