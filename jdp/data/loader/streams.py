"""Data in the form you hold it: any indexable source of examples, or any iterable of
batches, into `jdp.fit`.

An indexable source (`from_indexable`: a Hugging Face ``datasets.Dataset``, a Grain
``MapDataset``, anything with ``len()`` and ``source[i]`` giving one example as a
dict) is read in jdp's order: the batch of step ``s`` is a function of ``(seed,
s)``, so every promise of a split holds (any mesh or process count, an exact
resume).

An iterable of batches (`from_batches`: a generator function, a list, a Grain
``IterDataset``, a ``tf.data.Dataset``, a PyTorch ``DataLoader``; each item a dict
of arrays of one global batch) is read in your order, for training only. Every
process reads the same batches and keeps its own rows. The promise is weaker, and
exactly this: a checkpoint records how many batches were taken, and a resumed run
iterates the source again from its beginning and skips that many; the run goes on
exactly when the source gives the same batches each time it is iterated (a list,
a seeded generator, a dataset without shuffling or with a fixed seed). When the
source ends, it is iterated again, as a next epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from jdp.data.formats.transforms import Transform
from jdp.data.splits.checks import check_batch
from jdp.errors import UsageError


@dataclasses.dataclass(frozen=True, eq=False)
class IndexedSplit:
    """An indexable source's examples, read by index in jdp's order (`from_indexable`)."""

    source: Any
    input_key: str = "image"
    label_key: str | None = "label"
    num_classes: int | None = None
    transform: Transform | None = None
    classes: tuple[str, ...] | None = None
    kind = "image"
    map = None

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = [int(i) for i in np.asarray(indices).reshape(-1)]
        try:  # columnar sources (Hugging Face datasets) read many rows in one call
            rows = self.source[indices]
        except Exception:
            rows = None
        if isinstance(rows, Mapping):
            return {key: np.asarray(value) for key, value in rows.items()}
        examples = [self.source[i] for i in indices]
        if not examples:
            return {}
        return {key: np.stack([np.asarray(e[key]) for e in examples]) for key in examples[0]}


def from_indexable(
    source: Any,
    *,
    input_key: str = "image",
    label_key: str | None = "label",
    num_classes: int | None = None,
    transform: Transform | None = None,
) -> IndexedSplit:
    """A split of ``source[i]`` (a dict per example) for ``i`` below ``len(source)``, read
    in jdp's order with all a split's guarantees.

    ``num_classes`` defaults to the largest label + 1 (read once, here).

    Examples:
        >>> examples = [{"image": np.full(3, i, np.float32), "label": i % 2} for i in range(10)]
        >>> split = jdp.data.from_indexable(examples)
        >>> len(split), split.num_classes, split.read(np.array([4, 1]))["label"].tolist()
        (10, 2, [0, 1])
    """
    if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
        raise UsageError(
            f"from_indexable: a {type(source).__name__} has no len() and [i]; give an "
            "iterable of batches to jdp.data.from_batches instead"
        )
    split = IndexedSplit(source, input_key, label_key, num_classes, transform)
    if label_key is not None and num_classes is None and len(source):
        labels = split.read(np.arange(len(source)))[label_key]
        split = dataclasses.replace(split, num_classes=int(labels.max()) + 1)
    return split


@dataclasses.dataclass(frozen=True, eq=False)
class BatchStream:
    """An iterable of global batches, read in its own order (`from_batches`)."""

    source: Any  # an iterable, or a function returning a fresh iterator
    input_key: str = "image"
    label_key: str | None = "label"
    num_classes: int | None = None
    transform: Transform | None = None
    classes = None
    kind = "image"
    map = None

    def passes(self) -> Iterator[dict[str, np.ndarray]]:
        """The source's batches as NumPy dicts, pass after pass (UsageError if a pass
        after the first is empty: a one-shot iterator, or a source that ran dry)."""
        taken = 0
        while True:
            before = taken
            for item in self.source() if callable(self.source) else self.source:
                taken += 1
                yield as_arrays(item, taken)
            if taken == before:
                raise UsageError(
                    f"the batches ran out after {taken}: a one-shot iterator cannot be read "
                    "again; give a list, a dataset, or a function that returns a fresh "
                    "iterator (jdp.data.from_batches(lambda: my_batches()))"
                    if taken
                    else "the batches are empty: the source gave none"
                )

    def first(self) -> dict[str, np.ndarray]:
        """The first batch (for shapes, the batch size and the model's init)."""
        return next(self.passes())

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows of the first batch, for what reads a split only for its shapes."""
        return {key: value[np.asarray(indices) % len(value)] for key, value in self.first().items()}

    def __len__(self) -> int:
        return len(next(iter(self.first().values())))  # at least a batch: never empty


def from_batches(
    source: Iterable | Callable[[], Iterable],
    *,
    input_key: str = "image",
    label_key: str | None = "label",
    num_classes: int | None = None,
    transform: Transform | None = None,
) -> BatchStream:
    """A training split of your own batches, in your order (see the module for what a
    resume promises): each item a dict of arrays (NumPy, or anything ``np.asarray``
    reads: a ``tf.Tensor``, a CPU ``torch.Tensor``) of one global batch.

    ``num_classes`` defaults to the first batch's largest label + 1: give it when a
    batch may lack classes.

    Examples:
        >>> def batches():
        ...     rng = np.random.default_rng(0)
        ...     for _ in range(3):
        ...         yield {"image": rng.normal(size=(16, 4)), "label": rng.integers(0, 3, 16)}
        >>> stream = jdp.data.from_batches(batches, num_classes=3)
        >>> stream.first()["image"].shape
        (16, 4)
    """
    stream = BatchStream(source, input_key, label_key, num_classes, transform)
    if label_key is not None and num_classes is None:
        stream = dataclasses.replace(stream, num_classes=int(stream.first()[label_key].max()) + 1)
    return stream


def as_arrays(item: Any, number: int) -> dict[str, np.ndarray]:
    """A batch as a dict of NumPy arrays, all of one number of rows."""
    if not isinstance(item, Mapping):
        raise UsageError(f"batch {number} is a {type(item).__name__}; give dicts of arrays")
    arrays = {str(key): np.asarray(value) for key, value in item.items()}
    rows = {len(value) if value.ndim else -1 for value in arrays.values()}
    if len(rows) != 1 or -1 in rows:
        raise UsageError(
            f"batch {number}'s arrays differ in rows or are scalars; give one "
            "row per example in each"
        )
    return arrays


def stream_rows(
    stream: BatchStream, *, start: int, batch_size: int, rows: slice
) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of each batch from batch ``start`` on (the ones before read and
    passed over), preprocessed; UsageError for a batch of another size."""
    for number, batch in enumerate(stream.passes()):
        size = len(next(iter(batch.values())))
        if size != batch_size:
            raise UsageError(
                f"batch {number + 1} has {size} rows and the global batch is {batch_size}; "
                "give batches of --batch-size rows (drop a last, partial one)"
            )
        if number < start:
            continue
        check_batch(
            f"batch {number + 1} of the stream", batch, stream.label_key, stream.num_classes
        )
        batch = {key: value[rows] for key, value in batch.items()}
        if stream.transform is not None:
            batch[stream.input_key] = stream.transform(batch[stream.input_key])
        yield batch
