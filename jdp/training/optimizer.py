"""The optimizer a config names: its learning-rate schedule, peaking at ``--lr`` scaled
for the global batch.

Apart from `build` (``run.py``), which makes it, because others read it too: a
resume says how a new ``--steps`` moved the schedule, and the line that says what
was built (``messages.py``) shows the peak.
"""

from __future__ import annotations

import optax

from jdp.errors import UsageError
from jdp.optim import DECOUPLED_DECAY, make_optimizer, make_schedule, scale_lr
from jdp.training.config import TrainConfig


def peak_lr(config: TrainConfig) -> float:
    """``--lr`` scaled for the global batch by ``--lr-scaling``."""
    return scale_lr(config.lr, config.batch_size, config.lr_scaling, config.lr_reference_batch)


def config_optimizer(config: TrainConfig) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """The learning-rate schedule and the optimizer that follows it.

    Raises:
        UsageError: ``--end-lr`` above the peak: the decay would climb to it.
    """
    if config.end_lr > peak_lr(config):
        raise UsageError(
            f"--end-lr {config.end_lr:g} is above the peak learning rate {peak_lr(config):g} "
            f"(--lr{' scaled for the batch' if config.lr_scaling != 'none' else ''}): the "
            f"{config.schedule} schedule decays to it; give an --end-lr below it"
        )
    schedule = make_schedule(
        config.schedule,
        peak_lr(config),
        warmup_steps=config.warmup_steps,
        total_steps=config.decay_steps or config.steps,
        end_lr=config.end_lr,
        boundaries=[int(part) for part in config.lr_boundaries.split(",") if part],
        decay_factor=config.lr_decay_factor,
    )
    optimizer = make_optimizer(
        config.optimizer,
        schedule,
        momentum=config.momentum,
        b1=config.beta1,
        b2=config.beta2,
        weight_decay=config.weight_decay,
        clip_norm=config.clip_norm or None,
    )
    return schedule, optimizer


def describe(config: TrainConfig) -> str:
    """The optimizer as the run's first lines say it: its name and moments, the learning
    rate and schedule, warmup, weight decay (decoupled or L2) and clipping."""
    name = config.optimizer
    moments = (
        f" (b1 {config.beta1:g}, b2 {config.beta2:g})"
        if name in ("adam", "adamw", "lamb")
        else f" (momentum {config.momentum:g})"
        if name in ("momentum", "nesterov", "lars")
        else ""
    )
    scaling = (
        f" x {config.batch_size}/{config.lr_reference_batch} ({config.lr_scaling} scaling)"
        if config.lr_scaling != "none"
        else ""
    )
    decay = ""
    if config.schedule in ("cosine", "linear"):
        decay = f" to {config.end_lr:g} at step {config.decay_steps or config.steps}"
    parts = [
        f"{name}{moments}, lr {config.lr:g}{scaling} = {peak_lr(config):.4g} peak",
        f"{config.schedule} schedule{decay}",
        f"{config.warmup_steps} warmup steps",
    ]
    if config.weight_decay:
        how = (
            "decoupled"
            if name in DECOUPLED_DECAY
            else "as L2, added to the gradient (decoupled: --optimizer adamw)"
            if name == "adam"
            else "as L2, added to the gradient"
        )
        parts.append(f"weight decay {config.weight_decay:g} {how}")
    if config.clip_norm:
        parts.append(f"gradients clipped at global norm {config.clip_norm:g}")
    return ", ".join(parts)
