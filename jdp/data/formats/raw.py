"""Raw inputs read as a run's training read its data: image files decoded, converted and
resized as `jdp.data.from_folder` reads them, then the split's preprocessing, from the
facts a checkpoint records (`jdp.data.splits.facts`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jdp.data.formats.transforms import Transform
from jdp.errors import UsageError


def read_inputs(inputs: Any, facts: Mapping) -> np.ndarray:
    """``inputs`` as the model's input: image files (a path, or a list of them) or an
    array of raw examples (one, or a batch), preprocessed as training did.

    Raises:
        UsageError: a file Pillow cannot read, or examples of another shape than the
            training data's.
    """
    shape = tuple(facts.get("example_shape") or ())
    if isinstance(inputs, str | os.PathLike) or (
        isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], str | os.PathLike)
    ):
        paths = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
        center = (facts.get("transform") or {}).get("center")
        if center is not None:  # streamed images: evaluation's centre crop
            examples = _center_crops(paths, shape, center)
        else:
            examples = np.stack([_decode(os.fspath(path), shape) for path in paths])
    else:
        examples = np.asarray(inputs)
        if shape and examples.shape == shape:
            examples = examples[None]  # one example
    if shape and examples.shape[1:] != shape:
        raise UsageError(
            f"inputs of shape {examples.shape[1:]} per example; this model was trained on "
            f"{shape} (give image files, which are resized, or arrays of that shape)"
        )
    recorded = facts.get("transform")
    if recorded is None:
        return examples
    mean, std = recorded.get("mean"), recorded.get("std")
    transform = Transform(
        scale=recorded["scale"], mean=tuple(mean) if mean else None, std=tuple(std) if std else None
    )
    return transform(examples)


def _decode(path: str, shape: tuple[int, ...]) -> np.ndarray:
    """One image file as uint8 ``(height, width, channels)``: grey or RGB as the training
    images' channels say, resized to their size (bilinear, as ``from_folder`` resizes)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            channels = shape[-1] if len(shape) == 3 else 3
            image = image.convert("L" if channels == 1 else "RGB")
            if len(shape) == 3 and image.size != (shape[1], shape[0]):
                image = image.resize((shape[1], shape[0]), Image.Resampling.BILINEAR)
            array = np.asarray(image, np.uint8)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read image {path} ({error})") from None
    return array[..., None] if array.ndim == 2 else array


def _center_crops(paths: list, shape: tuple[int, ...], center: float) -> np.ndarray:
    """Image files as a streamed image split evaluates them (`jdp.data.formats.images`)."""
    from jdp.data.formats.images import ImageTransform

    transform = ImageTransform(size=tuple(shape[:2]), center=center)
    encoded = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                encoded.append(handle.read())
        except OSError as error:
            raise UsageError(f"cannot read image {path} ({error})") from None
    try:
        return transform(encoded)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"cannot read an image of {', '.join(map(str, paths))} ({error})"
        ) from None
