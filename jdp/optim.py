"""Optimizers and learning-rate schedules, composed from Optax."""

from __future__ import annotations

import optax


def warmup_cosine_schedule(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine decay to 0."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=0.0,
    )


def default_optimizer(
    lr: float, warmup_steps: int, total_steps: int
) -> optax.GradientTransformation:
    """Adam on a warmup-cosine schedule: the CLI's optimizer."""
    return optax.adam(warmup_cosine_schedule(lr, warmup_steps, total_steps))
