"""What a model is trained to do: the `Objective` on its outputs, and the built-in ones.

An objective is the loss to minimise and the metrics to measure on a model's
outputs and the batch, both per example. `classification` and `sequence` are the
built-in models' (`jdp.models.get_model`); `from_linen` and `from_nnx` take any.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp.models.head import per_token as head_per_token

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a model is trained to do, on its outputs and the batch.

    Attributes:
        loss: ``(outputs, batch) -> (rows,)`` per-example losses. The step minimises
            their mean: a mean over examples is the same whether a batch is split over
            1 device or 8, which a mean over, say, tokens of uneven counts is not.
        metrics: ``(outputs, batch) -> {name: (rows,)}`` per-example values, averaged
            over examples in training and exactly over the split in evaluation.
    """

    loss: Callable[[Any, Batch], jax.Array]
    metrics: Callable[[Any, Batch], dict[str, jax.Array]]
    # The eval metric that picks the best checkpoint when the run names none, and
    # whether higher ("max") or lower ("min") is better.
    best: tuple[str, str] = ("accuracy", "max")
    # ``{name: split mean} -> {name: figure}``: figures that are not means of
    # per-example values (perplexity is the exponential of the mean loss), added
    # to an evaluation's results; None for none.
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None
    # ``(outputs, batch) -> (losses, metrics)``: both in one pass, where computing them
    # apart would repeat work (a language model's logits taken in chunks); None: apart.
    both: Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]] | None = None


def _perplexity(means: dict[str, float]) -> dict[str, float]:
    return {"perplexity": math.exp(min(means["loss"], 700.0))}  # exp(710) overflows a float


def classification(label: str = "label", *, smoothing: float = 0.0) -> Objective:
    """Softmax cross-entropy on logits ``(rows, classes)``; metric ``accuracy``.

    ``smoothing`` trains towards labels smoothed as Szegedy et al. (2016) did: the
    true class ``1 - smoothing + smoothing / classes``, every other ``smoothing /
    classes`` (the loss an evaluation reports is the same, smoothed).

    Examples:
        >>> objective = jdp.models.classification()
        >>> logits, batch = jnp.array([[2.0, 0.0], [0.0, 2.0]]), {"label": jnp.array([0, 0])}
        >>> objective.metrics(logits, batch)["accuracy"]
        Array([1., 0.], dtype=float32)
    """

    def loss(logits, batch):
        logits = logits.astype(jnp.float32)
        if not smoothing:
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[label])
        labels = jax.nn.one_hot(batch[label], logits.shape[-1], dtype=jnp.float32)
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(labels, smoothing))

    def metrics(logits, batch):
        return {"accuracy": (jnp.argmax(logits, -1) == batch[label]).astype(jnp.float32)}

    return Objective(loss, metrics)


def sequence(target: str = "target", pad: int = 0) -> Objective:
    """Next-token cross-entropy on ``batch[target]`` (``<bos> tokens <eos> <pad>...``).

    The model is fed ``target[:, :-1]`` (after any prefix, such as a source for a
    decoder-only model) and predicts ``target[:, 1:]`` from the last positions of
    its logits ``(rows, length, vocab)``. An example's loss is the mean over its
    non-pad tokens. Metrics: ``accuracy``, the fraction of sequences predicted
    exactly (every token up to and including ``<eos>``), and ``token_accuracy``.

    Exact match under teacher forcing is exact match under greedy decoding: a greedy
    decoder emits the target token by token exactly when, fed the target's own
    prefix, the model's most likely next token is right at every position.
    """

    def tokens(logits, batch):
        labels = batch[target][:, 1:]
        logits = logits[:, -labels.shape[1] :].astype(jnp.float32)
        return logits, labels, (labels != pad).astype(jnp.float32)

    def loss(logits, batch):
        logits, labels, real = tokens(logits, batch)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return (losses * real).sum(-1) / jnp.maximum(real.sum(-1), 1.0)

    def metrics(logits, batch):
        logits, labels, real = tokens(logits, batch)
        right = (jnp.argmax(logits, -1) == labels).astype(jnp.float32) * real
        count = real.sum(-1)
        return {
            "accuracy": (right.sum(-1) == count).astype(jnp.float32),
            "token_accuracy": right.sum(-1) / jnp.maximum(count, 1.0),
        }

    return Objective(loss, metrics)


def language_model(
    key: str = "tokens", *, bits_per_byte: bool = False, chunked: bool = False
) -> Objective:
    """Next-token cross-entropy on windows ``batch[key]`` of ``length + 1`` tokens.

    The model reads ``tokens[:, :-1]`` and its logits ``(rows, length, vocab)``
    predict ``tokens[:, 1:]``; every token counts (a corpus has no padding), so
    the mean over examples is the mean over tokens. Metrics: ``token_accuracy``
    (the most likely next token is right), and ``bits_per_byte`` (the loss in
    bits, when each token is one byte: ``bits_per_byte=True``) or else
    ``perplexity`` (the exponential of the split's mean loss, added after
    averaging). The best checkpoint is the one of lowest loss. ``chunked``: the model
    returns `jdp.models.head.HeadInputs` (``--loss-chunks``), and the loss and metrics
    take the logits a chunk of tokens at a time, in one pass.

    Examples:
        >>> objective = jdp.models.language_model(bits_per_byte=True)
        >>> logits = jnp.zeros((1, 3, 256))  # uniform over 256 bytes: 8 bits each
        >>> objective.metrics(logits, {"tokens": jnp.zeros((1, 4), jnp.int32)})["bits_per_byte"]
        Array([8.], dtype=float32)
    """

    def loss(logits, batch):
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch[key][:, 1:]
        )
        return losses.mean(-1)

    def metrics(logits, batch):
        figures = {"token_accuracy": _token_accuracy(logits, batch[key][:, 1:]).mean(-1)}
        if bits_per_byte:
            figures["bits_per_byte"] = loss(logits, batch) / math.log(2.0)
        return figures

    def both(head, batch):
        def per_token(logits, labels):
            return {
                "loss": optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), labels
                ),
                "token_accuracy": _token_accuracy(logits, labels),
            }

        tokens = head_per_token(head, batch[key][:, 1:], per_token)
        losses = tokens["loss"].mean(-1)
        figures = {"token_accuracy": tokens["token_accuracy"].mean(-1)}
        if bits_per_byte:
            figures["bits_per_byte"] = losses / math.log(2.0)
        return losses, figures

    if chunked:
        loss = lambda outputs, batch: both(outputs, batch)[0]  # noqa: E731
        metrics = lambda outputs, batch: both(outputs, batch)[1]  # noqa: E731
    return Objective(
        loss,
        metrics,
        best=("loss", "min"),
        derived=None if bits_per_byte else _perplexity,
        both=both if chunked else None,
    )


def _token_accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """1.0 where the most likely next token is ``labels``' (the first of the largest
    logits, as argmax answers), else 0.0: ``(..., length)``."""
    # argmax's answer (the first of the largest logits is the label's) without its
    # index-carrying reduce, which XLA:CPU runs slowly, and without a second pass
    # that waits on the maximum: the label's logit is the row's maximum and every
    # logit before it is smaller. The two maxima read only the logits and the
    # labels, so XLA can compute them in one pass, beside the loss's own maximum.
    # gpt small's train step at a vocabulary of 50,257 on the 2-core machine
    # (fp32): 1,162 ms with the first index of the maximum, 1,043 with this, 1,027
    # without the metric on one device; on eight, 2,464, 2,283 and 2,147.
    wide = logits.astype(jnp.float32)
    top = wide.max(-1)
    index = lax.broadcasted_iota(jnp.int32, wide.shape, wide.ndim - 1)
    before = jnp.where(index < labels[..., None], wide, -jnp.inf).max(-1)
    at = jnp.take_along_axis(wide, labels[..., None], -1)[..., 0]
    # (A negative label, which take_along_axis would count from the end, is wrong.)
    right = (at == top) & ((labels == 0) | (before < top)) & (labels >= 0)
    return right.astype(jnp.float32)
