"""The optimizer a config names: its learning-rate schedule, peaking at ``--lr`` scaled
for the global batch.

Apart from `build` (``run.py``), which makes it, because others read it too: a
resume says how a new ``--steps`` moved the schedule, and the line that says what
was built (``messages.py``) shows the peak.
"""

from __future__ import annotations

import optax

from jdp.optim import make_optimizer, make_schedule, scale_lr
from jdp.training.config import TrainConfig


def peak_lr(config: TrainConfig) -> float:
    """``--lr`` scaled for the global batch by ``--lr-scaling``."""
    return scale_lr(config.lr, config.batch_size, config.lr_scaling, config.lr_reference_batch)


def config_optimizer(config: TrainConfig) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """The learning-rate schedule and the optimizer that follows it."""
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
