"""The trained model back: `load_model` from a checkpoint, `predict` over a split.

`load_model` reads one checkpoint's parameters and model state (BatchNorm
statistics), digests checked, with the config it was trained with, and rebuilds
a built-in model from that config. `predict` runs a model data-parallel over
every example of a split, in order, padding the last batch and dropping the
padding: each example's outputs come from the same per-device program and
batch shape as `jdp.fit`'s evaluation, so they reproduce its accuracy exactly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec

from jdp.checkpoint import read_checkpoint
from jdp.checkpoint.record import YOURS, RunSettings
from jdp.data.formats import read_inputs
from jdp.data.loader import eval_batches
from jdp.data.splits import data_facts as data_facts  # importable here, as before
from jdp.data.splits import from_arrays, split_shape
from jdp.errors import UsageError
from jdp.mesh import MASK_KEY, batch_sharded, batch_split, make_mesh, replicated
from jdp.models import Model
from jdp.models.registry import model_of_run


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What inference needs from a checkpoint.

    Attributes:
        model: the built-in model the config names, or the one given to
            `load_model`; None for your own model when none was given.
        params: the parameters.
        model_state: the other model variables (BatchNorm's ``batch_stats``), or {}.
        config: the run's recorded config (a dict).
        step: the checkpoint's step.
        metrics: the evaluation recorded with it (``accuracy``, ``loss``, ...), or {}.
    """

    model: Model | None
    params: Any
    model_state: Any
    config: dict
    step: int
    metrics: dict

    def predict(
        self, inputs: Any, *, mesh: Mesh | None = None, batch_size: int = 128
    ) -> Predictions:
        """Classes and probabilities for raw inputs, preprocessed as training did.

        ``inputs``: image files (a path or a list of paths: decoded, made grey or RGB
        and resized to the training images' size, as `jdp.data.from_folder` does) or
        an array of raw examples (one, or a batch); then the split's preprocessing
        (scaling, normalisation), recorded with the checkpoint.

        Raises:
            UsageError: a model of yours not given to `load_model`, a checkpoint of a
                model that does not classify, or inputs it cannot read.
        """
        facts = RunSettings(self.config).data
        if self.model is None:
            raise UsageError("this checkpoint holds your own model: pass model= to load_model")
        if not facts.get("num_classes"):
            raise UsageError(
                "LoadedModel.predict classifies; this model has no classes "
                "(use jdp.predict for its outputs)"
            )
        batch = {facts.get("input_key", "image"): read_inputs(inputs, facts)}
        logits = predict(
            self.model,
            self.params,
            batch,
            model_state=self.model_state,
            mesh=mesh,
            batch_size=batch_size,
        )
        shifted = np.exp(logits - logits.max(-1, keepdims=True))
        probabilities = shifted / shifted.sum(-1, keepdims=True)
        labels = probabilities.argmax(-1)
        names = facts.get("classes") or None
        return Predictions(labels, probabilities, [names[i] for i in labels] if names else None)


class Predictions(NamedTuple):
    """What `LoadedModel.predict` gives: each input's most likely ``labels``, every
    class's ``probabilities`` (rows sum to 1) and the class ``names`` of the labels
    (a folder's class folders, TFDS's label names), when the checkpoint recorded them."""

    labels: np.ndarray
    probabilities: np.ndarray
    names: list[str] | None


def load_model(
    path: str | os.PathLike,
    step: str | int = "latest",
    *,
    model: Model | None = None,
    mesh: Mesh | None = None,
) -> LoadedModel:
    """Loads a trained model from a checkpoint directory (or one step directory).

    Args:
        path: a ``--ckpt-dir``.
        step: ``"latest"``, ``"best"`` (by the run's ``--best-metric``, by default the
            highest accuracy, or a language model's lowest loss, on the split that
            chose it: validation when the run had one, else test) or a step number.
        model: your own model (`jdp.models.from_linen`, `from_nnx`); a built-in
            one is rebuilt from the recorded config.
        mesh: place the arrays replicated on it (default: the first device).

    Raises:
        UsageError: no such checkpoint, or a damaged one.

    Examples:
        >>> config = jdp.TrainConfig(mesh="data=8", steps=20, warmup_steps=2, ckpt_dir=f"{tmp}/r")
        >>> result = jdp.fit(config, console=jdp.Console(enabled=False))
        >>> loaded = jdp.load_model(f"{tmp}/r", "best")
        >>> loaded.step, loaded.metrics["accuracy"] == result.test_accuracy
        (20, True)
    """
    _, record, params, model_state = read_checkpoint(path, step, mesh=mesh)
    config = record.config
    if model is None and record.run.model != YOURS:
        model = _builtin(record.run)
    return LoadedModel(
        model=model,
        params=params,
        model_state=model_state,
        config=config,
        step=record.step,
        metrics=record.metrics,
    )


def _builtin(settings: RunSettings) -> Model | None:
    """The built-in model a recorded config names, shaped by the recorded data facts, giving
    its logits (`jdp.models.registry.model_of_run`)."""
    if not settings.data:
        return None  # a checkpoint from before data facts were recorded
    return model_of_run(settings.values, split_shape(settings.data), logits=True)


def predict(
    model: Model | Callable[[Any, dict], Any],
    params: Any,
    data,
    *,
    model_state: Any = None,
    mesh: Mesh | None = None,
    batch_size: int = 128,
) -> np.ndarray:
    """The model's outputs for every example of ``data``, in order, as one NumPy array.

    Args:
        model: a `jdp.models.Model` (evaluation mode), or ``fn(params, batch) -> outputs``.
        params: its parameters (say `load_model`'s).
        data: a split (`jdp.load_split`, `jdp.data.from_arrays`, ...) or a dict of arrays.
        model_state: the model's other variables (BatchNorm statistics), for a `Model`.
        mesh: the devices to run on (default: all, on ``data``).
        batch_size: the global batch; use the run's to reproduce its evaluation exactly.

    Examples:
        >>> fn = lambda params, batch: batch["x"] * params
        >>> jdp.predict(fn, 2.0, {"x": np.arange(10.0)}, mesh=jdp.make_mesh("data=8"),
        ...             batch_size=8).tolist()
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0]
    """
    if isinstance(data, Mapping):
        data = from_arrays(dict(data), label_key=None)
    if not hasattr(data, "__len__") or isinstance(data, np.ndarray):
        raise UsageError(
            f"predict's data is a split or a dict of arrays ({{'image': x}}), got "
            f"{type(data).__name__}"
        )
    if not len(data):
        raise UsageError("predict's data has no examples")
    mesh = mesh or make_mesh("data=-1")
    split = batch_split(mesh)  # data replicas, times DiLoCo groups
    if batch_size < 1 or batch_size % split:
        raise UsageError(
            f"predict's batch_size {batch_size} does not split over {split} devices; "
            f"use a multiple of {split}"
        )
    if isinstance(model, Model):
        apply = model.apply

        def outputs_of(params, model_state, batch):
            return apply(params, model_state, batch, train=False)[0]
    else:

        def outputs_of(params, model_state, batch):
            return model(params, batch)

    def per_replica(params, model_state, batch):
        batch = {key: value for key, value in batch.items() if key != MASK_KEY}
        return outputs_of(params, model_state, batch)

    program = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), batch_sharded(mesh).spec),
            out_specs=batch_sharded(mesh).spec,
        )
    )
    params, model_state = jax.device_put((params, model_state or {}), replicated(mesh))
    results = []
    for batch in eval_batches(data, mesh, batch_size=batch_size):
        outputs = program(params, model_state, batch)
        if jax.process_count() > 1:
            outputs = multihost_utils.process_allgather(outputs, tiled=True)
        results.append(jax.tree.map(np.asarray, outputs))
    merged = jax.tree.map(lambda *parts: np.concatenate(parts), *results)
    return jax.tree.map(lambda values: values[: len(data)], merged)
