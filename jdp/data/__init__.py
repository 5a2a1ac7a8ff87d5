"""Datasets and global batches: the bundled and catalog datasets by name, and your own.

Your own data: `from_arrays` (NumPy arrays), `from_tfds` (any TFDS dataset
prepared as array_record, a builder of your own included) and `from_folder`
(images in class folders) each return a split for ``jdp.fit(config, train=...,
validation=..., test=...)``; `holdout` sets a validation split apart; `Transform`
preprocesses images and ``map=`` takes your own per-example function.
"""

from jdp.data.custom import from_arrays, from_folder, from_npz, from_tfds, holdout
from jdp.data.sources import ArraySplit, Split
from jdp.data.transforms import Transform

__all__ = [
    "ArraySplit",
    "Split",
    "Transform",
    "from_arrays",
    "from_folder",
    "from_npz",
    "from_tfds",
    "holdout",
]
