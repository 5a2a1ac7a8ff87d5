"""Datasets by name: TFDS sources read with ``tfds.data_source``, no TensorFlow at run time.

A split is decoded once into host memory as raw ``uint8`` images and ``int32``
labels; the loader (``jdp.data.pipeline``) gathers, preprocesses and augments
batches from it. The bundled digits prepare offline; the catalog datasets read
what TFDS prepared in ``--data-dir`` and are downloaded and prepared there when
the network allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import os
import socket
from collections.abc import Callable

import numpy as np

from jdp.data import numbers2words
from jdp.data.transforms import Transform
from jdp.errors import UsageError, os_failure
from jdp.mesh import MASK_KEY
from jdp.report.console import quiet_absl


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How jdp reads one dataset: its TFDS name, where it downloads from, its preprocessing."""

    tfds_name: str
    transform: Transform
    download_host: str | None = None  # None: prepared offline from data a package ships


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


def default_data_dir() -> str:
    """TFDS's own default: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


@contextlib.contextmanager
def _quiet():
    """TFDS prints banners, progress bars and log lines (errors still raise); keep runs to
    jdp's own lines."""
    chatter = io.StringIO()
    with quiet_absl(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        yield


def _builder(name: str, data_dir: str):
    import tensorflow_datasets as tfds

    if name == "digits":
        from jdp.data import digits  # noqa: F401  (registers the builder with TFDS)
    # array_record: random access without TensorFlow (TFRecord would need it).
    return tfds.builder(name, data_dir=data_dir, file_format="array_record")


def _reachable(host: str, timeout: float = 3.0) -> bool:
    """A quick probe: TFDS's own download retries for minutes when offline."""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _prepare_command(name: str, data_dir: str) -> str:
    return f"python -m jdp.data prepare {name} --data-dir {data_dir}"


def _has_tensorflow() -> bool:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


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
    with _quiet():
        return _prepare(spec, name, data_dir or default_data_dir())


@contextlib.contextmanager
def _prepare_lock(data_dir: str):
    """One preparer per directory: the processes of a run on one host share ``data_dir``."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".jdp-prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prepare(spec: DatasetSpec, name: str, data_dir: str) -> str:
    builder = _builder(spec.tfds_name, data_dir)
    if builder.is_prepared():
        return str(builder.data_dir)
    with _prepare_lock(data_dir):
        builder = _builder(spec.tfds_name, data_dir)  # another process may have prepared it
        if builder.is_prepared():
            return str(builder.data_dir)
        return _download_and_prepare(spec, name, data_dir, builder)


def _download_and_prepare(spec: DatasetSpec, name: str, data_dir: str, builder) -> str:
    if spec.download_host:
        elsewhere = (
            f"run `{_prepare_command(name, data_dir)}` where the network reaches it "
            f"(after `pip install tensorflow`) and copy {os.path.join(data_dir, name)} here"
        )
        if not _reachable(spec.download_host):
            raise UsageError(
                f"dataset {name!r} is not prepared in {data_dir} and {spec.download_host} "
                f"cannot be reached; {elsewhere}"
            )
        if not _has_tensorflow():
            raise UsageError(
                f"dataset {name!r} is not prepared in {data_dir}, and TFDS needs TensorFlow to "
                f"prepare it (only to prepare, not to train); `pip install tensorflow` and "
                f"rerun, or {elsewhere}"
            )
    _run_prepare(builder, name, data_dir, "choose another --data-dir")
    return str(builder.data_dir)


def _run_prepare(builder, name: str, data_dir: str, otherwise: str) -> None:
    """``builder.download_and_prepare()``; a full or unwritable disk as one line."""
    try:
        builder.download_and_prepare()
    except (OSError, RuntimeError) as error:
        reason = os_failure(error)
        if reason is None:
            raise
        raise UsageError(
            f"could not prepare dataset {name!r} in {data_dir} ({reason}); free space there, "
            f"or {otherwise}"
        ) from None


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
    with _quiet():
        return _load_split(spec, name, split, data_dir)


def _check_data_dir(data_dir: str | None) -> str:
    if data_dir is not None and not os.path.isdir(data_dir):
        what = "is a file, not a directory" if os.path.exists(data_dir) else "does not exist"
        raise UsageError(
            f"--data-dir {data_dir} {what}; create it, or omit --data-dir to use "
            f"{default_data_dir()}"
        )
    return data_dir or default_data_dir()


def open_builder(name_or_builder, data_dir: str | None, spec: DatasetSpec | None = None):
    """A prepared TFDS builder: by name (prepared here when jdp knows how) or as given.

    A name TFDS does not know is looked up among the datasets already prepared
    in ``data_dir`` (a builder of your own needs no code to be read back).
    """
    with _quiet():
        return _open_builder(name_or_builder, data_dir, spec)


def _open_builder(name_or_builder, data_dir: str | None, spec: DatasetSpec | None):
    import tensorflow_datasets as tfds

    if not isinstance(name_or_builder, str):
        builder = name_or_builder
        if not builder.is_prepared():
            _run_prepare(
                builder, builder.name, str(builder.data_dir), "give the builder another data_dir"
            )
        return builder
    name, data_dir = name_or_builder, _check_data_dir(data_dir)
    if spec is not None:
        builder = _builder(spec.tfds_name, data_dir)
        if not builder.is_prepared():
            _prepare(spec, name, data_dir)
            builder = _builder(spec.tfds_name, data_dir)
        return builder
    try:
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError:
        raise UsageError(
            f"no TFDS dataset {name!r} is known or prepared in {data_dir}; prepare it there "
            "(your builder's download_and_prepare, with file_format='array_record'), or pass "
            "--data-dir"
        ) from None
    if not builder.is_prepared():
        raise UsageError(
            f"TFDS dataset {name!r} is not prepared in {data_dir}; prepare it there as "
            f"array_record (tfds.builder({name!r}, data_dir=..., file_format='array_record')"
            ".download_and_prepare(), which may need TensorFlow) and rerun"
        )
    return builder


def read_builder_split(builder, split: str) -> tuple[dict[str, np.ndarray], object]:
    """Every example of a prepared builder's ``split``, stacked per numeric feature.

    Returns:
        ``({feature: array}, builder.info)``; string and nested features are left out.
    """
    with _quiet():
        return _read_builder_split(builder, split)


def _read_builder_split(builder, split: str) -> tuple[dict[str, np.ndarray], object]:
    name, info = builder.name, builder.info
    if split not in info.splits:
        raise UsageError(
            f"dataset {name!r} has no split {split!r}; it has: {', '.join(info.splits)}"
        )
    if info.file_format is None or info.file_format.value != "array_record":
        raise UsageError(
            f"dataset {name!r} in {builder.data_dir} was prepared as {info.file_format}, which "
            "needs TensorFlow to read; prepare it as array_record (file_format='array_record') "
            "into another data directory"
        )
    source = builder.as_data_source(split=split)
    try:
        examples = source.__getitems__(range(len(source)))
    except RuntimeError as error:  # array_record's own checksums: "Corrupted Riegeli/records"
        reason = str(error).strip().splitlines()[0][:120]
        raise UsageError(
            f"dataset {name!r} ({split}) in {builder.data_dir} is damaged ({reason}); prepare "
            f"it again: remove {builder.data_dir} and rerun"
        ) from None
    arrays = {}
    for key in info.features:
        values = [np.asarray(example[key]) for example in examples]
        if not values or values[0].dtype.kind not in "biuf":
            continue  # text, bytes and nested features: not model inputs
        if len({value.shape for value in values}) > 1:
            raise UsageError(
                f"feature {key!r} of {name!r} has examples of different shapes; pad or resize "
                "them to one shape when preparing the dataset"
            )
        dtype = getattr(info.features[key], "np_dtype", None)  # a scalar reads as a Python float
        stacked = np.stack(values)
        arrays[key] = stacked.astype(dtype, copy=False) if dtype is not None else stacked
    return arrays, info


def _load_split(spec: DatasetSpec, name: str, split: str, data_dir: str | None) -> Split:
    builder = _open_builder(name, data_dir, spec)
    arrays, info = _read_builder_split(builder, split)
    return Split(
        image=arrays["image"],
        label=arrays["label"].astype(np.int32),
        num_classes=info.features["label"].num_classes,
        transform=spec.transform,
    )
