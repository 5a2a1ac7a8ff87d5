"""Datasets by name: TFDS sources read with ``tfds.data_source``, no TensorFlow at run time."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable

import numpy as np

from jdp.errors import UsageError


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How jdp reads one dataset: its TFDS name and the per-example preprocessing."""

    tfds_name: str
    num_classes: int
    preprocess: Callable[[np.ndarray], np.ndarray]
    builtin: bool  # prepared offline from data that ships with a package


def _scale(maximum: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda images: images.astype(np.float32) / maximum


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec("digits", 10, _scale(16.0), builtin=True),
}


@dataclasses.dataclass(frozen=True)
class Split:
    """One split held in host memory: ``image`` (float32, NHWC) and ``label`` (int32)."""

    image: np.ndarray
    label: np.ndarray
    num_classes: int

    def __len__(self) -> int:
        return len(self.label)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"image": self.image[indices], "label": self.label[indices]}


def check_dataset(name: str) -> DatasetSpec:
    """Returns the dataset's spec, or raises UsageError naming the known datasets."""
    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; choose one of: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def default_data_dir() -> str:
    """TFDS's own default: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


def load_split(name: str, split: str, data_dir: str | None = None) -> Split:
    """Reads a whole split into memory through ``tfds.data_source``.

    A bundled dataset is prepared into ``data_dir`` on first use.
    """
    spec = check_dataset(name)
    import tensorflow_datasets as tfds

    if spec.builtin:
        from jdp.data import digits  # noqa: F401  (registers the builder with TFDS)
    data_dir = data_dir or default_data_dir()
    # TFDS prints a preparation banner and progress bars (errors still raise);
    # keep the run's output to jdp's own lines.
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        source = tfds.data_source(
            spec.tfds_name,
            split=split,
            data_dir=data_dir,
            builder_kwargs={"file_format": "array_record"},  # TFRecord would need TensorFlow
        )
        examples = source.__getitems__(range(len(source)))
    return Split(
        image=spec.preprocess(np.stack([example["image"] for example in examples])),
        label=np.asarray([example["label"] for example in examples], np.int32),
        num_classes=spec.num_classes,
    )
