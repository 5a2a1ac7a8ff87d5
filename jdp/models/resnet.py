"""ResNets, with BatchNorm over the global batch.

``resnet20`` is He et al.'s CIFAR network (2016, section 4.2): a 3x3 stem and
three stages of three basic blocks at 16, 32 and 64 channels. ``resnet18`` is the
ImageNet ResNet-18 in the form used for CIFAR: four stages of two basic blocks
at 64 to 512 channels, with a 3x3 stem and no max-pool in place of the 7x7 stem
(which would shrink a 32x32 image to 8x8 before the first block). ``resnet50`` is
ImageNet's ResNet-50 in torchvision's layout (v1.5: the stride on each bottleneck's
3x3 convolution): a 7x7 stem with a max-pool, four stages of 3, 4, 6 and 3
bottleneck blocks at 64 to 512 channels, widened 4x (25,557,032 parameters for
1,000 classes).

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


def _batch_norm(*, train: bool, scale=nn.initializers.ones) -> nn.BatchNorm:
    """BatchNorm over the channels; in training, its statistics averaged over ``data``
    (the global batch's)."""
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        axis_name=DATA_AXIS if train else None,
        **norm_inits("conv_out", scale),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual; a 1x1 projection where the shape changes."""

    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        norm = partial(_batch_norm, train=train)
        conv = partial(named_conv, use_bias=False)
        y = nn.relu(norm()(conv(self.features, (3, 3), strides=self.stride)(x)))
        # Zero-initialised last scale: each block starts as the identity (Goyal et al.).
        y = norm(scale=nn.initializers.zeros)(conv(self.features, (3, 3))(y))
        if x.shape[-1] != self.features or self.stride != 1:
            x = norm()(conv(self.features, (1, 1), strides=self.stride)(x))
        return nn.relu(x + y)


class Bottleneck(nn.Module):
    """A 1x1 convolution to ``features``, a 3x3 one with the stride (torchvision's v1.5),
    a 1x1 one out to ``4 * features``, and the residual; a 1x1 projection where the
    shape changes."""

    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        norm = partial(_batch_norm, train=train)
        conv = partial(named_conv, use_bias=False)
        out = 4 * self.features
        y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
        y = conv(self.features, (3, 3), strides=self.stride)(y)
        y = nn.relu(norm()(y))
        # Zero-initialised last scale: each block starts as the identity (Goyal et al.).
        y = norm(scale=nn.initializers.zeros)(conv(out, (1, 1))(y))
        if x.shape[-1] != out or self.stride != 1:
            x = norm()(conv(out, (1, 1), strides=self.stride)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A stem, stages of blocks (the first of each later stage halves the size), logits.

    ``bottleneck`` builds the stages of `Bottleneck` blocks, ``imagenet_stem`` starts
    with ImageNet's 7x7 convolution of stride 2 and a 3x3 max-pool of stride 2 rather
    than a 3x3 convolution.
    """

    num_classes: int
    stages: tuple[int, ...] = (3, 3, 3)  # blocks per stage
    widths: tuple[int, ...] = (16, 32, 64)
    bottleneck: bool = False
    imagenet_stem: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        if self.imagenet_stem:
            x = named_conv(self.widths[0], (7, 7), strides=2, use_bias=False)(x)
        else:
            x = named_conv(self.widths[0], (3, 3), use_bias=False)(x)
        x = _batch_norm(train=train)(x)
        x = nn.relu(x)
        if self.imagenet_stem:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block_type = Bottleneck if self.bottleneck else BasicBlock
        for stage, (blocks, width) in enumerate(zip(self.stages, self.widths, strict=True)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                x = block_type(width, stride)(x, train=train)
        return dense(self.num_classes, ("conv_out", "classes"))(x.mean(axis=(1, 2)))
