"""Datasets and global batches: the bundled and catalog datasets by name, and your own.

Your own data: `from_arrays` (NumPy arrays), `from_tfds` (any TFDS dataset
prepared as array_record, a builder of your own included) and `from_folder`
(images in class folders) each return a split for ``jdp.fit(config, train=...,
validation=..., test=...)``; `holdout` sets a validation split apart; `Transform`
preprocesses images and ``map=`` takes your own per-example function.
`from_tokens` reads a token corpus on disk (llm.c shards, raw ``.bin``, ``.npy``)
as windows for a language model, memory-mapped. `check_splits` is what a run
checks of its splits before it builds the model.
"""

from jdp.data.checks import check_splits
from jdp.data.custom import from_arrays, from_folder, from_npz, from_tfds, holdout
from jdp.data.sources import ArraySplit, Split
from jdp.data.tokens import TokenSplit, from_tokens
from jdp.data.transforms import Transform

__all__ = [
    "ArraySplit",
    "Split",
    "TokenSplit",
    "Transform",
    "check_splits",
    "from_arrays",
    "from_folder",
    "from_npz",
    "from_tfds",
    "from_tokens",
    "holdout",
]
