"""Host batches by step: this process's rows of a global batch, read and preprocessed.

The determinism the loader promises (`jdp.data.loader.pipeline`) is kept here: a
training step's example indices depend on ``(seed, step)`` alone
(`global_batch_indices`), its augmentation and ``map`` draws on ``(seed, step)``
and each row's place in the global batch, never on the devices or processes;
each process then reads only its own ``rows``. An evaluation batch is the
split's next examples in order, the last one padded and marked by ``mask``.

The readers are plain picklable callables (a step or batch number -> a dict of
NumPy arrays), so Grain can run them in worker processes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jdp.data.splits.ledger import LEDGER_KEY
from jdp.data.splits.ledger import marks as ledger_marks
from jdp.data.splits.sources import Split
from jdp.errors import UsageError
from jdp.mesh import MASK_KEY

# Mixed into the augmentation seeds so their streams never coincide with an epoch order's.
_AUGMENT_STREAM = 0x61756780
_MAP_STREAM = 0x6D617080


def map_examples(fn: Callable, batch: dict[str, np.ndarray], rngs: list) -> dict[str, np.ndarray]:
    """``fn(example, rng)`` on each row of ``batch``, the results stacked back into a batch."""
    rows = len(next(iter(batch.values())))
    examples = [
        fn({name: value[row] for name, value in batch.items()}, rngs[row]) for row in range(rows)
    ]
    if not examples:
        return batch
    return {name: np.stack([example[name] for example in examples]) for name in examples[0]}


# Two epochs: the most one global batch straddles. A corpus of 4.3 million windows
# makes each 17 MB (uint32).
@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The order of the split in one epoch: a pure function of ``(seed, epoch)``."""
    order = np.random.default_rng((seed, epoch)).permutation(num_examples)
    if num_examples <= np.iinfo(np.uint32).max:
        order = order.astype(np.uint32)  # the same order in half the memory
    order.flags.writeable = False  # cached: shared by every caller
    return order


def global_batch_indices(seed: int, step: int, batch_size: int, num_examples: int) -> np.ndarray:
    """Example indices of step ``step``'s global batch (may straddle two epochs)."""
    return _stream(seed, step * batch_size, (step + 1) * batch_size, num_examples)


def _stream(seed: int, start: int, stop: int, num_examples: int) -> np.ndarray:
    """Examples ``start .. stop - 1`` of the run's stream: the epochs' orders end to end.
    Steps ``s .. s + k - 1`` are one stretch of it, read in one go."""
    parts = []
    for epoch in range(start // num_examples, (stop - 1) // num_examples + 1):
        order = epoch_permutation(seed, epoch, num_examples)
        first = epoch * num_examples
        parts.append(order[max(start - first, 0) : min(stop - first, num_examples)])
    return np.concatenate(parts)


class TrainReader:
    """Step -> this process's rows of that step's global batch, preprocessed and augmented.

    A plain picklable callable, so Grain can run it in worker processes. With
    ``ledger`` ``indices`` or ``bytes`` each batch carries its rows' digests under
    `jdp.data.splits.ledger.LEDGER_KEY`, for the loader to take out (`jdp.data.splits.ledger`).
    """

    def __init__(
        self, split: Split, *, batch_size: int, seed: int, rows: slice, ledger: str = "off"
    ):
        self.split, self.batch_size, self.seed, self.rows = split, batch_size, seed, rows
        self.ledger = ledger

    def indices(self, step: int) -> np.ndarray:
        """The example indices this process reads at ``step``."""
        return global_batch_indices(self.seed, step, self.batch_size, len(self.split))[self.rows]

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        return self.steps(step, 1)[0]

    def draw(self, step: int):
        """The augmentation's random choices for this process's rows at ``step``."""
        rng = np.random.default_rng((self.seed, step, _AUGMENT_STREAM))
        return self.split.transform.draw(rng, self.batch_size).take(self.rows)

    def steps(self, first: int, count: int) -> list[dict[str, np.ndarray]]:
        """The batches of ``count`` steps from ``first``, read and preprocessed in bulk.

        One gather and one vectorised transform for all of them: the per-batch
        cost of a small batch is mostly fixed overhead, which this pays once.
        The result is the same as ``count`` single calls.
        """
        steps = range(first, first + count)
        size = self.batch_size
        stream = _stream(self.seed, first * size, (first + count) * size, len(self.split))
        indices = stream.reshape(count, size)[:, self.rows]  # this process's rows of each
        batch = self.split.read(indices.reshape(-1))
        marks = None
        if self.ledger != "off":  # over the rows as read, before any augmentation
            marks = ledger_marks(
                first + 1,
                size,
                self.rows,
                stream.reshape(count, size),
                batch if self.ledger == "bytes" else None,
            )
        transform = self.split.transform
        if transform is not None:  # token sequences have nothing to preprocess
            augmentation = None
            if transform.augments:
                draws = [self.draw(step) for step in steps]
                augmentation = type(draws[0])(  # an Augmentation, or an image split's Crops
                    *(np.concatenate(parts) for parts in zip(*draws, strict=True))
                )
            batch[self.split.input_key] = transform(batch[self.split.input_key], augmentation)
        if self.split.map is not None:
            places = np.arange(self.batch_size)[self.rows]  # in the global batch
            rngs = [
                np.random.default_rng((self.seed, step, int(place), _MAP_STREAM))
                for step in steps
                for place in places
            ]
            batch = map_examples(self.split.map, batch, rngs)
        rows = indices.shape[1]
        batches = [
            {key: value[i * rows : (i + 1) * rows] for key, value in batch.items()}
            for i in range(count)
        ]
        if marks is not None:
            for one, mark in zip(batches, marks, strict=True):
                one[LEDGER_KEY] = mark
        return batches


class ChunkedReader:
    """Call ``i`` -> the list of batches of steps ``start + i*steps .. + steps - 1``.

    Bad data in a chunk (a token outside the vocabulary, an image cut short) is met at
    its own step: the chunk's batches before it come first, and the next call raises
    it, so the steps before it train and their state can be saved."""

    def __init__(self, reader: TrainReader, *, steps: int, start: int):
        self.reader, self.steps, self.start = reader, steps, start
        self._bad: UsageError | None = None

    def __call__(self, call: int) -> list[dict[str, np.ndarray]]:
        return self.read(self.start + call * self.steps, self.steps)

    def read(self, first: int, count: int) -> list[dict[str, np.ndarray]]:
        """The batches of steps ``first .. first + count - 1``; those before bad data, which
        the next read raises."""
        if self._bad is not None:
            raise self._bad
        try:
            return self.reader.steps(first, count)
        except UsageError:
            good = []
            for step in range(first, first + count):
                try:
                    good += self.reader.steps(step, 1)
                except UsageError as bad:
                    self._bad = bad
                    break
            if not good:
                raise
            return good


class EvalReader:
    """Batch number -> this process's rows of that padded eval batch, with ``mask``.

    Padding rows repeat example 0 and carry ``mask`` 0, so an eval step that sums
    masked values counts every example exactly once.
    """

    def __init__(self, split: Split, *, batch_size: int, rows: slice):
        self.split, self.batch_size, self.rows = split, batch_size, rows

    def __len__(self) -> int:
        return -(-len(self.split) // self.batch_size)

    def __call__(self, number: int) -> dict[str, np.ndarray]:
        indices = np.arange(number * self.batch_size, (number + 1) * self.batch_size)
        real = indices < len(self.split)
        batch = self.split.read(np.where(real, indices, 0)[self.rows])
        if self.split.transform is not None:
            batch[self.split.input_key] = self.split.transform(batch[self.split.input_key])
        if self.split.map is not None:
            batch = map_examples(self.split.map, batch, [None] * len(real[self.rows]))
        batch[MASK_KEY] = real[self.rows].astype(np.float32)
        return batch


@dataclasses.dataclass(frozen=True)
class CallBounds:
    """The steps at which a run acts between its calls, which no call crosses: every
    multiple of each of ``periods`` (0: none) and each of ``points``."""

    periods: tuple[int, ...] = ()
    points: tuple[int, ...] = ()

    def ahead(self, step: int) -> int | None:
        """The steps from ``step`` to the next bound after it; None where none comes."""
        gaps = [(step // period + 1) * period - step for period in self.periods if period > 0]
        return min(gaps + [point - step for point in self.points if point > step], default=None)


NO_BOUNDS = CallBounds()


def call_steps(step: int, steps: int, bounds: CallBounds = NO_BOUNDS) -> int:
    """The steps of the call after ``step`` in a run of ``steps`` steps a call: all of them,
    unless one of ``bounds`` comes sooner; then a shorter call closes the gap up to it."""
    ahead = bounds.ahead(step)
    return steps if ahead is None else min(steps, ahead)


def calls_from(
    start: int, stop: int, steps: int, bounds: CallBounds = NO_BOUNDS
) -> Iterator[tuple[int, int]]:
    """``(first step, steps)`` of each call from step ``start`` until one reaches ``stop``,
    as `call_steps` makes them (the step after ``first`` is the call's first)."""
    while start < stop:
        ran = call_steps(start, steps, bounds)
        yield start, ran
        start += ran


@jax.tree_util.register_pytree_node_class
class Singles(list):
    """A chunk's batches of one step a call each (`StackedReader`), not stacks of one; a
    tree of them to JAX (and to Grain's copy into shared memory)."""

    def tree_flatten(self) -> tuple[list, None]:
        return list(self), None

    @classmethod
    def tree_unflatten(cls, _, children) -> Singles:
        return cls(children)


def item_steps(item) -> int:
    """The steps of a `StackedReader`'s item of stacks (of a chunk's first: its calls are alike)."""
    first = item[0] if isinstance(item, list) else item
    return len(next(iter(first.values())))


class StackedReader:
    """Chunk ``i`` -> its calls' batches, ``steps`` steps a call stacked on axis 0, from step
    ``start``: with ``calls`` > 1, the list of up to that many calls' stacks, read at once.

    Where one of ``bounds`` falls inside a call, a shorter call closes the gap up to it
    (`call_steps`): a chunk holds calls of one length, and a chunk of one-step calls is
    `Singles`, its batches unstacked. Bad data gives the whole
    calls before it, then raises at the next read."""

    def __init__(
        self,
        reader: TrainReader,
        *,
        steps: int,
        start: int,
        calls: int = 1,
        bounds: CallBounds = NO_BOUNDS,
    ):
        self.chunks = ChunkedReader(reader, steps=steps * calls, start=start)
        self.steps, self.calls = steps, calls
        self.bounds = bounds
        self._firsts = [start]  # the first step of each chunk planned so far

    def _plan(self, first: int) -> tuple[int, int]:
        """``(calls, steps a call)`` of the chunk from step ``first``."""
        length = call_steps(first, self.steps, self.bounds)
        calls = 1
        while calls < self.calls:
            if call_steps(first + calls * length, self.steps, self.bounds) != length:
                break
            calls += 1
        return calls, length

    def __call__(self, call: int) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
        while len(self._firsts) <= call:  # chunks are read in order: each planned once
            calls, length = self._plan(self._firsts[-1])
            self._firsts.append(self._firsts[-1] + calls * length)
        first = self._firsts[call]
        calls, length = self._plan(first)
        batches = self.chunks.read(first, calls * length)
        whole = len(batches) // length
        if not whole:  # bad data inside the first call: its error
            return self.chunks.read(first + len(batches), 1)
        if length == 1 and self.steps > 1:
            return Singles(batches)
        stacks = [
            {
                key: np.stack([batch[key] for batch in batches[i * length : (i + 1) * length]])
                for key in batches[0]
            }
            for i in range(whole)
        ]
        return stacks if self.calls > 1 else stacks[0]
