"""Loss and eval metrics for a Flax Linen image classifier, in the step builders' forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def init_variables(module: nn.Module, sample: jax.Array, rng: jax.Array) -> tuple[Any, Any]:
    """Initialises ``module`` on a sample batch; returns ``(params, model_state)``."""
    variables = dict(module.init(rng, sample, train=False))
    params = variables.pop("params")
    return params, variables


def classifier_loss(module: nn.Module) -> Callable[..., Any]:
    """Mean softmax cross-entropy, with accuracy as aux (the ``has_model_state`` form).

    Batches hold ``image`` and integer ``label``; ``rng`` feeds dropout.
    """

    def loss_fn(params, model_state, batch, rng):
        variables = {"params": params, **model_state}
        if model_state:
            logits, model_state = module.apply(
                variables,
                batch["image"],
                train=True,
                mutable=list(model_state),
                rngs={"dropout": rng},
            )
        else:
            logits = module.apply(variables, batch["image"], train=True, rngs={"dropout": rng})
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return loss, {"accuracy": accuracy}, dict(model_state)

    return loss_fn


def classifier_metrics(module: nn.Module) -> Callable[..., dict[str, jax.Array]]:
    """Per-example loss and accuracy for `jdp.make_eval_step` (``has_model_state`` form)."""

    def metrics_fn(params, model_state, batch):
        logits = module.apply({"params": params, **model_state}, batch["image"], train=False)
        labels = batch["label"]
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
            "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
        }

    return metrics_fn
