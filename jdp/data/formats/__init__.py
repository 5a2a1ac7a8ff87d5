"""The forms a dataset is held in, and how one example becomes arrays: TFDS builders
on disk and the bundled datasets, token shards and corpora, image files and packed
images, NumPy files, and the per-example preprocessing.

The rest of jdp imports this wing through this face; its modules import each other
directly."""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.data.formats.corpora": (
            "is_corpus",
            "load_corpus",
        ),
        "jdp.data.formats.image_sources": ("from_images",),
        "jdp.data.formats.raw": ("read_inputs",),
        "jdp.data.formats.shards": (
            "write_llmc",
            "write_meta",
        ),
        "jdp.data.formats.tokens": (
            "TOKENS_PREFIX",
            "TokenSplit",
        ),
    },
)
