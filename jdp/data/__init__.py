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
`on_devices` places a split in memory on every device once: its batches are then
gathered there, the same ones, with no host read (``--data-on-device``).
"""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.data.splits.checks": ("check_splits",),
        "jdp.data.splits.custom": (
            "from_arrays",
            "from_folder",
            "from_npz",
            "from_tfds",
            "holdout",
        ),
        "jdp.data.formats.image_sources": ("from_images", "from_tfds_images", "pack"),
        "jdp.data.formats.images": ("ImageSplit", "ImageTransform"),
        "jdp.data.loader.on_device": ("OnDevice", "on_devices"),
        "jdp.data.splits.sources": ("ArraySplit", "Split"),
        "jdp.data.loader.streams": (
            "BatchStream",
            "IndexedSplit",
            "from_batches",
            "from_indexable",
        ),
        "jdp.data.formats.tokens": ("TokenSplit", "from_tokens"),
        "jdp.data.formats.transforms": ("Transform",),
    },
)
