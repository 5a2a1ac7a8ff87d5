"""A language model's output projection taken in chunks of tokens (``--loss-chunks``).

GPT-2's logits are ``rows x length x vocabulary`` values: at 32 rows of 1,024 tokens
and 50,304 entries, 6.1 GiB in fp32, held several times over by the loss and its
gradient, more than every layer's activations together. A model that returns
`HeadInputs` (its last hidden states and the output kernel) instead lets the
objective compute the logits, the loss and the metrics one chunk of tokens at a time,
each chunk's logits recomputed in the backward pass: no more than one chunk's logits
exist at once. The loss is the same sum over the same products. MaxText's vocabulary
tiling takes the same path; Liger Kernel's fused linear cross-entropy goes further,
computing the gradients during the forward pass, which spares the backward pass's
second product with the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class HeadInputs:
    """What the output projection reads: ``logits = hidden @ kernel.T``."""

    hidden: jax.Array  # (rows, length, width): the final LayerNorm's output
    kernel: jax.Array  # (vocab, width): the tied token embedding
    chunks: int = struct.field(pytree_node=False, default=1)

    def logits(self) -> jax.Array:
        """All of the logits at once, ``(rows, length, vocab)``, as the model's head makes
        them (decoding, exact match)."""
        return _project(self.hidden, self.kernel)


def _project(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    # Flax's Embed.attend: the product in the operands' common dtype.
    dtype = jnp.result_type(hidden, kernel)
    return jnp.dot(hidden.astype(dtype), kernel.astype(dtype).T)


def per_token(
    head: HeadInputs,
    labels: jax.Array,
    figures: Callable[[jax.Array, jax.Array], dict[str, jax.Array]],
) -> dict[str, jax.Array]:
    """``figures(logits, labels)`` of every token, ``{name: (rows, length)}``, computed
    over ``head.chunks`` chunks of the tokens in turn (fewer where they do not divide
    the tokens: the largest count at most ``chunks`` that does), each chunk's logits
    recomputed in the backward pass rather than kept. ``head`` may be the logits."""
    if not isinstance(head, HeadInputs):  # the logits themselves
        return figures(head, labels)
    rows, length, width = head.hidden.shape
    tokens = rows * length
    chunks = max(n for n in range(1, min(head.chunks, tokens) + 1) if tokens % n == 0)
    if chunks == 1:
        return figures(head.logits(), labels)
    hidden = head.hidden.reshape(chunks, tokens // chunks, width)
    kernel = head.kernel

    @jax.checkpoint
    def chunk(pair):
        x, y = pair
        return figures(_project(x, kernel), y)

    out = lax.map(chunk, (hidden, labels.reshape(chunks, tokens // chunks)))
    return {name: value.reshape(rows, length) for name, value in out.items()}
