"""Token corpora as splits: windows of a memory-mapped corpus, in jdp's data order.

A corpus is one token file, a directory of them or a glob (`jdp.data.formats.shards`
reads each file's format). A file's split is in its name: ``val`` or
``validation`` -> ``validation``, ``test`` -> ``test``, anything else ->
``train`` (nanoGPT's ``train.bin``/``val.bin``, llm.c's ``*_train_000001.bin``);
a single file given by itself is the training split.

Example ``i`` of a split is its ``i``-th window: ``seq_len + 1`` consecutive
tokens, the windows laid end to end and overlapping by one token (the last
target of one is the first input of the next), never across two files. The
loader draws a permutation of the windows per epoch from ``(seed, epoch)``, as
for any split (`jdp.data.loader.readers`), rather than nanoGPT's random offsets: each
token is trained on once per epoch, an epoch is a number of steps, and
evaluation reads each window exactly once. Only the rows a batch needs are read.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import jax
import numpy as np

from jdp.data.formats.shards import META_FILE, TOKEN_DTYPES, Shard, open_shard, read_meta, release
from jdp.errors import UsageError, not_there

TOKENS_PREFIX = "tokens:"
SPLITS = ("train", "validation", "test")
_SUFFIXES = (".bin", ".npy")
_WORDS = re.compile(r"[A-Za-z]+")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSplit:
    """One split of a token corpus: windows of ``seq_len + 1`` tokens read from disk.

    ``read(indices)`` returns ``{"tokens": int32 (rows, seq_len + 1)}``: a
    language model reads ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``. A
    token at or above ``vocab_size`` is an error naming its file and offset,
    never clamped. ``tokenizer`` is ``bytes`` when the ids are UTF-8 bytes (the
    loss is then reported in bits per byte), ``eos_id`` the id between documents.
    """

    shards: tuple[Shard, ...]
    seq_len: int
    vocab_size: int
    tokenizer: str | None = None
    eos_id: int | None = None
    windows: np.ndarray | None = None  # this split's windows of the shards, when a subset
    kind = "text"
    input_key, label_key = "tokens", None
    transform = None
    map = None
    num_classes = None

    def __post_init__(self):
        if self.seq_len < 1:
            raise UsageError(f"--seq-len must be at least 1, got {self.seq_len}")
        counts = [max(0, (shard.count - 1) // self.seq_len) for shard in self.shards]
        object.__setattr__(self, "_first", np.concatenate([[0], np.cumsum(counts)]))
        object.__setattr__(self, "_maps", {})

    def __len__(self) -> int:
        return int(self._first[-1]) if self.windows is None else len(self.windows)

    def __getstate__(self):  # Grain's workers open the files again
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def vocab(self) -> tuple:
        """No token strings: a corpus's ids need no table (see ``vocab_size``)."""
        return ()

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The windows at ``indices``, as int32 rows of ``seq_len + 1`` tokens."""
        indices = np.asarray(indices, np.int64)
        windows = indices if self.windows is None else self.windows[indices]
        files = np.searchsorted(self._first, windows, side="right") - 1
        width = np.arange(self.seq_len + 1)
        rows = np.empty((len(windows), self.seq_len + 1), np.int32)
        for file in np.unique(files):
            chosen = files == file
            starts = (windows[chosen] - self._first[file]) * self.seq_len
            tokens = self._tokens(file)
            self.shards[file].check_size()  # a file cut short under a live map: SIGBUS, no line
            rows[chosen] = tokens[starts[:, None] + width]
            release(tokens)
        if rows.size and (int(rows.max()) >= self.vocab_size or int(rows.min()) < 0):
            self._refuse(windows, files, rows)
        return {"tokens": rows}

    def take(self, indices: np.ndarray) -> TokenSplit:
        """The split of these windows, in this order."""
        windows = np.asarray(indices, np.int64)
        if self.windows is not None:
            windows = self.windows[windows]
        return dataclasses.replace(self, windows=windows)

    def _tokens(self, file: int) -> np.ndarray:
        if file not in self._maps:
            self._maps[file] = self.shards[file].tokens()
        return self._maps[file]

    def _refuse(self, windows: np.ndarray, files: np.ndarray, rows: np.ndarray):
        row, column = np.argwhere((rows >= self.vocab_size) | (rows < 0))[0]
        shard = self.shards[files[row]]
        offset = int((windows[row] - self._first[files[row]]) * self.seq_len + column)
        value = int(self.shards[files[row]].tokens()[offset])  # as stored, before int32
        raise UsageError(
            f"{shard.path}: token {value} at token offset {offset} (byte "
            f"{shard.offset + offset * np.dtype(shard.dtype).itemsize}) is not in [0, "
            f"{self.vocab_size}), the vocabulary; give the corpus's --vocab-size, or fix the file"
        )


def from_tokens(
    path: str | os.PathLike,
    split: str = "train",
    *,
    seq_len: int = 256,
    vocab_size: int | None = None,
    dtype: str | None = None,
) -> TokenSplit:
    """A split of a token corpus on disk: a file, a directory or a glob of shards.

    ``vocab_size`` and ``dtype`` (for raw ``.bin`` files without llm.c's header)
    default to the corpus's ``tokens.json``. See the module's docstring for how
    files map to splits and how windows are cut.

    Raises:
        UsageError: no such files, a split the corpus does not have, a file that
            cannot be read as tokens, or no vocabulary size.

    Examples:
        >>> np.arange(1000, dtype=np.uint16).tofile(f"{tmp}/train.bin")
        >>> train = jdp.data.from_tokens(f"{tmp}/train.bin", seq_len=9, vocab_size=1000,
        ...                              dtype="uint16")
        >>> len(train), train.read(np.array([1]))["tokens"].tolist()
        (111, [[9, 10, 11, 12, 13, 14, 15, 16, 17, 18]])
    """
    found = corpus(path, seq_len=seq_len, vocab_size=vocab_size, dtype=dtype)
    if found.get(split) is None:
        have = ", ".join(name for name in SPLITS if found.get(name) is not None)
        raise UsageError(f"token corpus {os.fspath(path)} has no {split} split; it has: {have}")
    return found[split]


def _no_dtype_given_to_a_header(given: str | None, shards: tuple[Shard, ...]) -> None:
    """A dtype given for a shard whose own header gives one (llm.c's, a ``.npy``'s) would
    be dropped in silence: refused."""
    for shard in shards:
        if given and shard.offset:  # a header before the tokens
            raise UsageError(
                f"--token-dtype {given} is for raw .bin files; {shard.path} has a header that "
                f"gives its tokens' dtype ({np.dtype(shard.dtype).name}); drop --token-dtype"
            )


def corpus(
    path: str | os.PathLike,
    *,
    seq_len: int,
    vocab_size: int | None = None,
    dtype: str | None = None,
) -> dict[str, TokenSplit | None]:
    """Every split of the corpus at ``path`` (None for a split it has no files of)."""
    files, directory = _files(os.fspath(path))
    meta = read_meta(directory)
    llmc = meta.get("format") == "llm.c"  # written by `jdp.data tokenize`: headers required
    given, dtype = dtype, dtype or (None if llmc else meta.get("dtype"))
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise UsageError(f"token dtype {dtype!r}: choose one of {', '.join(TOKEN_DTYPES)}")
    vocab_size = vocab_size or meta.get("vocab_size")
    if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
        raise UsageError(
            f"vocabulary size {vocab_size!r} of {os.fspath(path)}: give a whole number, at least "
            f"1 (--vocab-size, or vocab_size in {os.path.join(directory, META_FILE)})"
        )
    if not vocab_size and files and all(_gpt2_llmc(file) for file in files):
        # llm.c's GPT-2 shards (version 1) hold GPT-2's tokens: llm.c reads them so.
        vocab_size = GPT2_VOCAB
        if jax.process_index() == 0:  # one line for the run, not one per process
            print(
                f"jdp: {os.fspath(path)}: llm.c's GPT-2 shards (version 1), so GPT-2's "
                f"vocabulary of {GPT2_VOCAB:,} tokens; --vocab-size N says "
                "otherwise"
            )
    if not vocab_size:
        raise UsageError(
            f"the vocabulary size of {os.fspath(path)} is not known; pass --vocab-size N (or "
            f'vocab_size=), or write {os.path.join(directory, META_FILE)} with {{"vocab_size": N}}'
        )
    named = {name: [] for name in SPLITS}
    for file in files:
        named["train" if os.path.isfile(os.fspath(path)) else split_of(file)].append(file)
    splits = {}
    for name, paths in named.items():
        shards = tuple(open_shard(file, dtype, llmc=llmc) for file in paths)
        _no_dtype_given_to_a_header(given, shards)
        splits[name] = None
        if shards:
            split = TokenSplit(
                shards, seq_len, int(vocab_size), meta.get("tokenizer"), meta.get("eos_id")
            )
            if not len(split):
                held = sum(shard.count for shard in shards)
                fix = (
                    "tokenize the text again with a split that holds text"
                    if not held
                    else "use a shorter --seq-len"
                )
                raise UsageError(
                    f"the {name} files of {os.fspath(path)} hold {held:,} tokens, fewer than "
                    f"--seq-len + 1 = {seq_len + 1} in one file; {fix}"
                )
            splits[name] = split
    return splits


GPT2_VOCAB = 50257  # GPT-2's tokenizer's, which llm.c's version-1 shards hold


def _gpt2_llmc(path: str) -> bool:
    """Whether ``path`` starts with llm.c's header of its GPT-2 shards (magic 20240520,
    version 1)."""
    with open(path, "rb") as file:
        head = np.frombuffer(file.read(8).ljust(8, b"\0"), "<i4")
    return (int(head[0]), int(head[1])) == (20240520, 1)


def split_of(path: str) -> str:
    """The split a shard belongs to, by the words of its file name."""
    words = {word.lower() for word in _WORDS.findall(os.path.basename(path))}
    if words & {"val", "valid", "validation"}:
        return "validation"
    return "test" if "test" in words else "train"


def _files(spec: str) -> tuple[list[str], str]:
    """The corpus's token files, sorted, and the directory its ``tokens.json`` is in."""
    if os.path.isdir(spec):
        names = sorted(os.listdir(spec))
        files = [os.path.join(spec, name) for name in names if name.endswith(_SUFFIXES)]
        files = [file for file in files if os.path.isfile(file)]
        where = f"{spec} holds no .bin or .npy token files"
        directory = spec
    elif os.path.isfile(spec):
        files, directory, where = [spec], os.path.dirname(spec) or ".", ""
    else:
        files = sorted(path for path in glob.glob(spec) if os.path.isfile(path))
        where = f"no token files match {spec}"
        directory = os.path.dirname(files[0]) if files else "."
        if not glob.has_magic(spec):
            where = f"{spec} {not_there(spec, 'a token file or a directory of them')}"
    if not files:
        raise UsageError(f"{where}; give a token file, a directory of them, or a glob")
    return files, directory
