"""Optimizers, learning-rate schedules and batch-size scaling rules, composed from Optax."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jdp.errors import UsageError

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "lamb", "lars")
SCHEDULES = ("constant", "cosine", "linear", "noam", "piecewise")
LR_SCALING = ("none", "linear", "sqrt")


# What a parameter is, by its name in Flax (Linen and NNX) trees and Haiku's: the weights
# weight decay applies to, and the biases and normalisation scales it spares. PyTorch's and
# Equinox's ``weight`` names a norm's scale too, so it is left to the rank rule.
DECAYED = frozenset({"kernel", "embedding", "embeddings"})
SPARED = frozenset({"bias", "scale", "b", "offset"})
# The attribute that holds a boxed value (NNX's Variable, Linen's Partitioned): not a name.
_BOXES = frozenset({"value", "raw_value", "unbox"})


def decay_mask(params: Any) -> Any:
    """True for the leaves weight decay applies to: weight matrices and embeddings.

    Chosen by what a parameter is, its name in the tree (``kernel`` and ``embedding``
    decayed; ``bias`` and ``scale``, the biases and normalisation parameters, spared),
    not by its rank: scanned layers stack every parameter on a leading ``layers``
    axis, and attention's biases are ``(heads, head width)``, so a rank rule decays
    biases. A leaf whose name says neither is decayed when it has two or more
    dimensions.

    Examples:
        >>> decay_mask({"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((2, 4))}})
        {'dense': {'bias': False, 'kernel': True}}
    """

    def decayed(path, leaf) -> bool:
        name = _leaf_name(path)
        if name in DECAYED:
            return True
        if name in SPARED:
            return False
        return jnp.ndim(leaf) >= 2

    return jax.tree_util.tree_map_with_path(decayed, params)


def _leaf_name(path) -> str:
    """The last named key of a pytree path (a dict key, an attribute), lower-cased, past
    a box's own attribute (an ``nnx.Variable``'s ``value``)."""
    for key in reversed(path):
        for field in ("key", "name"):
            value = getattr(key, field, None)
            if isinstance(value, str) and not (field == "name" and value in _BOXES):
                return value.lower()
    return ""


def _check_choice(kind: str, name: str, choices: Sequence[str]) -> None:
    if name not in choices:
        raise UsageError(f"unknown {kind} {name!r}; choose one of: {', '.join(choices)}")


def make_schedule(
    name: str,
    peak_lr: float,
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    end_lr: float = 0.0,
    boundaries: Sequence[int] = (),
    decay_factor: float = 0.1,
    d_model: int | None = None,
) -> optax.Schedule:
    """Builds a learning-rate schedule: linear warmup from 0, then the named shape.

    Args:
        name: ``constant`` (hold ``peak_lr``), ``cosine`` or ``linear`` (decay to
            ``end_lr`` at ``total_steps``), ``piecewise`` (multiply by
            ``decay_factor`` at each of ``boundaries``), or ``noam``: the
            inverse-square-root schedule of "Attention Is All You Need",
            ``lr(k) = peak_lr * min(sqrt(w / k), k / w)`` for the ``k``-th update
            (``k = count + 1``), which peaks at ``peak_lr`` on update ``w =
            warmup_steps``. Given ``d_model``, ``peak_lr`` is the paper's factor
            instead: ``lr(k) = peak_lr * d_model**-0.5 * min(k**-0.5, k * w**-1.5)``.
        peak_lr: the learning rate at the end of warmup.
        warmup_steps: steps of linear warmup from 0 (``noam``: where it peaks).
        total_steps: the length of training; needed by ``cosine`` and ``linear``.
        end_lr: the final learning rate of ``cosine`` and ``linear``.
        boundaries: ``piecewise`` step boundaries, increasing.
        decay_factor: ``piecewise`` multiplier at each boundary.
        d_model: ``noam`` model width, to use the paper's normalisation.

    Returns:
        An ``optax.Schedule`` mapping the update count to a learning rate.

    Raises:
        UsageError: unknown name, or warmup longer than training.

    Examples:
        >>> schedule = jdp.make_schedule("cosine", 1e-3, warmup_steps=100, total_steps=1000)
        >>> round(float(schedule(100)), 6), round(float(schedule(1000)), 6)
        (0.001, 0.0)
    """
    _check_choice("schedule", name, SCHEDULES)
    if warmup_steps < 0:
        raise UsageError(f"warmup steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and warmup_steps > total_steps:
        raise UsageError(
            f"warmup ({warmup_steps} steps) is longer than training ({total_steps} steps); "
            f"use --warmup-steps {total_steps // 10} or train longer"
        )
    if name == "noam":
        return _noam(peak_lr, warmup_steps, d_model)
    if name in ("cosine", "linear") and total_steps is None:
        raise UsageError(f"the {name} schedule needs total_steps")
    if name == "constant":
        after = optax.constant_schedule(peak_lr)
    elif name == "cosine":
        after = optax.cosine_decay_schedule(
            peak_lr, max(total_steps - warmup_steps, 1), alpha=end_lr / peak_lr
        )
    elif name == "linear":
        after = optax.linear_schedule(peak_lr, end_lr, max(total_steps - warmup_steps, 1))
    else:
        after = _piecewise(peak_lr, warmup_steps, boundaries, decay_factor)
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, peak_lr, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def _noam(peak_lr: float, warmup_steps: int, d_model: int | None) -> optax.Schedule:
    """The inverse-square-root schedule (see `make_schedule`)."""
    if warmup_steps < 1:
        raise UsageError("the noam schedule needs --warmup-steps >= 1 (where it peaks)")
    peak = peak_lr if d_model is None else peak_lr * (d_model * warmup_steps) ** -0.5

    def noam(count):
        k = jnp.asarray(count, jnp.float32) + 1.0
        return peak * jnp.minimum(jnp.sqrt(warmup_steps / k), k / warmup_steps)

    return noam


def _piecewise(
    peak_lr: float, warmup_steps: int, boundaries: Sequence[int], decay_factor: float
) -> optax.Schedule:
    """``peak_lr`` times ``decay_factor`` at each boundary, counted after warmup."""
    if list(boundaries) != sorted(set(boundaries)) or any(b <= warmup_steps for b in boundaries):
        raise UsageError(
            f"piecewise boundaries {list(boundaries)} must increase and come after warmup"
        )
    return optax.piecewise_constant_schedule(
        peak_lr, {b - warmup_steps: decay_factor for b in boundaries}
    )


def scale_lr(base_lr: float, global_batch: int, rule: str, reference_batch: int = 256) -> float:
    """Scales a learning rate tuned for ``reference_batch`` to ``global_batch``.

    ``linear`` is Goyal et al.'s rule (``base_lr * global_batch / reference_batch``,
    used with warmup); ``sqrt`` suits adaptive optimizers; ``none`` keeps ``base_lr``.
    """
    _check_choice("lr scaling rule", rule, LR_SCALING)
    ratio = global_batch / reference_batch
    return {"none": base_lr, "linear": base_lr * ratio, "sqrt": base_lr * math.sqrt(ratio)}[rule]


# The optimizers whose weight decay is decoupled from the gradient, as their papers define
# it; the others add it to the gradient (L2).
DECOUPLED_DECAY = ("adamw", "lamb", "lars")


def make_optimizer(
    name: str | optax.GradientTransformation,
    learning_rate: float | optax.Schedule = 1e-3,
    *,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
) -> optax.GradientTransformation:
    """Builds an optimizer by name, with optional global-norm clipping and weight decay.

    Weight decay never touches biases or normalisation parameters (`decay_mask`, by
    the parameters' names).
    ``adamw``, ``lamb`` and ``lars`` decay decoupled from the gradient statistics,
    as their papers define; for ``sgd``, ``momentum``, ``nesterov`` and ``adam`` it
    is added to the gradient (L2).

    Args:
        name: one of ``sgd``, ``momentum``, ``nesterov``, ``adam``, ``adamw``,
            ``lamb`` (large-batch Adam), ``lars`` (large-batch SGD); or any
            ``optax.GradientTransformation``, returned as it is.
        learning_rate: a float or a schedule (see `make_schedule`).
        momentum: for ``momentum``, ``nesterov`` and ``lars``.
        weight_decay: decay coefficient (0 for none).
        clip_norm: clip the gradients' global norm to this value first (None: off).
        b1: Adam-family first-moment decay.
        b2: Adam-family second-moment decay.

    Returns:
        An ``optax.GradientTransformation``.

    Raises:
        UsageError: an unknown name or a negative coefficient.

    Examples:
        >>> schedule = jdp.make_schedule("cosine", 1e-3, warmup_steps=100, total_steps=1000)
        >>> optimizer = jdp.make_optimizer("adamw", schedule, weight_decay=0.05, clip_norm=1.0)
    """
    if isinstance(name, optax.GradientTransformation):
        return name
    _check_choice("optimizer", name, OPTIMIZERS)
    if weight_decay < 0 or (clip_norm is not None and clip_norm <= 0):
        raise UsageError("weight decay must be >= 0 and the clipping norm > 0")
    lr = learning_rate
    decoupled = {
        "adamw": lambda: optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
        "lamb": lambda: optax.lamb(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
        "lars": lambda: optax.lars(
            lr,
            weight_decay=weight_decay,
            weight_decay_mask=decay_mask,
            trust_ratio_mask=decay_mask,
            momentum=momentum,
        ),
    }
    coupled = {
        "sgd": lambda: optax.sgd(lr),
        "momentum": lambda: optax.sgd(lr, momentum=momentum),
        "nesterov": lambda: optax.sgd(lr, momentum=momentum, nesterov=True),
        "adam": lambda: optax.adam(lr, b1=b1, b2=b2),
    }
    parts = []
    if clip_norm is not None:
        parts.append(optax.clip_by_global_norm(clip_norm))
    if name in DECOUPLED_DECAY:
        parts.append(decoupled[name]())
    else:
        if weight_decay:
            parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
        parts.append(coupled[name]())
    return parts[0] if len(parts) == 1 else optax.chain(*parts)


def check_optimizer(optimizer: Any) -> None:
    """Refuses, in one line, an ``optimizer`` that is not an Optax transformation (an
    uncalled ``optax.adam``, None)."""
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise UsageError(
            f"optimizer must be an optax.GradientTransformation, e.g. optax.adam(1e-3), got "
            f"{type(optimizer).__name__} {getattr(optimizer, '__name__', '')}".rstrip()
        )
