"""Multi-head attention for the transformers (`jdp.models.transformer`): Flax's parameter
names, `jax.nn.dot_product_attention` (XLA's or cuDNN's fused kernel, chosen by
`implementation`; XLA's may recompute its scores in the backward pass, ``remat``; or
XLA's over blocks of queries, with the fused kernel's memory: `jdp.models.blocked`), and
Flax's unfused weights where dropout needs them."""

from __future__ import annotations

import functools
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from jdp.models.blocked import blocked_attention
from jdp.models.dropout import drop, row_masks
from jdp.models.fp8 import fp8_dot_general
from jdp.models.names import attention_inits

AttentionImplementation = Literal["auto", "xla", "cudnn", "blocked"]
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "blocked")


class Attention(nn.Module):
    """Multi-head attention through `jax.nn.dot_product_attention`: no ``T x T`` mask is made.

    A causal model says ``causal=True``; padding is a mask over the keys
    (``key_mask``, ``(rows, keys)``). The parameters are Flax's
    ``MultiHeadDotProductAttention``'s (``query``, ``key``, ``value``, ``out``), so
    checkpoints written with it restore. Dropout on the attention weights needs
    the weights themselves: a model that trains with it (``seq2seq``, as the
    reference Transformer) takes Flax's unfused path while training, with the
    masks Flax's module made, and the fused one to evaluate and decode. The
    weights' dropout mask is drawn per row (``rows``: `jdp.models.dropout`) and
    shared by the heads.
    """

    heads: int
    dropout: float = 0.0  # on the attention weights, while training
    implementation: AttentionImplementation = "auto"
    bias: bool = True  # the projections' biases
    # XLA's fused path: recompute the scores in the backward pass instead of keeping them
    # (``--remat attention``), as cuDNN's kernel does; its memory is then cuDNN's.
    remat: bool = False
    fp8: bool = False  # the projections' products in FP8 while training (`jdp.models.fp8`)

    @nn.compact
    def __call__(
        self,
        queries,
        keys,
        *,
        train: bool = False,
        causal: bool = False,
        key_mask=None,
        query_mask=None,
        rows=None,
    ) -> jax.Array:
        width = queries.shape[-1]
        if width % self.heads:
            raise ValueError(f"width {width} does not split into {self.heads} heads")
        inits = attention_inits()
        fp8 = {"dot_general": fp8_dot_general} if self.fp8 and train else {}

        def project(name):
            return nn.DenseGeneral(
                (self.heads, width // self.heads),
                name=name,
                kernel_init=inits["kernel_init"],
                bias_init=inits["bias_init"],
                use_bias=self.bias,
                **fp8,
            )

        q, k, v = project("query")(queries), project("key")(keys), project("value")(keys)
        if train and self.dropout > 0:
            mask = _unfused_mask(q, k, causal, key_mask, query_mask)
            weights = nn.dot_product_attention_weights(q, k, mask=mask)  # (rows, heads, q, k)
            keep, (rows_, _, queries_, keys_) = 1.0 - self.dropout, weights.shape
            masks = row_masks(self.make_rng("dropout"), rows, (rows_, 1, queries_, keys_), keep)
            attended = jnp.einsum("...hqk,...khd->...qhd", drop(weights, masks, keep), v)
        else:
            mask = None if key_mask is None else key_mask[:, None, None, :]
            how = implementation(self.implementation, q.dtype, q.shape[-1], masked=mask is not None)
            # XLA's CPU dot has no fp16 x fp16 -> fp32 (F16_F16_F32), what fp16 attention
            # asks for: the same products, of the same fp16 values, in fp32 there.
            upcast = q.dtype == jnp.float16 and jax.default_backend() == "cpu"
            attend = functools.partial(
                jax.nn.dot_product_attention, mask=mask, is_causal=causal, implementation=how
            )
            if how == "blocked":  # XLA's, with a fused kernel's memory (`jdp.models.blocked`)
                attend = functools.partial(blocked_attention, mask=mask, is_causal=causal)
            if self.remat and how == "xla":  # cuDNN's kernel keeps no scores already
                attend = jax.checkpoint(attend, policy=jax.checkpoint_policies.nothing_saveable)
            attended = attend(*((x.astype(jnp.float32) if upcast else x) for x in (q, k, v)))
            attended = attended.astype(q.dtype)
        return nn.DenseGeneral(
            width,
            axis=(-2, -1),
            name="out",
            kernel_init=inits["out_kernel_init"],
            bias_init=inits["out_bias_init"],
            use_bias=self.bias,
            **fp8,
        )(attended)


def _unfused_mask(q, k, causal, key_mask, query_mask):
    """The ``(rows, 1, queries, keys)`` mask of Flax's unfused attention, or None."""
    masks = []
    if causal:
        masks.append(nn.make_causal_mask(jnp.ones(q.shape[:2], bool)))
    if key_mask is not None:
        rows = jnp.ones(q.shape[:2], bool) if query_mask is None else query_mask
        masks.append(nn.make_attention_mask(rows, key_mask))
    return nn.combine_masks(*masks) if masks else None


def implementation(choice: str, dtype, head_width: int, *, masked: bool = False) -> str:
    """The attention implementation to run: ``choice``, or for ``auto`` cuDNN's fused
    kernel on a GPU in bf16 or fp16 with a head width it takes (a multiple of 8, at
    most 128) and no mask array, else XLA's."""
    if choice not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention {choice!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if choice == "cudnn" and not half:
        # cuDNN's kernel takes half precision only; the one fp32 pass of a bf16 model is
        # its initialization (the parameters are fp32), which XLA's computes alike.
        return "xla"
    if choice != "auto":
        return choice
    fits = head_width % 8 == 0 and head_width <= 128 and not masked
    return "cudnn" if fits and half and jax.default_backend() == "gpu" else "xla"
