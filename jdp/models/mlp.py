"""The reference documents' Keras model: Dense(512, relu) -> Dense(classes)."""

from __future__ import annotations

import flax.linen as nn
import jax

from jdp.models.names import dense


class MLP(nn.Module):
    """Flattens the image, hidden ReLU layers, logits out.

    Logical names: the layers alternate ``(embed, mlp)`` and ``(mlp, embed)``, so
    under tensor parallelism a column-parallel layer feeds a row-parallel one.
    """

    num_classes: int
    hidden: tuple[int, ...] = (512,)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        width_name = "embed"
        for width in self.hidden:
            out = "mlp" if width_name == "embed" else "embed"
            x = nn.relu(dense(width, (width_name, out))(x))
            width_name = out
        return dense(self.num_classes, (width_name, "classes"))(x)
