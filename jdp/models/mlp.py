"""The reference documents' Keras model: Dense(512, relu) -> Dense(classes)."""

from __future__ import annotations

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Flattens the image, one hidden ReLU layer, logits out."""

    num_classes: int
    hidden: int = 512

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)
