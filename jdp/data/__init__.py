"""Datasets and global batches: the bundled and catalog datasets by name, and your own.

Your own data: `from_arrays` (NumPy arrays), `from_tfds` (any TFDS dataset
prepared as array_record, a builder of your own included) and `from_folder`
(images in class folders) each return a split for ``jdp.fit(config, train=...,
validation=..., test=...)``; `holdout` sets a validation split apart; `Transform`
preprocesses images and ``map=`` takes your own per-example function.
`from_tokens` reads a token corpus on disk (llm.c shards, raw ``.bin``, ``.npy``)
as windows for a language model, memory-mapped. `from_indexable` reads any source
with ``len()`` and ``[i]`` (a Hugging Face dataset, a Grain ``MapDataset``) in
jdp's order; `from_batches` takes any iterable of batches (a generator, a
``tf.data.Dataset``, a ``DataLoader``) for training, in its own order.
`from_images` streams a class-folder tree of any size, or the array_record
shards `pack` writes of it, decoding and cropping each batch in the loader
(`ImageTransform`); `from_tfds_images` a TFDS dataset of images of many sizes.
`check_splits` is what a run checks of its splits before it builds the model.
"""

from jdp.data.checks import check_splits
from jdp.data.custom import from_arrays, from_folder, from_npz, from_tfds, holdout
from jdp.data.image_sources import from_images, from_tfds_images, pack
from jdp.data.images import ImageSplit, ImageTransform
from jdp.data.sources import ArraySplit, Split
from jdp.data.streams import BatchStream, IndexedSplit, from_batches, from_indexable
from jdp.data.tokens import TokenSplit, from_tokens
from jdp.data.transforms import Transform

__all__ = [
    "ArraySplit",
    "BatchStream",
    "ImageSplit",
    "ImageTransform",
    "IndexedSplit",
    "Split",
    "TokenSplit",
    "Transform",
    "check_splits",
    "from_arrays",
    "from_batches",
    "from_folder",
    "from_images",
    "from_indexable",
    "from_npz",
    "from_tfds",
    "from_tfds_images",
    "from_tokens",
    "holdout",
    "pack",
]
