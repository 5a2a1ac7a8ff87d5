"""Text corpora by name, and ``--dataset tokens:PATH``: the token splits of a run.

``python_stdlib`` is real text that every machine with Python has: the ``.py``
sources of the running interpreter's standard library (its tests, IDLE's tests
and any installed packages left out; 12.1 MB for CPython 3.11.7), as UTF-8
bytes (vocabulary 256, so the loss reads in bits per byte). It is written by
the Python core developers and licensed under the Python Software Foundation
License Version 2. On first use it is tokenized into ``DATA_DIR/jdp_corpora/``
(``python -m jdp.data tokenize``'s shards, a seeded 1% of the files as ``val``;
under a second), once per Python version, since the sources differ between versions.
"""

from __future__ import annotations

import os
import platform
import shutil
import sysconfig
import tempfile

from jdp.data.formats.builders import default_data_dir
from jdp.data.formats.shards import META_FILE, write_meta
from jdp.data.formats.tokens import SPLITS, TOKENS_PREFIX, TokenSplit, corpus
from jdp.errors import UsageError

STDLIB = "python_stdlib"
CORPORA = (STDLIB,)
LICENCE = "Python Software Foundation License Version 2"
# Not the library itself: its tests (half the bytes, much of it generated data)
# and whatever was installed into it.
_LEFT_OUT = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def is_corpus(dataset: str) -> bool:
    """Whether ``--dataset`` names a token corpus (a named one, or ``tokens:PATH``)."""
    return dataset in CORPORA or dataset.startswith(TOKENS_PREFIX)


def load_corpus(
    dataset: str,
    *,
    seq_len: int,
    data_dir: str | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
) -> dict[str, TokenSplit | None]:
    """The splits of ``--dataset`` (``python_stdlib`` or ``tokens:PATH``), None where absent.

    Raises:
        UsageError: a corpus with no training files, or one that cannot be read.
    """
    path = prepare_stdlib(data_dir) if dataset in CORPORA else dataset[len(TOKENS_PREFIX) :]
    splits = corpus(path, seq_len=seq_len, vocab_size=vocab_size, dtype=dtype)
    if splits["train"] is None:
        others = ", ".join(name for name in SPLITS if splits[name] is not None)
        raise UsageError(
            f"{path} has no training files, only {others}; name the training shards with "
            "train (or anything but val and test)"
        )
    return splits


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files that make ``python_stdlib``, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, folders, names in os.walk(root):
        folders[:] = [name for name in folders if name not in _LEFT_OUT]
        files.extend(os.path.join(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


def prepare_stdlib(data_dir: str | None = None) -> str:
    """The directory of ``python_stdlib``'s shards, tokenized there on first use.

    Several processes may prepare it at once: each writes a directory of its own
    and renames it into place; the first rename wins and the others discard theirs.
    """
    from jdp.data.formats.tokenize import tokenize

    root = os.path.join(data_dir or default_data_dir(), "jdp_corpora")
    target = os.path.join(root, f"{STDLIB}-{platform.python_version()}")
    if os.path.exists(os.path.join(target, META_FILE)):
        return target
    files = stdlib_files()
    if not files:
        raise UsageError(
            f"found no standard library sources under {sysconfig.get_paths()['stdlib']}; "
            "this Python was installed without them: use --dataset tokens:PATH"
        )
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{STDLIB}-", dir=root)
    try:
        # Bytes need no encoding: in this process, 0.4 s (worker processes take longer
        # to start, and need a main guard in the script that trains).
        meta = tokenize(
            files,
            scratch,
            tokenizer="bytes",
            val_fraction=0.01,
            name=STDLIB,
            workers=0,
            progress=False,
        )
        source = f"the standard library of Python {platform.python_version()}"
        write_meta(scratch, meta | {"source": source, "licence": LICENCE})
        os.chmod(scratch, 0o755)  # mkdtemp's is the owner's only; a data directory is shared
        try:
            os.rename(scratch, target)
        except OSError:  # another process put it there first
            if not os.path.exists(os.path.join(target, META_FILE)):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
