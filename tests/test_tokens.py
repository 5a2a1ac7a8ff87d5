"""Token corpora: the formats read alike, bad files named in one line, windows in jdp's
order on any mesh or process count, exact resume, and the language model's metrics."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from closeness import EARLY_STEPS, assert_drift_within, assert_sequences_close
from helpers import assert_bitwise_equal, run_cli, saved_arrays, subprocess_env

import jdp
from jdp import plot
from jdp.checkpoint import load_params
from jdp.data.formats.shards import HEADER_BYTES, write_llmc, write_meta
from jdp.data.formats.tokens import from_tokens, split_of
from jdp.data.loader.readers import TrainReader
from jdp.mesh import process_rows

SEQ = 32


def _text_bytes(limit: int) -> np.ndarray:
    """Real text as byte tokens: the start of this Python's own ``os.py`` and ``re`` sources."""
    sources = [os.__file__, re.__file__, json.__file__]
    data = b"".join(pathlib.Path(path).read_bytes() for path in sources)
    assert len(data) >= limit, len(data)
    return np.frombuffer(data[:limit], np.uint8)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """An llm.c corpus of byte tokens: a train and a val shard and their tokens.json."""
    directory = tmp_path_factory.mktemp("corpus")
    tokens = _text_bytes(60_000)
    write_llmc(directory / "text_train_000000.bin", tokens[:50_000])
    write_llmc(directory / "text_val_000000.bin", tokens[50_000:])
    write_meta(directory, {"vocab_size": 256, "tokenizer": "bytes", "eos_id": None})
    return directory


def test_llmc_nanogpt_and_npy_read_the_same_windows(tmp_path):
    tokens = (np.arange(5000) * 7919 % 50257).astype(np.uint16)
    write_llmc(tmp_path / "a.bin", tokens)
    tokens.tofile(tmp_path / "raw.bin")
    np.save(tmp_path / "c.npy", tokens.astype(np.uint32))
    (tmp_path / "meta").mkdir()
    tokens.tofile(tmp_path / "meta" / "train.bin")
    write_meta(tmp_path / "meta", {"dtype": "uint16", "vocab_size": 50257})
    splits = [
        from_tokens(tmp_path / "a.bin", seq_len=SEQ, vocab_size=50257),
        from_tokens(tmp_path / "raw.bin", seq_len=SEQ, vocab_size=50257, dtype="uint16"),
        from_tokens(tmp_path / "c.npy", seq_len=SEQ, vocab_size=50257),
        from_tokens(tmp_path / "meta", seq_len=SEQ),  # dtype and vocabulary from tokens.json
    ]
    indices = np.array([0, 155, 3, 77])
    expected = np.stack([tokens[i * SEQ : i * SEQ + SEQ + 1] for i in indices]).astype(np.int32)
    for split in splits:
        assert len(split) == (len(tokens) - 1) // SEQ
        np.testing.assert_array_equal(split.read(indices)["tokens"], expected)
    # A dtype given for a file whose header gives its own would be dropped: refused.
    for headed in ("a.bin", "c.npy"):
        with pytest.raises(jdp.UsageError, match=r"--token-dtype uint32 is for raw \.bin files"):
            from_tokens(tmp_path / headed, seq_len=SEQ, vocab_size=50257, dtype="uint32")


def test_a_directory_of_only_validation_files_has_no_training_split(tmp_path):
    write_llmc(tmp_path / "web_val_000000.bin", np.zeros(100, np.uint16))
    (tmp_path / "sub.bin").mkdir()  # a directory named like a shard is not one
    with pytest.raises(jdp.UsageError, match="has no train split; it has: validation"):
        from_tokens(tmp_path, seq_len=8, vocab_size=10)
    with pytest.raises(jdp.UsageError, match="vocabulary size 'abc'"):
        from_tokens(tmp_path, "validation", seq_len=8, vocab_size="abc")


def test_a_glob_or_directory_is_one_corpus_split_by_file_name(tmp_path):
    for number in range(3):
        write_llmc(tmp_path / f"web_train_{number:06d}.bin", np.full(101, number, np.uint16))
    write_llmc(tmp_path / "web_val_000000.bin", np.full(51, 9, np.uint16))
    by_glob = from_tokens(str(tmp_path / "web_train_*.bin"), seq_len=10, vocab_size=10)
    by_dir = from_tokens(tmp_path, seq_len=10, vocab_size=10)
    validation = from_tokens(tmp_path, "validation", seq_len=10, vocab_size=10)
    assert len(by_glob) == len(by_dir) == 30 and len(validation) == 5
    rows = by_dir.read(np.arange(30))["tokens"]
    assert [int(row[0]) for row in rows[::10]] == [0, 1, 2]  # a window never crosses files
    assert (rows == rows[:, :1]).all() and (validation.read(np.arange(5))["tokens"] == 9).all()
    assert [split_of(n) for n in ("train.bin", "val.bin", "x_valid.npy", "test.bin")] == [
        "train",
        "validation",
        "validation",
        "test",
    ]


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_bad_shards_are_one_line_naming_the_file(tmp_path):
    tokens = np.arange(300, dtype=np.uint16)
    write_llmc(tmp_path / "version.bin", tokens)
    header = np.fromfile(tmp_path / "version.bin", "<i4", count=3)
    with open(tmp_path / "version.bin", "r+b") as file:
        file.seek(4)
        file.write(np.int32(3).tobytes())  # magic of GPT-2's shards, an unknown version
    assert header[0] == 20240520
    write_llmc(tmp_path / "short.bin", tokens)
    with open(tmp_path / "short.bin", "r+b") as file:
        file.truncate(HEADER_BYTES + 2 * 250)
    tokens.tofile(tmp_path / "raw.bin")
    np.save(tmp_path / "floats.npy", np.zeros(10, np.float32))
    (tmp_path / "tiny.bin").write_bytes(b"\x00" * 10)  # shorter than a header, not int32s
    (tmp_path / "llmc").mkdir()
    write_llmc(tmp_path / "llmc" / "c_train_000000.bin", tokens)
    with open(tmp_path / "llmc" / "c_train_000000.bin", "r+b") as file:
        file.write(b"\x01")  # one flipped byte of the magic
    write_meta(tmp_path / "llmc", {"format": "llm.c", "dtype": "uint16", "vocab_size": 65536})
    with pytest.raises(jdp.UsageError) as error:
        from_tokens(tmp_path / "llmc", seq_len=8)  # never the header read as tokens
    assert "does not start with llm.c's header" in _one_line(error)
    cases = {
        "tiny.bin": "no llm.c header and no declared token dtype",
        "version.bin": "version 3",
        "short.bin": "says 300 tokens and the file holds 250",
        "raw.bin": "no llm.c header and no declared token dtype",
        "floats.npy": "a token shard is one-dimensional",
    }
    for name, needle in cases.items():
        with pytest.raises(jdp.UsageError) as error:
            from_tokens(tmp_path / name, seq_len=8, vocab_size=1000)
        line = _one_line(error)
        assert str(tmp_path / name) in line and needle in line, line


def test_a_token_outside_the_vocabulary_names_its_file_and_offset(tmp_path):
    tokens = np.zeros(1000, np.uint16)
    tokens[517] = 300
    write_llmc(tmp_path / "train.bin", tokens)
    split = from_tokens(tmp_path / "train.bin", seq_len=8, vocab_size=256)
    split.read(np.arange(60))  # windows before the bad token read
    with pytest.raises(jdp.UsageError) as error:
        split.read(np.arange(len(split)))
    line = _one_line(error)
    where = f"{tmp_path / 'train.bin'}: token 300 at token offset 517 (byte 2058)"
    assert f"{where} is not in [0, 256)" in line, line
    np.save(tmp_path / "wide.npy", np.array([1, 2, 2**32 - 1, 3] * 10, np.uint32))
    wide = from_tokens(tmp_path / "wide.npy", seq_len=4, vocab_size=256)
    with pytest.raises(jdp.UsageError, match=r"token 4294967295 at token offset 2 .* not in \[0"):
        wide.read(np.arange(len(wide)))  # read as int32 it would be -1: never trained on


def test_a_shard_cut_short_under_a_run_and_a_wrong_dtype_are_one_line(tmp_path):
    tokens = np.arange(4000, dtype=np.uint16) % 256
    write_llmc(tmp_path / "train.bin", tokens)
    split = from_tokens(tmp_path / "train.bin", seq_len=8, vocab_size=256)
    split.read(np.arange(len(split)))
    os.truncate(tmp_path / "train.bin", 3000)  # under its map: reading past the end is SIGBUS
    with pytest.raises(
        jdp.UsageError,
        match=r"train.bin changed while the run read it \(9,024 "
        r"bytes when opened, now 3,000 bytes\)",
    ):
        split.read(np.arange(len(split)))
    # uint32 ids (little-endian) declared uint16: every second 16-bit word is a high half, 0.
    (tmp_path / "wide").mkdir()
    (np.arange(1, 4001) % 256).astype("<u4").tofile(tmp_path / "wide" / "train.bin")
    write_meta(tmp_path / "wide", {"dtype": "uint16", "vocab_size": 256})
    with pytest.raises(jdp.UsageError, match="every second of its uint16 tokens is 0"):
        from_tokens(tmp_path / "wide", seq_len=8)


@pytest.mark.slow
def test_a_bad_token_met_mid_run_saves_the_state_before_it(tmp_path):
    """The batch that holds it never trains; the steps before it are not lost."""
    tokens = np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint16)
    tokens[517] = 300  # window 64 of 124, met at step 3 of this order
    (tmp_path / "corpus").mkdir()
    write_llmc(tmp_path / "corpus" / "c_train_000000.bin", tokens)
    run = tmp_path / "run"
    flags = [
        *"--model gpt --dataset".split(),
        f"tokens:{tmp_path / 'corpus'}",
        *"--steps 40 --vocab-size 256 --seq-len 8 --batch-size 8".split(),
        *"--warmup-steps 0 --mesh data=2 --ckpt-dir".split(),
        run,
    ]
    result = run_cli(*flags)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    found = re.search(
        r"token 300 at token offset 517 .* \(met after step (\d+)\); that step's "
        r"state is saved in (.*)$",
        line,
    )
    assert found and found[2] == str(run), line
    # Saved is the step just before the first batch that holds the bad token, in the order
    # a run of this seed reads (each step read alone: the run's reader reads in chunks).
    reader = TrainReader(
        from_tokens(tmp_path / "corpus", seq_len=8, vocab_size=256),
        batch_size=8,
        seed=0,
        rows=slice(None),
    )
    first_bad = next(step for step in range(40) if not _reads(reader, step))
    assert first_bad >= 1 and int(found[1]) == first_bad, (first_bad, line)
    assert jdp.checkpoint.read_record(run / found[1]).step == first_bad


def _reads(reader, step) -> bool:
    try:
        reader(step)
    except jdp.UsageError:
        return False
    return True


def test_each_process_reads_only_its_rows_of_the_same_global_batch(corpus):
    split = from_tokens(corpus, seq_len=SEQ)
    whole = TrainReader(split, batch_size=16, seed=3, rows=slice(None))
    halves = [
        TrainReader(split, batch_size=16, seed=3, rows=slice(i * 8, i * 8 + 8)) for i in (0, 1)
    ]
    for step in (0, 5, 200):  # 200: past the first epoch of 48 windows per 16
        parts = [half(step)["tokens"] for half in halves]
        np.testing.assert_array_equal(np.concatenate(parts), whole(step)["tokens"])
        assert not set(halves[0].indices(step)) & set(halves[1].indices(step))
    assert process_rows(jdp.make_mesh("data=8"), 16) == slice(0, 16)


def _fit(corpus, **fields):
    """The gpt without dropout: jdp draws dropout per data replica (`jdp.replica`), so
    only a model without it computes the same on 1 replica and on 8."""
    model = jdp.models.from_linen(
        jdp.models.GPT(256, width=64, heads=4, layers=2, hidden=128, dropout=0.0, max_len=SEQ),
        jdp.models.language_model(bits_per_byte=True),
        inputs=lambda batch: (batch["tokens"][:, :-1],),
    )
    config = jdp.TrainConfig(
        dataset=f"tokens:{corpus}",
        seq_len=SEQ,
        batch_size=16,
        steps=12,
        warmup_steps=10,
        log_every=1,
        **fields,
    )
    return jdp.fit(config, model=model, console=jdp.Console(enabled=False))


@pytest.mark.slow
def test_data8_matches_data1_on_token_data(corpus):
    one, eight = _fit(corpus, mesh="data=1"), _fit(corpus, mesh="data=8")
    losses = [
        [r["loss"] for r in result.history if r["kind"] == "train"] for result in (one, eight)
    ]
    # Within a window both compute the same; only the mean over the 16 windows and
    # the gradients' sums are reordered: the warmup steps' bound (closeness.py).
    assert_sequences_close(losses[1], losses[0], rtol=EARLY_STEPS)
    assert_drift_within(eight.state.params, one.state.params)
    assert set(one.validation) >= {"loss", "bits_per_byte", "token_accuracy"}
    assert "accuracy" not in one.validation  # no exact match of whole windows
    assert one.validation["bits_per_byte"] == pytest.approx(one.validation["loss"] / np.log(2))
    record = [r for r in one.history if r["kind"] == "train"][-1]
    assert record["tokens_seen"] == 12 * 16 * SEQ and "tokens_per_sec" in record
    line = one.summary_line()
    assert re.search(r" val_loss=[\d.]+ val_bits_per_byte=[\d.]+ examples/s=\d+ tokens/s=", line)
    assert "test_" not in line, line


def test_gpt_positions_follow_seq_len(corpus):
    train = from_tokens(corpus, seq_len=48)
    model = jdp.models.get_model("gpt", train)
    params, _ = jax.jit(model.init)(jax.random.key(0), train.read(np.arange(2)))
    positions = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if "Embed_1" in jax.tree_util.keystr(path)
    ]
    assert positions[0].shape == (48, 128)
    with pytest.raises(jdp.UsageError, match="windows are 48 tokens and --seq-len is 32"):
        jdp.models.get_model("gpt", train, seq_len=32)
    numbers = jdp.load_split("numbers2words", "train")
    with pytest.raises(jdp.UsageError, match="--seq-len 8 is shorter than the data's sequences"):
        jdp.models.get_model("gpt", numbers, seq_len=8)


def test_perplexity_is_the_exponential_of_the_mean_loss():
    objective = jdp.models.language_model()  # ids that are not bytes: perplexity
    assert objective.best == ("loss", "min")
    assert objective.derived({"loss": 2.0})["perplexity"] == pytest.approx(np.exp(2.0))


@pytest.mark.slow
def test_the_best_checkpoint_is_the_lowest_loss_and_bad_best_metrics_are_refused(corpus, tmp_path):
    flags = [
        *"--model gpt --dataset".split(),
        f"tokens:{corpus}",
        "--seq-len",
        str(SEQ),
        *"--batch-size 16 --mesh data=2".split(),
    ]
    for best, needle in (
        (
            "accuracy",
            "the evaluation gives bits_per_byte, loss, token_accuracy; choose one of them",
        ),
        ("test/loss", "in this run the val split picks the best checkpoint; name val/loss"),
    ):
        result = run_cli(
            *flags,
            *"--steps 2 --ckpt-dir".split(),
            tmp_path / best.replace("/", "_"),
            "--best-metric",
            best,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"jdp.train: error: --best-metric {best}: " + needle
        ], result.stderr
    run = run_cli(
        *flags,
        *"--steps 40 --eval-every 10 --eval-batches 2 --ckpt-every 10 --keep 1".split(),
        *"--lr 0.03 --ckpt-dir".split(),
        tmp_path / "run",
    )
    assert run.returncode == 0, run.stderr
    losses = {
        int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+): val_loss=([\d.]+)", run.stdout)
    }
    kept = sorted(int(name) for name in os.listdir(tmp_path / "run") if name.isdigit())
    best = min(losses, key=losses.get)
    assert kept == sorted({best, 40}), (kept, losses)
    loaded = jdp.load_model(str(tmp_path / "run"), "best")  # chosen as the run kept it
    assert loaded.step == best and loaded.config["seq_len"] == SEQ


def test_llmc_gpt2_shards_without_metadata_read_as_gpt2s_vocabulary(tmp_path, capsys):
    """llm.c's version-1 shards hold GPT-2's tokens (llm.c reads them with 50,257): a
    default, said in one line, where other files without a vocabulary are refused."""
    from jdp.data.formats.tokens import corpus

    write_llmc(tmp_path / "fineweb_train_000001.bin", (np.arange(5000) % 50257).astype(np.uint16))
    splits = corpus(tmp_path, seq_len=16)
    assert splits["train"].vocab_size == 50257
    assert "llm.c's GPT-2 shards (version 1), so GPT-2's vocabulary of 50,257" in (
        capsys.readouterr().out
    )


def test_the_cli_names_a_missing_vocabulary_and_dtype(tmp_path):
    (np.arange(50_000) % 500).astype(np.uint16).tofile(tmp_path / "train.bin")
    result = run_cli("--model", "gpt", "--dataset", f"tokens:{tmp_path}", "--steps", "1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"jdp.train: error: the vocabulary size of {tmp_path} is not known; pass --vocab-size N "
        f'(or vocab_size=), or write {tmp_path / "tokens.json"} with {{"vocab_size": N}}'
    ]
    result = run_cli(
        *"--model gpt --dataset".split(),
        f"tokens:{tmp_path}",
        *"--steps 1 --vocab-size 500".split(),
    )
    assert result.returncode == 2 and "no llm.c header and no declared token dtype" in result.stderr
    result = run_cli(
        *"--model mlp --dataset".split(),
        f"tokens:{tmp_path}",
        *"--vocab-size 500 --token-dtype uint16 --steps 1".split(),
    )
    assert result.returncode == 2 and "for it choose --model gpt" in result.stderr, result.stderr


_KILL_RUN = [
    *"--model gpt --seq-len".split(),
    str(SEQ),
    *"--batch-size 16 --mesh data=8 --steps 20 --ckpt-every 5".split(),
    *"--warmup-steps 5".split(),
]


def _train(corpus, directory, *launch, log=True) -> subprocess.CompletedProcess:
    """`_KILL_RUN` on ``corpus`` into ``directory`` (its ``ckpt`` and, with ``log``, ``log``
    of every step's loss), under ``launch`` if given."""
    command = [
        sys.executable,
        "-m",
        "jdp.train",
        *_KILL_RUN,
        "--dataset",
        f"tokens:{corpus}",
        "--ckpt-dir",
        str(directory / "ckpt"),
    ]
    if log:
        command += ["--log-dir", str(directory / "log"), "--log-every", "1"]
    result = subprocess.run(
        [*launch, *command], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def _losses(directory) -> list[float]:
    with open(directory / "log" / "metrics.jsonl") as records:
        return [r["loss"] for r in map(json.loads, records) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory):
    """One process's uninterrupted `_KILL_RUN`: the reference of the kill's and the
    launcher's tests (logging reads the losses; it changes no step)."""
    directory = tmp_path_factory.mktemp("whole")
    _train(corpus, directory)
    return directory


# The scheduled lane, with the next: per change, tests/test_checkpoint.py kills and
# resumes bitwise, each step's windows follow (seed, step) alone
# (test_each_process_reads_only_its_rows_of_the_same_global_batch) and
# tests/test_distributed.py runs two processes under the launcher.
@pytest.mark.slow
@pytest.mark.scheduled
def test_sigkill_then_resume_on_token_data_is_bitwise_identical(corpus, whole, tmp_path):
    command = [
        sys.executable,
        "-m",
        "jdp.train",
        *_KILL_RUN,
        "--dataset",
        f"tokens:{corpus}",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )
    deadline = time.monotonic() + 180
    while not (tmp_path / "ckpt" / "10").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run ended before it was killed"
    resumed = _train(corpus, tmp_path, log=False)
    assert re.search(r"^jdp: resuming from step \d+ in ", resumed.stdout, re.M)
    assert_bitwise_equal(saved_arrays(tmp_path / "ckpt", 20), saved_arrays(whole / "ckpt", 20))


@pytest.mark.slow
@pytest.mark.scheduled
def test_two_processes_match_one_on_token_data(corpus, whole, tmp_path):
    launcher = [sys.executable, *"-m jdp.launch --nproc 2 --devices-per-process 4 --".split()]
    _train(corpus, tmp_path, *launcher)
    single, double = _losses(whole), _losses(tmp_path)
    # Gloo sums the two processes' gradients in another order: the warmup's bound.
    assert_sequences_close(double[:5], single[:5], rtol=EARLY_STEPS)
    assert_drift_within(load_params(str(tmp_path / "ckpt")), load_params(str(whole / "ckpt")))


def test_python_stdlib_is_the_standard_librarys_text_and_decodes_back(tmp_path):
    from jdp.data.formats.corpora import LICENCE, prepare_stdlib, stdlib_files
    from jdp.data.formats.shards import open_shard, read_meta
    from jdp.data.formats.tokenize import decode

    directory = prepare_stdlib(str(tmp_path))
    assert prepare_stdlib(str(tmp_path)) == directory  # prepared once
    meta = read_meta(directory)
    assert meta["licence"] == LICENCE and meta["vocab_size"] == 256
    assert sum(meta["bytes"].values()) >= 5_000_000  # the floor for a real corpus
    assert 0 < meta["documents"]["val"] < meta["documents"]["train"]
    files = stdlib_files()
    assert not any(f"{os.sep}test{os.sep}" in path for path in files)
    shards = {}
    with open(os.path.join(directory, "documents.tsv")) as table:
        rows = [line.rstrip("\n").split("\t") for line in table][1:]
    assert sorted(row[4] for row in rows) == sorted(files)
    for _, shard, offset, count, path in rows[:: max(1, len(rows) // 60)]:  # 60 of them
        if shard not in shards:
            shards[shard] = open_shard(os.path.join(directory, shard)).tokens()
        tokens = shards[shard][int(offset) : int(offset) + int(count)]
        assert decode(tokens) == pathlib.Path(path).read_text(encoding="utf-8"), path
    splits = jdp.data.formats.tokens.corpus(directory, seq_len=256)
    assert splits["validation"] is not None and splits["test"] is None


@pytest.mark.slow
def test_a_language_model_trains_on_python_stdlib_from_the_cli(tmp_path):
    result = run_cli(
        *"--model gpt --dataset python_stdlib --data-dir".split(),
        tmp_path,
        *"--seq-len 64 --batch-size 16 --steps 12 --mesh data=2".split(),
        "--log-dir",
        tmp_path / "log",
        # The logits a chunk at a time: the other gpt runs take them whole.
        *"--eval-batches 4 --loss-chunks 4".split(),
    )
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    figures = dict(re.findall(r"(\w+(?:/s)?)=([\d.]+)", line))
    assert float(figures["val_bits_per_byte"]) < 8.0  # better than uniform over 256 bytes
    assert "tokens/s" in figures and "accuracy" not in line
    assert "(python_stdlib" in result.stdout or "python_stdlib (" in result.stdout
    runs = {"lm": plot.read_run(str(tmp_path / "log"))}
    chosen = [plot._choose(choices, runs)[1] for choices in plot._PANELS]
    assert chosen == ["loss", "bits_per_byte", "lr", "tokens_per_sec"]
    assert os.path.getsize(plot.plot_runs([str(tmp_path / "log")], str(tmp_path / "c.png")))


@pytest.mark.slow
def test_a_nanogpt_shape_optimizer_and_evaluation_are_flags(corpus, tmp_path):
    """nanoGPT's n_layer, n_head, n_embd, dropout, eval_iters, beta2, min_lr and
    lr_decay_iters as flags: the model has the shape asked for (and keeps it in its
    checkpoint), an evaluation reads the batches asked for, and the schedule ends at
    --end-lr from --decay-steps on."""
    from helpers import cli

    run = cli(
        *"--model gpt --dataset".split(),
        f"tokens:{corpus}",
        "--seq-len",
        str(SEQ),
        *"--layers 2 --heads 2 --width 64 --hidden 96 --dropout 0".split(),
        *"--eval-batches 2 --eval-every 4 --steps 8 --batch-size 8".split(),
        *"--mesh data=2 --beta2 0.95 --end-lr 1e-4 --decay-steps 6".split(),
        *"--warmup-steps 2 --log-every 1 --ckpt-dir".split(),
        tmp_path / "run",
        "--log-dir",
        tmp_path / "run",
    )
    assert run.returncode == 0, run.stderr
    loaded = jdp.load_model(str(tmp_path / "run"))
    shapes = jax.tree.map(np.shape, loaded.params)
    assert shapes["blocks"]["FeedForward_0"]["Dense_0"]["kernel"] == (2, 64, 96)
    assert shapes["blocks"]["MultiHeadDotProductAttention_0"]["query"]["kernel"] == (2, 64, 2, 32)
    assert loaded.config["beta2"] == 0.95 and loaded.config["dropout"] == 0.0
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    evaluated = [r for r in records if r["kind"] == "val"]
    assert [r["count"] for r in evaluated] == [2 * 8] * 2  # 2 batches of 8 windows
    lrs = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    # Step s updates with the schedule at s - 1: the decay ends at 6, then it holds.
    assert lrs[7] == lrs[8] == pytest.approx(1e-4) and lrs[6] > 1e-4
