"""The bundled dataset: scikit-learn's 8x8 handwritten digits as a TFDS builder.

The 1,797 images ship inside scikit-learn, so the builder prepares its
array_record files offline in about a second. A fixed permutation holds out 359
images as the test split (not a multiple of 8, which keeps exact eval honest).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

TEST_SIZE = 359
_SPLIT_SEED = 20240611


class Digits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's handwritten digits: 8x8 grey images (values 0..16), 10 classes."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Train 1438 / test 359, split by a fixed permutation."
    }

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80",
        )

    def _split_generators(self, dl_manager):
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(_SPLIT_SEED).permutation(len(digits.target))
        return {
            "train": self._generate_examples(digits, order[TEST_SIZE:]),
            "test": self._generate_examples(digits, order[:TEST_SIZE]),
        }

    def _generate_examples(self, digits, indices):
        for index in indices:
            image = digits.images[index].astype(np.uint8)[..., None]
            yield int(index), {"image": image, "label": int(digits.target[index])}
