"""A split's facts that a built-in model's shape depends on, recorded with a run.

`jdp.fit` records them in the run's config (under ``data``); `jdp.load_model`
rebuilds a built-in model from them without the data: what kind of examples, how
many classes or which vocabulary, and the keys of the input and the label. The
record is written and read here, in one place, so the two agree on its keys.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import numpy as np


def data_facts(split) -> dict:
    """What a built-in model's shape depends on, for `load_model` to rebuild it."""
    return {
        "kind": split.kind,
        "num_classes": getattr(split, "num_classes", None),
        "vocab": list(getattr(split, "vocab", ()) or ()),
        "input_key": split.input_key,
        "label_key": split.label_key,
        # A token corpus's: no token table, its size; windows' length; byte tokens or not.
        "vocab_size": getattr(split, "vocab_size", None),
        "seq_len": getattr(split, "seq_len", None),
        "tokenizer": getattr(split, "tokenizer", None),
        "eos_id": getattr(split, "eos_id", None),  # the id between documents, if any
        # What jdp.LoadedModel.predict needs to read raw inputs as training read them.
        "classes": list(getattr(split, "classes", None) or ()),
        "transform": _transform(getattr(split, "transform", None)),
        "example_shape": _example_shape(split),
        "normalize": _normalize(getattr(split, "normalize", None)),
    }


def _normalize(normalize) -> dict | None:
    """The per-channel mean and std a model of uint8 images applies on the devices."""
    return None if normalize is None else {"mean": normalize.mean, "std": normalize.std}


def _transform(transform) -> dict | None:
    """The evaluation preprocessing of a `jdp.data.Transform` (never its augmentation); for
    streamed images, their centre crop (normalised by the model, `normalize`)."""
    if transform is None:
        return None
    if hasattr(transform, "center"):
        return {"scale": 1.0, "mean": None, "std": None, "center": transform.center}
    return {"scale": transform.scale, "mean": transform.mean, "std": transform.std}


def _example_shape(split) -> list[int] | None:
    if hasattr(split, "example_shape"):  # streamed images: the crops' shape
        return list(split.example_shape)
    read = getattr(split, "read", None)
    if read is None or split.kind != "image" or not len(split):
        return None
    return list(read(np.arange(1))[split.input_key].shape[1:])


def split_shape(facts: Mapping) -> types.SimpleNamespace:
    """A stand-in for the split ``facts`` were recorded from, as far as a built-in
    model reads one (`jdp.models.get_model`); a fact missing takes its default."""
    return types.SimpleNamespace(
        kind=facts.get("kind", "image"),
        num_classes=facts.get("num_classes"),
        vocab=tuple(facts.get("vocab") or ()),
        input_key=facts.get("input_key", "image"),
        label_key=facts.get("label_key", "label"),
        vocab_size=facts.get("vocab_size"),
        seq_len=facts.get("seq_len") or 0,
        tokenizer=facts.get("tokenizer"),
        normalize=_normalizer(facts),
    )


def _normalizer(facts: Mapping):
    from jdp.data.formats.images import Normalize

    recorded = facts.get("normalize")
    if not recorded:
        return None
    key = facts.get("input_key", "image")
    return Normalize(key, tuple(recorded["mean"]), tuple(recorded["std"]))
