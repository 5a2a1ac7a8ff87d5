"""Reading a NumPy ``.npz`` file's arrays of one split (``--dataset npz:FILE``): Keras's
``mnist.npz`` layout, or `from_arrays`' names, each array suffixed by its split; a
FIFO, a device, a file cut short or one holding Python objects is one line."""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

from jdp.data.formats.transforms import Transform
from jdp.errors import UsageError, check_input_file

# The names an .npz's arrays may give a split: x_val is as common as x_validation.
_SPLIT_NAMES = {"validation": ("validation", "val", "valid")}


def read_npz(path: str | os.PathLike, split: str) -> dict[str, Any] | None:
    """`jdp.data.from_npz`'s arguments of `from_arrays` for ``split`` of the file: its
    features and which are the input and label, and the transform of uint8 inputs;
    None when the file has no array of ``split``."""
    file = os.fspath(path)
    check_input_file(file, "the .npz file")
    try:
        with open(file, "rb") as handle:
            zipped = handle.read(4) == b"PK\x03\x04"  # what numpy.savez writes: a zip
    except OSError as error:
        raise UsageError(f"cannot read {file} as a NumPy .npz file ({error})") from None
    if not zipped:
        raise UsageError(
            f"{file} is not a NumPy .npz file (not the zip archive numpy.savez writes); "
            "save the arrays with numpy.savez(file, x_train=..., y_train=..., ...)"
        )
    try:
        with np.load(file, allow_pickle=False) as arrays:
            named = [
                name
                for name in _SPLIT_NAMES.get(split, (split,))
                if any(array.endswith(f"_{name}") for array in arrays.files)
            ]
            suffix = f"_{named[0] if named else split}"
            features = {
                name[: -len(suffix)]: arrays[name] for name in arrays.files if name.endswith(suffix)
            }
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:  # a cut-short file
        reason = f"{error or type(error).__name__}; is it whole?"
        if "pickle" in str(error):
            reason = "it holds Python objects, which jdp never unpickles; save numeric arrays"
        raise UsageError(f"cannot read {file} as a NumPy .npz file ({reason})") from None
    if len(named) > 1:
        raise UsageError(
            f"{file} has arrays of the {split} split named both _{named[0]} and _{named[1]}; "
            "keep one of them"
        )
    split = named[0] if named else split
    if not features:
        return None
    if ("x" in features) != ("y" in features):  # Keras's layout, half of it
        have, lack = ("x", "y") if "x" in features else ("y", "x")
        raise UsageError(
            f"{file} has {have}_{split} and no {lack}_{split}; save both (inputs and labels) "
            "for each split it has"
        )
    keras = "x" in features and "y" in features
    input_key, label_key = ("x", "y") if keras else (None, "label")
    transform = Transform() if features[input_key or "image"].dtype == np.uint8 else None
    if keras and features["y"].ndim == 1 and features["y"].dtype.kind in "iu":
        features["y"] = features["y"].astype(np.int32)
    return dict(features=features, input_key=input_key, label_key=label_key, transform=transform)
