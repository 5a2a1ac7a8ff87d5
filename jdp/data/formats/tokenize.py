"""Text files to token shards in llm.c's format: ``python -m jdp.data tokenize``.

One UTF-8 text file is one document; whole documents are set apart for validation;
each split is written as ``{name}_train_000000.bin``... beside ``tokens.json``
(`jdp.data.formats.shards`), for ``jdp.data.from_tokens``. ``documents.tsv`` says where each
document lies: a header, then a row per piece of a document in a shard (a document
over two shards has two): split, shard, token offset, tokens (the eos id before the
document included) and path. The ids are UTF-8 bytes, or a Hugging Face
``tokenizer.json``'s (``pip install tokenizers``). The output is the same bytes for any
number of workers, which are spawned: call `tokenize` under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import functools
import itertools
import math
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from jdp.data.formats.shards import META_FILE, ShardWriter, write_meta
from jdp.data.formats.tokens import split_of
from jdp.errors import UsageError, not_there

DOCUMENTS_FILE = "documents.tsv"
COLUMNS = ("split", "shard", "offset", "tokens", "path")
EOS_TOKEN = "<|endoftext|>"  # GPT-2's, written before each document as llm.c does
SPLITS = ("train", "val")
_FACTS = ("documents", "tokens", "bytes", "shards")  # per split, in tokens.json
# Documents in flight to the workers: two windows of at most this many bytes (or documents).
WINDOW_BYTES, WINDOW_DOCUMENTS = 64 << 20, 4096
_READ_BYTES = 16 << 20


def tokenize(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str = "bytes",
    val_fraction: float = 0.01,
    workers: int | None = None,
    shard_tokens: int = 100_000_000,
    name: str = "corpus",
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Tokenizes the text files of ``inputs`` into llm.c shards in ``out``.

    Directories are walked, files taken in path order; one with a NUL byte or not
    UTF-8 is skipped and counted (each file is read twice: to find text, to encode).
    Documents drawn by a permutation from ``seed`` go to validation until they hold
    ``val_fraction`` of the bytes (a single document: the last ``val_fraction`` of
    its tokens); each split keeps the path order.

    Args:
        inputs: text files and directories of them.
        out: the directory to write; it may not hold token files or ``tokens.json``.
        tokenizer: ``"bytes"`` (UTF-8 bytes, nothing between documents) or the path of
            a ``tokenizer.json``; its ``<|endoftext|>`` is written before each document.
        val_fraction: the share of bytes set apart for validation, in [0, 1).
        workers: processes that encode (default: one per CPU; 0 or 1: this one).
        shard_tokens: the most tokens one shard holds.
        name: the shards' prefix.
        seed: draws the validation documents.
        progress: report on stderr while encoding.

    Returns:
        What it wrote in ``tokens.json``: the vocabulary, per split the documents,
        tokens, bytes and shards, and the files ``skipped``.

    Raises:
        UsageError: a missing input, no text, an ``out`` tokenized before, a bad option.

    Examples:
        >>> import pathlib
        >>> from jdp.data.formats.tokenize import decode, tokenize
        >>> _ = pathlib.Path(tmp, "hello.txt").write_text("Hello, wörld!", encoding="utf-8")
        >>> meta = tokenize(tmp, f"{tmp}/tokens", val_fraction=0, progress=False)
        >>> meta["tokens"], meta["vocab_size"]
        ({'train': 14, 'val': 0}, 256)
        >>> shard = f"{tmp}/tokens/corpus_train_000000.bin"
        >>> decode(jdp.data.formats.shards.open_shard(shard).tokens())
        'Hello, wörld!'
    """
    _check_options(val_fraction, shard_tokens, workers, name)
    spec, vocab_size, eos_id = _vocabulary(tokenizer)
    out = _check_out(out)
    inputs = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
    files = _find(inputs, out)
    workers = min((os.cpu_count() or 1) if workers is None else workers, len(files))
    with _pool(workers) as pool:
        paths, sizes = _texts(pool, workers, files, inputs)
        encode = functools.partial(_encode, tokenizer=spec)
        encoded = _reporting(_ordered(pool, workers, encode, paths, sizes), sizes, progress)
        val = _val_documents(sizes, val_fraction, seed)
        os.makedirs(out, exist_ok=True)
        pieces = _pieces(paths, sizes, encoded, val, val_fraction, spec)
        written = _write(out, name, shard_tokens, pieces)
    meta = {
        "format": "llm.c",
        "vocab_size": vocab_size,
        "dtype": "uint16" if vocab_size <= 1 << 16 else "uint32",
        "tokenizer": spec if spec == "bytes" else os.path.basename(spec),
        "eos_id": eos_id,
        **{fact: {s: getattr(written[s], fact) for s in SPLITS} for fact in _FACTS},
        "skipped": len(files) - len(paths),
        "seed": seed,
        "val_fraction": val_fraction,
        "val_split": (val_fraction or None) and ("documents", "tail")[sum(map(bool, sizes)) == 1],
    }
    write_meta(out, meta)
    if spec != "bytes":  # a copy beside the shards: the corpus decodes on its own (jdp.sample)
        _load(spec).save(os.path.join(out, meta["tokenizer"]))
    return meta


def decode(tokens: Sequence[int] | np.ndarray, tokenizer: str = "bytes") -> str:
    """The text of ``tokens``: UTF-8 bytes (a broken character becomes U+FFFD), or
    ``tokenizer``'s ids with its special tokens (``<|endoftext|>``) kept.

    Examples:
        >>> from jdp.data.formats.tokenize import decode
        >>> decode([104, 195, 169])
        'hé'
    """
    ids = np.asarray(tokens, np.int64)
    if tokenizer != "bytes":
        return _load(os.path.abspath(tokenizer)).decode(ids.tolist(), skip_special_tokens=False)
    if ids.size and (ids.min() < 0 or ids.max() > 255):
        raise UsageError(f"token {int(ids.max())} is not a byte; give the corpus's tokenizer")
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _check_options(val_fraction: float, shard_tokens: int, workers: int | None, name: str):
    if not 0 <= val_fraction < 1:
        raise UsageError(f"--val-fraction {val_fraction} is not in [0, 1); use 0.01, or 0 for none")
    if shard_tokens < 1:
        raise UsageError(f"--shard-tokens {shard_tokens}: a shard holds at least 1 token")
    if workers is not None and workers < 0:
        raise UsageError(f"--workers {workers}: give 0 or 1 (this process) or more")
    # The reader tells the splits apart by the words of the file names (jdp.data.formats.tokens).
    readable = split_of(f"{name}_train_0.bin") == "train"
    if not readable or split_of(f"{name}_val_0.bin") != "validation" or os.sep in name:
        raise UsageError(
            f"--name {name!r} would hide the shards' split (or is a path); use a plain "
            "word without val, valid, validation or test, e.g. corpus"
        )


def _vocabulary(tokenizer: str) -> tuple[str, int, int | None]:
    """The tokenizer as the workers name it, its vocabulary size and its eos id."""
    if tokenizer == "bytes":
        return "bytes", 256, None
    loaded = _load(spec := os.path.abspath(tokenizer))
    return spec, loaded.get_vocab_size(), loaded.token_to_id(EOS_TOKEN)


@functools.lru_cache(maxsize=4)
def _load(path: str):
    """The ``tokenizers.Tokenizer`` in the file at ``path``, once per process."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--tokenizer PATH needs tokenizers: pip install tokenizers") from None
    if not os.path.isfile(path):
        raise UsageError(f"tokenizer file {path} {not_there(path)}; give a tokenizer.json or bytes")
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise UsageError(f"{path}: not a tokenizer.json ({reason}); give one or bytes") from None


def _check_out(out: str | os.PathLike) -> str:
    """``out``, unless it holds what a run wrote before."""
    out = os.fspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file; give a directory")
    names = os.listdir(out) if os.path.isdir(out) else []
    if META_FILE in names:
        raise UsageError(f"{out} was tokenized before ({META_FILE}); choose another --out")
    if held := sorted(name for name in names if name.endswith((".bin", ".npy"))):
        raise UsageError(
            f"{out} already holds token files ({held[0]}...), which would be read with the new "
            "ones; remove them or choose another --out"
        )
    return out


def _find(inputs: Sequence[str | os.PathLike], out: str) -> list[str]:
    """The files of ``inputs``, directories walked (``out`` left out), sorted by path."""
    skip = os.path.realpath(out)
    found = set()
    for given in map(os.fspath, inputs):
        if os.path.isdir(given):
            for root, dirs, names in os.walk(given):
                dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(root, d)) != skip]
                paths = (os.path.join(root, name) for name in names)
                found.update(os.path.normpath(path) for path in paths if os.path.isfile(path))
        elif os.path.isfile(given):
            found.add(os.path.normpath(given))
        else:
            what = "is not a file or directory" if os.path.exists(given) else "does not exist"
            raise UsageError(f"{given} {what}; give text files or directories of them")
    return sorted(found)


def _texts(pool, workers: int, files: list[str], inputs: list) -> tuple[list[str], list[int]]:
    """The paths of the text files among ``files``, and their sizes in bytes."""
    texts = _ordered(pool, workers, _text_size, files, [os.path.getsize(f) for f in files])
    found = [(path, size) for path, size in zip(files, texts, strict=True) if size is not None]
    if not any(size for _, size in found):  # none, or only empty ones
        named, other = ", ".join(map(os.fspath, inputs)), len(files) - len(found)
        raise UsageError(
            f"no UTF-8 text files in {named} ({other} other files, {len(found)} "
            "empty); give files of text, or directories of them"
        )
    return [path for path, _ in found], [size for _, size in found]


def _text_size(path: str) -> int | None:
    """The file's size in bytes when it is UTF-8 text without NUL bytes, else None."""
    decoder, size = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(path, "rb") as file:
            while chunk := file.read(_READ_BYTES):
                if b"\0" in chunk:
                    return None
                decoder.decode(chunk)
                size += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return None
    except OSError as error:
        raise UsageError(f"cannot read {path} ({error.strerror}); fix or leave it out") from None
    return size


def _encode(path: str, tokenizer: str) -> np.ndarray:
    """The document's token ids: its bytes, or the tokenizer's ids after its eos id."""
    with open(path, "rb") as file:
        data = file.read()
    if tokenizer == "bytes":
        return np.frombuffer(data, np.uint8)
    loaded = _load(tokenizer)
    ids = loaded.encode(data.decode("utf-8", errors="replace")).ids  # UTF-8 in the first pass
    eos = loaded.token_to_id(EOS_TOKEN)
    dtype = np.uint16 if loaded.get_vocab_size() <= 1 << 16 else np.uint32
    return np.asarray(([] if eos is None else [eos]) + ids, dtype)


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """Worker processes, or None to work in this one."""
    if workers <= 1:
        yield None
        return
    # Spawned: a fork of a process running JAX's threads can deadlock. An executor: a worker
    # that dies breaks it (BrokenProcessPool), where a Pool would start another and wait.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    except BrokenProcessPool:
        raise UsageError(
            "a worker process died (out of memory, or a script that calls tokenize outside "
            'if __name__ == "__main__":); fix that, or pass --workers 0 (workers=0)'
        ) from None
    finally:
        pool.shutdown(cancel_futures=True)


def _ordered(pool, workers: int, function, items: list, sizes: list[int]) -> Iterator:
    """``function`` of each item, in order, with at most two windows of items in flight."""
    if pool is None:
        yield from map(function, items)
        return
    by_count = np.arange(len(items)) // WINDOW_DOCUMENTS
    windows = np.maximum(np.cumsum(sizes, dtype=np.int64) // WINDOW_BYTES, by_count).tolist()
    pending = iter(())
    for _, group in itertools.groupby(zip(windows, items, strict=True), lambda pair: pair[0]):
        window = [item for _, item in group]
        submitted = pool.map(function, window, chunksize=max(1, len(window) // (4 * workers)))
        yield from pending
        pending = submitted
    yield from pending


def _val_documents(sizes: list[int], val_fraction: float, seed: int) -> set[int]:
    """Documents drawn until they hold ``val_fraction`` of the bytes, one with text left."""
    if not val_fraction or np.count_nonzero(sizes) < 2:
        return set()
    goal, held, chosen = val_fraction * sum(sizes), 0, set()
    drawn = np.random.default_rng(seed).permutation(len(sizes)).tolist()  # an empty one trains
    for index in [index for index in drawn if sizes[index]][:-1]:
        if held >= goal:
            break
        chosen.add(index)
        held += sizes[index]
    return chosen


def _tail_start(tokens: np.ndarray, val_fraction: float, byte_ids: bool) -> int:
    """Where the only document's validation tail starts: its last ``val_fraction`` of
    tokens, one at least on either side; for byte ids, at a character's first byte."""
    count = len(tokens)
    if not val_fraction or count < 2:
        return count
    start = back = count - min(count - 1, math.ceil(count * val_fraction))
    while byte_ids and back > 0 and 0x80 <= tokens[back] < 0xC0:  # a UTF-8 continuation byte
        back -= 1
    return back or start


def _pieces(paths, sizes, encoded, val, val_fraction, spec) -> Iterator[tuple]:
    """(split, tokens, path, bytes) of each document; the only one's head and tail apart."""
    for index, (path, size, tokens) in enumerate(zip(paths, sizes, encoded, strict=True)):
        if np.count_nonzero(sizes) > 1 or not val_fraction or not size:
            yield ("val" if index in val else "train"), tokens, path, size
            continue
        start = _tail_start(tokens, val_fraction, spec == "bytes")
        tail = min(size, len(decode(tokens[start:], spec).encode()))  # its bytes, decoded
        yield "train", tokens[:start], path, size - tail
        if start < len(tokens):
            yield "val", tokens[start:], path, tail


def _write(out: str, name: str, shard_tokens: int, pieces: Iterable[tuple]) -> dict:
    """Writes each piece to its split's shards, and its row of ``documents.tsv``."""
    path = os.path.join(out, DOCUMENTS_FILE)  # a name not UTF-8 written as its own bytes
    with open(path, "w", newline="", encoding="utf-8", errors="surrogateescape") as file:
        table = csv.writer(file, delimiter="\t", lineterminator="\n")
        table.writerow(COLUMNS)
        written = {split: ShardWriter(out, name, split, shard_tokens, table) for split in SPLITS}
        for split, tokens, path, size in pieces:
            written[split].add(tokens, path, size)
        for shards in written.values():
            shards.close()
    return written


def _reporting(encoded: Iterator, sizes: list[int], enabled: bool) -> Iterator:
    """``encoded``, reported on stderr: a bar on a terminal, elsewhere a line about every 10%."""
    stream, total, done, shown, bar = sys.stderr, sum(sizes), 0, 0, None
    if enabled and stream.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=stream)
    for count, (size, tokens) in enumerate(zip(sizes, encoded, strict=True), 1):
        yield tokens
        done += size
        percent = 100 * done // total if total else 100 * count // len(sizes)
        if bar is not None:
            bar.update(size)
        elif enabled and percent // 10 > shown:
            shown = percent // 10
            print(
                f"tokenize: {percent}% ({done:,} of {total:,} bytes, {count:,} of "
                f"{len(sizes):,} documents)",
                file=stream,
                flush=True,
            )
    if bar is not None:
        bar.close()
