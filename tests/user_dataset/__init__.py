"""A TFDS builder as a user writes one: their own feature names, no supervised keys.

A package, not a module: TFDS locates a builder's files through its package.

Prepared by the tests into a temporary data directory; the command line reads it
back from there without importing this module.
"""

from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

TEST_SIZE = 297  # not a multiple of any batch or device count


class MyDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's digits under the user's names: ``pixels`` (0..16), ``digit``, ``weight``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Train 1500 / test 297."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "pixels": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                    "digit": tfds.features.ClassLabel(num_classes=10),
                    "weight": tfds.features.Tensor(shape=(), dtype=np.float32),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(1).permutation(len(digits.target))
        return {
            "train": self._generate_examples(digits, order[TEST_SIZE:]),
            "test": self._generate_examples(digits, order[:TEST_SIZE]),
        }

    def _generate_examples(self, digits, indices):
        for index in indices:
            yield (
                int(index),
                {
                    "pixels": digits.images[index].astype(np.uint8)[..., None],
                    "digit": int(digits.target[index]),
                    "weight": np.float32(1.0),
                },
            )
