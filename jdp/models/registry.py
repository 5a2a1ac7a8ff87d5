"""The built-in models by name and size (``--model``, ``--model-size``), and the data each takes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jdp.errors import UsageError
from jdp.models.adapters import from_linen
from jdp.models.cnn import CNN
from jdp.models.mlp import MLP
from jdp.models.model import INIT_OPTIONS, Model
from jdp.models.objectives import classification, language_model, sequence
from jdp.models.resnet import ResNet
from jdp.models.transformer import GPT, Seq2SeqTransformer, flops_per_token

SIZES = ("small", "standard", "124m", "350m", "774m", "1.3b")
# The language model's published sizes (GPT-2's and GPT-3 XL), its vocabulary padded up
# to a multiple of this: GPT-2's 50,257 tokens as 50,304 (whole tiles for the matrix units).
LM_SIZES = ("124m", "350m", "774m", "1.3b")
# gpt's fields that flags set in place of a size's (``--layers`` ...; ``--dropout`` too).
GPT_SHAPE = ("layers", "heads", "width", "hidden")
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in model: what data it takes and its module at each size."""

    data: tuple[str, ...]  # the kinds of split it takes: "image", "sequence" (pairs), "text"
    module: Callable[..., Any]
    sizes: dict[str, dict[str, Any]]


_BOTTLENECKS = {"bottleneck": True, "imagenet_stem": True}  # ImageNet's ResNets from 50 layers

MODELS: dict[str, Builtin] = {
    "mlp": Builtin(
        ("image",), MLP, {"small": {"hidden": (512,)}, "standard": {"hidden": (1024, 1024)}}
    ),
    "cnn": Builtin(
        ("image",), CNN, {"small": {"features": (32, 64)}, "standard": {"features": (64, 128, 256)}}
    ),
    "resnet20": Builtin(
        ("image",),
        ResNet,
        {
            "small": {"stages": (3, 3, 3), "widths": (8, 16, 32)},
            "standard": {"stages": (3, 3, 3), "widths": (16, 32, 64)},
        },
    ),
    "resnet18": Builtin(
        ("image",),
        ResNet,
        {
            "small": {"stages": (2, 2, 2, 2), "widths": (16, 32, 64, 128)},
            "standard": {"stages": (2, 2, 2, 2), "widths": (64, 128, 256, 512)},
        },
    ),
    # standard: torchvision's ResNet-50 (v1.5), 25,557,032 parameters for 1,000 classes.
    "resnet50": Builtin(
        ("image",),
        ResNet,
        {
            "small": {"stages": (3, 4, 6, 3), "widths": (16, 32, 64, 128), **_BOTTLENECKS},
            "standard": {"stages": (3, 4, 6, 3), "widths": (64, 128, 256, 512), **_BOTTLENECKS},
        },
    ),
    # small: the reference DDP Transformer (d_model 128, 4 heads, 2 + 2 layers);
    # standard: Transformer base (Vaswani et al., 2017).
    "seq2seq": Builtin(
        ("sequence",),
        Seq2SeqTransformer,
        {
            "small": {"width": 128, "heads": 4, "layers": 2, "hidden": 512},
            "standard": {"width": 512, "heads": 8, "layers": 6, "hidden": 2048},
        },
    ),
    # standard: GPT-2 small (124M parameters with its 50,257-token vocabulary).
    "gpt": Builtin(
        ("sequence", "text"),
        GPT,
        {
            "small": {"width": 128, "heads": 4, "layers": 4, "hidden": 512, "max_len": 256},
            "standard": {"width": 768, "heads": 12, "layers": 12, "hidden": 3072, "max_len": 1024},
            # GPT-2 small, medium and large (Radford et al., 2019), GPT-3 XL (Brown et al., 2020).
            "124m": {"width": 768, "heads": 12, "layers": 12, "hidden": 3072, "max_len": 1024},
            "350m": {"width": 1024, "heads": 16, "layers": 24, "hidden": 4096, "max_len": 1024},
            "774m": {"width": 1280, "heads": 20, "layers": 36, "hidden": 5120, "max_len": 1024},
            "1.3b": {"width": 2048, "heads": 16, "layers": 24, "hidden": 8192, "max_len": 2048},
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
    if size not in builtin.sizes:
        raise UsageError(
            f"model size {size} is the language model's; {name} comes in: "
            f"{', '.join(builtin.sizes)}"
        )
    if data is not None and data not in builtin.data:
        fitting = ", ".join(sorted(n for n, m in MODELS.items() if data in m.data))
        raise UsageError(
            f"model {name!r} takes {' or '.join(builtin.data)} data and the dataset holds "
            f"{data} data; for it choose --model {fitting}"
        )
    return builtin


def context(name: str, size: str = "small") -> int:
    """The tokens a built-in model reads at once by default (its ``max_len``; 256 for others)."""
    return MODELS[name].sizes[size].get("max_len", 256) if name in MODELS else 256


def _lm_inputs(batch):
    """A decoder-only model reads the source, then the target it is to continue."""
    return (jnp.concatenate([batch["source"], batch["target"][:, :-1]], axis=1),)


def _window_inputs(batch):
    """A language model reads a window's tokens but the last, and predicts the next of each."""
    return (batch["tokens"][:, :-1],)


def model_of_run(settings: Mapping[str, Any], split, *, logits: bool = False) -> Model:
    """The built-in model a run's settings name, shaped for ``split``: a `jdp.TrainConfig`'s
    fields (``dataclasses.asdict``) as a run builds it, or the config a checkpoint recorded
    as `jdp.load_model` rebuilds it. A setting an older jdp did not record takes the value
    that jdp ran with (``unroll_layers``: the layers unrolled, written before scanned ones).
    ``logits``: the model returns logits, not the loss's chunked head (``--loss-chunks``:
    predicting wants every logit). ``architecture``: gpt's shape, loaded weights'. Its
    parameters' program compiles quicker on the CPU, to the same bits (`INIT_OPTIONS`)."""
    model = get_model(
        settings["model"],
        split,
        settings.get("model_size", "small"),
        seq_len=settings.get("seq_len") or 0,
        remat=settings.get("remat", "none"),
        attention=settings.get("attention", "auto"),
        unroll=settings.get("unroll_layers", True),
        architecture=settings.get("architecture"),
        label_smoothing=settings.get("label_smoothing", 0.0),
        loss_chunks=1 if logits else settings.get("loss_chunks", 1),
        shape=gpt_shape(settings),
        fp8=settings.get("fp8", False),
    )
    return dataclasses.replace(model, init_options=INIT_OPTIONS)


def gpt_shape(settings: Mapping[str, Any]) -> dict[str, Any]:
    """gpt's fields a run's settings give in place of its size's (``--layers`` ...,
    ``--no-bias``, ``--dropout``)."""
    shape = {name: settings[name] for name in GPT_SHAPE if settings.get(name)}
    shape |= {"bias": False} if settings.get("bias") is False else {}
    return shape | ({"dropout": settings["dropout"]} if settings.get("dropout") is not None else {})


def get_model(
    name: str,
    split,
    size: str = "small",
    *,
    seq_len: int = 0,
    remat: str = "none",
    attention: str = "auto",
    unroll: bool = False,
    architecture: Mapping[str, Any] | None = None,
    label_smoothing: float = 0.0,
    loss_chunks: int = 1,
    shape: Mapping[str, Any] | None = None,
    fp8: bool = False,
) -> Model:
    """The built-in model ``name`` at ``size``, shaped for ``split`` (classes or vocabulary).

    ``seq_len`` sets the positions ``gpt`` has (``--seq-len``; a token corpus's
    windows set it by default); ``remat`` and ``unroll`` its layers (`GPT`);
    ``attention`` the implementation of gpt's and seq2seq's attention. At the
    published sizes (``124m`` ...) gpt's vocabulary is the data's padded to a
    multiple of 128. ``architecture``: gpt's `GPT` fields in place of the size's (a
    model loaded from weights, `jdp.models.from_hf`), its vocabulary unpadded.
    ``label_smoothing``: an image classifier's (`jdp.models.classification`).
    ``loss_chunks``: gpt on a token corpus takes its logits for the loss that many
    chunks of tokens at a time (`jdp.models.head`).
    ``shape``: gpt's ``layers``, ``heads``, ``width``, ``hidden``, ``bias`` or ``dropout`` in place
    of the size's (``--layers`` ...). ``fp8``: gpt's layers' products in FP8 while training
    (`jdp.models.fp8`).

    Examples:
        >>> train = jdp.load_split("digits", "train", data_dir=tmp)
        >>> model = jdp.models.get_model("cnn", train)
        >>> params, _ = model.init(jax.random.key(0), {"image": train.image[:1]})
        >>> sum(np.size(leaf) for leaf in jax.tree.leaves(params))
        19562
    """
    builtin = check_model(name, size, split.kind)
    if fp8 and name != "gpt":
        raise UsageError(f"fp8 is gpt's layers' products; {name} has none: leave it out")
    options = dict(builtin.sizes[size])
    if shape:
        shape = _checked_shape(name, shape, options, loaded=architecture is not None)
        options.update(shape)
    if "image" in builtin.data:
        if split.label_key is None or not split.num_classes:
            raise UsageError(
                f"the built-in {name} classifies, and the data has no integer label; give "
                "label_key= naming it, or bring your own model (jdp.models.from_linen)"
            )
        return from_linen(
            builtin.module(num_classes=split.num_classes, **options),
            classification(split.label_key, smoothing=label_smoothing),
            inputs=getattr(split, "normalize", None) or split.input_key,  # uint8 images' too
        )
    if label_smoothing:
        raise UsageError(
            f"--label-smoothing is for the image classifiers; {name} predicts tokens: leave it out"
        )
    options["attention"] = attention
    if name != "gpt":
        module = builtin.module(vocab_size=len(split.vocab), **options)
        return from_linen(
            module, sequence(), inputs=lambda b: (b["source"], b["target"][:, :-1]), rows_arg="rows"
        )
    options["max_len"] = seq_len or getattr(split, "seq_len", 0) or options["max_len"]
    options.update(remat=remat, unroll=unroll, fp8=fp8)
    if loss_chunks > 1:
        if split.kind != "text":
            raise UsageError(
                f"--loss-chunks {loss_chunks} is for a language model on a token corpus; "
                "drop it for this data"
            )
        options["loss_chunks"] = loss_chunks
    pad = VOCAB_MULTIPLE if size in LM_SIZES else 1
    if architecture is not None:  # its shape; a dropout the flags give over the weights'
        return _loaded_gpt(split, {**architecture, **(shape or {})}, options)
    return _gpt(split, options, pad)


def _gpt(split, options: dict, pad: int) -> Model:
    """gpt at ``options`` for ``split``: a language model on a token corpus's windows, or
    a model of a pair's source and target read as one sequence; its vocabulary padded to
    a multiple of ``pad``."""
    if split.kind == "text":
        if split.seq_len > options["max_len"]:
            raise UsageError(
                f"the data's windows are {split.seq_len} tokens and --seq-len is "
                f"{options['max_len']}; make them agree (seq_len= of jdp.data.from_tokens)"
            )
        module = GPT(vocab_size=_padded(split.vocab_size, pad), **options)
        bits = split.tokenizer == "bytes"
        objective = language_model(
            split.input_key, bits_per_byte=bits, chunked=module.loss_chunks > 1
        )
        model = from_linen(module, objective, inputs=_window_inputs, rows_arg="rows")
        return dataclasses.replace(model, flops=_lm_flops(module))
    needed = split.source.shape[1] + split.target.shape[1] - 1 if hasattr(split, "source") else 0
    if needed > options["max_len"]:
        raise UsageError(
            f"--seq-len {options['max_len']} is shorter than the data's sequences "
            f"({needed} tokens); use --seq-len {needed} or more"
        )
    module = GPT(vocab_size=_padded(len(split.vocab), pad), **options)
    model = from_linen(module, sequence(), inputs=_lm_inputs, rows_arg="rows")
    return dataclasses.replace(model, flops=_lm_flops(module))


def _checked_shape(name: str, shape: Mapping[str, Any], options: dict, *, loaded: bool) -> dict:
    """gpt's fields the flags set (``--width`` alone: 4 times as many hidden units, GPT-2's
    ratio), checked against the model, the loaded weights and the size's ``options``."""
    if name != "gpt":
        raise UsageError(f"{', '.join(map(_flag, shape))} shape the gpt; --model is {name}")
    fixed = sorted(set(shape) & {*GPT_SHAPE, "bias"})
    if loaded and fixed:
        raise UsageError(
            f"{', '.join(map(_flag, fixed))}: the loaded weights set the gpt's shape; "
            "drop them (--dropout may change)"
        )
    if "width" in shape and "hidden" not in shape:
        shape = {**shape, "hidden": 4 * shape["width"]}
    width, heads = shape.get("width", options["width"]), shape.get("heads", options["heads"])
    if width % heads:
        raise UsageError(
            f"a width of {width} does not split into {heads} heads; give a "
            "--width that --heads divides"
        )
    return dict(shape)


def _flag(field: str) -> str:
    """A shape field as the flag that sets it."""
    return "--no-bias" if field == "bias" else f"--{field}"


def _loaded_gpt(split, architecture: Mapping[str, Any], options: dict) -> Model:
    """gpt as ``architecture`` makes it (its positions and vocabulary), for ``split``."""
    vocab = split.vocab_size if split.kind == "text" else len(split.vocab)
    if vocab > architecture["vocab_size"]:
        raise UsageError(
            f"the data's vocabulary is {vocab} tokens and the loaded model's "
            f"{architecture['vocab_size']}; tokenize the data with the model's tokenizer"
        )
    window = (
        split.seq_len
        if split.kind == "text"
        else (split.source.shape[1] + split.target.shape[1] - 1)
    )
    if window > architecture["max_len"]:
        raise UsageError(
            f"the data's windows are {window} tokens and the loaded model has "
            f"{architecture['max_len']} positions; make the windows shorter"
        )
    options = {key: value for key, value in options.items() if key != "max_len"}
    module = GPT(**{**options, **architecture})
    if split.kind == "text":
        bits = split.tokenizer == "bytes"
        objective = language_model(
            split.input_key, bits_per_byte=bits, chunked=module.loss_chunks > 1
        )
        model = from_linen(module, objective, inputs=_window_inputs, rows_arg="rows")
    else:
        model = from_linen(module, sequence(), inputs=_lm_inputs, rows_arg="rows")
    return dataclasses.replace(model, flops=_lm_flops(module))


def _padded(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def _lm_flops(module: GPT):
    """``(params, batch) -> model FLOPs of one step on batch``, `flops_per_token`'s count."""

    def flops(params, batch) -> float:
        if "source" in batch:  # the tokens the model reads: as `_lm_inputs` joins them
            rows, source = batch["source"].shape
            seq_len = source + batch["target"].shape[1] - 1
        else:
            rows, window = batch["tokens"].shape
            seq_len = window - 1
        parameters = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
        per_token = flops_per_token(
            parameters,
            layers=module.layers,
            width=module.width,
            seq_len=seq_len,
            max_len=module.max_len,
        )
        return per_token * rows * seq_len

    return flops
