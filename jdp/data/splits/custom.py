"""Your own data, read into the same loader as the bundled datasets.

Three ways in, each returning an `ArraySplit` (named arrays in host memory):

- `from_arrays`: NumPy arrays, or a dict of them with any feature names;
- `from_tfds`: any TFDS dataset prepared as array_record, from the catalog or a
  builder of your own (its feature names are kept);
- `from_folder`: a folder of images with one subdirectory per class, decoded
  with Pillow.

On the command line, ``--dataset tfds:NAME`` and ``--dataset folder:PATH`` name
the last two, and ``--dataset npz:FILE`` a NumPy file of arrays named like
Keras's ``mnist.npz`` (`from_npz`; `load_named`). `holdout` sets a
seeded fraction of a split apart, as a validation split.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jdp.data.formats.builders import open_builder, read_builder_split
from jdp.data.formats.image_sources import (
    class_tree,
    from_images,
    from_tfds_images,
    streamed_image_key,
)
from jdp.data.formats.images import PACKED_META
from jdp.data.formats.npz import read_npz
from jdp.data.formats.transforms import Transform
from jdp.data.splits.checks import MANY_CLASSES
from jdp.data.splits.sources import DATASETS, ArraySplit, check_dataset, load_split
from jdp.errors import UsageError

# The prefixes of --dataset that name your own data.
TFDS_PREFIX, FOLDER_PREFIX, NPZ_PREFIX, IMAGES_PREFIX = "tfds:", "folder:", "npz:", "images:"
PREFIXES = (TFDS_PREFIX, FOLDER_PREFIX, NPZ_PREFIX, IMAGES_PREFIX)
# Mixed into a holdout's seed so its order never coincides with an epoch's.
_HOLDOUT_STREAM = 0x686F6C64


def from_arrays(
    features: np.ndarray | Mapping[str, np.ndarray],
    labels: np.ndarray | None = None,
    *,
    input_key: str | None = None,
    label_key: str | None = "label",
    num_classes: int | None = None,
    transform: Transform | None = None,
    map: Callable | None = None,
) -> ArraySplit:
    """A split of your NumPy arrays: ``from_arrays(x, y)`` or ``from_arrays({"name": array, ...})``.

    ``from_arrays(x, y)`` names them ``image`` and ``label`` (what `jdp.models.from_linen`
    and the built-in models read by default). A dict keeps its names; say which
    feature is the input (``input_key``, default ``image`` or the first
    non-label feature) and which the integer label (``label_key``, None for
    none). ``num_classes`` defaults to the largest label + 1. ``transform``
    preprocesses the input (``jdp.data.Transform()`` divides uint8 images by
    255); ``map(example, rng) -> example`` is your own per-example function
    (see `ArraySplit`).

    Examples:
        >>> x = np.random.default_rng(0).normal(size=(100, 5)).astype(np.float32)
        >>> split = jdp.data.from_arrays({"x": x, "y": (x[:, 0] > 0).astype(np.int32)},
        ...                              input_key="x", label_key="y")
        >>> len(split), split.num_classes, sorted(split.read(np.arange(2)))
        (100, 2, ['x', 'y'])
    """
    if num_classes is not None:
        num_classes = _class_count(num_classes)
    if labels is not None:
        if isinstance(features, Mapping):
            raise UsageError("from_arrays: give a dict of features, or inputs and labels")
        features = {"image": features, "label": labels}
        input_key, label_key = input_key or "image", "label"
    elif not isinstance(features, Mapping):
        raise UsageError("from_arrays: give labels with the inputs, or a dict of named features")
    arrays = {str(name): np.asarray(value) for name, value in features.items()}
    if label_key is not None and label_key not in arrays:
        label_key = None if label_key == "label" else label_key  # the default is optional
    if input_key is None:
        others = [name for name in arrays if name != label_key]
        input_key = "image" if "image" in arrays else (others[0] if others else label_key)
    if label_key is not None:
        labels = arrays.get(label_key)
        if labels is not None:
            if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
                raise UsageError(
                    f"labels {label_key!r} must be one integer class per example, got "
                    f"{labels.dtype} of shape {labels.shape}; pass label_key=None for other targets"
                )
            arrays[label_key] = labels.astype(np.int32)
            if num_classes is None:
                num_classes = _inferred_classes(labels, label_key)
    return ArraySplit(arrays, input_key, label_key, num_classes, transform, map)


def _class_count(num_classes: Any) -> int:
    """``num_classes`` as an int (a NumPy integer too), refused below 1."""
    try:
        count = operator.index(num_classes)
    except TypeError:
        count = 0
    if count < 1:
        raise UsageError(
            f"from_arrays: num_classes is a whole number, 1 or more, got {num_classes!r}"
        )
    return count


def _inferred_classes(labels: np.ndarray, name: str) -> int:
    """The largest label + 1, unless that label stands far above the others (a uint8
    255, a common "ignore" value, among 0..3 would make a 256-way classifier): then a
    UsageError naming it. ``num_classes`` given says the classes are meant. Labels that
    are ids running past 65,536 are the data checks' (`jdp.data.splits.checks`)."""
    present = np.unique(labels)
    largest = int(present[-1]) if len(present) else -1
    if len(present) > 1 and 16 <= largest < MANY_CLASSES and largest > 2 * present[-2] + 2:
        count = int(np.sum(labels == largest))
        raise UsageError(
            f"labels {name!r}: label {largest} ({count} example{'s' * (count != 1)}) stands far "
            f"above the others (up to {int(present[-2])}), which would make {largest + 1} "
            f"classes; drop or relabel those examples (255 is often an 'ignore' value), or "
            f"give num_classes={largest + 1} if they are meant"
        )
    return largest + 1


def from_tfds(
    name_or_builder,
    split: str = "train",
    *,
    data_dir: str | None = None,
    input_key: str | None = None,
    label_key: str | None = None,
    transform: Transform | None = None,
    map: Callable | None = None,
) -> ArraySplit:
    """A split of any TFDS dataset prepared as array_record, read without TensorFlow.

    ``name_or_builder`` is a catalog name (``"mnist"``), the name of a dataset
    already prepared in ``data_dir`` (its code need not be importable), or a
    builder instance of your own (``MyDataset(data_dir=..., file_format="array_record")``),
    prepared here when it is not yet; a builder class defined in a script, not
    a package, sets ``pkg_dir_path = pathlib.Path(__file__).parent``, or TFDS
    fails looking for its files. Feature names are kept. ``input_key`` and
    ``label_key`` default to the dataset's supervised keys, else its only image
    feature (or its largest other feature) and its only class label. Image (and
    other uint8) inputs are divided by 255 unless ``transform`` says otherwise;
    the bundled and catalog datasets jdp knows use their own preprocessing.

    Raises:
        UsageError: a dataset that is not there and cannot be prepared, a split it
            does not have, or features that cannot be stacked into arrays.
    """
    name = name_or_builder if isinstance(name_or_builder, str) else None
    known = check_dataset(name) if name in DATASETS else None
    builder = open_builder(name_or_builder, data_dir, known)
    arrays, info = read_builder_split(builder, split)
    features = info.features
    kinds = {key: type(features[key]).__name__ for key in arrays}
    supervised = tuple(info.supervised_keys or ()) if _plain(info.supervised_keys) else ()
    if label_key is None:
        classes = [key for key, kind in kinds.items() if kind == "ClassLabel"]
        label_key = supervised[1] if supervised else (classes[0] if len(classes) == 1 else None)
    if input_key is None:
        images = sorted(key for key, kind in kinds.items() if kind == "Image")
        # Else the largest other feature: the pixels, say, not a per-example weight.
        others = sorted(
            (key for key in arrays if key != label_key),
            key=lambda key: (-arrays[key][0].size if len(arrays[key]) else 0, key),
        )
        input_key = supervised[0] if supervised else (images + others)[0]
    for role, key in (("input_key", input_key), ("label_key", label_key)):
        if key is not None and key not in arrays:
            raise UsageError(
                f"{role} {key!r} is not a numeric feature of {builder.name}; its features "
                f"are {', '.join(map(repr, arrays))}"
            )
    num_classes, names = None, None
    if label_key is not None:
        num_classes = getattr(features[label_key], "num_classes", None)
        names = getattr(features[label_key], "names", None)
        arrays[label_key] = arrays[label_key].astype(np.int32)
    if transform is None:
        if known is not None:
            transform = known.transform
        elif arrays[input_key].dtype == np.uint8:
            transform = Transform()
    split = from_arrays(
        arrays,
        input_key=input_key,
        label_key=label_key,
        num_classes=num_classes,
        transform=transform,
        map=map,
    )
    return dataclasses.replace(split, classes=tuple(names)) if names else split


def _plain(keys) -> bool:
    """Supervised keys as a plain (input, label) pair of feature names."""
    return (
        isinstance(keys, tuple | list)
        and len(keys) == 2
        and all(isinstance(key, str) for key in keys)
    )


def from_folder(
    path: str | os.PathLike,
    *,
    image_size: tuple[int, int] | None = None,
    transform: Transform | None = None,
    classes: tuple[str, ...] | None = None,
    map: Callable | None = None,
) -> ArraySplit:
    """A split of the images under ``path``, one subdirectory per class.

    Class ``i`` is the ``i``-th subdirectory in sorted order (or in ``classes``,
    to keep the labels of another split). Images are decoded with Pillow, in
    grey when every one is grey, else RGB, into ``uint8`` ``image`` and
    ``int32`` ``label``; ``image_size=(height, width)`` resizes them, otherwise
    they must share one size. ``transform`` defaults to dividing by 255.

    Raises:
        UsageError: a missing folder, no class subdirectories, a class folder
            without images, an image Pillow cannot read, or images of different
            sizes without ``image_size``.
    """
    from PIL import Image

    root = os.fspath(path)
    files, labels, classes = class_tree(root, classes)
    images = []
    for file in files:
        try:
            with Image.open(file) as image:
                image.load()
                images.append(image.copy())
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read image {file} ({error}); remove or replace it") from None
    grey = all(image.mode in ("1", "L", "LA", "I", "I;16") for image in images)
    mode = "L" if grey else "RGB"
    decoded = []
    for file, image in zip(files, images, strict=True):
        image = image.convert(mode)
        if image_size is not None:
            height, width = image_size
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        elif image.size != images[0].size:
            raise UsageError(
                f"images differ in size: {files[0]} is {images[0].size[0]}x{images[0].size[1]}, "
                f"{file} is {image.size[0]}x{image.size[1]}; resize them, or pass "
                "image_size=(height, width) (--image-size H,W)"
            )
        array = np.asarray(image, np.uint8)
        decoded.append(array[..., None] if grey else array)
    split = from_arrays(
        np.stack(decoded),
        np.asarray(labels, np.int32),
        num_classes=len(classes),
        transform=transform if transform is not None else Transform(),
        map=map,
    )
    return dataclasses.replace(split, classes=classes)


def holdout(split, fraction: float, seed: int):
    """``(rest, held_out)``: a seeded ``fraction`` of ``split``'s examples set apart.

    Both keep the original order; the choice depends only on ``seed`` and the
    number of examples.

    Examples:
        >>> split = jdp.data.from_arrays(np.arange(10.0)[:, None], np.arange(10) % 2)
        >>> train, validation = jdp.data.holdout(split, 0.2, seed=0)
        >>> len(train), len(validation)
        (8, 2)
    """
    if not 0.0 < fraction < 1.0:
        raise UsageError(f"a held-out fraction must be in (0, 1), got {fraction}")
    count = len(split)
    held = max(1, round(count * fraction))
    if held >= count:
        raise UsageError(
            f"holding out {fraction:g} of {count} examples leaves none to train on; "
            "use a smaller fraction"
        )
    order = np.random.default_rng((seed, _HOLDOUT_STREAM)).permutation(count)
    return split.take(np.sort(order[held:])), split.take(np.sort(order[:held]))


def from_npz(path: str | os.PathLike, split: str = "train") -> ArraySplit | None:
    """A split of a NumPy ``.npz`` file whose arrays are named ``FEATURE_SPLIT``.

    Keras's ``mnist.npz`` layout (``x_train``, ``y_train``, ``x_test``, ``y_test``)
    is one: feature ``x`` is the input and ``y`` the label; otherwise ``image``
    and ``label`` are, as in `from_arrays`. uint8 inputs are divided by 255. The
    ``validation`` split's arrays may end in ``_validation``, ``_val`` or ``_valid``.
    Returns None when the file has no array of ``split`` (`jdp.data.formats.npz` reads it).
    """
    found = read_npz(path, split)
    return None if found is None else from_arrays(**found)


def load_named(
    dataset: str,
    split: str,
    data_dir: str | None = None,
    *,
    image_size: tuple[int, int] | None = None,
):
    """``--dataset``'s ``split``: a built-in dataset, ``tfds:NAME``, ``folder:PATH`` or
    ``npz:FILE``.

    A folder with ``train`` and ``test`` subfolders gives those; a folder of
    class folders alone gives a seeded fifth of its images as ``test`` and the
    rest as ``train``; ``image_size`` resizes a folder's images. Returns None for a
    split the dataset does not have (``validation``, say).
    """
    if dataset.startswith(TFDS_PREFIX):
        name = dataset[len(TFDS_PREFIX) :]
        builder = open_builder(name, data_dir, DATASETS.get(name))
        if streamed_image_key(builder.info.features):  # images of many sizes: streamed
            if split != "train" and split not in builder.info.splits:
                return None  # imagenet2012 has train and validation
            return from_tfds_images(builder, split, image_size=image_size or (224, 224))
        if split == "validation":
            return _tfds_validation(name, data_dir)
        return from_tfds(name, split, data_dir=data_dir)
    if dataset.startswith(FOLDER_PREFIX):
        return _folder_split(dataset[len(FOLDER_PREFIX) :], split, image_size)
    if dataset.startswith(IMAGES_PREFIX):  # streamed, at --image-size (224 by default)
        return _folder_split(
            dataset[len(IMAGES_PREFIX) :], split, image_size or (224, 224), opener=from_images
        )
    if dataset.startswith(NPZ_PREFIX):
        found = from_npz(dataset[len(NPZ_PREFIX) :], split)
        if found is None and split != "validation":
            raise UsageError(
                f"{dataset[len(NPZ_PREFIX) :]} has no arrays of the {split} split; name them "
                f"like x_{split} and y_{split}"
            )
        return found
    if split == "validation":
        return None
    return load_split(dataset, split, data_dir)


def _tfds_validation(name: str, data_dir: str | None):
    builder = open_builder(name, data_dir, DATASETS.get(name))
    if "validation" not in builder.info.splits:
        return None
    return from_tfds(name, "validation", data_dir=data_dir)


def _folder_split(
    root: str, split: str, image_size: tuple[int, int] | None = None, opener: Callable = from_folder
):
    """``split`` of a tree of splits, or of one class tree (a seeded fifth as ``test``),
    opened by ``from_folder`` (decoded into memory) or ``from_images`` (streamed)."""
    parts = {part: os.path.join(root, part) for part in ("train", "test", "validation")}
    if os.path.isdir(parts["train"]):
        if not os.path.isdir(parts[split]):
            if split == "validation":
                return None
            raise UsageError(f"{root} has a train folder and no {split} folder; add {parts[split]}")
        classes = tuple(sorted(e.name for e in os.scandir(parts["train"]) if e.is_dir()))
        if os.path.isfile(os.path.join(parts["train"], PACKED_META)):
            classes = None  # packed together: `from_images` checks they agree
        return opener(parts[split], classes=classes, image_size=image_size)
    if split == "validation":
        return None
    train, test = holdout(opener(root, image_size=image_size), 0.2, seed=0)
    return train if split == "train" else test
