"""The built-in models by name and size (``--model``, ``--model-size``), and the data each takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jdp.errors import UsageError
from jdp.models.adapters import from_linen
from jdp.models.cnn import CNN
from jdp.models.mlp import MLP
from jdp.models.model import Model
from jdp.models.objectives import classification, sequence
from jdp.models.resnet import ResNet
from jdp.models.transformer import GPT, Seq2SeqTransformer

SIZES = ("small", "standard")


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in model: what data it takes and its module at each size."""

    data: str  # "image" or "sequence", as `jdp.data.sources.dataset_kind` names datasets
    module: Callable[..., Any]
    sizes: dict[str, dict[str, Any]]


MODELS: dict[str, Builtin] = {
    "mlp": Builtin(
        "image", MLP, {"small": {"hidden": (512,)}, "standard": {"hidden": (1024, 1024)}}
    ),
    "cnn": Builtin(
        "image", CNN, {"small": {"features": (32, 64)}, "standard": {"features": (64, 128, 256)}}
    ),
    "resnet20": Builtin(
        "image",
        ResNet,
        {
            "small": {"stages": (3, 3, 3), "widths": (8, 16, 32)},
            "standard": {"stages": (3, 3, 3), "widths": (16, 32, 64)},
        },
    ),
    "resnet18": Builtin(
        "image",
        ResNet,
        {
            "small": {"stages": (2, 2, 2, 2), "widths": (16, 32, 64, 128)},
            "standard": {"stages": (2, 2, 2, 2), "widths": (64, 128, 256, 512)},
        },
    ),
    # small: the reference DDP Transformer (d_model 128, 4 heads, 2 + 2 layers);
    # standard: Transformer base (Vaswani et al., 2017).
    "seq2seq": Builtin(
        "sequence",
        Seq2SeqTransformer,
        {
            "small": {"width": 128, "heads": 4, "layers": 2, "hidden": 512},
            "standard": {"width": 512, "heads": 8, "layers": 6, "hidden": 2048},
        },
    ),
    # standard: GPT-2 small (124M parameters with its 50,257-token vocabulary).
    "gpt": Builtin(
        "sequence",
        GPT,
        {
            "small": {"width": 128, "heads": 4, "layers": 4, "hidden": 512, "max_len": 256},
            "standard": {"width": 768, "heads": 12, "layers": 12, "hidden": 3072, "max_len": 1024},
        },
    ),
}


def check_model(name: str, size: str = "small", data: str | None = None) -> Builtin:
    """The built-in model ``name``; UsageError for an unknown name or size, or the wrong data."""
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}")
    if size not in SIZES:
        raise UsageError(f"unknown model size {size!r}; choose one of: {', '.join(SIZES)}")
    builtin = MODELS[name]
    if data is not None and data != builtin.data:
        fitting = ", ".join(sorted(n for n, m in MODELS.items() if m.data == data))
        raise UsageError(
            f"model {name!r} takes {builtin.data} data and the dataset holds {data} data; "
            f"for it choose --model {fitting}"
        )
    return builtin


def _lm_inputs(batch):
    """A decoder-only model reads the source, then the target it is to continue."""
    return (jnp.concatenate([batch["source"], batch["target"][:, :-1]], axis=1),)


def get_model(name: str, split, size: str = "small") -> Model:
    """The built-in model ``name`` at ``size``, shaped for ``split`` (classes or vocabulary).

    Examples:
        >>> train = jdp.load_split("digits", "train", data_dir=tmp)
        >>> model = jdp.models.get_model("cnn", train)
        >>> params, _ = model.init(jax.random.key(0), {"image": train.image[:1]})
        >>> sum(np.size(leaf) for leaf in jax.tree.leaves(params))
        19562
    """
    builtin = check_model(name, size, split.kind)
    options = builtin.sizes[size]
    if builtin.data == "image":
        if split.label_key is None or not split.num_classes:
            raise UsageError(
                f"the built-in {name} classifies, and the data has no integer label; give "
                "label_key= naming it, or bring your own model (jdp.models.from_linen)"
            )
        return from_linen(
            builtin.module(num_classes=split.num_classes, **options),
            classification(split.label_key),
            inputs=split.input_key,
        )
    module = builtin.module(vocab_size=len(split.vocab), **options)
    if name == "gpt":
        return from_linen(module, sequence(), inputs=_lm_inputs)
    return from_linen(module, sequence(), inputs=lambda b: (b["source"], b["target"][:, :-1]))
