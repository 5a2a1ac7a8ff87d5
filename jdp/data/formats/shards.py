"""Token shards on disk: llm.c's format, nanoGPT's raw ``.bin``, ``.npy``, and the metadata.

- llm.c: a header of 256 little-endian int32 (magic, version, token count, zeros),
  then the tokens: magic 20240520 version 1 holds uint16 tokens (GPT-2's),
  magic 20240801 version 7 uint32 (Llama 3's).
- nanoGPT's ``train.bin`` / ``val.bin``: raw tokens with no header; their dtype
  must be declared (``tokens.json`` beside them, or ``--token-dtype``), never guessed.
- ``.npy``: a one-dimensional array of token ids, uint16, uint32 or int32.

``tokens.json`` beside the shards says what the ids mean: ``vocab_size``,
``dtype`` (for raw ``.bin``), ``tokenizer`` (``bytes`` or the tokenizer file's
name), ``eos_id`` (the id written before each document, or null), and what
``python -m jdp.data tokenize`` counted. Every shard is opened memory-mapped:
nothing reads a corpus whole.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os

import numpy as np

from jdp.errors import UsageError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# (magic, version) -> token dtype, as llm.c writes them.
LLMC_FORMATS = {(20240520, 1): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
LLMC_MAGICS = {magic for magic, _ in LLMC_FORMATS}
META_FILE = "tokens.json"
TOKEN_DTYPES = ("uint16", "uint32", "int32")


@dataclasses.dataclass(frozen=True)
class Shard:
    """One file of tokens: where its tokens start (bytes), how many, and their dtype."""

    path: str
    offset: int
    count: int
    dtype: str

    def check_size(self) -> None:
        """UsageError when the file no longer holds its tokens (cut short, replaced) since
        it was opened: reading its map past the new end would kill the process (SIGBUS)."""
        whole = self.offset + self.count * np.dtype(self.dtype).itemsize
        try:
            now = os.path.getsize(self.path)
        except OSError as error:
            now = error.strerror
        if now != whole:
            now = f"{now:,} bytes" if isinstance(now, int) else now
            raise UsageError(
                f"{self.path} changed while the run read it ({whole:,} bytes when opened, now "
                f"{now}); restore it, or start again on the new data"
            )

    def tokens(self) -> np.ndarray:
        """The shard's tokens, memory-mapped read-only (an empty array for an empty shard).

        ``release(tokens)`` afterwards gives back the pages a read mapped in.
        """
        if self.count == 0:
            return np.zeros(0, self.dtype)
        with open(self.path, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(mapped, self.dtype, count=self.count, offset=self.offset)


def release(tokens: np.ndarray) -> None:
    """Unmaps the pages of a shard's mapping (`Shard.tokens`) from this process.

    They stay in the kernel's page cache, so reading them again costs no disk
    read; the process's resident memory stops counting them. Without it, the
    kernel maps whole cached folios around each window read: 960 windows of
    257 tokens took 190 MiB to 1.3 GiB of a 2 GB corpus into resident memory.
    A call costs about 0.1 ms.
    """
    mapped = getattr(tokens.base, "obj", None)  # np.frombuffer's memoryview of the mmap
    if isinstance(mapped, mmap.mmap):
        mapped.madvise(mmap.MADV_DONTNEED)


def write_llmc(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Writes ``tokens`` as an llm.c shard: uint16 when every id fits, else uint32."""
    tokens = np.asarray(tokens)
    wide = tokens.size and int(tokens.max()) > np.iinfo(np.uint16).max
    (magic, version), dtype = next(
        (key, dtype) for key, dtype in LLMC_FORMATS.items() if (dtype.itemsize == 4) == bool(wide)
    )
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = magic, version, tokens.size
    with open(path, "wb") as file:
        file.write(header.tobytes())
        file.write(tokens.astype(dtype).tobytes())


def write_meta(directory: str | os.PathLike, meta: dict) -> None:
    """Writes ``tokens.json`` in ``directory``."""
    with open(os.path.join(directory, META_FILE), "w") as file:
        json.dump(meta, file, indent=1, sort_keys=True)
        file.write("\n")


class ShardWriter:
    """One split's llm.c shards of at most ``shard_tokens`` tokens each, named
    ``{name}_{split}_000000.bin`` on, and a row of ``table`` (a `csv.writer`) for each
    piece of a document a shard holds: split, shard, offset, tokens, the document."""

    def __init__(self, out: str, name: str, split: str, shard_tokens: int, table):
        self.out, self.prefix, self.split = out, f"{name}_{split}", split
        self.shard_tokens, self.table = shard_tokens, table
        self.pending, self.filled, self.named = [], 0, False
        self.documents = self.tokens = self.bytes = self.shards = 0

    def add(self, tokens: np.ndarray, path: str, size: int):
        self.documents += 1
        self.tokens += len(tokens)
        self.bytes += size
        start = 0
        while True:
            piece = tokens[start : start + self.shard_tokens - self.filled]
            shard = f"{self.prefix}_{self.shards:06d}.bin"
            self.table.writerow([self.split, shard, self.filled, len(piece), path])
            self.pending.append(piece)
            self.filled, self.named, start = self.filled + len(piece), True, start + len(piece)
            if self.filled == self.shard_tokens:
                self._flush()
            if start >= len(tokens):
                return

    def close(self):
        if self.filled or self.named:
            self._flush()

    def _flush(self):
        tokens = np.concatenate(self.pending) if self.pending else np.zeros(0, np.uint16)
        write_llmc(os.path.join(self.out, f"{self.prefix}_{self.shards:06d}.bin"), tokens)
        self.pending, self.filled, self.named, self.shards = [], 0, False, self.shards + 1


def read_meta(directory: str) -> dict:
    """``tokens.json`` in ``directory``, or ``{}`` when there is none."""
    path = os.path.join(directory, META_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as file:
            meta = json.load(file)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path} ({error}); fix or remove it") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{path} is not a JSON object of token facts; fix or remove it")
    return meta


def open_shard(path: str, dtype: str | None = None, *, llmc: bool = False) -> Shard:
    """The shard at ``path``: its llm.c header checked, a ``.npy`` read by its own header, a
    raw ``.bin`` by the declared ``dtype``; with ``llmc`` a ``.bin`` must have llm.c's header.

    Raises:
        UsageError: one line naming the file: an unknown llm.c version, a count
            that disagrees with the file's size, a ``.npy`` that is not one-dimensional
            token ids, or a raw ``.bin`` with no declared dtype.
    """
    if path.endswith(".npy"):
        return _npy_shard(path)
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        start = file.read(HEADER_BYTES)
    head = np.frombuffer(start[: len(start) // 4 * 4], "<i4")
    if len(head) and int(head[0]) in LLMC_MAGICS:
        return _llmc_shard(path, head, size)
    if llmc:
        first = int(head[0]) if len(head) else None
        raise UsageError(
            f"{path} does not start with llm.c's header (magic {first}), and the "
            f"{META_FILE} beside it says its shards are llm.c's; it is damaged, write it again"
        )
    if dtype is None:
        raise UsageError(
            f"{path} has no llm.c header and no declared token dtype; write "
            f'{os.path.join(os.path.dirname(path) or ".", META_FILE)} with {{"dtype": "uint16", '
            '"vocab_size": N}, or pass --token-dtype uint16 (or uint32)'
        )
    item = np.dtype(dtype).itemsize
    if size % item:
        raise UsageError(
            f"{path} is {size} bytes, not a whole number of {dtype} tokens; it is truncated "
            "or not of that dtype"
        )
    _check_not_wider(path, np.dtype(dtype), size // item)
    return Shard(path, 0, size // item, np.dtype(dtype).str)


def _check_not_wider(path: str, dtype: np.dtype, count: int) -> None:
    """UsageError when a file declared uint16 reads as uint32's halves: every second
    16-bit word 0 (the high halves of ids below 65,536) over its first 64 Ki tokens."""
    if dtype != np.uint16 or count < 64:
        return
    words = np.fromfile(path, "<u2", count=min(count, 1 << 16))
    if not words[1::2].any() and words[0::2].any():
        raise UsageError(
            f"{path}: every second of its uint16 tokens is 0, as the high halves "
            "of uint32 tokens are; declare its dtype uint32"
        )


def _llmc_shard(path: str, head: np.ndarray, size: int) -> Shard:
    if len(head) < HEADER_INTS:
        raise UsageError(f"{path} is shorter than llm.c's {HEADER_BYTES}-byte header; truncated")
    magic, version, count = (int(value) for value in head[:3])
    dtype = LLMC_FORMATS.get((magic, version))
    if dtype is None:
        known = ", ".join(f"magic {m} version {v}" for m, v in LLMC_FORMATS)
        raise UsageError(
            f"{path}: llm.c header with magic {magic} and version {version}; jdp reads {known}"
        )
    held = (size - HEADER_BYTES) / dtype.itemsize
    if count < 0 or held != count:
        raise UsageError(
            f"{path}: its header says {count} tokens and the file holds {held:g}; it is "
            "truncated or damaged, write it again"
        )
    return Shard(path, HEADER_BYTES, count, dtype.str)


def _npy_shard(path: str) -> Shard:
    try:
        with open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(file)
            offset = file.tell()
    except Exception as error:  # numpy parses the header with Python's own tokenizer
        raise UsageError(f"cannot read {path} as a .npy array ({error})") from None
    if len(shape) != 1 or dtype.name not in TOKEN_DTYPES or dtype.hasobject:
        raise UsageError(
            f"{path} holds {dtype} of shape {shape}; a token shard is one-dimensional "
            f"{', '.join(TOKEN_DTYPES)}"
        )
    expected = offset + shape[0] * dtype.itemsize
    if os.path.getsize(path) != expected:
        raise UsageError(
            f"{path}: its header says {shape[0]} tokens and the file is "
            f"{os.path.getsize(path)} bytes, not {expected}; it is truncated or damaged"
        )
    del fortran  # one-dimensional: the order does not matter
    return Shard(path, offset, shape[0], dtype.str)
