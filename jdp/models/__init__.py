"""Built-in Flax models, selectable by name with ``--model``, and adapters for your own.

Each built-in model has a ``small`` size (the reference workloads' sizes, or one
that trains in minutes on a CPU) and a ``standard`` one, chosen with
``--model-size``: the published architecture's for resnet20, resnet18, seq2seq
(Transformer base) and gpt (GPT-2 small); simply wider for mlp and cnn, which
have no canonical size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdp.mesh import DATA_AXIS
from jdp.models.adapters import from_linen, from_nnx
from jdp.models.cnn import CNN
from jdp.models.generate import generate, gpt_for
from jdp.models.hf import Pretrained, from_hf
from jdp.models.mlp import MLP
from jdp.models.model import Model
from jdp.models.objectives import Objective, classification, language_model, sequence
from jdp.models.registry import get_model
from jdp.models.resnet import ResNet
from jdp.models.transformer import GPT, Seq2SeqTransformer, greedy_decode, stack_layers


def translate(model: Model, params, model_state, batch, *, bos: int, eos: int) -> jnp.ndarray:
    """Greedy decoding of ``batch``'s sources by a built-in sequence model (seq2seq, gpt).

    Returns ``(rows, target length)`` tokens from ``<bos>``, as long as ``batch["target"]``
    (whose contents are not read); see `greedy_decode`.
    """

    @jax.jit  # compiled once per prefix length
    def next_logits(prefix):
        feed = {**batch, "target": jnp.pad(prefix, ((0, 0), (0, 1)))}  # the model reads [:, :-1]
        outputs, _ = model.apply(params, model_state, feed, train=False)
        return outputs[:, -prefix.shape[1] :]

    rows, length = batch["target"].shape
    return greedy_decode(next_logits, rows, length - 1, bos=bos, eos=eos)


__all__ = [
    "CNN",
    "DATA_AXIS",
    "GPT",
    "MLP",
    "Model",
    "Objective",
    "Pretrained",
    "ResNet",
    "Seq2SeqTransformer",
    "classification",
    "from_hf",
    "from_linen",
    "from_nnx",
    "generate",
    "get_model",
    "gpt_for",
    "greedy_decode",
    "language_model",
    "sequence",
    "stack_layers",
    "translate",
]
