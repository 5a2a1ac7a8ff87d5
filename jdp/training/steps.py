"""A run's train step as its config makes it: at any number of steps per call, and the
learning rate it reports, in the step or computed on the host when it is read."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jdp.models import Model
from jdp.precision import Precision, make_precision
from jdp.step import CompiledStep, make_train_step
from jdp.training.config import TrainConfig


def built_calls(config: TrainConfig) -> int:
    """The steps a call of the step `build` makes: ``--steps-per-call``, or 1 for ``auto``
    (`jdp.training.calls` chooses before the first step)."""
    return 1 if config.steps_per_call == "auto" else config.steps_per_call


def step_maker(
    config: TrainConfig,
    model: Model,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    precision: Precision,
    schedule: optax.Schedule | None,
) -> Callable[[int], CompiledStep]:
    """``step_for(steps_per_call)``: the run's train step, scanning that many steps a call."""
    made = functools.partial(
        make_train_step,
        model.loss_fn,
        optimizer,
        mesh,
        backend=config.backend,
        has_model_state=True,
        precision=precision,
        accumulate=config.accumulate,
        lr_schedule=step_lr(config, schedule),
        skip_nonfinite=config.nan_policy == "skip",
        grad_norm=config.grad_norm,
    )
    return lambda steps_per_call: made(steps_per_call=steps_per_call)


def lr_in_step(config: TrainConfig) -> bool:
    """Whether the train step returns the learning rate: where an update may be skipped
    inside a call (fp16's loss scale, ``--nan-policy skip``: the schedule counts the
    updates applied) and with DiLoCo's groups. Elsewhere the run computes it on the
    host when it is read (`logged_lr`): an output of every call costs the host about a
    microsecond and a half, 4% of a small model's call."""
    precision = make_precision(config.precision, reduce=config.reduce_dtype)
    skips = precision.loss_scaling or config.nan_policy == "skip"
    return skips or config.mesh_spec.has("group")


def step_lr(config: TrainConfig, schedule: optax.Schedule | None) -> optax.Schedule | None:
    """The schedule a run's train step reports its learning rate by, where it must
    (`lr_in_step`); else None."""
    return schedule if lr_in_step(config) else None


def logged_lr(schedule: optax.Schedule, skipped: int) -> Callable[[int], jax.Array]:
    """``lr_at(step)``: the rate the step that ended at ``step`` used, as the step computes
    it (``schedule(count)`` in float32, compiled, ``count`` the updates applied before
    it), for a run whose skipped count stays ``skipped``. Compiled here, before the loop
    (37 ms on the 2-core CPU): at the first log it fell inside the timed steps, a fifth
    of the README's first command's."""
    rate = jax.jit(lambda count: jnp.asarray(schedule(count), jnp.float32))
    rate = rate.lower(jax.ShapeDtypeStruct((), jnp.int32)).compile()
    return lambda step: rate(np.int32(step - 1 - skipped))
