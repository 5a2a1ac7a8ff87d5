"""Attention over blocks of queries that keeps what a fused kernel keeps: ``--attention
blocked``.

XLA's attention makes the ``rows x heads x queries x keys`` scores and, unless told to
recompute them, keeps them for the backward pass; cuDNN's fused kernel (FlashAttention's
algorithm) keeps only the queries, keys, values, the output and each query's softmax
statistics. This computes the same attention in plain JAX, on any backend, with that
memory: the scores of one block of queries at a time, forward and backward, and those
residuals between them. Its backward pass waits for the output's gradient, so a
compiler cannot start every layer's recomputation at once. `jdp.plan` compiles it as
its stand-in for cuDNN's kernel, whose memory a CPU cannot compile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 128  # queries a block: a fused kernel's tile (FlashAttention-2 uses 64-128)


def blocked_attention(q, k, v, *, mask=None, is_causal: bool = False, block: int = BLOCK):
    """`jax.nn.dot_product_attention`'s result for ``(rows, positions, heads, width)``
    queries, keys and values (its default scale), ``mask`` a boolean array that
    broadcasts to ``(rows, heads, queries, keys)`` (padding: ``(rows, 1, 1, keys)``),
    ``is_causal`` as there (query i sees keys up to i). A query that sees no key gets the
    values' mean, as there."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"blocked attention needs as many key heads as query heads, got "
            f"{k.shape[2]} and {q.shape[2]}"
        )
    queries = q.shape[1]
    block = min(block, queries)
    pad = -queries % block
    if mask is not None:  # every query's row of the mask, padded as the queries are
        mask = jnp.broadcast_to(
            mask, (q.shape[0], 1 if mask.shape[1] == 1 else q.shape[2], queries, k.shape[1])
        )
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=True)
    padded = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    out = _attend(padded, k, v, mask, is_causal=is_causal, block=block)
    return out[:, :queries]


def _scores(index, q_block, k, mask_block, *, is_causal: bool):
    """One block of queries' scaled scores, ``(rows, heads, block, keys)`` in fp32, with
    what the masks hide at XLA's large negative (a finite one: a row that sees nothing
    averages, where -inf would give NaN); and which scores are seen (None: all)."""
    block, keys = q_block.shape[1], k.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_block, k, preferred_element_type=jnp.float32)
    scores = scores * q_block.shape[-1] ** -0.5
    seen = mask_block
    if is_causal:
        rows = index * block + jnp.arange(block)[:, None]
        causal = (rows >= jnp.arange(keys)[None, :])[None, None]
        seen = causal if seen is None else seen & causal
    if seen is None:
        return scores, None
    return jnp.where(seen, scores, -0.7 * jnp.finfo(jnp.float32).max), seen


def _blocks(x, block: int):
    """``(rows, positions, ...)`` as ``(blocks, rows, block, ...)``; the mask's positions
    are its third axis."""
    return x.reshape(x.shape[0], -1, block, *x.shape[2:]).swapaxes(0, 1)


def _mask_blocks(mask, block: int):
    if mask is None:
        return None
    rows, heads, queries, keys = mask.shape
    return mask.reshape(rows, heads, queries // block, block, keys).transpose(2, 0, 1, 3, 4)


def _unblock(x):
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, mask, is_causal, block):
    return _forward(q, k, v, mask, is_causal, block)[0]


def _forward(q, k, v, mask, is_causal, block):
    def one(args):
        index, q_block, mask_block = args
        scores, _ = _scores(index, q_block, k, mask_block, is_causal=is_causal)
        top = scores.max(-1)
        weights = jnp.exp(scores - top[..., None])
        total = weights.sum(-1)
        out = jnp.einsum(
            "bhqk,bkhd->bqhd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        out = out / total.transpose(0, 2, 1)[..., None]
        # The softmax's maximum and sum, not their log-sum-exp: a row that sees nothing has
        # the large negative as its maximum, beside which fp32 loses the sum's log.
        return out.astype(q.dtype), jnp.stack([top, total], -1).transpose(0, 2, 1, 3)

    count = q.shape[1] // block
    out, stats = lax.map(one, (jnp.arange(count), _blocks(q, block), _mask_blocks(mask, block)))
    return _unblock(out), _unblock(stats)  # (rows, queries, heads, width), (.., heads, 2)


def _attend_forward(q, k, v, mask, is_causal, block):
    out, stats = _forward(q, k, v, mask, is_causal, block)
    return out, (q, k, v, mask, out, stats)


def _attend_backward(is_causal, block, residuals, grad):
    # The barrier ties the recomputation to the output's gradient: without it a compiler
    # may recompute every layer's scores as soon as the forward pass ends.
    q, k, v, mask, out, stats, grad = lax.optimization_barrier((*residuals, grad))
    delta = jnp.sum(grad.astype(jnp.float32) * out.astype(jnp.float32), -1)  # (rows, q, heads)

    def one(carry, args):
        grad_k, grad_v = carry
        index, q_block, mask_block, grad_block, stats_block, delta_block = args
        scores, seen = _scores(index, q_block, k, mask_block, is_causal=is_causal)
        top, total = stats_block.transpose(3, 0, 2, 1)[..., None]
        weights = jnp.exp(scores - top) / total
        grad_v += jnp.einsum(
            "bhqk,bqhd->bkhd",
            weights.astype(grad.dtype),
            grad_block,
            preferred_element_type=jnp.float32,
        )
        grad_weights = jnp.einsum(
            "bqhd,bkhd->bhqk", grad_block, v, preferred_element_type=jnp.float32
        )
        grad_scores = weights * (grad_weights - delta_block.transpose(0, 2, 1)[..., None])
        grad_scores = grad_scores * q_block.shape[-1] ** -0.5
        if seen is not None:  # a hidden score is a constant: no gradient flows through it
            grad_scores = jnp.where(seen, grad_scores, 0.0)
        grad_q = jnp.einsum(
            "bhqk,bkhd->bqhd", grad_scores.astype(k.dtype), k, preferred_element_type=jnp.float32
        )
        grad_k += jnp.einsum(
            "bhqk,bqhd->bkhd",
            grad_scores.astype(q.dtype),
            q_block,
            preferred_element_type=jnp.float32,
        )
        return (grad_k, grad_v), grad_q.astype(q.dtype)

    count = q.shape[1] // block
    blocks = (
        jnp.arange(count),
        _blocks(q, block),
        _mask_blocks(mask, block),
        _blocks(grad, block),
        _blocks(stats, block),
        _blocks(delta, block),
    )
    zeros = jnp.zeros_like(k, jnp.float32)  # varying as k is, inside a shard_map
    (grad_k, grad_v), grad_q = lax.scan(one, (zeros, zeros), blocks)
    grad_mask = None if mask is None else jnp.zeros(mask.shape, jax.dtypes.float0)
    return _unblock(grad_q), grad_k.astype(k.dtype), grad_v.astype(v.dtype), grad_mask


_attend.defvjp(_attend_forward, _attend_backward)
