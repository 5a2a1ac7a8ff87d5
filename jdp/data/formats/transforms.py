"""Per-example preprocessing and augmentation on the host, vectorised over a batch."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Augmentation(NamedTuple):
    """The random choices for a batch of examples: crop offsets ``(n, 2)`` and flips ``(n,)``."""

    offsets: np.ndarray
    flips: np.ndarray

    def take(self, rows: np.ndarray | slice) -> Augmentation:
        return Augmentation(self.offsets[rows], self.flips[rows])


@dataclasses.dataclass(frozen=True)
class Transform:
    """Raw ``uint8`` images to ``float32`` model inputs, with optional training augmentation.

    Images are divided by ``scale``, then normalised per channel by ``mean`` and
    ``std`` when given. In training, each example may be padded by
    ``crop_padding`` zeros on every side and randomly cropped back to its size,
    and flipped left-right with probability 1/2.
    """

    scale: float = 255.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    crop_padding: int = 0
    flip: bool = False

    @property
    def augments(self) -> bool:
        return self.crop_padding > 0 or self.flip

    def draw(self, rng: np.random.Generator, num_examples: int) -> Augmentation:
        """Draws the random choices for ``num_examples`` examples."""
        offsets = rng.integers(0, 2 * self.crop_padding + 1, size=(num_examples, 2))
        flips = rng.random(num_examples) < 0.5 if self.flip else np.zeros(num_examples, bool)
        return Augmentation(offsets, flips)

    def __call__(self, images: np.ndarray, augmentation: Augmentation | None = None) -> np.ndarray:
        x = images.astype(np.float32)
        x *= np.float32(1.0 / self.scale)  # in place: one float array a batch, not two
        if self.mean is not None:
            x -= np.asarray(self.mean, np.float32)
            x *= np.asarray(1.0 / np.asarray(self.std), np.float32)
        if augmentation is None or not self.augments or not len(x):
            return x
        return crop_and_flip(x, augmentation, self.crop_padding)


def crop_and_flip(x: np.ndarray, augmentation: Augmentation, padding: int) -> np.ndarray:
    """One gather: each example's crop window, its columns reversed where it flips."""
    n, height, width, _ = x.shape
    padded = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    rows = augmentation.offsets[:, :1] + np.arange(height)
    cols = augmentation.offsets[:, 1:] + np.arange(width)
    cols = np.where(augmentation.flips[:, None], cols[:, ::-1], cols)
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
