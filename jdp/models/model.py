"""`Model`: a model in the forms jdp's step builders take, whichever adapter made it.

A `Model` holds ``init`` and ``apply`` in the ``has_model_state`` form and its
`Objective`; from them it gives ``loss_fn`` for `jdp.make_train_step`,
``metrics_fn`` for `jdp.make_eval_step` and the parameters made on a mesh in
their layout (`Model.init_on_mesh`). `from_linen` and `from_nnx` make one from a
Flax module; the built-in models are made by `from_linen`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.layout import Rules, param_specs
from jdp.layout import shardings as layout_shardings
from jdp.mesh import on_cpus
from jdp.models.memory import check_fits
from jdp.models.objectives import Batch, Objective

# The parameters are made once: on the CPU, LLVM's first optimisation level compiles
# their program 1.2-3.6x as fast as XLA's default (the digits MLP's 0.46 -> 0.16 s,
# resnet20's 3.3 -> 0.9 s, resnet50's 4.3 -> 2.5 s, GPT-2 124M's 0.70 -> 0.55 s, which
# then runs as fast). Each built-in model's parameters came out the same bits (all seven
# measured; mlp, cnn, resnet20 and gpt in `tests/test_models.py`), so a run's built-in
# model is made so (`jdp.models.registry.model_of_run`). Level 1 changes the last bits of
# some arithmetic (docs/figures.md) and level 0 of the initialisers too: a model of yours,
# and every step, keep XLA's default.
INIT_OPTIONS = {"xla_backend_optimization_level": 1}


def init_options(options: dict | None, mesh: Mesh) -> dict | None:
    """``options`` for the parameters' program on ``mesh``'s devices where they are CPUs
    and ``XLA_FLAGS`` sets no level for every program (a program's own options would
    override it); else None."""
    if options is None or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    return options if on_cpus(mesh) else None


@dataclasses.dataclass(frozen=True)
class Model:
    """A model in the step builders' ``has_model_state`` forms.

    Attributes:
        init: ``(rng, batch) -> (params, model_state)`` from a sample batch.
        apply: ``(params, model_state, batch, *, train, rng) -> (outputs, model_state)``.
        objective: the loss and metrics on the outputs.
        update: puts trained ``(params, model_state)`` back where the model came
            from (an NNX module), or None.

    Examples:
        >>> import flax.linen as nn
        >>> class Net(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x, train: bool = False):
        ...         return nn.Dense(10)(x.reshape(x.shape[0], -1))
        >>> model = jdp.models.from_linen(Net(), jdp.models.classification())
        >>> batch = {"image": np.zeros((64, 8, 8, 1), np.float32), "label": np.zeros(64, np.int32)}
        >>> params, model_state = model.init(jax.random.key(0), batch)
        >>> mesh, optimizer = jdp.make_mesh("data=8"), optax.adam(1e-3)
        >>> state = jdp.create_train_state(params, optimizer, mesh, model_state=model_state)
        >>> step = jdp.make_train_step(model.loss_fn, optimizer, mesh, has_model_state=True)
        >>> eval_step = jdp.make_eval_step(model.metrics_fn, mesh, has_model_state=True)
        >>> state, metrics = step(state, jdp.shard_batch(batch, mesh))
        >>> sorted(metrics)
        ['accuracy', 'loss']
    """

    init: Callable[[jax.Array, Batch], tuple[Any, Any]]
    apply: Callable[..., tuple[Any, Any]]
    objective: Objective
    # ``(params, model_state) -> None``: puts trained values back into the object
    # the model was made from (an NNX module); `jdp.fit` calls it at the end.
    update: Callable[[Any, Any], None] | None = None
    # ``(rng, batch) -> names``: the parameters' logical axis names (a tree like the
    # parameters, a tuple or None at each leaf), read without computing them; None
    # when the model gives none.
    names: Callable[[jax.Array, Batch], Any] | None = None
    # ``(params, batch) -> float``: the model FLOPs of one training step on ``batch``
    # (forward and backward, as a formula such as PaLM's counts them), for MFU; None:
    # jdp counts the products in the traced forward pass (`jdp.report.model_flops`).
    flops: Callable[[Any, Batch], float] | None = None
    # Whether ``apply`` takes a `jdp.rngs.RowKey` for its rng in training: its dropout
    # drawn per example of the global batch (`jdp.models.dropout`), the same on any mesh.
    row_keys: bool = False
    # The compiler options of the parameters' program on CPU devices (`init_options`):
    # a run's built-in model's are `INIT_OPTIONS`; None, XLA's defaults.
    init_options: dict | None = dataclasses.field(default=None, compare=False)

    def init_on_mesh(
        self, rng: jax.Array, batch: Batch, mesh: Mesh, *, rules: Rules | None = None
    ) -> tuple[Any, Any, Any]:
        """``(params, model_state, param_specs)``: the parameters made on ``mesh`` in their
        layout (`jdp.param_specs` from the model's logical axis names and ``rules``),
        each device computing only its shards; the model state replicated. Pass
        ``param_specs`` to `jdp.create_train_state`.

        Examples:
            >>> model = jdp.models.get_model("mlp", jdp.load_split("digits", "train"))
            >>> batch = {"image": np.zeros((1, 8, 8, 1), np.float32),
            ...          "label": np.zeros(1, np.int32)}
            >>> mesh = jdp.make_mesh("data=2,fsdp=2,model=2")
            >>> params, _, specs = model.init_on_mesh(jax.random.key(0), batch, mesh)
            >>> specs["Dense_0"]["kernel"], params["Dense_0"]["kernel"].sharding.spec
            (P('fsdp', 'model'), P('fsdp', 'model'))
        """
        abstract, _ = jax.eval_shape(self.init, rng, batch)
        names = None if self.names is None else self.names(rng, batch)
        specs = param_specs(abstract, mesh, names=names, rules=rules)
        check_fits(abstract, specs, mesh)
        replicated = NamedSharding(mesh, PartitionSpec())
        params, model_state = jax.jit(
            self.init,
            out_shardings=(layout_shardings(specs, mesh), replicated),
            compiler_options=init_options(self.init_options, mesh),
        )(rng, batch)
        return params, model_state, specs

    def loss_fn(self, params, model_state, batch, rng):
        """Mean loss, mean metrics and the new model state, for `jdp.make_train_step`."""
        outputs, model_state = self.apply(params, model_state, batch, train=True, rng=rng)
        if self.objective.both is not None:  # one pass
            losses, metrics = self.objective.both(outputs, batch)
            return losses.mean(), {name: v.mean() for name, v in metrics.items()}, model_state
        loss = self.objective.loss(outputs, batch).mean()
        metrics = {name: v.mean() for name, v in self.objective.metrics(outputs, batch).items()}
        return loss, metrics, model_state

    def metrics_fn(self, params, model_state, batch):
        """Per-example ``loss`` and metrics, for `jdp.make_eval_step`."""
        outputs, _ = self.apply(params, model_state, batch, train=False)
        if self.objective.both is not None:  # one pass
            losses, metrics = self.objective.both(outputs, batch)
            return {"loss": losses} | metrics
        return {"loss": self.objective.loss(outputs, batch)} | self.objective.metrics(
            outputs, batch
        )
