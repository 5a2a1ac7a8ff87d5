"""A run's splits checked once, on the host, before the model is built: wrong data is
named, never trained on.

Every split a run has (train, validation, test) must hold examples; each integer
label must be a class of the training split (``0 .. num_classes - 1``); float
inputs must be finite; and every split's features must have the training
split's shape per example and kind of number. A split read from disk as it
trains (a token corpus) is checked by its reader instead, window by window. Each
problem is one `UsageError` naming the split, the example and the value.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jdp.errors import UsageError

# Float inputs are checked this many values at a time: the check's temporaries stay
# small whatever the split's size.
_CHUNK_VALUES = 1 << 22


def check_splits(splits: Mapping[str, object | None]) -> None:
    """UsageError for the first problem in ``splits`` (``{"train": ..., "test": ...}``;
    None for a split the run does not have).

    Examples:
        >>> x = np.zeros((4, 2), np.float32)
        >>> train = jdp.data.from_arrays(x, np.array([0, 1, 2, 1]))
        >>> test = jdp.data.from_arrays(x, np.array([0, 1, 3, 1]))
        >>> jdp.data.check_splits({"train": train, "test": test})
        Traceback (most recent call last):
        ...
        jdp.errors.UsageError: label 3 of example 2 of the test split is not a class of ...
    """
    present = {name: split for name, split in splits.items() if split is not None}
    for name, split in present.items():
        if not len(split):
            raise UsageError(f"the {name} split has no examples; {_fill(name)}")
    train = present.get("train")
    reference = in_memory(train) if train is not None else None
    classes = getattr(train, "num_classes", None)
    if reference is not None and classes:
        _check_sparse(reference.get(getattr(train, "label_key", None)), classes)
    for name, split in present.items():
        arrays = in_memory(split)
        if arrays is None:  # read from disk as it trains
            continue
        _check_labels(name, arrays.get(getattr(split, "label_key", None)), classes)
        for key, array in arrays.items():
            _check_finite(name, key, array)
        if reference is not None and split is not train:
            _check_shapes(name, arrays, reference)


def check_batch(
    name: str, arrays: Mapping[str, np.ndarray], label_key: str | None, classes: int | None
) -> None:
    """One batch's labels and float inputs, as `check_splits` checks a split's (a batch of
    a stream, read as training goes: ``name`` says which)."""
    _check_labels(name, arrays.get(label_key) if label_key else None, classes)
    for key, array in arrays.items():
        _check_finite(name, key, array)


def _fill(name: str) -> str:
    if name == "train":
        return "give it examples (a folder of images, arrays with rows, a prepared dataset)"
    return f"give the {name} split examples, or leave it out"


def in_memory(split) -> dict[str, np.ndarray] | None:
    """The split's arrays by feature name when it holds them in memory."""
    features = getattr(split, "features", None)
    if isinstance(features, Mapping):  # your own arrays (ArraySplit)
        return dict(features)
    if hasattr(split, "image") and hasattr(split, "label"):  # a built-in image split
        return {"image": split.image, "label": split.label}
    if hasattr(split, "source") and hasattr(split, "target"):  # numbers2words
        return {"source": split.source, "target": split.target}
    return None


def _check_labels(name: str, labels: np.ndarray | None, classes: int | None) -> None:
    if labels is None or not len(labels):
        return
    if classes is None:
        bad = np.flatnonzero(labels < 0)
        known = "labels are class indices from 0"
    else:
        bad = np.flatnonzero((labels < 0) | (labels >= classes))
        known = (
            f"its labels are 0 to {classes - 1}, num_classes {classes}"
            if classes > 0
            else "it has no classes"
            if classes == 0
            else "labels are class indices from 0"  # counted from labels all below 0
        )
    if len(bad):
        index = int(bad[0])
        of = "a class of the training split" if classes is not None else "a class"
        raise UsageError(
            f"label {int(labels[index])} of example {index} of the {name} split is not {of} "
            f"({known}); {len(bad)} label(s) are outside: relabel them as class indices, "
            "leave those examples out, or give num_classes"
        )


# A classifier over more classes than this is built only for labels that use them.
MANY_CLASSES = 1 << 16


def _check_sparse(labels: np.ndarray | None, classes: int) -> None:
    """UsageError for labels that are ids, not class indices: a few values that run to a
    huge number, which would make an output layer of that many classes."""
    if labels is None or classes <= MANY_CLASSES:
        return
    used = len(np.unique(labels))
    if used * 100 < classes:
        raise UsageError(
            f"the training split's labels run to {int(labels.max())} (num_classes {classes}) "
            f"but take {used} values: a classifier would have {classes:,} outputs; number "
            "the classes 0 to K-1 (np.unique(labels, return_inverse=True))"
        )


def _check_finite(name: str, key: str, array: np.ndarray) -> None:
    if array.dtype.kind not in "fc" or not array.size:
        return
    rows = max(1, _CHUNK_VALUES // max(1, array[0].size))
    for start in range(0, len(array), rows):
        chunk = array[start : start + rows]
        finite = np.isfinite(chunk)
        if finite.all():
            continue
        row = start + int(np.flatnonzero(~finite.reshape(len(chunk), -1).all(1))[0])
        value = array[row][~np.isfinite(array[row])].flat[0]
        raise UsageError(
            f"example {row} of the {name} split has {value} in {key!r}; inputs must be "
            "finite: repair or drop that example"
        )


def _check_shapes(
    name: str, arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]
) -> None:
    for key, array in arrays.items():
        if key not in reference:
            continue
        want = reference[key]
        if array.shape[1:] != want.shape[1:]:
            raise UsageError(
                f"{key!r} of the {name} split is {_shape(array)} per example and the training "
                f"split's is {_shape(want)}; give every split examples of one shape (resize "
                "the images, or pad the sequences, alike)"
            )
        if _kind(array) != _kind(want):
            raise UsageError(
                f"{key!r} of the {name} split holds {array.dtype} and the training split's "
                f"{want.dtype}; give every split the same kind of numbers"
            )


def _shape(array: np.ndarray) -> str:
    return "x".join(map(str, array.shape[1:])) or "a scalar"


def _kind(array: np.ndarray) -> str:
    """Integers, floats or other: a uint8 and an int32 label are both class indices."""
    kind = array.dtype.kind
    return "integer" if kind in "iub" else "float" if kind in "fc" else kind
