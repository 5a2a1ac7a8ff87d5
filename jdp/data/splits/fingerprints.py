"""What data a run trained on, as a short fingerprint its checkpoints record: a resume on
other data is refused, not trained on as if it were the same run.

Splits held in memory (the bundled datasets, TFDS splits, image folders, your
arrays) are fingerprinted by their whole content: SHA-256 over each array's
name, dtype, shape and bytes (the fastest of hashlib's on CPUs with SHA
extensions, 1.2 GB/s measured against BLAKE2b's 0.3), paid only by runs that
save checkpoints. A token corpus is read from disk as it trains and may be far larger
than memory: its fingerprint is each file's name and size and a SHA-256 of 16
blocks of 64 KiB spread over it, read in milliseconds whatever the corpus's
size; so are packed images' shards (`jdp.data.formats.images`), and a folder of images by its
files' names. A corpus replaced, regenerated, grown or cut is seen; a change of a few
bytes between the sampled blocks is not (a full read of 100 GB at each start
would cost minutes).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from jdp.data.splits.checks import in_memory

_BLOCKS, _BLOCK_BYTES = 16, 64 * 1024
_ROWS_BYTES = 1 << 24  # arrays are hashed this many bytes at a time


def fingerprint(split) -> str:
    """A short hex digest of ``split``'s examples (see the module); "" for a split jdp
    cannot read the content of."""
    digest = hashlib.sha256()
    digest.update(f"{len(split)} examples".encode())
    arrays = in_memory(split)
    if arrays is not None:
        for name in sorted(arrays):
            _hash_array(digest, name, arrays[name])
        return digest.hexdigest()[:24]
    if getattr(split, "decodes", False):  # streamed images (`jdp.data.formats.images`)
        return _images(digest, split)
    shards = getattr(split, "shards", None)
    if shards is None:
        return ""
    digest.update(f"windows of {split.seq_len + 1}".encode())
    if split.windows is not None:  # a subset of the corpus's windows
        _hash_array(digest, "windows", np.asarray(split.windows))
    for shard in shards:
        _hash_file(digest, shard.path)
    return digest.hexdigest()[:24]


def _images(digest, split) -> str:
    """Streamed images: their labels, and their packed shards sampled as a corpus's
    files are, or the names of a folder's files."""
    if split.labels is not None:  # else read with the images, from the files hashed below
        _hash_array(digest, "labels", split.labels)
    if split.rows is not None:  # a subset of the store's images
        _hash_array(digest, "rows", np.asarray(split.rows))
    for path in getattr(split.store, "paths", ()):
        _hash_file(digest, path)
    digest.update(getattr(split.store, "names", b""))
    return digest.hexdigest()[:24]


def _hash_array(digest, name: str, array: np.ndarray) -> None:
    digest.update(f"{name} {array.dtype.str} {array.shape}".encode())
    if not array.size:
        return
    rows = max(1, _ROWS_BYTES // max(1, array[0].nbytes))
    for start in range(0, len(array), rows):
        digest.update(np.ascontiguousarray(array[start : start + rows]).data)


def _hash_file(digest, path: str) -> None:
    size = os.path.getsize(path)
    digest.update(f"{os.path.basename(path)} {size}".encode())
    span = max(0, size - _BLOCK_BYTES)
    with open(path, "rb") as file:
        for offset in sorted({span * i // (_BLOCKS - 1) for i in range(_BLOCKS)}):
            file.seek(offset)
            digest.update(file.read(_BLOCK_BYTES))
