"""The reference documents' Keras model: Dense(512, relu) -> Dense(classes)."""

from __future__ import annotations

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Flattens the image, hidden ReLU layers, logits out."""

    num_classes: int
    hidden: tuple[int, ...] = (512,)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)
