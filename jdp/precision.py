"""Mixed precision: a dtype policy, and dynamic loss scaling for fp16.

Parameters stay fp32 (the master copy); the loss is computed with parameters and
inputs cast to the compute dtype, so gradients arrive in fp32 through the casts.
fp16's narrow range needs the loss scaled up before differentiation and the
gradients scaled back down; the scale halves (and the update is skipped) when a
gradient overflows and doubles after a run of finite steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jdp.errors import UsageError

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a step computes and communicates.

    Attributes:
        compute_dtype: dtype of the forward and backward pass.
        reduce_dtype: dtype of the gradient all-reduce (bf16 halves the bytes).
        loss_scaling: dynamic loss scaling (needed for fp16).
        init_scale: the first loss scale.
        growth_interval: finite steps after which the scale doubles.
    """

    compute_dtype: Any = jnp.float32
    reduce_dtype: Any = jnp.float32
    loss_scaling: bool = False
    init_scale: float = 2.0**15
    growth_interval: int = 2000


def make_precision(
    name: str = "fp32",
    *,
    reduce: str = "fp32",
    init_scale: float = 2.0**15,
    growth_interval: int = 2000,
) -> Precision:
    """The policy for ``fp32``, ``bf16`` or ``fp16`` compute (fp16 turns on loss scaling).

    Args:
        name: the compute dtype.
        reduce: the gradient all-reduce dtype, ``fp32`` or ``bf16``.
        init_scale: fp16's first loss scale.
        growth_interval: finite fp16 steps after which the scale doubles.

    Examples:
        >>> precision = jdp.make_precision("bf16", reduce="bf16")
    """
    for label, value in (("precision", name), ("reduce dtype", reduce)):
        if value not in PRECISIONS:
            raise UsageError(f"unknown {label} {value!r}; choose one of: {', '.join(PRECISIONS)}")
    if growth_interval < 1 or not init_scale >= 1:
        raise UsageError("the loss scale must start >= 1 and grow after at least 1 step")
    return Precision(
        compute_dtype=PRECISIONS[name],
        reduce_dtype=PRECISIONS[reduce],
        loss_scaling=name == "fp16",
        init_scale=init_scale,
        growth_interval=growth_interval,
    )


@flax.struct.dataclass
class LossScale:
    """Dynamic loss-scale state, carried in the `TrainState`.

    Attributes:
        scale: the current loss scale (1 when scaling is off).
        good_steps: finite steps since the scale last changed.
        skipped: updates skipped so far because a gradient was not finite.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array

    @classmethod
    def create(cls, precision: Precision | None = None) -> LossScale:
        scaling = precision is not None and precision.loss_scaling
        return cls(
            scale=jnp.asarray(precision.init_scale if scaling else 1.0, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
        )

    def update(self, finite: jax.Array, growth_interval: int) -> LossScale:
        """The next state after a step whose averaged gradient was ``finite`` or not."""
        grown = self.good_steps + 1 >= growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grown, self.scale * 2.0, self.scale),
            jnp.maximum(self.scale / 2.0, 1.0),
        )
        good_steps = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return LossScale(scale, good_steps, self.skipped + (~finite).astype(jnp.int32))


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point leaves of ``tree`` to ``dtype``; others pass through."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, tree
    )


def all_finite(tree: Any) -> jax.Array:
    """True when every element of every leaf is finite."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))
