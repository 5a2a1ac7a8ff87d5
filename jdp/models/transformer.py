"""Transformers: an encoder-decoder (``seq2seq``) and a decoder-only language model (``gpt``).

Pre-LayerNorm blocks (the normalisation before each sub-layer, as GPT-2 and most
recent models: stable at the learning rates the other models use), dropout on
attention weights and residual branches, token ``0`` is padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdp.layout import SCANNED_LAYERS, STACKED, gather_layer
from jdp.models.attention import (
    Attention,
    AttentionImplementation,
)
from jdp.models.dropout import RowDropout
from jdp.models.fp8 import fp8_dot_general
from jdp.models.head import HeadInputs
from jdp.models.names import dense, embed, norm_inits

Remat = Literal["none", "dots", "full", "attention"]
# What each layer-wide --remat keeps for the backward pass (the rest is recomputed);
# ``attention`` recomputes only the attention's scores (`jdp.models.attention.Attention`).
REMAT_POLICIES = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weights' products
    "full": jax.checkpoint_policies.nothing_saveable,  # only each layer's input
}


def sinusoids(length: int, width: int) -> np.ndarray:
    """The fixed positional encodings of Vaswani et al. (2017), ``(length, width)``."""
    positions = np.arange(length)[:, None]
    rates = np.exp(-np.log(10_000.0) * np.arange(0, width, 2) / width)
    table = np.zeros((length, width), np.float32)
    table[:, 0::2] = np.sin(positions * rates)
    table[:, 1::2] = np.cos(positions * rates)
    return table


# Flax's LayerNorm epsilon; GPT-2's is 1e-5 (a model loaded from its weights keeps it).
EPSILON = 1e-6


def layer_norm(epsilon: float = EPSILON, *, bias: bool = True) -> nn.LayerNorm:
    """``nn.LayerNorm`` over the model width (``embed``); ``bias``: with its shift."""
    return nn.LayerNorm(epsilon=epsilon, use_bias=bias, **norm_inits("embed"))


class FeedForward(nn.Module):
    hidden: int
    dropout: float
    bias: bool = True
    fp8: bool = False  # the products in FP8 while training (`jdp.models.fp8`)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool, rows=None) -> jax.Array:
        width = x.shape[-1]
        options = {
            "use_bias": self.bias,
            "dot_general": fp8_dot_general if self.fp8 and train else None,
        }
        x = nn.gelu(dense(self.hidden, ("embed", "mlp"), **options)(x))
        x = dense(width, ("mlp", "embed"), **options)(x)
        return RowDropout(self.dropout, name="Dropout_0")(x, rows, deterministic=not train)


class Block(nn.Module):
    """Self-attention, optional cross-attention on ``memory``, feed-forward; pre-LN residuals."""

    heads: int
    hidden: int
    dropout: float
    attention_dropout: float | None = None  # on the attention weights; None: ``dropout``
    attention: AttentionImplementation = "auto"
    epsilon: float = EPSILON  # the LayerNorms'
    bias: bool = True  # in the dense layers and LayerNorms (nanoGPT's bias=False: none)
    remat_attention: bool = False  # the attention's scores recomputed in the backward pass
    fp8: bool = False  # the dense layers' products in FP8 while training (`jdp.models.fp8`)

    @nn.compact
    def __call__(
        self,
        x,
        *,
        train: bool,
        causal: bool = False,
        mask=None,
        memory=None,
        memory_mask=None,
        target_mask=None,
        rows=None,
    ):
        """``mask``: the keys of ``x`` to attend to; ``memory_mask`` those of ``memory``
        (``target_mask``, the rows of ``x`` that are not padding, for Flax's unfused path);
        ``rows``: their indices in the global batch, for dropout (`jdp.models.dropout`)."""
        rate = self.dropout if self.attention_dropout is None else self.attention_dropout

        def attend(index, queries, keys, **masks):
            # The names Flax's MultiHeadDotProductAttention had: older checkpoints restore.
            module = Attention(
                self.heads,
                rate,
                self.attention,
                self.bias,
                self.remat_attention,
                fp8=self.fp8,
                name=f"MultiHeadDotProductAttention_{index}",
            )
            attended = module(queries, keys, train=train, rows=rows, **masks)
            return RowDropout(self.dropout, name=f"Dropout_{index}")(
                attended, rows, deterministic=not train
            )

        normed = layer_norm(self.epsilon, bias=self.bias)(x)
        x = x + attend(0, normed, normed, causal=causal, key_mask=mask, query_mask=mask)
        if memory is not None:
            x = x + attend(
                1,
                layer_norm(self.epsilon, bias=self.bias)(x),
                memory,
                key_mask=memory_mask,
                query_mask=target_mask,
            )
        feed = FeedForward(self.hidden, self.dropout, self.bias, self.fp8)
        return x + feed(layer_norm(self.epsilon, bias=self.bias)(x), train=train, rows=rows)


class CausalLayer(Block):
    """A decoder-only model's block as `nn.scan` and `nn.remat` call it:
    ``((x, rows), unused) -> ((x, rows), None)``, training or not fixed."""

    train: bool = False

    def __call__(self, carry, _=None):
        x, rows = carry
        return (super().__call__(x, train=self.train, causal=True, rows=rows), rows), None


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
    attention: AttentionImplementation = "auto"

    def setup(self):
        self.embed = embed(self.vocab_size, self.width, "vocab")
        block = lambda: Block(self.heads, self.hidden, self.dropout, attention=self.attention)  # noqa: E731
        self.encoder = [block() for _ in range(self.layers)]
        self.decoder = [block() for _ in range(self.layers)]
        self.encoder_norm, self.decoder_norm = layer_norm(), layer_norm()
        self.embed_dropout = RowDropout(self.dropout)
        self.head = dense(self.vocab_size, ("embed", "vocab"))

    def _embed(self, tokens: jax.Array, train: bool, rows=None) -> jax.Array:
        x = self.embed(tokens)  # in the parameters' dtype: keep it (NumPy constants are fp64)
        positions = jnp.asarray(sinusoids(tokens.shape[1], self.width), x.dtype)
        x = x * jnp.asarray(np.sqrt(self.width), x.dtype) + positions[None]
        return self.embed_dropout(x, rows, deterministic=not train)

    def encode(self, source: jax.Array, *, train: bool = False, rows=None) -> jax.Array:
        x = self._embed(source, train, rows)
        keep = source != self.pad
        for block in self.encoder:
            x = block(x, train=train, mask=keep, rows=rows)
        return self.encoder_norm(x)

    def decode(self, memory, source, target_in, *, train: bool = False, rows=None) -> jax.Array:
        y = self._embed(target_in, train, rows)
        for block in self.decoder:
            y = block(
                y,
                train=train,
                causal=True,
                memory=memory,
                memory_mask=source != self.pad,
                target_mask=target_in != self.pad,
                rows=rows,
            )
        return self.head(self.decoder_norm(y))

    def __call__(self, source, target_in, *, train: bool = False, rows=None) -> jax.Array:
        """``rows``: the rows' indices in the global batch, for dropout (`jdp.models.dropout`)."""
        memory = self.encode(source, train=train, rows=rows)
        return self.decode(memory, source, target_in, train=train, rows=rows)


class GPT(nn.Module):
    """Decoder-only Transformer language model: ``tokens -> next-token logits``.

    GPT-2's layout: learned positions, pre-LN causal blocks, a final LayerNorm
    and the output projection tied to the token embedding. The blocks are one
    layer under `nn.scan` (parameters stacked on a leading ``layers`` axis: one
    compiled layer, and FSDP gathers one layer's parameters at a time);
    ``unroll`` makes them a Python loop of ``Block_0``, ``Block_1``, ... as
    checkpoints written before scanned layers hold them. ``remat`` recomputes
    each layer's activations in the backward pass: ``dots`` keeps the products
    with the weights, ``full`` keeps only each layer's input, ``attention`` keeps
    all but XLA's attention scores (cuDNN's kernel keeps none: its memory, on XLA).
    Dropout is on the embeddings and residual branches, not the attention weights, so attention
    is fused (``attention``: ``auto``, ``xla`` or ``cudnn``). ``epsilon`` is the
    LayerNorms' (GPT-2's weights were trained with 1e-5: `jdp.models.from_hf`).
    ``bias=False`` leaves the biases out of every dense layer and LayerNorm
    (nanoGPT's ``bias=False``). ``loss_chunks`` above 1 returns `HeadInputs` in place
    of the logits, for a loss that takes them that many chunks of tokens at a time
    (`jdp.models.head`; `HeadInputs.logits` gives them all). ``fp8`` runs the layers'
    products (not the embeddings' or the logits') in FP8 while training
    (`jdp.models.fp8`); evaluating and sampling run them in the compute precision.
    """

    vocab_size: int
    width: int = 128
    heads: int = 4
    layers: int = 4
    hidden: int = 512
    dropout: float = 0.1
    max_len: int = 256
    unroll: bool = False
    remat: Remat = "none"
    attention: AttentionImplementation = "auto"
    epsilon: float = EPSILON
    bias: bool = True
    loss_chunks: int = 1
    fp8: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False, rows=None) -> jax.Array:
        """``rows``: the rows' indices in the global batch, for dropout (`jdp.models.dropout`)."""
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"{tokens.shape[1]} tokens, more than max_len={self.max_len}")
        tokens_embed = embed(self.vocab_size, self.width, "vocab")
        positions = embed(self.max_len, self.width, "length")(jnp.arange(tokens.shape[1]))
        x = RowDropout(self.dropout, name="Dropout_0")(
            tokens_embed(tokens) + positions[None], rows, deterministic=not train
        )
        rows = jnp.arange(tokens.shape[0]) if rows is None else rows
        layer = CausalLayer
        if not self.unroll:  # FSDP gathers a layer's parameters inside the scan's body
            layer = nn.map_variables(
                layer, "params", trans_in_fn=gather_layer, init=True, mutable=True
            )
        if self.remat in REMAT_POLICIES:
            # Inside a scan XLA cannot merge the recomputation back into the forward pass.
            layer = nn.remat(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=self.unroll)
        options = {
            "heads": self.heads,
            "hidden": self.hidden,
            "dropout": self.dropout,
            "attention_dropout": 0.0,
            "attention": self.attention,
            "epsilon": self.epsilon,
            "bias": self.bias,
            "remat_attention": self.remat == "attention",
            "fp8": self.fp8,
            "train": train,
        }
        if self.unroll:
            for index in range(self.layers):
                (x, _), _ = layer(**options, name=f"Block_{index}")((x, rows), None)
        else:
            stack = nn.scan(
                layer,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.layers,
                metadata_params={nn.PARTITION_NAME: STACKED},
            )
            (x, _), _ = stack(**options, name=SCANNED_LAYERS)((x, rows), None)
        normed = layer_norm(self.epsilon, bias=self.bias)(x)
        if self.loss_chunks > 1:  # the objective takes the logits a chunk at a time
            return HeadInputs(normed, tokens_embed.embedding, self.loss_chunks)
        return tokens_embed.attend(normed)


def stack_layers(params: dict, layers: int) -> dict:
    """Unrolled `GPT` parameters (``Block_0`` ... ``Block_{layers-1}``) as the scanned
    model holds them (``blocks``, each leaf stacked on a leading axis)."""
    names = [f"Block_{index}" for index in range(layers)]
    rest = {key: value for key, value in params.items() if key not in names}
    return {
        **rest,
        "blocks": jax.tree.map(lambda *leaves: jnp.stack(leaves), *(params[n] for n in names)),
    }


def flops_per_token(
    parameters: int, *, layers: int, width: int, seq_len: int, max_len: int
) -> float:
    """Model FLOPs of one trained token of `GPT` (forward and backward), as PaLM's
    appendix B counts them: ``6 N`` for the weights (``N`` the parameters but the
    position table, which is read, not multiplied) plus ``12 L T d`` for attention's
    two products (``L`` layers, ``T`` tokens, ``d`` the width), counted whole:
    the causal half that a kernel may skip is not taken off, as PaLM and nanoGPT.
    """
    weights = parameters - max_len * width
    return 6.0 * weights + 12.0 * layers * seq_len * width


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
