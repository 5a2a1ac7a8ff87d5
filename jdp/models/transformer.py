"""Transformers: an encoder-decoder (``seq2seq``) and a decoder-only language model (``gpt``).

Pre-LayerNorm blocks (the normalisation before each sub-layer, as GPT-2 and most
recent models: stable at the learning rates the other models use), dropout on
attention weights and residual branches, token ``0`` is padding.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdp.models.names import attention_inits, dense, embed, norm_inits


def sinusoids(length: int, width: int) -> np.ndarray:
    """The fixed positional encodings of Vaswani et al. (2017), ``(length, width)``."""
    positions = np.arange(length)[:, None]
    rates = np.exp(-np.log(10_000.0) * np.arange(0, width, 2) / width)
    table = np.zeros((length, width), np.float32)
    table[:, 0::2] = np.sin(positions * rates)
    table[:, 1::2] = np.cos(positions * rates)
    return table


def layer_norm() -> nn.LayerNorm:
    """``nn.LayerNorm`` over the model width (``embed``)."""
    return nn.LayerNorm(**norm_inits("embed"))


class FeedForward(nn.Module):
    hidden: int
    dropout: float

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        width = x.shape[-1]
        x = nn.gelu(dense(self.hidden, ("embed", "mlp"))(x))
        return nn.Dropout(self.dropout, deterministic=not train)(dense(width, ("mlp", "embed"))(x))


class Block(nn.Module):
    """Self-attention, optional cross-attention on ``memory``, feed-forward; pre-LN residuals."""

    heads: int
    hidden: int
    dropout: float

    @nn.compact
    def __call__(self, x, mask, *, train: bool, memory=None, memory_mask=None):
        def attend(queries, keys, attention_mask):
            attended = nn.MultiHeadDotProductAttention(
                self.heads, dropout_rate=self.dropout, deterministic=not train,
                **attention_inits(),
            )(queries, keys, mask=attention_mask)  # fmt: skip
            return nn.Dropout(self.dropout, deterministic=not train)(attended)

        normed = layer_norm()(x)
        x = x + attend(normed, normed, mask)
        if memory is not None:
            x = x + attend(layer_norm()(x), memory, memory_mask)
        return x + FeedForward(self.hidden, self.dropout)(layer_norm()(x), train=train)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer: ``(source, target_in) -> logits (rows, target length, vocab)``.

    The reference DDP Transformer's model (``nn.Transformer`` with a shared
    embedding and a linear head), with what it leaves out: positional encodings,
    the decoder's causal mask and the padding masks.
    """

    vocab_size: int
    width: int = 128
    heads: int = 4
    layers: int = 2  # in the encoder and in the decoder
    hidden: int = 512
    dropout: float = 0.1
    pad: int = 0

    def setup(self):
        self.embed = embed(self.vocab_size, self.width, "vocab")
        block = lambda: Block(self.heads, self.hidden, self.dropout)  # noqa: E731
        self.encoder = [block() for _ in range(self.layers)]
        self.decoder = [block() for _ in range(self.layers)]
        self.encoder_norm, self.decoder_norm = layer_norm(), layer_norm()
        self.embed_dropout = nn.Dropout(self.dropout)
        self.head = dense(self.vocab_size, ("embed", "vocab"))

    def _embed(self, tokens: jax.Array, train: bool) -> jax.Array:
        x = self.embed(tokens)  # in the parameters' dtype: keep it (NumPy constants are fp64)
        positions = jnp.asarray(sinusoids(tokens.shape[1], self.width), x.dtype)
        x = x * jnp.asarray(np.sqrt(self.width), x.dtype) + positions[None]
        return self.embed_dropout(x, deterministic=not train)

    def encode(self, source: jax.Array, *, train: bool = False) -> jax.Array:
        x = self._embed(source, train)
        keep = source != self.pad
        mask = nn.make_attention_mask(keep, keep)
        for block in self.encoder:
            x = block(x, mask, train=train)
        return self.encoder_norm(x)

    def decode(self, memory, source, target_in, *, train: bool = False) -> jax.Array:
        y = self._embed(target_in, train)
        causal = nn.make_causal_mask(target_in)
        cross = nn.make_attention_mask(target_in != self.pad, source != self.pad)
        for block in self.decoder:
            y = block(y, causal, train=train, memory=memory, memory_mask=cross)
        return self.head(self.decoder_norm(y))

    def __call__(self, source, target_in, *, train: bool = False) -> jax.Array:
        return self.decode(self.encode(source, train=train), source, target_in, train=train)


class GPT(nn.Module):
    """Decoder-only Transformer language model: ``tokens -> next-token logits``.

    GPT-2's layout: learned positions, pre-LN causal blocks, a final LayerNorm
    and the output projection tied to the token embedding.
    """

    vocab_size: int
    width: int = 128
    heads: int = 4
    layers: int = 4
    hidden: int = 512
    dropout: float = 0.1
    max_len: int = 256

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"{tokens.shape[1]} tokens, more than max_len={self.max_len}")
        tokens_embed = embed(self.vocab_size, self.width, "vocab")
        positions = embed(self.max_len, self.width, "length")(jnp.arange(tokens.shape[1]))
        x = nn.Dropout(self.dropout, deterministic=not train)(
            tokens_embed(tokens) + positions[None]
        )
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.heads, self.hidden, self.dropout)(x, mask, train=train)
        return tokens_embed.attend(layer_norm()(x))


def greedy_decode(
    next_logits: Callable[[jax.Array], jax.Array], rows: int, length: int, *, bos: int, eos: int
) -> jax.Array:
    """Greedy decoding: ``length`` tokens after ``<bos>``, each the most likely given those before.

    ``next_logits(prefix)`` returns logits ``(rows, prefix length, vocab)`` for a
    prefix ``(rows, n)``; after ``<eos>`` a row continues with ``<eos>``.
    Returns ``(rows, length + 1)`` tokens starting with ``<bos>``.
    """
    tokens = jnp.full((rows, 1), bos, jnp.int32)
    done = jnp.zeros(rows, bool)
    for _ in range(length):
        token = jnp.argmax(next_logits(tokens)[:, -1], -1).astype(jnp.int32)
        token = jnp.where(done, eos, token)
        done = done | (token == eos)
        tokens = jnp.concatenate([tokens, token[:, None]], axis=1)
    return tokens
