"""The typed, frozen run configuration and its command-line flags."""

from __future__ import annotations

import dataclasses

from jdp.errors import UsageError
from jdp.mesh_spec import MeshSpec
from jdp.training import choices, config_checks
from jdp.training.sections import (
    CHECKPOINTS,
    DATA,
    DILOCO,
    EVALUATION,
    HEALTH,
    INPUT,
    LAYOUT,
    LENGTH,
    MODEL,
    OBSERVABILITY,
    OPTIMIZER,
    PROCESS,
    STEP,
    Section,
    _flag,
)

# The gpt's shape flags: each replaces its --model-size's value when set (as
# jdp.models.registry.GPT_SHAPE, which the config may not import).
GPT_SHAPE = ("layers", "heads", "width", "hidden")
# DiLoCo's synchronisation interval when a mesh has a group axis and --sync-every is 0.
DEFAULT_SYNC_EVERY = 50


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Invalid values raise `UsageError`."""

    mesh: str = _flag(
        LAYOUT,
        "data=-1",
        "device mesh, axes in this order: group, data (replicas), fsdp (parameters, gradients "
        "and optimizer state split, and the batch), model (tensor parallel: heads and MLP "
        "units split); e.g. data=8, data=-1 (all devices), fsdp=8, data=2,fsdp=4, "
        "data=4,model=2, or group=2,data=4 (DiLoCo: 2 groups of 4 replicas that synchronise "
        "every --sync-every steps)",
    )
    backend: choices.Backend = _flag(
        LAYOUT, "jit", "step backend: jit (jit over shard_map) or pmap"
    )
    remat: choices.Remat = _flag(
        LAYOUT,
        "none",
        "gpt: recompute activations in the backward pass to save memory: none, dots (keep "
        "the products with the weights), full (keep only each layer's input) or attention "
        "(recompute only XLA's attention scores, which cuDNN's kernel never keeps)",
    )
    attention: choices.Attention = _flag(
        LAYOUT,
        "auto",
        "gpt and seq2seq: attention's implementation, auto (cuDNN's fused kernel on a GPU in "
        "bf16/fp16, else XLA's), xla, cudnn or blocked (a fused kernel's memory, anywhere)",
    )
    loss_chunks: int = _flag(
        LAYOUT,
        1,
        "gpt on a token corpus: take the logits for the loss this many chunks of "
        "tokens at a time, each recomputed in the backward pass (1: all at once)",
    )
    model: choices.ModelName = _flag(
        MODEL,
        "mlp",
        "built-in model: mlp, cnn, resnet20, resnet18, resnet50 (images), seq2seq or gpt "
        "(sequences)",
    )
    model_size: choices.ModelSize = _flag(
        MODEL,
        "small",
        "small (trains in minutes on a CPU) or standard (published); gpt also 124m, 350m, "
        "774m (GPT-2's) and 1.3b (GPT-3 XL's), their vocabulary padded to a multiple of 128",
    )
    label_smoothing: float = _flag(
        MODEL, 0.0, "a built-in image classifier's loss on labels smoothed by this much (0: none)"
    )
    unroll_layers: bool = _flag(
        MODEL,
        False,
        "gpt: its blocks as a Python loop, not one scanned layer (as checkpoints written "
        "before scanned layers hold them; compile time then grows with depth)",
    )
    fp8: bool = _flag(MODEL, False, "gpt: its layers' matrix products in FP8 while training")
    layers: int = _flag(MODEL, 0, "gpt: blocks, in place of --model-size's (0: the size's)")
    heads: int = _flag(MODEL, 0, "gpt: attention heads, dividing the width (0: the size's)")
    width: int = _flag(MODEL, 0, "gpt: the model width, nanoGPT's n_embd (0: the size's)")
    hidden: int = _flag(MODEL, 0, "gpt: the feed-forward's hidden units (0: the size's)")
    bias: bool = _flag(MODEL, True, "gpt: biases in dense layers, LayerNorms (nanoGPT: --no-bias)")
    dropout: float | None = _flag(
        MODEL, None, "gpt: the dropout rate (empty: the size's, 0.1; nanoGPT pretrains with 0)"
    )
    dataset: str = _flag(
        DATA,
        "digits",
        "digits (bundled), numbers2words (generated), mnist, fashion_mnist, cifar10, "
        "python_stdlib (text: the Python standard library's sources as bytes, prepared on first "
        "use), tfds:NAME (any TFDS dataset prepared as array_record), folder:PATH (images in "
        "class folders, in memory), images:PATH (class folders or their packed form, streamed "
        "and decoded per batch, Inception crops), npz:FILE (arrays named like x_train, y_train) "
        "or tokens:PATH (a token corpus: llm.c shards, raw .bin or .npy; a file, directory "
        "or glob, its val and test files by name)",
    )
    image_size: str = _flag(
        DATA,
        "",
        "H,W: resize folder:PATH's images (of several sizes), "
        "images:PATH's crops (default 224,224)",
    )
    seq_len: int = _flag(
        DATA,
        0,
        "tokens a language model reads at once: a token corpus's window, and the gpt model's "
        "positions (0: the model's own, 256 for gpt small, 1024 for standard)",
    )
    vocab_size: int = _flag(
        DATA, 0, "a token corpus's vocabulary size (0: from the tokens.json beside it)"
    )
    token_dtype: choices.TokenDtype = _flag(
        DATA,
        "",
        "the ids of raw .bin token files (no llm.c "
        "header): uint16, uint32 or int32 (default: from "
        "tokens.json; never guessed)",
    )
    validation_fraction: float = _flag(
        DATA,
        0.0,
        "hold out this fraction of the training split (seeded) to validate on: it chooses the "
        "best checkpoint and early stopping, and the test split is only reported (0: none)",
    )
    data_dir: str | None = _flag(
        INPUT, None, "TFDS data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)"
    )
    batch_size: int = _flag(DATA, 128, "global batch size, split over the data axis")
    loader_workers: int = _flag(
        INPUT,
        0,
        "Grain worker processes that load and augment batches (0: a thread of this process)",
    )
    prefetch: int = _flag(
        INPUT,
        2,
        "batches (with --steps-per-call, calls' stacked batches) placed on the devices ahead",
    )
    data_on_device: choices.DataOnDevice = _flag(
        INPUT,
        "auto",
        "place the splits on every device once and gather each step's rows "
        "there, the same batches without a host read (auto: when they fit in a quarter of "
        "a device's memory left by the model, and no --loader-workers)",
    )
    steps: int = _flag(LENGTH, 400, "number of training steps")
    epochs: int = _flag(
        LENGTH, 0, "train for this many passes over the training split instead of --steps (0: off)"
    )
    optimizer: choices.OptimizerName = _flag(
        OPTIMIZER, "adam", "sgd, momentum, nesterov, adam, adamw, lamb or lars"
    )
    lr: float = _flag(
        OPTIMIZER, 3e-3, "base learning rate: the schedule's peak, before --lr-scaling"
    )
    schedule: choices.ScheduleName = _flag(
        OPTIMIZER, "cosine", "after warmup: constant, cosine, linear, noam or piecewise"
    )
    warmup_steps: int = _flag(OPTIMIZER, 40, "steps of linear learning-rate warmup from 0")
    lr_scaling: choices.LrScaling = _flag(
        OPTIMIZER, "none", "scale --lr with the global batch: none, linear (Goyal et al.) or sqrt"
    )
    lr_reference_batch: int = _flag(
        OPTIMIZER, 256, "the batch size --lr was tuned for (for --lr-scaling)"
    )
    lr_boundaries: str = _flag(
        OPTIMIZER, "", "piecewise schedule: comma-separated steps, e.g. 200,300"
    )
    lr_decay_factor: float = _flag(
        OPTIMIZER, 0.1, "piecewise schedule: multiplier at each boundary"
    )
    momentum: float = _flag(OPTIMIZER, 0.9, "momentum of momentum, nesterov and lars")
    beta1: float = _flag(OPTIMIZER, 0.9, "Adam's b1 (adam, adamw, lamb)")
    beta2: float = _flag(OPTIMIZER, 0.999, "Adam's b2 (adam, adamw, lamb; nanoGPT's GPT-2: 0.95)")
    end_lr: float = _flag(
        OPTIMIZER, 0.0, "cosine and linear: the learning rate the decay ends at (nanoGPT's min_lr)"
    )
    decay_steps: int = _flag(
        OPTIMIZER, 0, "cosine and linear: the step the decay ends at, held after (0: --steps)"
    )
    weight_decay: float = _flag(OPTIMIZER, 0.0, "weight decay (biases and norm scales are spared)")
    clip_norm: float = _flag(OPTIMIZER, 0.0, "clip the gradients' global norm to this (0: off)")
    accumulate: int = _flag(STEP, 1, "micro-batches per update (gradient accumulation)")
    steps_per_call: int | choices.Auto = _flag(
        LAYOUT,
        "auto",
        "optimizer steps per compiled call, scanned on the device (auto: the run chooses, "
        "bitwise one step a call; a number forces it)",
        shown=STEP.name,
    )
    precision: choices.PrecisionName = _flag(
        STEP, "fp32", "compute dtype: fp32, bf16 or fp16 (fp16 scales the loss)"
    )
    reduce_dtype: choices.ReduceDtype = _flag(
        STEP, "fp32", "gradient all-reduce dtype: fp32 or bf16"
    )
    shard_optimizer: bool = _flag(
        LAYOUT,
        False,
        "ZeRO-1: split the optimizer's state over the data axis (parameters stay as the mesh "
        "lays them out)",
    )
    axis_rules: str = _flag(
        LAYOUT,
        "",
        "logical axis name -> mesh axis, over jdp's rules, e.g. mlp=model,embed=none "
        "(none: never split that dimension)",
    )
    sync_every: int = _flag(
        DILOCO,
        0,
        f"DiLoCo (a mesh with a group axis): steps between the groups' synchronisations "
        f"(0: {DEFAULT_SYNC_EVERY})",
    )
    outer_optimizer: choices.OuterOptimizerName = _flag(
        DILOCO,
        "nesterov",
        "DiLoCo's outer optimizer: nesterov (Nesterov momentum) or sgd (heavy-ball momentum; "
        "local SGD is sgd with --outer-lr 1 --outer-momentum 0)",
    )
    outer_lr: float = _flag(DILOCO, 0.7, "DiLoCo's outer learning rate")
    outer_momentum: float = _flag(DILOCO, 0.9, "DiLoCo's outer momentum (0: none)")
    nan_policy: choices.NanPolicy = _flag(
        STEP,
        "stop",
        "a non-finite loss or gradient: stop (the run, exit 1), skip (that update, as fp16 "
        "does) or ignore; a non-finite state is never saved",
    )
    max_skipped_fraction: float = _flag(
        EVALUATION,
        0.25,
        "stop when more than this fraction of the steps were skipped (fp16 or skip)",
    )
    eval_every: int = _flag(
        EVALUATION,
        0,
        "evaluate every N steps, on the validation split when the run has one "
        "(a language model's corpus does), else the test split (0: only at the end)",
    )
    eval_batches: int = _flag(
        EVALUATION,
        0,
        "read the first N batches of each split an evaluation reads (nanoGPT's eval_iters; 0: all)",
    )
    ckpt_dir: str | None = _flag(
        CHECKPOINTS, None, "directory of Orbax checkpoints; a run resumes from the latest one in it"
    )
    ckpt_every: int = _flag(
        CHECKPOINTS, 0, "save every N steps (0: only at the end and when preempted)"
    )
    ckpt_every_minutes: float = _flag(
        CHECKPOINTS, 10.0, "also save once this many minutes passed since the last save (0: off)"
    )
    keep: int = _flag(
        CHECKPOINTS, 3, "latest checkpoints to keep (the best by --best-metric is kept too)"
    )
    best_metric: str = _flag(
        CHECKPOINTS,
        "",
        "the eval metric that picks the best checkpoint, NAME or SPLIT/NAME of the split that "
        "chooses (val with a validation split, else test), e.g. val/loss (default: the "
        "model's own: accuracy, or loss for a language model); each evaluation better than "
        "every earlier one is saved",
    )
    best_mode: choices.BestMode = _flag(
        CHECKPOINTS,
        "auto",
        "is a higher or a lower --best-metric better: max, min, or auto (min for loss, "
        "perplexity and bits_per_byte, else max)",
    )
    no_resume: bool = _flag(
        CHECKPOINTS, False, "start fresh; refused when --ckpt-dir holds checkpoints"
    )
    restart_from_scratch: bool = _flag(
        CHECKPOINTS,
        False,
        "where every checkpoint in --ckpt-dir is damaged (set aside as "
        "damaged-STEP-TIME), train from step 0 in it; refused otherwise",
    )
    allow_new_data: bool = _flag(
        CHECKPOINTS,
        False,
        "resume on training data other than the checkpoints recorded (refused otherwise)",
    )
    init_from: str | None = _flag(
        LENGTH,
        None,
        "start from the parameters (and model state) of a run's --ckpt-dir or step directory, "
        "or hf:DIR, a Hugging Face GPT-2 (--model gpt takes its shape); a fresh optimizer",
    )
    eval_only: bool = _flag(
        LENGTH,
        False,
        "evaluate the latest checkpoint in --ckpt-dir (made with the flags it recorded) on the "
        "test split, and train nothing",
    )
    seed: int = _flag(MODEL, 0, "seed for initialisation and the data order", shown="seed")
    log_dir: str | None = _flag(
        OBSERVABILITY,
        None,
        "run directory: TensorBoard events, metrics.jsonl, config.json, run.json, profiles",
    )
    log_every: int = _flag(
        OBSERVABILITY, 20, "write train metrics (loss, lr, examples/s, MFU) every N steps"
    )
    tracker: str = _flag(
        OBSERVABILITY,
        "tensorboard",
        "where --log-dir's metrics also go: "
        "tensorboard, mlflow (MLFLOW_TRACKING_URI), wandb (WANDB_MODE), comma-separated, or none",
    )
    summary: bool = _flag(
        OBSERVABILITY,
        False,
        "print the model's parameters, bytes per device and FLOPs per example first (jdp.summary)",
    )
    grad_norm: bool = _flag(
        OBSERVABILITY,
        False,
        "report the gradients' global norm (grad_norm) each step: one more pass over the "
        "gradients, 4-7%% of a 10.8M-parameter MLP's step on the CPU",
    )
    profile_steps: str = _flag(
        OBSERVABILITY,
        "",
        "profile steps A:B (inclusive) into LOG_DIR/profile, e.g. 10:15 (needs --log-dir)",
    )
    coordinator: str | None = _flag(
        PROCESS, None, "multi-process run: HOST:PORT of process 0 (or $JDP_COORDINATOR)"
    )
    num_processes: int | None = _flag(
        PROCESS, None, "multi-process run: number of processes (or $JDP_NUM_PROCESSES)"
    )
    process_id: int | None = _flag(
        PROCESS, None, "multi-process run: this process, 0..N-1 (or $JDP_PROCESS_ID)"
    )
    startup_timeout: float = _flag(PROCESS, 300.0, "seconds to wait for every process to start")
    compile_cache: str = _flag(
        PROCESS,
        "auto",
        "directory of JAX's compilation cache, where a "
        "resumed run reads its compiled steps back: auto (in --ckpt-dir, "
        "when given), DIR or off",
    )
    heartbeat_timeout: float = _flag(
        HEALTH, 60.0, "seconds after which a silent process counts as lost and the run stops"
    )
    stall_timeout: float = _flag(
        HEALTH,
        600.0,
        "seconds without progress (4x evaluating or "
        "saving; compiling never counts) before a run ends stalled, exit 75 (0: off, else >= 1)",
    )
    check_replicas_every: int = _flag(
        HEALTH, 0, "compare a checksum of the parameters on every device every N steps (0: off)"
    )
    data_ledger: choices.DataLedger = _flag(
        HEALTH,
        "indices",
        "digests of the global batches, in "
        "metrics.jsonl and the checkpoints and checked as they are "
        "read: indices, bytes (of the rows too) or off",
    )
    early_stop_patience: int = _flag(
        EVALUATION, 0, "stop when --early-stop-metric has not improved for N evaluations (0: off)"
    )
    early_stop_metric: choices.EarlyStopMetric = _flag(
        EVALUATION,
        "loss",
        "test metric for --early-stop-patience: loss (lower wins) or accuracy (higher)",
    )

    @property
    def model_label(self) -> str:
        """The built-in model as the run's lines name it: its size, and the gpt's shape
        flags that replace the size's."""
        shape = [f"--{name} {getattr(self, name)}" for name in GPT_SHAPE if getattr(self, name)]
        shape += [] if self.bias else ["--no-bias"]
        return f"{self.model} {self.model_size}" + (f" with {' '.join(shape)}" if shape else "")

    def __post_init__(self):
        config_checks.check(self)

    @property
    def mesh_spec(self) -> MeshSpec:
        """``--mesh`` read once (by the checks, first); the run reads this, not the text."""
        return MeshSpec.parse(self.mesh)

    @property
    def resolved_sync_every(self) -> int:
        """The steps between DiLoCo's synchronisations: ``--sync-every``, or its default."""
        return self.sync_every or DEFAULT_SYNC_EVERY

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """``--profile-steps A:B`` as ``(A, B)``, or None; UsageError for a malformed one."""
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

    def gpt_shape(self) -> dict[str, int | float]:
        """The gpt's fields the shape flags set (``--layers``, ...), the size's otherwise."""
        shape = {name: getattr(self, name) for name in GPT_SHAPE if getattr(self, name)}
        shape |= {} if self.bias else {"bias": False}
        return shape | ({"dropout": self.dropout} if self.dropout is not None else {})

    def resume_conflicts(self, saved: dict, recorded: dict | None = None) -> list[str]:
        """The settings of ``recorded`` (this run's, as checkpoints record them, by default
        its fields: what the user brought in place of fields is recorded as theirs) that
        differ from ``saved`` (the run that wrote a checkpoint), as ``--flag X (was Y)``. A
        resumed run may change where and how it runs (`TOPOLOGY_FIELDS`: mesh, backend,
        loader, checkpointing), never what it computes."""
        recorded = dataclasses.asdict(self) if recorded is None else recorded
        compared = {field.name for field in dataclasses.fields(self)} | {"lr_schedule"}
        return [
            f"--{name.replace('_', '-')} {value} (was {saved[name]})"
            for name, value in recorded.items()
            if name in compared - TOPOLOGY_FIELDS and name in saved and saved[name] != value
        ]


def fields_of(*, section: Section | None = None, **holds: bool) -> tuple[str, ...]:
    """The names of `TrainConfig`'s fields in ``section`` (any, when None) for which each
    of ``holds`` (``resumable=True``, ``per_process=False``, ...) is as given."""
    return tuple(
        field.name
        for field in dataclasses.fields(TrainConfig)
        if section in (None, field.metadata["section"])
        and all(getattr(field.metadata["section"], key) == value for key, value in holds.items())
    )


# What a resumed run may change: where and how it runs, not what it computes.
TOPOLOGY_FIELDS = frozenset(fields_of(resumable=True))
# DiLoCo's flags, which only a mesh with a group axis takes.
DILOCO_FIELDS = fields_of(section=DILOCO)
# What may differ between the processes of one run: who each is, where it finds
# the data, how it loads it, and how long it waits for the others.
_PER_PROCESS_FIELDS = frozenset(fields_of(per_process=True))
