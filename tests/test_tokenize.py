"""``python -m jdp.data tokenize``: text files into llm.c shards that read back exactly."""

import csv
import math
import os
import re
import sys

import numpy as np
import pytest
from helpers import run_python
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jdp.data.__main__ import main
from jdp.data.formats import shards
from jdp.data.formats import tokenize as tokenize_module
from jdp.data.formats.tokenize import COLUMNS, DOCUMENTS_FILE, EOS_TOKEN, decode, tokenize
from jdp.errors import UsageError

# Nested folders, non-ASCII text, CRLF line ends and an empty file: each one document.
TEXTS = {
    "a.txt": "Hello, world.\n",
    "f.txt": "Ωμέγα — the last letter.\n" * 5,
    "notes/b.md": "# Naïve café\n\nCrème brûlée, 日本語, an emoji 🙂.\n",
    "notes/d.txt": "line one\r\nline two\r\n",
    "notes/deeper/c.txt": "The quick brown fox jumps over the lazy dog.\n" * 20,
    "zeta/e.py": "print('ünïcödé')\n",
    "zeta/empty.txt": "",
}
# Not text, skipped and counted: bytes that are not UTF-8, and NUL bytes that are.
NOT_TEXT = {
    "image.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
    "notes/latin1.txt": b"caf\xe9",
    "zeta/records.dat": b"id\x00\x00\x00\x07name\x00",
}
TOTAL = sum(len(text.encode()) for text in TEXTS.values())


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, data in [*((n, t.encode()) for n, t in TEXTS.items()), *NOT_TEXT.items()]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def bpe(tmp_path):
    """A small byte-level BPE tokenizer.json with GPT-2's <|endoftext|>, trained on TEXTS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS.values(), trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def _documents(out, root) -> dict[str, list[tuple[str, np.ndarray]]]:
    """Each document's pieces (split, tokens), by its path below ``root``, read from
    documents.tsv and the shards; its rows must tile every shard, in order."""
    with open(out / DOCUMENTS_FILE, newline="", encoding="utf-8") as file:
        header, *rows = csv.reader(file, delimiter="\t")
    assert tuple(header) == COLUMNS == ("split", "shard", "offset", "tokens", "path")
    found, ends = {}, {}
    for split, shard, offset, count, path in rows:
        assert shard.startswith(f"corpus_{split}_") and int(offset) == ends.get(shard, 0)
        ends[shard] = int(offset) + int(count)
        tokens = shards.open_shard(str(out / shard)).tokens()[int(offset) : ends[shard]]
        found.setdefault(os.path.relpath(path, root), []).append((split, tokens))
    written = {name for name in os.listdir(out) if name.endswith(".bin")}
    assert written == set(ends)
    assert all(shards.open_shard(str(out / name)).count == end for name, end in ends.items())
    return found


def _split_tokens(out, split) -> np.ndarray:
    files = sorted(out.glob(f"corpus_{split}_*.bin"))
    return np.concatenate([shards.open_shard(str(file)).tokens() for file in files])


def test_bytes_shards_are_the_text_files_exactly(corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    meta = tokenize(corpus, out, val_fraction=0.2, workers=0)
    found = _documents(out, corpus)
    assert found.keys() == TEXTS.keys()
    split_of = {}
    for path, pieces in found.items():
        ((split, tokens),) = pieces  # whole documents, each in one shard
        assert decode(tokens) == TEXTS[path], path
        split_of[path] = split
    val = {path for path, split in split_of.items() if split == "val"}
    assert val and val != TEXTS.keys()
    held = {
        split: b"".join(TEXTS[path].encode() for path in sorted(TEXTS) if split_of[path] == split)
        for split in ("train", "val")
    }
    for split, data in held.items():  # the files' bytes concatenated in path order
        assert _split_tokens(out, split).astype(np.uint8).tobytes() == data
    assert len(held["val"]) >= 0.2 * TOTAL
    assert meta == shards.read_meta(str(out))
    assert meta["format"] == "llm.c" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "bytes" and meta["eos_id"] is None and meta["seed"] == 0
    assert meta["skipped"] == len(NOT_TEXT) == 3
    assert meta["documents"] == {"train": len(TEXTS) - len(val), "val": len(val)}
    assert meta["tokens"] == meta["bytes"] == {split: len(data) for split, data in held.items()}
    assert meta["shards"] == {"train": 1, "val": 1} and meta["val_split"] == "documents"
    reported = capsys.readouterr().err.splitlines()  # not a terminal: lines, the last at 100%
    assert 1 <= len(reported) <= 10 and reported[-1].startswith("tokenize: 100% (")


def test_the_validation_documents_follow_the_seed(corpus, tmp_path):
    def val(seed, name):
        tokenize(corpus, tmp_path / name, val_fraction=0.1, workers=0, seed=seed, progress=False)
        found = _documents(tmp_path / name, corpus)
        return {path for path, [(split, _)] in found.items() if split == "val"}

    def drawn(seed):  # the documents in path order, drawn until they hold 10% of the bytes
        paths, chosen = sorted(TEXTS), set()  # (an empty one, holding no text, trains)
        order = [i for i in np.random.default_rng(seed).permutation(len(paths)) if TEXTS[paths[i]]]
        for index in order[:-1]:
            if sum(len(TEXTS[path].encode()) for path in chosen) >= 0.1 * TOTAL:
                break
            chosen.add(paths[index])
        return chosen

    sets = [val(seed, f"seed{seed}") for seed in range(6)]
    assert sets == [drawn(seed) for seed in range(6)]
    assert val(3, "again") == sets[3] and len({frozenset(chosen) for chosen in sets}) > 1


def test_validation_leaves_a_document_for_training(corpus, tmp_path):
    meta = tokenize(corpus, tmp_path / "tokens", val_fraction=0.99, workers=0, progress=False)
    # the one left with text, and the empty one (drawn for neither split's text)
    assert meta["documents"] == {"train": 2, "val": len(TEXTS) - 2}


def test_an_empty_document_after_a_full_shard_names_a_shard_on_disk(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("ab")
    (tmp_path / "texts" / "b.txt").write_text("")
    out = tmp_path / "tokens"
    meta = tokenize(
        tmp_path / "texts", out, val_fraction=0, shard_tokens=2, workers=0, progress=False
    )
    assert meta["shards"]["train"] == 2 and meta["documents"]["train"] == 2
    assert [len(piece) for [(_, piece)] in _documents(out, tmp_path / "texts").values()] == [2, 0]


def test_a_tokenizer_json_writes_its_ids_after_its_eos(corpus, bpe, tmp_path):
    out = tmp_path / "tokens"
    meta = tokenize([corpus], out, tokenizer=bpe, val_fraction=0, workers=0, progress=False)
    eos = Tokenizer.from_file(bpe).token_to_id(EOS_TOKEN)
    assert meta["eos_id"] == eos is not None
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "tokenizer.json" and meta["documents"]["val"] == 0
    tokens = _split_tokens(out, "train")
    assert decode(tokens, bpe) == "".join(EOS_TOKEN + TEXTS[path] for path in sorted(TEXTS))
    assert int((tokens == eos).sum()) == len(TEXTS) and len(tokens) < TOTAL  # merges happened
    for path, [(_, piece)] in _documents(out, corpus).items():
        assert piece[0] == eos and decode(piece[1:], bpe) == TEXTS[path]


def test_two_workers_write_the_bytes_one_writes(corpus, bpe, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize_module, "WINDOW_DOCUMENTS", 2)  # several windows in flight
    for workers in (1, 2):
        options = dict(val_fraction=0.2, workers=workers, shard_tokens=40, progress=False)
        tokenize(corpus, tmp_path / f"workers{workers}", tokenizer=bpe, **options)
    one, two = tmp_path / "workers1", tmp_path / "workers2"
    assert len(list(one.glob("*.bin"))) > 3
    assert sorted(os.listdir(one)) == sorted(os.listdir(two))
    for name in os.listdir(one):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


@pytest.mark.slow
def test_workers_that_cannot_start_are_an_error_not_a_hang(corpus, tmp_path):
    """A script that calls tokenize outside ``if __name__ == "__main__":`` runs itself again
    in each spawned worker, which then cannot start one of its own."""
    script = tmp_path / "script.py"
    script.write_text(
        "from jdp.data.formats.tokenize import tokenize\n"
        f"tokenize({str(corpus)!r}, {str(tmp_path / 'tokens')!r}, workers=2, progress=False)\n"
    )
    result = run_python(script, timeout=120)
    assert result.returncode == 1
    assert "jdp.errors.UsageError: a worker process died" in result.stderr, result.stderr


def test_small_shards_hold_the_same_tokens_in_order(corpus, tmp_path):
    tokenize(corpus, tmp_path / "whole", val_fraction=0, workers=0, progress=False)
    meta = tokenize(
        corpus, tmp_path / "small", val_fraction=0, workers=0, shard_tokens=100, progress=False
    )
    files = sorted((tmp_path / "small").glob("corpus_train_*.bin"))
    assert len(files) == meta["shards"]["train"] == math.ceil(TOTAL / 100) > 1
    assert [shards.open_shard(str(file)).count for file in files[:-1]] == [100] * (len(files) - 1)
    whole = _split_tokens(tmp_path / "whole", "train")
    np.testing.assert_array_equal(_split_tokens(tmp_path / "small", "train"), whole)
    found = _documents(tmp_path / "small", corpus)  # a document over several shards: a row each
    assert len(found["notes/deeper/c.txt"]) >= 9
    for path, pieces in found.items():
        assert decode(np.concatenate([tokens for _, tokens in pieces])) == TEXTS[path]


def test_one_document_gives_its_tail_to_validation(tmp_path):
    (tmp_path / "only.txt").write_bytes(("🙂" * 150).encode())  # 600 bytes, 4 a character
    out = tmp_path / "tokens"
    meta = tokenize(tmp_path / "only.txt", out, val_fraction=0.05, workers=0, progress=False)
    train, val = _split_tokens(out, "train"), _split_tokens(out, "val")
    # The last 5% (30 bytes) would cut a character: the tail starts at the character's start.
    assert decode(train) == "🙂" * 142 and decode(val) == "🙂" * 8
    assert meta["tokens"] == meta["bytes"] == {"train": 568, "val": 32}
    assert meta["documents"] == {"train": 1, "val": 1} and meta["val_split"] == "tail"
    assert [split for split, _ in _documents(out, tmp_path)["only.txt"]] == ["train", "val"]


def test_the_command_line_says_what_it_wrote(corpus, tmp_path):
    out = tmp_path / "tokens"
    result = run_python(
        "-m",
        "jdp.data",
        "tokenize",
        corpus,
        "--out",
        out,
        *"--val-fraction 0.2 --workers 1".split(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    tokens = shards.read_meta(str(out))["tokens"]
    assert result.stdout == (
        f"jdp.data: {len(TEXTS)} documents (3 skipped: not text), {tokens['train']:,} train and "
        f"{tokens['val']:,} val tokens in 2 shards, vocabulary 256, in {out}\n"
    )
    assert "tokenize: 100% (" in result.stderr


@pytest.mark.parametrize("case", ["missing input", "tokenized before", "tokenizer not JSON"])
def test_the_command_line_refuses_in_one_line(corpus, tmp_path, capsys, case):
    out, flags = tmp_path / "tokens", []
    if case == "missing input":
        corpus, expected = tmp_path / "nowhere", f"{tmp_path / 'nowhere'} does not exist; give"
    elif case == "tokenized before":
        out.mkdir()
        (out / shards.META_FILE).write_text("{}")
        expected = f"{out} was tokenized before (tokens.json); choose another --out"
    else:
        (tmp_path / "tokenizer.json").write_text("merges: not JSON")
        flags = ["--tokenizer", str(tmp_path / "tokenizer.json")]
        expected = "tokenizer.json: not a tokenizer.json ("
    assert main(["tokenize", str(corpus), "--out", str(out), "--workers", "0", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("jdp.data: error: ") and expected in captured.err


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"val_fraction": 1.0}, "--val-fraction 1.0 is not in [0, 1)"),
        ({"val_fraction": -0.1}, "--val-fraction -0.1 is not in [0, 1)"),
        ({"shard_tokens": 0}, "--shard-tokens 0: a shard holds at least 1 token"),
        ({"name": "test"}, "--name 'test' would hide the shards' split"),
        ({"tokenizer": "missing.json"}, "missing.json does not exist; give a tokenizer.json"),
    ],
)
def test_bad_options_are_refused(corpus, tmp_path, options, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        tokenize(corpus, tmp_path / "tokens", workers=0, progress=False, **options)
    assert not (tmp_path / "tokens").exists()


def test_no_text_files_and_old_token_files_are_refused(corpus, tmp_path):
    with pytest.raises(UsageError, match=r"no UTF-8 text files in .* \(1 other files, 0 empty\)"):
        tokenize(corpus / "image.png", tmp_path / "tokens", workers=0, progress=False)
    (tmp_path / "old").mkdir()
    shards.write_llmc(tmp_path / "old" / "corpus_train_000003.bin", np.arange(5))
    with pytest.raises(UsageError, match="already holds token files"):
        tokenize(corpus, tmp_path / "old", workers=0, progress=False)


def test_an_empty_document_never_leaves_a_split_without_tokens(tmp_path):
    # Two documents, one empty: drawn for validation, the text left training on nothing.
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some text to train on. " * 20)
    (tmp_path / "text" / "b.txt").write_text("")
    for seed in range(4):  # either document drawn first
        meta = tokenize(
            tmp_path / "text",
            tmp_path / f"tokens{seed}",
            val_fraction=0.5,
            workers=0,
            progress=False,
            seed=seed,
        )
        assert meta["tokens"]["train"] > 0 and meta["tokens"]["val"] > 0, meta
        assert meta["val_split"] == "tail" and meta["documents"]["val"] == 1, meta
    (tmp_path / "text" / "a.txt").write_text("")
    with pytest.raises(UsageError, match=r"no UTF-8 text files in .* \(0 other files, 2 empty"):
        tokenize(tmp_path / "text", tmp_path / "none", workers=0, progress=False)


def test_a_file_name_that_is_not_utf8_is_tokenized_and_listed_as_its_bytes(tmp_path):
    (tmp_path / "text").mkdir()
    odd = os.fsencode(tmp_path / "text") + b"/caf\xe9.txt"  # Latin-1's "café.txt"
    with open(odd, "w") as file:
        file.write("some text. " * 20)
    meta = tokenize(
        tmp_path / "text", tmp_path / "tokens", val_fraction=0, workers=0, progress=False
    )
    assert meta["tokens"]["train"] == 220
    assert odd in (tmp_path / "tokens" / "documents.tsv").read_bytes()


def test_a_tokenizer_file_needs_the_tokenizers_package(bpe, corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(UsageError, match="pip install tokenizers"):
        tokenize(corpus, tmp_path / "tokens", tokenizer=bpe, workers=0)
