"""Text from a trained language model: a checkpoint's `gpt` and its corpus's tokenizer.

`load_sampler` reads a checkpoint (`jdp.load_model`), the `GPT` its parameters
make (`jdp.models.generate.gpt_for`) and the tokenizer its token corpus was
written with: UTF-8 bytes, or a Hugging Face ``tokenizer.json`` found beside the
corpus (``python -m jdp.data tokenize`` copies it there), beside the checkpoint,
or given. `Sampler.sample` encodes a prompt, continues it with
`jdp.models.generate` and decodes the new tokens. `sample_line` is the short
sample a language model's run prints at its end. ``python -m jdp.sample`` is the
command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jdp.checkpoint.record import RunSettings
from jdp.data.formats import TOKENS_PREFIX, TokenSplit
from jdp.errors import UsageError, not_there
from jdp.inference import load_model
from jdp.models.generate import generate, gpt_for
from jdp.models.transformer import EPSILON, GPT

BYTES = "bytes"
DEFAULT_NEW_TOKENS = 64
# What `python -m jdp.sample` and `Sampler.sample` draw with unless told: nanoGPT's
# sample.py defaults (temperature 0.8 among the 200 most likely tokens); 0 is greedy.
TEMPERATURE, TOP_K = 0.8, 200
# The sample a run prints at its end: a prompt from the start of the held-out text,
# continued as a quick look at the model (not an evaluation), the same each run.
END_PROMPT_TOKENS = 16
END_TEMPERATURE, END_TOP_K, END_SEED = 0.8, 40, 0


REPLACEMENT = "\ufffd".encode()  # what a byte codec decodes an id past 255 as


@dataclasses.dataclass(frozen=True)
class Codec:
    """Text to token ids and back: UTF-8 bytes, or a ``tokenizers.Tokenizer``.

    Examples:
        >>> codec = Codec(BYTES)
        >>> codec.encode("hé"), codec.decode([104, 195, 169])
        ([104, 195, 169], 'hé')
    """

    name: str  # "bytes" or the tokenizer file's path
    tokenizer: Any = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``: a broken UTF-8 character, or an id past a byte's, becomes
        U+FFFD; a tokenizer's special tokens (``<|endoftext|>``) are kept."""
        ids = [int(token) for token in tokens]
        if self.tokenizer is None:
            parts = (bytes([i]) if 0 <= i < 256 else REPLACEMENT for i in ids)
            return b"".join(parts).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def find_codec(recorded: str | None, places: Sequence[str], given: str | None = None) -> Codec:
    """The corpus's tokenizer: ``given`` (``bytes`` or a file), else the one its
    ``tokens.json`` records (``recorded``), as a path or by its name in ``places``.

    Raises:
        UsageError: no tokenizer recorded or found, or a file that is not one.

    Examples:
        >>> find_codec("bytes", []).encode("hé")
        [104, 195, 169]
        >>> find_codec("tokenizer.json", [tmp])
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: the corpus's tokenizer tokenizer.json is not found (looked ...
    """
    if (given or recorded) == BYTES:
        return Codec(BYTES)
    if given is not None:
        return _load_tokenizer(given)
    if recorded is None:
        raise UsageError(
            "the corpus records no tokenizer; pass --tokenizer PATH/tokenizer.json, or bytes"
        )
    name = os.path.basename(recorded)
    for path in [recorded, *(os.path.join(place, name) for place in places)]:
        if os.path.isfile(path):
            return _load_tokenizer(path)
    looked = ", ".join(dict.fromkeys(os.path.abspath(place) for place in places)) or "nowhere"
    raise UsageError(
        f"the corpus's tokenizer {recorded} is not found (looked beside the corpus and the "
        f"checkpoint: {looked}); pass --tokenizer PATH/tokenizer.json"
    )


def _load_tokenizer(path: str) -> Codec:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"{path} needs tokenizers: pip install tokenizers") from None
    if not os.path.isfile(path):
        raise UsageError(f"tokenizer file {path} {not_there(path)}; give a tokenizer.json or bytes")
    try:
        return Codec(os.path.abspath(path), Tokenizer.from_file(path))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise UsageError(f"{path}: not a tokenizer.json ({reason}); give one or bytes") from None


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A language model and its tokenizer: text in, its continuation out.

    Attributes:
        module: the `GPT` the parameters make.
        params: its parameters.
        codec: the corpus's tokenizer.
        vocab_size: the data's vocabulary (the model's may be padded beyond it).

    Examples:
        >>> gpt = jdp.models.GPT(vocab_size=256, width=16, heads=2, layers=1, hidden=32,
        ...                      max_len=16)
        >>> params = jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        >>> sampler = Sampler(gpt, params, Codec(BYTES), vocab_size=256)
        >>> sampler.continue_tokens(Codec(BYTES).encode("Hi"), max_new_tokens=3).shape
        (3,)
    """

    module: GPT
    params: Any
    codec: Codec
    vocab_size: int

    def continue_tokens(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> np.ndarray:
        """The ids of ``max_new_tokens`` new tokens after the ids ``prompt`` (see `generate`)."""
        ids = np.asarray(prompt, np.int64)
        if not ids.size:
            raise UsageError("the prompt is empty; give some text to continue")
        if not 0 <= seed < 2**32:  # a key's seed, as --seed of a run
            raise UsageError(f"--seed must be in [0, 2**32), got {seed}")
        if ids.max() >= self.vocab_size:
            raise UsageError(
                f"the prompt has token {int(ids.max())}, beyond the model's vocabulary of "
                f"{self.vocab_size}; give the corpus's tokenizer (--tokenizer)"
            )
        tokens = generate(
            self.module,
            self.params,
            ids.astype(np.int32)[None],
            max_new_tokens=max_new_tokens,
            rng=jax.random.key(seed),
            temperature=temperature,
            top_k=top_k,
            vocab_size=self.vocab_size,
        )
        return np.asarray(tokens[0])

    def sample(
        self,
        prompt: str,
        *,
        max_new_tokens: int = DEFAULT_NEW_TOKENS,
        temperature: float = TEMPERATURE,
        top_k: int | None = TOP_K,
        seed: int = 0,
    ) -> str:
        """The text the model continues ``prompt`` with: ``max_new_tokens`` tokens drawn
        at ``temperature`` (0: greedy) among the ``top_k`` most likely (None: all), from
        ``seed``; past the model's context each is read from its last ``max_len``
        tokens, as nanoGPT samples."""
        ids = self.codec.encode(prompt)
        tokens = self.continue_tokens(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
        )
        return self.codec.decode(tokens)


def load_sampler(
    path: str | os.PathLike, step: str | int = "latest", *, tokenizer: str | None = None
) -> Sampler:
    """The language model of a checkpoint (a ``--ckpt-dir`` or a step directory) with
    its corpus's tokenizer (``tokenizer``: ``bytes`` or a tokenizer.json instead).

    Raises:
        UsageError: not a checkpoint, not a language model trained on a token corpus,
            or no tokenizer found.

    Examples:
        With a ``--ckpt-dir`` of a run: ``load_sampler("runs/gpt").sample("def ",
        max_new_tokens=32, temperature=0.8, top_k=40)``; elsewhere, one line:

        >>> load_sampler(tmp)
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: no checkpoint in ...; pass a --ckpt-dir or one of its step ...
    """
    loaded = load_model(path, step)
    settings = RunSettings(loaded.config)
    data = settings.data
    check_language_model(loaded.config)
    places = [corpus_directory(settings.dataset), os.fspath(path)]
    codec = find_codec(data.get("tokenizer"), [p for p in places if p], tokenizer)
    module = gpt_for(loaded.params, epsilon=epsilon_of(settings))
    vocab = int(data.get("vocab_size") or module.vocab_size)
    check_codec(codec, data.get("tokenizer"), vocab)
    return Sampler(module, loaded.params, codec, vocab)


def check_codec(codec: Codec, recorded: str | None, vocab: int) -> None:
    """Refuses bytes given for a corpus of more ids than bytes that did not record them
    (most of its ids would decode as U+FFFD).

    Examples:
        >>> check_codec(Codec(BYTES), "tokenizer.json", 50257)
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: --tokenizer bytes reads ids 0-255, and this model's corpus ...
    """
    if codec.name == BYTES and recorded != BYTES and vocab > 256:
        raise UsageError(
            f"--tokenizer bytes reads ids 0-255, and this model's corpus has {vocab:,}; "
            "pass its tokenizer.json, or leave --tokenizer out to find the one it recorded"
        )


def epsilon_of(settings: RunSettings) -> float:
    """The LayerNorms' epsilon of a recorded run's gpt: its weights' (GPT-2's: 1e-5)."""
    return settings.architecture.get("epsilon", EPSILON)


def check_language_model(config: dict, *, to: str = "sample from") -> None:
    """Refuses a recorded config that is not a language model trained on a token corpus
    (your own model on one passes: its parameters must then be a `GPT`'s); the line says
    what to ``to`` instead.

    Examples:
        >>> check_language_model({"model": "mlp", "data": {"kind": "image"}})
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: the checkpoint holds --model mlp, not a language model; ...
    """
    settings = RunSettings(config)
    model, kind = settings.model, settings.data.get("kind")
    if kind == "text" and (model == "gpt" or model.startswith("yours")):
        return
    where = f"{to} a gpt trained on a token corpus (--dataset tokens:DIR or python_stdlib)"
    if kind is None:
        raise UsageError(f"the checkpoint records no data facts (an older jdp wrote it); {where}")
    if kind == "sequence":
        raise UsageError(
            f"the checkpoint's {model} was trained on sequence pairs (numbers2words), which "
            f"have no text tokenizer; decode them with jdp.models.translate, or {where}"
        )
    what = "your own model" if model.startswith("yours") else f"--model {model}"
    raise UsageError(f"the checkpoint holds {what}, not a language model; {where}")


def corpus_directory(dataset: str) -> str | None:
    """The directory of ``tokens:PATH``'s corpus (its ``tokens.json``), or None."""
    if not dataset.startswith(TOKENS_PREFIX):
        return None
    path = dataset[len(TOKENS_PREFIX) :]
    return path if os.path.isdir(path) else os.path.dirname(path) or "."


def sample_line(
    params: Any, splits: dict[str, TokenSplit | None], *, epsilon: float = EPSILON
) -> str | None:
    """A run's closing sample, ``jdp: sample: "PROMPT" -> "CONTINUATION"`` (newlines
    escaped): the first tokens of the held-out split (validation, else test, else
    train), continued at temperature 0.8 among the 40 most likely tokens, seed 0,
    up to the corpus's end of a document (its ``eos_id``), if one is drawn.
    None when the corpus's tokenizer is not found. ``epsilon``: the model's LayerNorms'.

    Raises:
        UsageError: parameters that this process cannot read whole (sharded over processes).

    Examples:
        >>> from jdp.data.formats import write_llmc, write_meta
        >>> write_llmc(f"{tmp}/text_val_000000.bin", np.frombuffer(b"Hello! " * 9, np.uint8))
        >>> write_meta(tmp, {"vocab_size": 256, "tokenizer": "bytes"})
        >>> gpt = jdp.models.GPT(vocab_size=256, width=16, heads=2, layers=1, hidden=32,
        ...                      max_len=16)
        >>> params = jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        >>> print(sample_line(params, jdp.data.formats.tokens.corpus(tmp, seq_len=16)))
        jdp: sample: "Hell" -> "..."
    """
    split = next(s for s in (splits.get(n) for n in ("validation", "test", "train")) if s)
    try:
        codec = find_codec(split.tokenizer, [os.path.dirname(split.shards[0].path)])
    except UsageError:
        return None  # a corpus without its tokenizer: nothing to decode with
    module = gpt_for(params, epsilon=epsilon)
    sampler = Sampler(module, jax.tree.map(_local, params), codec, split.vocab_size)
    length = min(END_PROMPT_TOKENS, module.max_len // 4, split.seq_len)
    prompt = split.read(np.array([0]))["tokens"][0, : max(1, length)]
    tokens = sampler.continue_tokens(
        prompt,
        max_new_tokens=min(DEFAULT_NEW_TOKENS, module.max_len - len(prompt)),
        temperature=END_TEMPERATURE,
        top_k=END_TOP_K,
        seed=END_SEED,
    )
    eos = getattr(split, "eos_id", None)
    if eos is not None and eos in tokens:  # the document ends there: no raw <|endoftext|>
        tokens = tokens[: list(tokens).index(eos)]
    quoted = [json.dumps(codec.decode(ids), ensure_ascii=False) for ids in (prompt, tokens)]
    return f"jdp: sample: {quoted[0]} -> {quoted[1]}"


def _local(leaf) -> np.ndarray:
    """A parameter whole in this process's memory: its value, or its local replica."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return np.asarray(leaf)
    if leaf.is_fully_replicated:
        return np.asarray(leaf.addressable_data(0))
    raise UsageError(
        "the parameters are sharded over processes; sample from the checkpoint with "
        "python -m jdp.sample CKPT_DIR"
    )
