"""A small CNN with cross-replica BatchNorm, for small images such as the 8x8 digits."""

from __future__ import annotations

import flax.linen as nn
import jax

from jdp.mesh import DATA_AXIS
from jdp.models.names import conv, dense, norm_inits


class CNN(nn.Module):
    """Conv blocks (3x3 conv, BatchNorm, ReLU) with 2x2 max-pooling between them, as the
    Keras MNIST CNN; global average pooling; logits.

    In training, BatchNorm normalises with the statistics of the global batch:
    mean and variance are averaged over the ``data`` axis, so the model must run
    inside jdp's train step (where that axis exists). With ``train=False`` it
    uses the running averages and runs anywhere.
    """

    num_classes: int
    features: tuple[int, ...] = (32, 64)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        for index, width in enumerate(self.features):
            if index:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = conv(width, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(
                use_running_average=not train,
                momentum=0.9,
                axis_name=DATA_AXIS if train else None,
                **norm_inits("conv_out"),
            )(x)
            x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        return dense(self.num_classes, ("conv_out", "classes"))(x)
