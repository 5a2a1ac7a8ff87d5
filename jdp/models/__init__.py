"""Built-in Flax models, selectable by name with ``--model``."""

from __future__ import annotations

import flax.linen as nn

from jdp.errors import UsageError
from jdp.models.classifier import classifier_loss, classifier_metrics, init_variables
from jdp.models.cnn import CNN
from jdp.models.mlp import MLP

MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN}


def check_model(name: str) -> type[nn.Module]:
    """Returns the model class, or raises UsageError naming the known models."""
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def get_model(name: str, num_classes: int) -> nn.Module:
    """Builds the built-in model ``name`` for ``num_classes`` classes."""
    return check_model(name)(num_classes=num_classes)


__all__ = [
    "CNN",
    "MLP",
    "MODELS",
    "check_model",
    "classifier_loss",
    "classifier_metrics",
    "get_model",
    "init_variables",
]
