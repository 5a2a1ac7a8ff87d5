"""TFDS catalog builders (MNIST, CIFAR-10) prepared from generated images, offline.

TFDS's MNIST and CIFAR-10 builders need TensorFlow to parse their downloads, so
tests prepare the same builders (same name, version, features and file layout)
from generated examples with PNGs encoded by Pillow; jdp then reads them back
exactly as it reads a real ``tfds build`` output.
"""

import io

import numpy as np
from PIL import Image


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format="png")
    return buffer.getvalue()


def _generated(catalog_builder, splits):
    """The catalog builder class, its examples replaced by ``splits`` (name -> images, labels)."""

    class Generated(catalog_builder, skip_registration=True):
        name = catalog_builder.name

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(*data) for split, data in splits.items()}

        def _generate_examples(self, images, labels):
            for index, (image, label) in enumerate(zip(images, labels, strict=True)):
                example = {"image": _png(image), "label": int(label)}
                if "id" in self.info.features:
                    example["id"] = f"generated_{index:05d}"
                yield index, example

    return Generated


def prepare(catalog_builder, data_dir, sizes, shape, seed=7):
    rng = np.random.default_rng(seed)
    splits = {
        split: (
            rng.integers(0, 256, (count, *shape), dtype=np.uint8),
            rng.integers(0, 10, count, dtype=np.uint8),
        )
        for split, count in sizes.items()
    }
    builder = _generated(catalog_builder, splits)(
        data_dir=str(data_dir), file_format="array_record"
    )
    builder.download_and_prepare()
    return splits
