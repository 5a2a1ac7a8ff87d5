"""Datasets by name: TFDS sources read with ``tfds.data_source``, no TensorFlow at run time.

A split is decoded once into host memory as raw ``uint8`` images and ``int32``
labels; the loader (``jdp.data.loader.pipeline``) gathers, preprocesses and augments
batches from it. The bundled digits prepare offline; the catalog datasets read
what TFDS prepared in ``--data-dir`` and are downloaded and prepared there when
the network allows (`jdp.data.formats.builders`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jdp.data.formats import numbers2words
from jdp.data.formats.builders import (
    DatasetSpec,
    default_data_dir,
    open_builder,
    prepare_spec,
    quiet,
    read_builder_split,
)

# Each `name as name` re-exports a name that lived here before builders.py.
from jdp.data.formats.transforms import Transform
from jdp.errors import UsageError
from jdp.mesh import MASK_KEY

_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)

DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec("digits", Transform(scale=16.0)),
    "mnist": DatasetSpec("mnist", Transform(), download_host="storage.googleapis.com"),
    "fashion_mnist": DatasetSpec(
        "fashion_mnist", Transform(), download_host="storage.googleapis.com"
    ),
    "cifar10": DatasetSpec(
        "cifar10",
        Transform(mean=_CIFAR_MEAN, std=_CIFAR_STD, crop_padding=4, flip=True),
        download_host="www.cs.toronto.edu",
    ),
}


# Generated on the fly, no files: name -> module with ``SIZES`` (its splits) and
# ``generate(split)`` (the split in memory).
GENERATED = {"numbers2words": numbers2words}


# Images already in model units: only cast to float32.
AS_IS = Transform(scale=1.0)


@dataclasses.dataclass(frozen=True)
class Split:
    """One split in host memory: raw ``image`` (uint8, NHWC), ``label`` (int32) and its transform.

    ``read(indices)`` is the loader's only access, so a split that does not fit in
    memory could serve the same interface from disk.
    """

    image: np.ndarray
    label: np.ndarray
    num_classes: int
    transform: Transform = AS_IS
    classes: tuple[str, ...] | None = None  # class names, label order (TFDS's ClassLabel)
    kind = "image"
    input_key, label_key = "image", "label"  # what a built-in model reads and predicts
    map = None  # no per-example function (see `ArraySplit`)

    def __len__(self) -> int:
        return len(self.label)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"image": self.image[indices], "label": self.label[indices]}

    def take(self, indices: np.ndarray) -> Split:
        """The split of these examples, in this order."""
        return dataclasses.replace(self, image=self.image[indices], label=self.label[indices])


@dataclasses.dataclass(frozen=True, eq=False)
class ArraySplit:
    """One split of named arrays in host memory, any names: your own data (`jdp.data`).

    Every array has one row per example. ``input_key`` names the feature a
    built-in model reads and ``label_key`` the integer class it predicts (your
    own model may read any of them). ``transform`` (a `Transform`, for images)
    applies to ``input_key``, vectorised over a batch; ``map`` is your own
    per-example function ``map(example, rng) -> example`` on a dict of NumPy
    arrays, run in the loader (in Grain's workers with ``--loader-workers``).
    ``rng`` is a ``numpy.random.Generator`` drawn from the seed, the step and
    the example's place in the global batch in training (so augmentation does
    not depend on the devices or processes), and None in evaluation.
    """

    features: dict[str, np.ndarray]
    input_key: str = "image"
    label_key: str | None = "label"
    num_classes: int | None = None
    transform: Transform | None = None
    map: Callable[[dict, np.random.Generator | None], dict] | None = None
    classes: tuple[str, ...] | None = None  # class names, label order (an image folder's)
    kind = "image"

    def __post_init__(self):
        if not self.features:
            raise UsageError("a split needs at least one feature array")
        lengths = {name: len(array) for name, array in self.features.items()}
        if len(set(lengths.values())) != 1:
            raise UsageError(
                "the features have different numbers of rows ("
                + ", ".join(f"{name}: {n}" for name, n in lengths.items())
                + "); give one row per example in each"
            )
        if MASK_KEY in self.features:
            raise UsageError(
                f"a feature is named {MASK_KEY!r}, which jdp's evaluation adds to mark "
                "padding rows; rename it"
            )
        for role, key in (("input_key", self.input_key), ("label_key", self.label_key)):
            if key is not None and key not in self.features:
                raise UsageError(
                    f"{role} {key!r} is not a feature; the features are "
                    f"{', '.join(map(repr, self.features))}"
                )

    def __len__(self) -> int:
        return len(next(iter(self.features.values())))

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {name: array[indices] for name, array in self.features.items()}

    def take(self, indices: np.ndarray) -> ArraySplit:
        """The split of these examples, in this order."""
        return dataclasses.replace(self, features=self.read(indices))


def check_dataset(name: str) -> DatasetSpec | None:
    """The dataset's spec (None for a generated one); UsageError naming the known datasets."""
    if name in GENERATED:
        return None
    if name not in DATASETS:
        known = ", ".join(sorted(DATASETS | GENERATED))
        raise UsageError(f"unknown dataset {name!r}; choose one of: {known}")
    return DATASETS[name]


def dataset_kind(name: str) -> str:
    """``image`` or ``sequence``: what the dataset's examples are, for choosing a model."""
    return "image" if check_dataset(name) else "sequence"


def prepare(name: str, data_dir: str | None = None) -> str:
    """Downloads (catalog datasets) and prepares ``name`` in ``data_dir`` as array_record.

    Reading a prepared dataset needs no TensorFlow; preparing a catalog dataset
    does, because TFDS's builders read their downloads and encode images with it.

    Returns:
        The directory of the prepared dataset version.

    Raises:
        UsageError: an unknown dataset, a download host that cannot be reached, or
            a catalog dataset to prepare without TensorFlow installed.
    """
    spec = check_dataset(name)
    if spec is None:
        raise UsageError(f"dataset {name!r} is generated when a run starts; nothing to prepare")
    with quiet():
        return prepare_spec(spec, name, data_dir or default_data_dir())


def load_split(
    name: str, split: str, data_dir: str | None = None
) -> Split | numbers2words.SequenceSplit:
    """Reads a whole split into host memory through ``tfds.data_source``.

    The bundled dataset is prepared into ``data_dir`` on first use; a catalog
    dataset is downloaded and prepared when the network allows; ``numbers2words``
    is generated (a `SequenceSplit` of token pairs).

    Raises:
        UsageError: an unknown dataset or split, a ``data_dir`` that does not exist,
            or a dataset that is not prepared and cannot be downloaded.

    Examples:
        >>> train = jdp.load_split("digits", "train", data_dir=tmp)
        >>> len(train), train.num_classes, train.image.shape[1:]
        (1438, 10, (8, 8, 1))
    """
    spec = check_dataset(name)
    if spec is None:
        generated = GENERATED[name]
        if split not in generated.SIZES:
            raise UsageError(
                f"dataset {name!r} has no split {split!r}; it has: {', '.join(generated.SIZES)}"
            )
        return generated.generate(split)
    with quiet():
        return _load_split(spec, name, split, data_dir)


def _load_split(spec: DatasetSpec, name: str, split: str, data_dir: str | None) -> Split:
    builder = open_builder(name, data_dir, spec)
    arrays, info = read_builder_split(builder, split)
    labels = info.features["label"]
    return Split(
        image=arrays["image"],
        label=arrays["label"].astype(np.int32),
        num_classes=labels.num_classes,
        transform=spec.transform,
        classes=tuple(labels.names) if getattr(labels, "names", None) else None,
    )
