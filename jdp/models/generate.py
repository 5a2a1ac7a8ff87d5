"""Sampling from a `GPT` with a key/value cache: `generate`.

One forward pass over the prompt fills each layer's cache of keys and values;
then each new token goes through every layer alone, attending to the cache: a
`jax.lax.scan` over the new tokens, inside it one over the stacked layers. A step
costs the cache's length, not a forward pass over the whole prefix, so the cost
is linear in the generated length, and the program is compiled once per batch,
prompt length and number of new tokens (temperature and rng are its arguments).

Past the model's context (``max_len``), generation goes on as nanoGPT's does: each
further token is read from a forward pass over the last ``max_len`` tokens alone
(a sliding window, positions from 0 again), and a prompt longer than the context
is cropped to its last ``max_len`` tokens the same way.

The layers are the model's own: its parameters applied through the same Flax
modules (``LayerNorm``, ``DenseGeneral``, `FeedForward`, ``Embed``), in the
parameters' dtype, so a cached position's logits are the full model's at that
position up to the rounding of a different summation order.

`translate` decodes a built-in sequence model's targets greedily, the whole prefix
through the model for each new token.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jdp.errors import UsageError
from jdp.models.model import Model
from jdp.models.transformer import (
    EPSILON,
    GPT,
    FeedForward,
    layer_norm,
    stack_layers,
)

_ATTENTION = "MultiHeadDotProductAttention_0"


class _Spec(NamedTuple):
    """What the compiled program is specialised on, besides the arrays' shapes."""

    new_tokens: int
    top_k: int | None
    vocab_size: int
    greedy: bool
    with_logits: bool
    epsilon: float  # the LayerNorms' (`GPT.epsilon`)


def generate(
    module: GPT,
    params: Any,
    prompt_tokens: jax.Array | np.ndarray,
    *,
    max_new_tokens: int,
    rng: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    vocab_size: int | None = None,
    with_logits: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Samples ``max_new_tokens`` tokens after ``prompt_tokens`` from a `GPT`, cached.

    Args:
        module: the `GPT` (scanned or unrolled; `gpt_for` reads it off its parameters).
        params: its parameters (``{"params": ...}`` or the dict inside; ``blocks``
            stacked, or ``Block_0``... as ``unroll=True`` makes them), fp32 or bf16.
        prompt_tokens: int ids ``(rows, length)``, every row as long.
        max_new_tokens: the tokens to add; past the model's ``max_len`` each is
            read from the last ``max_len`` tokens (a sliding window, uncached).
        rng: a PRNG key; token ``i`` is drawn with ``jax.random.split(rng,
            max_new_tokens)[i]``. Not needed for greedy decoding.
        temperature: divides the logits; 0 is greedy (the most likely token).
        top_k: draw among the ``top_k`` most likely tokens only.
        vocab_size: the data's vocabulary, when the model's is padded beyond it:
            tokens at or above it are never chosen.
        with_logits: also return each new token's logits, as the model gave them.

    Returns:
        The new tokens, int32 ``(rows, max_new_tokens)``; with ``with_logits``,
        also the logits they were drawn from, ``(rows, max_new_tokens, vocab)``.

    Raises:
        UsageError: a bad option.

    Examples:
        >>> gpt = jdp.models.GPT(vocab_size=16, width=16, heads=2, layers=2, hidden=32,
        ...                      max_len=12)
        >>> params = jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        >>> prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
        >>> tokens = jdp.models.generate(gpt, params, prompt, max_new_tokens=5,
        ...                              rng=jax.random.key(1), temperature=0.8, top_k=4,
        ...                              vocab_size=10)
        >>> tokens.shape, bool((tokens < 10).all())
        ((2, 5), True)
    """
    params = _stacked(module, params)
    prompt = jnp.asarray(prompt_tokens)
    _check(module, prompt, max_new_tokens, temperature, top_k, vocab_size)
    greedy = temperature == 0
    if rng is None and not greedy:
        raise UsageError("generate: sampling with temperature > 0 needs rng=jax.random.key(...)")
    vocab_size = module.vocab_size if vocab_size is None else vocab_size
    keys = jax.random.split(jax.random.key(0) if rng is None else rng, max_new_tokens)
    spec = _Spec(
        new_tokens=max_new_tokens,
        top_k=None if top_k is None else min(top_k, vocab_size),
        vocab_size=vocab_size,
        greedy=greedy,
        with_logits=with_logits,
        epsilon=module.epsilon,
    )
    # The temperature is an argument, not a constant: another one reuses the program.
    parts = _continue(module, params, prompt.astype(jnp.int32), keys, np.float32(temperature), spec)
    tokens = jnp.concatenate([part[0] for part in parts], axis=1)
    if not with_logits:
        return tokens
    return tokens, jnp.concatenate([part[1] for part in parts], axis=1)


def _continue(module: GPT, stacked, prompt, keys, temperature, spec: _Spec) -> list:
    """``(tokens, logits)`` of the cached decoding while the context holds the tokens,
    then of the sliding window past it (nanoGPT's), as many as ``spec.new_tokens``."""
    context, parts = module.max_len, []
    cached = max(0, min(spec.new_tokens, context - prompt.shape[1]))  # what the cache holds
    if cached:
        parts.append(
            _decode(stacked, prompt, keys[:cached], temperature, spec._replace(new_tokens=cached))
        )
    if cached < spec.new_tokens:  # past the context: a window of the last max_len tokens
        so_far = jnp.concatenate([prompt, *(part[0] for part in parts)], axis=1)
        window = spec._replace(new_tokens=spec.new_tokens - cached)
        scanned = module.clone(unroll=False)  # the stacked layers, whichever layout came
        parts.append(
            _window_decode(
                scanned, stacked, so_far[:, -context:], keys[cached:], temperature, window
            )
        )
    return parts


@functools.partial(jax.jit, static_argnames=("module", "spec"))
def _window_decode(module: GPT, params, window, keys, temperature, spec: _Spec):
    """``(tokens, logits or None)`` of ``spec.new_tokens`` tokens, each read from the
    whole model's pass over the last ``module.max_len`` tokens (``window`` holds them
    at the start), nanoGPT's way past the context: a scan, one program."""

    def step(window, key):
        logits = module.apply({"params": params}, window, train=False)[:, -1]
        token = _choose(logits, key, temperature, spec)
        window = jnp.concatenate([window[:, 1:], token[:, None]], axis=1)
        return window, (token, logits if spec.with_logits else None)

    _, (tokens, logits) = jax.lax.scan(step, window, keys)
    return tokens.T, None if logits is None else logits.transpose(1, 0, 2)


def gpt_for(params: Any, *, epsilon: float = EPSILON) -> GPT:
    """The `GPT` (evaluation only: no dropout) whose parameters ``params`` are, read
    from their shapes: a checkpoint's parameters are enough to `generate` from.
    ``epsilon``, the LayerNorms' (not in the shapes): GPT-2's weights' is 1e-5.

    Examples:
        >>> gpt = jdp.models.GPT(vocab_size=16, width=16, heads=2, layers=3, hidden=32,
        ...                      max_len=12, unroll=True)
        >>> shapes = jax.eval_shape(gpt.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        >>> found = jdp.models.gpt_for(shapes)
        >>> found.vocab_size, found.heads, found.layers, found.hidden, found.max_len, found.unroll
        (16, 2, 3, 32, 12, True)
    """
    params = _unwrapped(params)
    unroll = "blocks" not in params
    try:
        layer = params["Block_0" if unroll else "blocks"]
        stacked = layer["LayerNorm_0"]["scale"].shape[0] if not unroll else 0
        vocab, width = params["Embed_0"]["embedding"].shape
        return GPT(
            vocab_size=vocab,
            width=width,
            heads=layer[_ATTENTION]["query"]["kernel"].shape[-2],
            layers=sum(name.startswith("Block_") for name in params) if unroll else stacked,
            hidden=layer["FeedForward_0"]["Dense_0"]["kernel"].shape[-1],
            dropout=0.0,
            max_len=params["Embed_1"]["embedding"].shape[0],
            unroll=unroll,
            epsilon=epsilon,
        )
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"the parameters ({', '.join(sorted(params))}) are not a GPT's") from None


def _unwrapped(params: Any) -> dict:
    """The parameters' dict, without Flax's ``{"params": ...}`` or logical-name boxes."""
    params = meta.unbox(params)
    return params["params"] if set(params) == {"params"} else params


def _stacked(module: GPT, params: Any) -> dict:
    """``params`` with their layers stacked (``blocks``), as the scanned model holds them."""
    params = _unwrapped(params)
    if "blocks" not in params:
        params = stack_layers(params, module.layers)
    expected = (module.vocab_size, module.width)
    if tuple(params["Embed_0"]["embedding"].shape) != expected:
        raise UsageError(
            f"the parameters' token embedding is {params['Embed_0']['embedding'].shape}, and "
            f"the GPT's {expected}; give the module they were made with (or gpt_for(params))"
        )
    return params


# The most tokens one call adds: a key per token is drawn up front (8 bytes each), and
# past the context each token is one more forward pass over the whole window, so a
# million tokens of GPT-2 small is hours of one GPU already.
MAX_NEW_TOKENS = 2**20


def _check(module: GPT, prompt, new_tokens: int, temperature: float, top_k, vocab_size):
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer) or not prompt.shape[1]:
        raise UsageError(
            f"generate: the prompt is {prompt.dtype} {prompt.shape}; give token ids "
            "(rows, length), at least one per row"
        )
    if not 1 <= new_tokens <= MAX_NEW_TOKENS:
        raise UsageError(
            f"generate: max_new_tokens {new_tokens}; give 1 to {MAX_NEW_TOKENS:,} (2**20)"
        )
    if not temperature >= 0 or not np.isfinite(temperature):
        raise UsageError(f"generate: temperature {temperature}; give 0 (greedy) or more")
    if top_k is not None and top_k < 1:
        raise UsageError(f"generate: top_k {top_k}; give at least 1, or None for all tokens")
    if vocab_size is not None and not 1 <= vocab_size <= module.vocab_size:
        raise UsageError(
            f"generate: vocab_size {vocab_size} is not in [1, {module.vocab_size}], the model's"
        )


@functools.partial(jax.jit, static_argnames="spec")
def _decode(params, prompt, keys, temperature, spec: _Spec):
    """``(tokens (rows, new), logits (rows, new, vocab) or None)``: the prompt's pass,
    which fills the caches, then a scan of one-token steps that read them."""
    length = prompt.shape[1]
    total = length + spec.new_tokens  # the caches' length: every position this run holds
    x = _embed(params, prompt, jnp.arange(length))
    x, caches = _layers(params["blocks"], x, None, 0, total, spec.epsilon)
    first_logits = _logits(params, x[:, -1], spec.epsilon)
    first = _choose(first_logits, keys[0], temperature, spec)

    def step(carry, inputs):
        caches, token = carry
        position, key = inputs
        x = _embed(params, token[:, None], position[None])
        x, caches = _layers(params["blocks"], x, caches, position, total, spec.epsilon)
        logits = _logits(params, x[:, 0], spec.epsilon)
        token = _choose(logits, key, temperature, spec)
        return (caches, token), (token, logits if spec.with_logits else None)

    positions = length + jnp.arange(spec.new_tokens - 1)
    _, (rest, logits) = jax.lax.scan(step, (caches, first), (positions, keys[1:]))
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    if not spec.with_logits:
        return tokens, None
    return tokens, jnp.concatenate([first_logits[:, None], logits.transpose(1, 0, 2)], axis=1)


def _embed(params, tokens, positions):
    """The tokens' and positions' embeddings, summed as `GPT` sums them."""
    token_table, position_table = params["Embed_0"]["embedding"], params["Embed_1"]["embedding"]
    embedded = _apply(nn.Embed(*token_table.shape), params["Embed_0"], tokens)
    return embedded + _apply(nn.Embed(*position_table.shape), params["Embed_1"], positions)[None]


def _logits(params, x, epsilon: float):
    """The final LayerNorm, then the output projection tied to the token embedding."""
    table = params["Embed_0"]["embedding"]
    normed = _apply(layer_norm(epsilon), params["LayerNorm_0"], x)
    return nn.Embed(*table.shape).apply({"params": params["Embed_0"]}, normed, method="attend")


def _layers(blocks, x, caches, start, total: int, epsilon: float):
    """Every layer on ``x`` (at positions ``start``...), a scan over the stacked
    parameters; returns ``x`` and each layer's (keys, values) cache, stacked."""

    def layer(x, inputs):
        return _layer(*inputs, x, start, total, epsilon)

    return jax.lax.scan(layer, x, (blocks, caches))


def _layer(params, cache, x, start, total: int, epsilon: float):
    """One `CausalLayer` on ``x`` (rows, tokens, width) at positions ``start``...,
    attending to the cache of keys and values (None: a new one of ``total`` positions)."""
    attention = params[_ATTENTION]
    normed = _apply(layer_norm(epsilon), params["LayerNorm_0"], x)
    q, k, v = (_project(attention[name], normed) for name in ("query", "key", "value"))
    if cache is None:
        cache = (jnp.zeros((k.shape[0], total, *k.shape[2:]), k.dtype),) * 2
    keys = jax.lax.dynamic_update_slice_in_dim(cache[0], k, start, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(cache[1], v, start, axis=1)
    # Causal over the cache: query i is position start + i, and the positions not yet
    # written (beyond the last query) are masked out, not read.
    queries_at = start + jnp.arange(x.shape[1])
    mask = (jnp.arange(total)[None, :] <= queries_at[:, None])[None, None]
    attended = jax.nn.dot_product_attention(q, keys, values, mask=mask, implementation="xla")
    out = attention["out"]["kernel"]
    x = x + _apply(nn.DenseGeneral(out.shape[-1], axis=(-2, -1)), attention["out"], attended)
    feed = params["FeedForward_0"]
    hidden = feed["Dense_0"]["kernel"].shape[-1]
    normed = _apply(layer_norm(epsilon), params["LayerNorm_1"], x)
    return x + FeedForward(hidden, 0.0).apply({"params": feed}, normed, train=False), (keys, values)


def _project(params, x):
    """A query, key or value projection: (rows, tokens, width) -> (..., heads, head width)."""
    return _apply(nn.DenseGeneral(params["kernel"].shape[1:]), params, x)


def _apply(module: nn.Module, params, *args):
    return module.apply({"params": params}, *args)


def _choose(logits, key, temperature, spec: _Spec):
    """The next token of each row: the most likely one, or one drawn at ``temperature``
    from the ``top_k`` most likely; never one at or beyond the data's vocabulary."""
    logits = logits.astype(jnp.float32)
    if spec.vocab_size < logits.shape[-1]:
        real = jnp.arange(logits.shape[-1])[None, :] < spec.vocab_size
        logits = jnp.where(real, logits, -jnp.inf)
    if spec.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if spec.top_k is None:
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
    values, indices = jax.lax.top_k(logits, spec.top_k)
    chosen = jax.random.categorical(key, values / temperature)
    return jnp.take_along_axis(indices, chosen[:, None], axis=1)[:, 0].astype(jnp.int32)


def translate(model: Model, params, model_state, batch, *, bos: int, eos: int) -> jnp.ndarray:
    """Greedy decoding of ``batch``'s sources by a built-in sequence model (seq2seq, gpt).

    Returns ``(rows, target length)`` tokens from ``<bos>``, as long as ``batch["target"]``
    (whose contents are not read), each the most likely given those before it; after
    ``<eos>`` a row continues with ``<eos>`` (as `greedy_decode`).

    One program decodes every position: each step runs the model on the whole target
    buffer and reads the logits at its position. The decoder is causal, so the
    positions not yet decoded are never attended to: each token is the one a call on
    its prefix alone gives, and the one the evaluation's exact match reads from the
    same call (`sequence`).
    """
    rows, length = batch["target"].shape

    @jax.jit
    def decode(batch):
        def step(index, carry):
            tokens, done = carry
            outputs, _ = model.apply(params, model_state, {**batch, "target": tokens}, train=False)
            # The target's positions are the last (a gpt reads the source before them).
            token = jnp.argmax(outputs[:, index - (length - 1)], -1).astype(jnp.int32)
            token = jnp.where(done, eos, token)
            return tokens.at[:, index + 1].set(token), done | (token == eos)

        tokens = jnp.full((rows, length), eos, jnp.int32).at[:, 0].set(bos)
        return jax.lax.fori_loop(0, length - 1, step, (tokens, jnp.zeros(rows, bool)))[0]

    return decode(batch)
