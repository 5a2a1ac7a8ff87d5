"""ResNets for CIFAR-sized images (32x32), with BatchNorm over the global batch.

``resnet20`` is He et al.'s CIFAR network (2016, section 4.2): a 3x3 stem and
three stages of three basic blocks at 16, 32 and 64 channels. ``resnet18`` is the
ImageNet ResNet-18 in the form used for CIFAR: four stages of two basic blocks
at 64 to 512 channels, with a 3x3 stem and no max-pool in place of the 7x7 stem
(which would shrink a 32x32 image to 8x8 before the first block).

In training, BatchNorm's mean and variance are averaged over the ``data`` axis,
so the model must run inside jdp's train step; evaluation uses the running
averages and runs anywhere.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax

from jdp.mesh import DATA_AXIS
from jdp.models.names import conv as named_conv
from jdp.models.names import dense, norm_inits


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual; a 1x1 projection where the shape changes."""

    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            axis_name=DATA_AXIS if train else None,
        )
        conv = partial(named_conv, use_bias=False)
        y = nn.relu(
            norm(**norm_inits("conv_out"))(conv(self.features, (3, 3), strides=self.stride)(x))
        )
        # Zero-initialised last scale: each block starts as the identity (Goyal et al.).
        y = norm(**norm_inits("conv_out", nn.initializers.zeros))(conv(self.features, (3, 3))(y))
        if x.shape[-1] != self.features or self.stride != 1:
            x = norm(**norm_inits("conv_out"))(conv(self.features, (1, 1), strides=self.stride)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A stem, stages of basic blocks (the first of each later stage halves the size), logits."""

    num_classes: int
    stages: tuple[int, ...] = (3, 3, 3)  # blocks per stage
    widths: tuple[int, ...] = (16, 32, 64)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = named_conv(self.widths[0], (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, axis_name=DATA_AXIS if train else None,
            **norm_inits("conv_out"),
        )(x)  # fmt: skip
        x = nn.relu(x)
        for stage, (blocks, width) in enumerate(zip(self.stages, self.widths, strict=True)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                x = BasicBlock(width, stride)(x, train=train)
        return dense(self.num_classes, ("conv_out", "classes"))(x.mean(axis=(1, 2)))
