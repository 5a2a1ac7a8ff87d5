"""GPT-2 weights from and to Hugging Face ``transformers``' checkpoint directories.

A directory as ``GPT2LMHeadModel.save_pretrained`` writes it (or as the Hub holds
GPT-2's published weights): ``config.json`` and ``model.safetensors``, or shards
listed in ``model.safetensors.index.json``. They are read and written with the
``safetensors`` library; neither torch nor ``transformers`` is needed.

``transformers``' GPT-2 is jdp's `GPT` with other names: its ``Conv1D`` layers
hold their weights as ``(in, out)``, as a Flax ``Dense`` kernel does, and
``c_attn`` holds the query, key and value projections side by side, each
``heads`` blocks of ``width // heads`` columns. Only the LayerNorm epsilon
differs (1e-5), and the model keeps it (`GPT.epsilon`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax.core import meta

from jdp.errors import UsageError
from jdp.models.transformer import GPT
from jdp.tool import key_of, read_json

PREFIX = "hf:"  # --init-from hf:DIR
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
_SAVED_BY = "give a directory GPT2LMHeadModel.save_pretrained wrote"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's
# GPT-2's activations that are the tanh approximation of GELU, which `GPT` computes.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
# Per layer: (jdp's path below ``blocks``, transformers' name below ``h.N``).
_LAYER = (
    (("LayerNorm_0", "scale"), "ln_1.weight"),
    (("LayerNorm_0", "bias"), "ln_1.bias"),
    (("LayerNorm_1", "scale"), "ln_2.weight"),
    (("LayerNorm_1", "bias"), "ln_2.bias"),
    (("FeedForward_0", "Dense_0", "kernel"), "mlp.c_fc.weight"),
    (("FeedForward_0", "Dense_0", "bias"), "mlp.c_fc.bias"),
    (("FeedForward_0", "Dense_1", "kernel"), "mlp.c_proj.weight"),
    (("FeedForward_0", "Dense_1", "bias"), "mlp.c_proj.bias"),
)
_TOP = (
    (("Embed_0", "embedding"), "wte.weight"),
    (("Embed_1", "embedding"), "wpe.weight"),
    (("LayerNorm_0", "scale"), "ln_f.weight"),
    (("LayerNorm_0", "bias"), "ln_f.bias"),
)
_ATTENTION = "MultiHeadDotProductAttention_0"
_SHAPE_KEYS = ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions")  # config.json's
_QKV = ("query", "key", "value")


class Pretrained(NamedTuple):
    """A `GPT` and its parameters (scanned layers), as `from_hf` read them."""

    module: GPT
    params: dict
    architecture: dict  # the `GPT` fields the weights set


def from_hf(directory: str | os.PathLike, **options: Any) -> Pretrained:
    """GPT-2 from a ``transformers`` checkpoint directory, as jdp's `GPT`.

    ``options`` are the `GPT` fields the weights do not set (``remat``,
    ``attention``, ``dropout``: by default the checkpoint's ``resid_pdrop``).

    Raises:
        UsageError: no such directory, not GPT-2, or a tensor missing, unknown or of
            another shape (named).

    Examples:
        >>> gpt = jdp.models.GPT(vocab_size=40, width=16, heads=2, layers=2, hidden=32,
        ...                      max_len=8)
        >>> params = jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        >>> jdp.models.hf.write_hf(tmp, gpt, params["params"])
        >>> loaded = jdp.models.from_hf(tmp)  # or a directory save_pretrained wrote
        >>> loaded.module.layers, loaded.module.epsilon == gpt.epsilon
        (2, True)
    """
    directory = os.fspath(directory)
    architecture = read_architecture(directory)
    module = GPT(**{**architecture, **options})
    return Pretrained(module, read_weights(directory, architecture), architecture)


def read_architecture(directory: str) -> dict:
    """The `GPT` fields of a ``transformers`` GPT-2 directory's ``config.json``."""
    path = os.path.join(directory, CONFIG_FILE)
    config = read_json(path, "a GPT-2 config.json", _SAVED_BY)
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a GPT-2 config.json: not a JSON object; {_SAVED_BY}")
    if config.get("model_type") != "gpt2":
        raise UsageError(
            f"{path} is a {config.get('model_type')!r} model; jdp loads GPT-2 (model_type gpt2)"
        )
    refused = {
        "activation_function": (config.get("activation_function", "gelu_new") not in TANH_GELU),
        "scale_attn_by_inverse_layer_idx": config.get("scale_attn_by_inverse_layer_idx", False),
        "scale_attn_weights": not config.get("scale_attn_weights", True),
        "add_cross_attention": config.get("add_cross_attention", False),
        "tie_word_embeddings": not config.get("tie_word_embeddings", True),
    }
    for name, differs in refused.items():
        if differs:
            raise UsageError(
                f"{path}: {name} {config.get(name)!r} is not GPT-2's, which jdp's gpt computes"
            )
    missing = [key for key in _SHAPE_KEYS if not isinstance(config.get(key), int)]
    if missing:
        raise UsageError(f"{path} states no {', '.join(missing)}; GPT-2's config.json has them")
    _check_numbers(path, config)
    width = config["n_embd"]
    return {
        "vocab_size": config["vocab_size"],
        "width": width,
        "heads": config["n_head"],
        "layers": config["n_layer"],
        "hidden": config.get("n_inner") or 4 * width,
        "max_len": config["n_positions"],
        "epsilon": config.get("layer_norm_epsilon", 1e-5),
        "dropout": config.get("resid_pdrop", 0.1),
    }


def _check_numbers(path: str, config: Mapping) -> None:
    """UsageError naming a key of ``config.json`` whose value no GPT-2 can have."""
    sizes = [*_SHAPE_KEYS, *(["n_inner"] if config.get("n_inner") is not None else [])]
    for key in sizes:
        if not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1:
            raise UsageError(f"{path}: {key} {config[key]!r} is not a positive whole number")
    if config["n_embd"] % config["n_head"]:
        raise UsageError(
            f"{path}: n_head {config['n_head']} does not divide n_embd "
            f"{config['n_embd']}; each head takes an equal share"
        )
    for key, default, low in (("layer_norm_epsilon", 1e-5, "(0"), ("resid_pdrop", 0.1, "[0")):
        value = config.get(key, default)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not 0 <= value < 1 or (low == "(0" and value == 0):
            raise UsageError(f"{path}: {key} {value!r} is not a number in {low}, 1)")


def read_weights(directory: str, architecture: Mapping) -> dict:
    """The parameters of a ``transformers`` GPT-2 directory, as `GPT` holds them."""
    tensors = _read_tensors(directory)
    named = {_short(name): value for name, value in tensors.items()}
    layers, width, heads = architecture["layers"], architecture["width"], architecture["heads"]
    expected = _expected_shapes(architecture)
    taken = set()

    def take(name: str) -> np.ndarray:
        if name not in named:
            raise UsageError(f"{directory}: the tensor {name} is missing")
        value = named[name]
        if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != "bfloat16":
            raise UsageError(
                f"{directory}: the tensor {name} holds {value.dtype} numbers; "
                "GPT-2's weights are floating point"
            )
        if value.shape != expected[name]:
            raise UsageError(
                f"{directory}: the tensor {name} is {value.shape}, and config.json makes it "
                f"{expected[name]}"
            )
        value = np.asarray(value, np.float32)
        if not np.isfinite(value).all():  # else the loss is NaN at step 1, blamed on the data
            raise UsageError(
                f"{directory}: the tensor {name} holds NaN or infinite numbers; "
                "these weights cannot be trained from"
            )
        taken.add(name)
        return value

    params: dict = {}
    for path, name in _TOP:
        _put(params, path, take(name))
    blocks: dict = {}
    for path, name in _LAYER:
        _put(blocks, path, np.stack([take(f"h.{i}.{name}") for i in range(layers)]))
    split = [np.split(take(f"h.{i}.attn.c_attn.weight"), 3, axis=1) for i in range(layers)]
    biases = [np.split(take(f"h.{i}.attn.c_attn.bias"), 3) for i in range(layers)]
    for index, part in enumerate(_QKV):
        kernel = np.stack([s[index] for s in split]).reshape(layers, width, heads, -1)
        bias = np.stack([b[index] for b in biases]).reshape(layers, heads, -1)
        blocks.setdefault(_ATTENTION, {})[part] = {"kernel": kernel, "bias": bias}
    out = np.stack([take(f"h.{i}.attn.c_proj.weight") for i in range(layers)])
    blocks[_ATTENTION]["out"] = {
        "kernel": out.reshape(layers, heads, width // heads, width),
        "bias": np.stack([take(f"h.{i}.attn.c_proj.bias") for i in range(layers)]),
    }
    params["blocks"] = blocks
    _check_rest(directory, named, taken)
    return params


def _check_rest(directory: str, named: Mapping, taken: set) -> None:
    """UsageError for a tensor that was not read: the head when it is not the embedding
    (an untied head), anything unknown; the causal-mask buffers old files hold pass."""
    for name, value in named.items():
        mask = name.endswith((".attn.bias", ".attn.masked_bias")) and value.ndim != 1
        if name in taken or mask:
            continue
        if name == "lm_head.weight" and np.array_equal(value, named["wte.weight"]):
            continue  # tied, written out anyway
        raise UsageError(
            f"{directory}: the tensor {name} is not GPT-2's; jdp's gpt has no place for it"
        )


def _expected_shapes(architecture: Mapping) -> dict[str, tuple[int, ...]]:
    vocab, width, hidden = architecture["vocab_size"], architecture["width"], architecture["hidden"]
    shapes = {
        "wte.weight": (vocab, width),
        "wpe.weight": (architecture["max_len"], width),
        "ln_f.weight": (width,),
        "ln_f.bias": (width,),
    }
    per_layer = {
        "ln_1.weight": (width,),
        "ln_1.bias": (width,),
        "ln_2.weight": (width,),
        "ln_2.bias": (width,),
        "attn.c_attn.weight": (width, 3 * width),
        "attn.c_attn.bias": (3 * width,),
        "attn.c_proj.weight": (width, width),
        "attn.c_proj.bias": (width,),
        "mlp.c_fc.weight": (width, hidden),
        "mlp.c_fc.bias": (hidden,),
        "mlp.c_proj.weight": (hidden, width),
        "mlp.c_proj.bias": (width,),
    }
    for layer in range(architecture["layers"]):
        shapes.update({f"h.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _short(name: str) -> str:
    """``transformer.h.0.ln_1.weight`` -> ``h.0.ln_1.weight`` (the Hub's files have no prefix)."""
    return name.removeprefix("transformer.")


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        weight_map = key_of(
            read_json(index, "a safetensors index", _SAVED_BY),
            index,
            ["weight_map"],
            "a safetensors index",
            _SAVED_BY,
        )
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and os.sep not in name for name in weight_map.values()
        ):
            raise UsageError(f"{index}: weight_map is not tensor names to file names; {_SAVED_BY}")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, WEIGHTS_FILE)):
        files = [WEIGHTS_FILE]
    else:
        raise UsageError(
            f"{directory} holds no {WEIGHTS_FILE}; save the model with safetensors "
            "(save_pretrained's default) or convert its pytorch_model.bin"
        )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(_load(os.path.join(directory, name)))
    return tensors


def _load(path: str) -> dict[str, np.ndarray]:
    """One safetensors file's tensors as NumPy arrays; bfloat16, which NumPy's reader
    does not know, through the Flax reader."""
    from safetensors import SafetensorError
    from safetensors import flax as safetensors_flax
    from safetensors import numpy as safetensors_numpy

    try:
        try:
            return safetensors_numpy.load_file(path)
        except TypeError:  # "data type 'bfloat16' not understood"
            return {n: np.asarray(v) for n, v in safetensors_flax.load_file(path).items()}
    except (SafetensorError, OSError) as error:
        raise UsageError(f"{path}: not readable as safetensors ({error})") from None


def special_tokens(directory: str) -> dict[str, int | None]:
    """``bos_token_id`` and ``eos_token_id`` of a ``transformers`` directory's
    ``config.json`` (None where it states none or cannot be read)."""
    try:
        with open(os.path.join(directory, CONFIG_FILE)) as file:
            config = json.load(file)
    except (OSError, ValueError):
        config = {}
    return {
        key: config.get(key) if isinstance(config.get(key), int) else None for key in SPECIAL_TOKENS
    }


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id")


def write_hf(
    directory: str | os.PathLike,
    module: GPT,
    params: Mapping,
    special: Mapping[str, int | None] | None = None,
) -> None:
    """Writes `GPT` ``module``'s ``params`` (scanned layers; host or device arrays)
    as a ``transformers`` GPT-2 directory: ``config.json`` (``special``: its
    ``bos_token_id`` and ``eos_token_id``) and ``model.safetensors``."""
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    params = jax.tree.map(np.asarray, meta.unbox(params))
    layers, width = module.layers, module.width
    tensors: dict[str, np.ndarray] = {}
    for path, name in _TOP:
        tensors[f"transformer.{name}"] = _get(params, path)
    blocks = params["blocks"]
    attention = blocks[_ATTENTION]
    for layer in range(layers):
        prefix = f"transformer.h.{layer}."
        for path, name in _LAYER:
            tensors[prefix + name] = _get(blocks, path)[layer]
        parts = [attention[part]["kernel"][layer].reshape(width, width) for part in _QKV]
        tensors[prefix + "attn.c_attn.weight"] = np.concatenate(parts, axis=1)
        biases = [attention[part]["bias"][layer].reshape(width) for part in _QKV]
        tensors[prefix + "attn.c_attn.bias"] = np.concatenate(biases)
        out = attention["out"]["kernel"][layer]
        tensors[prefix + "attn.c_proj.weight"] = out.reshape(width, width)
        tensors[prefix + "attn.c_proj.bias"] = attention["out"]["bias"][layer]
    os.makedirs(directory, exist_ok=True)
    contiguous = {name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()}
    weights = os.path.join(directory, WEIGHTS_FILE)
    try:
        save_file(contiguous, weights, metadata={"format": "pt"})
    except Exception as error:  # safetensors' own type, for the OS's failures too
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found is None:
            raise
        with contextlib.suppress(OSError):
            os.remove(weights)  # a file cut short is no export
        number = int(found.group(1))
        raise OSError(number, os.strerror(number), weights) from None
    with open(os.path.join(directory, CONFIG_FILE), "w") as file:
        json.dump(_config(module) | dict(special or {}), file, indent=2)


def _config(module: GPT) -> dict:
    """``config.json`` of `GPT` ``module`` as a ``transformers`` GPT-2."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": module.vocab_size,
        "n_positions": module.max_len,
        "n_embd": module.width,
        "n_layer": module.layers,
        "n_head": module.heads,
        "n_inner": module.hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": module.epsilon,
        "resid_pdrop": module.dropout,
        "embd_pdrop": module.dropout,
        "attn_pdrop": 0.0,  # jdp's gpt has no dropout on attention weights
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def directory_of(init_from: str | None) -> str | None:
    """``DIR`` of ``--init-from hf:DIR``; None for a jdp checkpoint or none."""
    return init_from[len(PREFIX) :] if init_from and init_from.startswith(PREFIX) else None


def architecture_for(init_from: str | None, model: str, split) -> dict | None:
    """The `GPT` fields ``--init-from hf:DIR`` sets (None for another ``--init-from``),
    checked against the run's ``--model`` and training ``split``."""
    directory = directory_of(init_from)
    if directory is None:
        return None
    if model != "gpt":
        raise UsageError(f"--init-from {init_from} loads GPT-2's weights; use --model gpt")
    architecture = read_architecture(directory)
    bytes_ids = getattr(split, "tokenizer", None) == "bytes"
    if bytes_ids and os.path.exists(os.path.join(directory, "tokenizer.json")):
        raise UsageError(
            f"the data's ids are UTF-8 bytes and {directory}'s model reads its tokenizer's; "
            f"tokenize the corpus with --tokenizer {os.path.join(directory, 'tokenizer.json')}"
        )
    return architecture
