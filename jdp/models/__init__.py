"""Built-in Flax models, selectable by name with ``--model``, and adapters for your own.

Each built-in model has a ``small`` size (the reference workloads' sizes, or one
that trains in minutes on a CPU) and a ``standard`` one, chosen with
``--model-size``: the published architecture's for resnet20, resnet18, seq2seq
(Transformer base) and gpt (GPT-2 small); simply wider for mlp and cnn, which
have no canonical size.
"""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.mesh": ("DATA_AXIS",),
        "jdp.models.adapters": ("from_linen", "from_nnx"),
        "jdp.models.cnn": ("CNN",),
        "jdp.models.generate": ("generate", "gpt_for", "translate"),
        "jdp.models.hf": ("Pretrained", "from_hf"),
        "jdp.models.mlp": ("MLP",),
        "jdp.models.model": ("Model",),
        "jdp.models.objectives": ("Objective", "classification", "language_model", "sequence"),
        "jdp.models.registry": ("get_model",),
        "jdp.models.resnet": ("ResNet",),
        "jdp.models.transformer": ("GPT", "Seq2SeqTransformer", "greedy_decode", "stack_layers"),
    },
)
