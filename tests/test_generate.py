"""Sampling with a key/value cache: the cached model is the full model, token for token
and logit for logit; the options do what they say; ``python -m jdp.sample`` and the line
a language model's run ends with."""

import json
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli, run_python

import jdp
from jdp.data.formats.tokenize import tokenize
from jdp.data.formats.tokens import corpus
from jdp.models.generate import _decode
from jdp.models.transformer import GPT, stack_layers
from jdp.sample import main, training_sample
from jdp.sampling import (
    BYTES,
    check_codec,
    check_language_model,
    find_codec,
    load_sampler,
    sample_line,
)

# A model padded beyond the data's vocabulary, as the published sizes are: rows 50..63
# of the embedding are never a token of the data.
VOCAB, PADDED = 50, 64
ROWS, PROMPT, NEW = 3, 6, 12
# fp32 (unit roundoff u = 2**-24 = 6e-8): the cached pass and the full model differ only
# in the order of their sums (attention over a masked cache of 18 keys, not over the
# prefix; products of one row, not of many). Each sum of K terms is off by at most
# K * u * (the sum of their magnitudes); the longest here is the feed-forward's 64 terms,
# the logits reach about 10, and a logit passes through about six such sums in the two
# layers and the head: 6 * 64 * 6e-8 * 10 ~ 2e-4 at worst (measured: 3e-5).
FP32_ATOL = 2e-4


def _gpt(unroll=False) -> GPT:
    return GPT(
        vocab_size=PADDED,
        width=32,
        heads=4,
        layers=2,
        hidden=64,
        dropout=0.0,
        max_len=24,
        unroll=unroll,
    )


def _init(module: GPT, seed=0):
    params = nn.unbox(jax.jit(module.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))
    # Twice the initial weights: a random model's greedy text is one token repeated, and
    # these continue each row differently, so the comparison sees the cache at work.
    return jax.tree.map(lambda leaf: leaf * 2 if leaf.ndim >= 2 else leaf, params["params"])


@pytest.fixture(scope="module")
def model():
    module = _gpt()
    return module, _init(module)


@pytest.fixture(scope="module")
def prompt():
    return jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (ROWS, PROMPT)), jnp.int32)


def uncached_greedy(module, params, prompt, new):
    """Greedy decoding without a cache: the whole model run again for each token, on a
    buffer as long as the prefix will grow (compiled once, where a growing prefix would
    compile once per length); causal attention makes position t's logits those of the
    prefix alone. Returns the tokens and each step's smallest margin between the two
    most likely tokens."""
    apply = jax.jit(lambda tokens: module.apply({"params": params}, tokens))
    tokens = np.zeros((prompt.shape[0], prompt.shape[1] + new), np.int32)
    tokens[:, : prompt.shape[1]] = prompt
    margins = []
    for position in range(prompt.shape[1], tokens.shape[1]):
        logits = np.asarray(apply(jnp.asarray(tokens))[:, position - 1], np.float32)[:, :VOCAB]
        top = np.sort(logits, axis=-1)
        margins.append(float((top[:, -1] - top[:, -2]).min()))
        tokens[:, position] = logits.argmax(-1)
    return tokens[:, prompt.shape[1] :], min(margins)


def test_cached_greedy_is_uncached_greedy_token_for_token(model, prompt):
    module, params = model
    options = {"max_new_tokens": NEW, "temperature": 0, "vocab_size": VOCAB}
    tokens, logits = jdp.models.generate(module, params, prompt, with_logits=True, **options)
    expected, margin = uncached_greedy(module, params, prompt, NEW)
    assert margin > 10 * FP32_ATOL  # no near-tie the rounding could break either way
    np.testing.assert_array_equal(tokens, expected)
    assert tokens.dtype == jnp.int32 and logits.shape == (ROWS, NEW, PADDED)
    assert len({tuple(row) for row in np.asarray(tokens).tolist()}) == ROWS
    # Each new position's cached logits are the full model's at that position.
    grown = jnp.concatenate([prompt, tokens[:, :-1]], axis=1)
    full = jax.jit(module.apply)({"params": params}, grown)  # jitted: op by op took seconds
    np.testing.assert_allclose(logits, full[:, PROMPT - 1 :], rtol=0, atol=FP32_ATOL)


def sliding_greedy(module, params, prompt, new):
    """nanoGPT's sampling loop, greedy: each token from the whole model's pass over the
    last ``max_len`` tokens (the prompt cropped likewise), no cache. A shorter prefix runs
    padded on the right to ``max_len`` (causal attention: position t's logits are the
    prefix's alone), so one program serves every step, not one per length."""
    window = module.max_len
    apply = jax.jit(lambda tokens: module.apply({"params": params}, tokens))
    tokens = np.asarray(prompt)
    for _ in range(new):
        last = tokens[:, -window:]
        padded = np.zeros((tokens.shape[0], window), np.int32)
        padded[:, : last.shape[1]] = last
        logits = np.asarray(apply(jnp.asarray(padded))[:, last.shape[1] - 1])
        tokens = np.concatenate([tokens, logits[:, :VOCAB].argmax(-1)[:, None]], axis=1)
    return tokens[:, prompt.shape[1] :]


@pytest.mark.parametrize("length, new", [(PROMPT, 40), (30, 5)])
@pytest.mark.slow
def test_past_the_context_sampling_slides_its_window_as_nanogpt(model, length, new):
    """A model of 24 positions continues a prompt of 6 for 40 tokens (18 from the cache,
    22 from a window of the last 24), and a prompt of 30 (cropped to its last 24): token
    for token nanoGPT's uncached loop."""
    module, params = model
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (ROWS, length)), jnp.int32)
    tokens = jdp.models.generate(
        module, params, prompt, max_new_tokens=new, temperature=0, vocab_size=VOCAB
    )
    np.testing.assert_array_equal(tokens, sliding_greedy(module, params, prompt, new))
    drawn = jdp.models.generate(
        module,
        params,
        prompt,
        max_new_tokens=new,
        temperature=0.8,
        top_k=5,
        vocab_size=VOCAB,
        rng=jax.random.key(3),
    )
    assert drawn.shape == (ROWS, new) and bool((drawn < VOCAB).all())


@pytest.mark.slow
def test_top_k_1_is_greedy_and_sampling_follows_the_rng(model, prompt):
    module, params = model
    common = {"max_new_tokens": NEW, "vocab_size": VOCAB}
    greedy = jdp.models.generate(module, params, prompt, temperature=0, **common)
    top1 = jdp.models.generate(module, params, prompt, rng=jax.random.key(5), top_k=1, **common)
    np.testing.assert_array_equal(top1, greedy)

    def sample(seed, temperature=2.0):
        return np.asarray(
            jdp.models.generate(
                module, params, prompt, rng=jax.random.key(seed), temperature=temperature, **common
            )
        )

    first = sample(1)
    compiled = _decode._cache_size()
    np.testing.assert_array_equal(sample(1), first)
    assert not np.array_equal(sample(2), first)
    assert not np.array_equal(sample(1, temperature=0.5), first)
    # Another rng or temperature reuses the program compiled for these shapes.
    assert _decode._cache_size() == compiled


@pytest.mark.slow
def test_padded_vocabulary_rows_are_never_sampled(model, prompt):
    module, params = model
    # Make the padding rows of the tied embedding the most likely next tokens by far.
    table = params["Embed_0"]["embedding"]
    loud = {**params, "Embed_0": {"embedding": table.at[VOCAB:].multiply(50.0)}}
    unmasked = jdp.models.generate(module, loud, prompt, max_new_tokens=4, temperature=0)
    assert (np.asarray(unmasked) >= VOCAB).all()
    for options in ({"temperature": 0}, {"temperature": 1.5}, {"temperature": 1.0, "top_k": 60}):
        tokens = jdp.models.generate(
            module,
            loud,
            prompt,
            max_new_tokens=NEW,
            vocab_size=VOCAB,
            rng=jax.random.key(0),
            **options,
        )
        assert (np.asarray(tokens) < VOCAB).all(), options


@pytest.mark.slow
def test_the_unrolled_layout_generates_as_the_scanned_one(prompt):
    unrolled = _gpt(unroll=True)
    params = _init(unrolled, seed=1)
    assert "Block_1" in params and "blocks" not in params
    options = {"max_new_tokens": NEW, "temperature": 0, "vocab_size": VOCAB}
    tokens = jdp.models.generate(unrolled, params, prompt, **options)
    scanned = jdp.models.generate(_gpt(), stack_layers(params, 2), prompt, **options)
    np.testing.assert_array_equal(tokens, scanned)
    expected, margin = uncached_greedy(unrolled, params, prompt, NEW)
    assert margin > 10 * FP32_ATOL
    np.testing.assert_array_equal(tokens, expected)
    assert jdp.models.gpt_for(params) == unrolled
    assert jdp.models.gpt_for({"params": stack_layers(params, 2)}) == _gpt()
    # Past the context too, whichever layout the parameters and the module are in.
    options["max_new_tokens"] = 30
    past = jdp.models.generate(unrolled, params, prompt, **options)
    np.testing.assert_array_equal(past, jdp.models.generate(_gpt(), params, prompt, **options))
    np.testing.assert_array_equal(past, sliding_greedy(unrolled, params, prompt, 30))


@pytest.mark.slow
def test_bf16_parameters_generate_in_bf16(model, prompt):
    module, params = model
    half = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), params)
    options = {"max_new_tokens": NEW, "temperature": 0, "vocab_size": VOCAB}
    tokens, logits = jdp.models.generate(module, half, prompt, with_logits=True, **options)
    assert logits.dtype == jnp.bfloat16 and (np.asarray(tokens) < VOCAB).all()
    grown = jnp.concatenate([prompt, tokens[:, :-1]], axis=1)
    full = jax.jit(module.apply)({"params": half}, grown)
    assert full.dtype == jnp.bfloat16
    # bf16 keeps 8 significant bits: a logit of magnitude up to 16 is rounded to 2**-4, and
    # a different summation order may move it by a few such steps.
    expected = np.asarray(full[:, PROMPT - 1 :], np.float32)
    np.testing.assert_allclose(np.asarray(logits, np.float32), expected, rtol=0, atol=0.25)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prompt": np.zeros(5, np.int32)}, "int32 (5,); give token ids (rows, length)"),
        ({"prompt": np.zeros((1, 2), np.float32)}, "float32 (1, 2); give token ids"),
        ({"max_new_tokens": 0}, "max_new_tokens 0; give 1 to 1,048,576 (2**20)"),
        ({"max_new_tokens": 10**12}, "max_new_tokens 1000000000000; give 1 to 1,048,576"),
        ({"temperature": -1.0}, "temperature -1.0; give 0 (greedy) or more"),
        ({"top_k": 0}, "top_k 0; give at least 1"),
        ({"vocab_size": 65}, "vocab_size 65 is not in [1, 64]"),
        ({"rng": None}, "temperature > 0 needs rng="),
    ],
)
def test_bad_requests_are_one_line(model, prompt, options, message):
    module, params = model
    arguments = {"prompt": prompt, "max_new_tokens": 4, "rng": jax.random.key(0)} | options
    with pytest.raises(jdp.UsageError, match=re.escape(message)):
        jdp.models.generate(module, params, arguments.pop("prompt"), **arguments)


def test_a_seed_past_a_keys_range_is_one_line():
    from jdp.sampling import BYTES, Codec, Sampler

    sampler = Sampler(None, None, Codec(BYTES), vocab_size=256)  # refused before the model
    with pytest.raises(jdp.UsageError, match=re.escape("--seed must be in [0, 2**32), got")):
        sampler.sample("Hi", seed=2**70)


def _bpe(path):
    """A small byte-level BPE tokenizer.json with GPT-2's <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([json.__doc__, re.__doc__], trainer)
    tokenizer.save(str(path))
    return str(path)


def test_a_run_ends_with_a_sample_when_its_corpus_decodes(tmp_path):
    (tmp_path / "text").mkdir()
    for name, module in (("json.txt", json), ("re.txt", re)):
        (tmp_path / "text" / name).write_text(module.__doc__ * 3, encoding="utf-8")
    meta = tokenize(
        tmp_path / "text",
        tmp_path / "tokens",
        tokenizer=_bpe(tmp_path / "bpe.json"),
        val_fraction=0.3,
        workers=0,
        progress=False,
    )
    assert (tmp_path / "tokens" / "bpe.json").is_file()  # copied beside the shards
    module = GPT(vocab_size=meta["vocab_size"], width=16, heads=2, layers=1, hidden=32, max_len=32)
    params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    splits = corpus(tmp_path / "tokens", seq_len=32)
    line = sample_line(params, splits)
    quoted = re.fullmatch(r'jdp: sample: (".*") -> (".*")', line)
    assert quoted, line
    # The prompt is the start of the validation split, which begins with a document's eos.
    assert json.loads(quoted[1]).startswith("<|endoftext|>") and "\n" not in line
    (tmp_path / "tokens" / "bpe.json").unlink()
    assert sample_line(params, splits) is None  # nothing to decode with: no line


def test_the_closing_sample_stops_at_the_end_of_a_document(tmp_path):
    """A continuation that draws the corpus's end-of-document id ends there: the line
    never prints a raw <|endoftext|>."""
    import dataclasses

    from jdp.data.formats.shards import write_llmc, write_meta

    write_llmc(tmp_path / "text_val_000000.bin", np.frombuffer(b"Hello, world! " * 9, np.uint8))
    write_meta(tmp_path, {"vocab_size": 256, "tokenizer": "bytes"})
    module = GPT(vocab_size=256, width=16, heads=2, layers=1, hidden=32, max_len=32)
    params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    splits = corpus(tmp_path, seq_len=32)

    def continuation(eos):
        validation = dataclasses.replace(splits["validation"], eos_id=eos)
        line = sample_line(params, {**splits, "validation": validation})
        return json.loads(re.fullmatch(r'jdp: sample: ".*" -> (".*")', line)[1])

    whole = continuation(None)
    # A byte drawn after the first (one that decodes alone): call it the end of a document.
    end = next(char for char in whole[1:] if ord(char) < 128)
    assert continuation(ord(end)) == whole[: whole.index(end)]


def test_the_tokenizer_is_found_or_named(tmp_path):
    assert find_codec(BYTES, []).decode(find_codec(BYTES, []).encode("wörd")) == "wörd"
    assert find_codec(BYTES, []).decode([104, 300, -1, 105]) == "h\ufffd\ufffdi"  # no byte
    check_codec(find_codec(BYTES, []), BYTES, 512)  # a byte corpus's padded vocabulary
    with pytest.raises(jdp.UsageError, match="records no tokenizer; pass --tokenizer"):
        find_codec(None, [str(tmp_path)])
    looked = (
        f"tokenizer.json is not found (looked beside the corpus and the checkpoint: {tmp_path})"
    )
    with pytest.raises(jdp.UsageError, match=re.escape(looked + "; pass --tokenizer")):
        find_codec("tokenizer.json", [str(tmp_path)])
    _bpe(tmp_path / "tokenizer.json")
    codec = find_codec("tokenizer.json", [str(tmp_path / "nowhere"), str(tmp_path)])
    assert codec.decode(codec.encode("Decode JSON.")) == "Decode JSON."
    assert find_codec("tokenizer.json", [], given=BYTES).name == BYTES
    (tmp_path / "text.txt").write_text("hello")
    with pytest.raises(jdp.UsageError, match=r"text\.txt: not a tokenizer\.json"):
        find_codec(None, [], given=str(tmp_path / "text.txt"))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": "mlp", "data": {"kind": "image"}}, "holds --model mlp, not a language model"),
        ({"model": "gpt", "data": {"kind": "sequence"}}, "sequence pairs \\(numbers2words\\)"),
        ({"model": "yours", "data": {"kind": "image"}}, "holds your own model, not a language"),
        ({"model": "gpt"}, "records no data facts"),
    ],
)
def test_only_a_language_model_samples(config, message):
    with pytest.raises(jdp.UsageError, match=message):
        check_language_model(config)
    with pytest.raises(jdp.UsageError, match=r"export a gpt trained on a token corpus"):
        check_language_model(config, to="export")  # jdp.export's line


def test_the_command_line_refuses_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"jdp.sample: error: no checkpoint in {tmp_path}; pass a "
        "--ckpt-dir or one of its step directories"
    ]


def test_a_failed_sample_never_fails_the_run(capsys):
    config = jdp.TrainConfig(model="gpt", dataset="tokens:/no/such/corpus")
    result = types.SimpleNamespace(preempted=None, state=types.SimpleNamespace(params={}))
    assert training_sample(config, result) is None
    assert capsys.readouterr().err.startswith("jdp: no sample: UsageError: /no/such/corpus")
    assert training_sample(jdp.TrainConfig(), result) is None  # an mlp: no sample, no line


@pytest.mark.slow
def test_train_a_language_model_then_sample_from_its_checkpoint(tmp_path):
    (tmp_path / "text").mkdir()
    for name, module in (("json.txt", json), ("re.txt", re)):
        (tmp_path / "text" / name).write_text(module.__doc__ * 4, encoding="utf-8")
    made = run_python(
        "-m",
        "jdp.data",
        "tokenize",
        tmp_path / "text",
        "--out",
        tmp_path / "tokens",
        *"--val-fraction 0.3 --workers 0".split(),
    )
    assert made.returncode == 0, made.stderr
    run = run_cli(
        *"--model gpt --dataset".split(),
        f"tokens:{tmp_path / 'tokens'}",
        *"--seq-len 32 --batch-size 8 --steps 3 --mesh data=2".split(),
        "--ckpt-dir",
        tmp_path / "ckpt",
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    samples = [line for line in lines if line.startswith("jdp: sample: ")]
    assert len(samples) == 1 and lines[-1].startswith("jdp.train: steps=3"), run.stdout
    assert "no sample" not in run.stderr, run.stderr

    def sample(*flags):
        return run_python("-m", "jdp.sample", tmp_path / "ckpt", "--prompt", "Regular ", *flags)

    greedy = sample("--max-new-tokens", "8", "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr
    loaded = load_sampler(tmp_path / "ckpt")
    assert loaded.codec.name == BYTES and loaded.vocab_size == 256
    expected = loaded.sample("Regular ", max_new_tokens=8, temperature=0)
    assert greedy.stdout == expected + "\n"
    # nanoGPT's defaults (64 tokens at temperature 0.8 among the top 200), past the
    # 32-token context: the window slides.
    drawn = [sample("--seed", "7", "--step", "3") for _ in range(2)]
    assert len(drawn[0].stdout.encode()) >= 64  # a byte or more a token
    assert drawn[0].returncode == 0 and drawn[0].stdout == drawn[1].stdout, drawn[0].stderr
    assert drawn[0].stdout == loaded.sample("Regular ", seed=7) + "\n"
