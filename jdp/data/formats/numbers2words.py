"""The reference Transformer's toy task, generated: digits to words, ``123 -> one two three``.

No download: the examples are drawn from a seed. A number has 1 to ``max_digits``
digits (the length drawn uniformly, then the digits; no leading zero). The
distinct numbers drawn are shuffled and dealt to train first and test after, so
the two splits never share a number and follow the same distribution (short
numbers are few: there are only 10 of one digit). Sources are digit tokens,
targets ``<bos> words <eos>``, both padded with ``<pad>`` (token 0) to fixed
lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPECIALS = ("<pad>", "<bos>", "<eos>")
VOCAB = SPECIALS + tuple("0123456789") + WORDS
PAD, BOS, EOS = 0, 1, 2
_DIGIT, _WORD = len(SPECIALS), len(SPECIALS) + 10

SIZES = {"train": 20_000, "test": 2_000}


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """One split of token pairs in host memory: ``source`` and ``target``, int32, padded.

    The loader reads it as it reads an image `Split`: ``read(indices)`` returns the
    batch's rows; there is nothing to preprocess.
    """

    source: np.ndarray
    target: np.ndarray
    vocab: tuple[str, ...]
    kind = "sequence"
    transform = None
    map = None
    input_key, label_key = "source", None
    pad, bos, eos = PAD, BOS, EOS

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"source": self.source[indices], "target": self.target[indices]}

    def take(self, indices: np.ndarray) -> SequenceSplit:
        """The split of these examples, in this order."""
        return dataclasses.replace(self, **self.read(indices))

    def decode(self, tokens: np.ndarray) -> str:
        """Tokens to text, without ``<pad>``, ``<bos>`` and anything from ``<eos>`` on."""
        words = []
        for token in np.asarray(tokens).tolist():
            if token == EOS:
                break
            if token not in (PAD, BOS):
                words.append(self.vocab[token])
        return " ".join(words)


def _draw_numbers(rng: np.random.Generator, count: int, max_digits: int) -> np.ndarray:
    """``count`` distinct numbers, in random order."""
    capacity = sum(9 * 10 ** (n - 1) + (n == 1) for n in range(1, max_digits + 1))
    if count > capacity:
        raise ValueError(f"only {capacity} numbers have at most {max_digits} digits")
    seen: dict[int, None] = {}
    while len(seen) < count:
        lengths = rng.integers(1, max_digits + 1, size=count)
        low = np.where(lengths == 1, 0, 10 ** (lengths - 1))
        numbers = rng.integers(low, 10**lengths)
        for number in numbers.tolist():
            seen.setdefault(number, None)
    return rng.permutation(np.fromiter(seen, np.int64, count=len(seen))[:count])


def encode(numbers: np.ndarray, max_digits: int) -> tuple[np.ndarray, np.ndarray]:
    """Numbers to padded ``(source, target)`` token arrays."""
    source = np.full((len(numbers), max_digits), PAD, np.int32)
    target = np.full((len(numbers), max_digits + 2), PAD, np.int32)
    for row, number in enumerate(numbers.tolist()):
        digits = [int(d) for d in str(number)]
        source[row, : len(digits)] = [_DIGIT + d for d in digits]
        target[row, : len(digits) + 2] = [BOS, *(_WORD + d for d in digits), EOS]
    return source, target


def generate(split: str, *, seed: int = 0, max_digits: int = 7) -> SequenceSplit:
    """The ``train`` (20,000 numbers) or ``test`` (2,000) split drawn from ``seed``."""
    if split not in SIZES:
        raise KeyError(split)
    numbers = _draw_numbers(np.random.default_rng(seed), sum(SIZES.values()), max_digits)
    boundary = SIZES["train"]
    numbers = numbers[:boundary] if split == "train" else numbers[boundary:]
    return SequenceSplit(*encode(numbers, max_digits), vocab=VOCAB)
