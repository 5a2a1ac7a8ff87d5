"""Matrix products in FP8 while training: gpt's ``--fp8``.

`fp8_dot_general` is a ``dot_general`` for Flax's dense layers (``dot_general=``). Each
operand is rounded to FP8 E4M3 (3 mantissa bits, up to 448) and each output gradient,
in the backward pass, to E5M2 (2 bits, up to 57,344), after scaling the whole tensor so
that its largest magnitude is the format's largest: the current scaling of
Transformer Engine's and torchao's tensorwise recipes, with nothing kept between steps.
The rounded values are multiplied back by the scale before the product, the form XLA's
GPU compiler rewrites into cuBLASLt's FP8 matrix products on Hopper and later; elsewhere
the product runs in the operands' own precision on FP8's values.

The scale of a batch-split operand is its largest magnitude over the whole global
batch: inside jdp's step the ``data`` axis is bound and the largest is taken over it,
so every mesh rounds every value alike (data parallelism does not change the math);
outside one, a ``jit`` over the global batch takes it whole. The gradients pass the
operands' rounding straight through (the straight-through estimator of quantized
training).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jdp.mesh_spec import DATA_AXIS

FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`jax.lax.dot_general` of ``lhs`` and ``rhs`` rounded to E4M3, its output's gradient
    rounded to E5M2 (see the module)."""
    out = lax.dot_general(
        _rounded(lhs),
        _rounded(rhs),
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return _gradient_rounded(out)


def round_to(x: jax.Array, dtype) -> jax.Array:
    """``x`` scaled so that its largest magnitude (over the bound ``data`` axis too) is
    ``dtype``'s largest, rounded to ``dtype``, and scaled back, in ``x``'s dtype. A tensor
    of zeros stays zeros."""
    largest = jnp.max(jnp.abs(x)).astype(jnp.float32)
    if _data_bound():
        largest = lax.pmax(largest, DATA_AXIS)
    scale = jnp.where(largest > 0, largest / float(jnp.finfo(dtype).max), 1.0)
    rounded = (x.astype(jnp.float32) / scale).astype(dtype)
    return (rounded.astype(jnp.float32) * scale).astype(x.dtype)


def _data_bound() -> bool:
    try:
        lax.axis_size(DATA_AXIS)
    except NameError:  # no shard_map or pmap names it here
        return False
    return True


@jax.custom_vjp
def _rounded(x):
    return round_to(x, FORWARD)


def _rounded_forward(x):
    return round_to(x, FORWARD), None


def _rounded_backward(_, grad):
    return (grad,)  # straight through


_rounded.defvjp(_rounded_forward, _rounded_backward)


@jax.custom_vjp
def _gradient_rounded(x):
    return x


def _gradient_rounded_forward(x):
    return x, None


def _gradient_rounded_backward(_, grad):
    return (round_to(grad, BACKWARD),)


_gradient_rounded.defvjp(_gradient_rounded_forward, _gradient_rounded_backward)
