"""Logical axis names on the built-in models' parameters (`jdp.layout` maps them to
mesh axes). Each helper keeps Flax's default initializer, so a named model starts
from the values the unnamed one did.

The names: ``embed`` (the model width), ``mlp`` (hidden units), ``heads`` and ``kv``
(attention heads and the width of one), ``vocab``, ``length`` (positions),
``conv_in``/``conv_out`` (channels), ``spatial`` (a convolution's window),
``classes`` (logits).
"""

from __future__ import annotations

import flax.linen as nn
from flax.linen.linear import default_embed_init, default_kernel_init


def named(init, *names: str | None):
    """``init`` whose parameter carries ``names``, one per dimension."""
    return nn.with_logical_partitioning(init, names)


def dense(features: int, names: tuple[str | None, str | None], **kwargs) -> nn.Dense:
    """``nn.Dense`` with its kernel named ``names`` (in, out) and its bias ``names[1]``."""
    return nn.Dense(
        features,
        kernel_init=named(default_kernel_init, *names),
        bias_init=named(nn.initializers.zeros_init(), names[1]),
        **kwargs,
    )


def conv(features: int, window: tuple[int, int], **kwargs) -> nn.Conv:
    """``nn.Conv`` with its kernel named (spatial, spatial, conv_in, conv_out)."""
    return nn.Conv(
        features,
        window,
        kernel_init=named(default_kernel_init, "spatial", "spatial", "conv_in", "conv_out"),
        bias_init=named(nn.initializers.zeros_init(), "conv_out"),
        **kwargs,
    )


def norm_inits(axis: str, scale=nn.initializers.ones) -> dict:
    """``scale_init`` and ``bias_init`` of a normalisation over channels named ``axis``."""
    return {
        "scale_init": named(scale, axis),
        "bias_init": named(nn.initializers.zeros_init(), axis),
    }


def embed(count: int, width: int, rows: str) -> nn.Embed:
    """``nn.Embed`` of ``count`` rows (named ``rows``) of ``width`` (``embed``)."""
    return nn.Embed(count, width, embedding_init=named(default_embed_init, rows, "embed"))


def attention_inits() -> dict:
    """``nn.MultiHeadDotProductAttention``'s initializers: query, key and value kernels
    (embed, heads, kv), the output kernel (heads, kv, embed), and their biases."""
    zeros = nn.initializers.zeros_init()
    return {
        "kernel_init": named(default_kernel_init, "embed", "heads", "kv"),
        "bias_init": named(zeros, "heads", "kv"),
        "out_kernel_init": named(default_kernel_init, "heads", "kv", "embed"),
        "out_bias_init": named(zeros, "embed"),
    }
