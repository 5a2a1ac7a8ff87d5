"""What a model costs each device on a mesh: the figures `python -m jdp.plan` reports.

From shapes and the layout (`jdp.layout`), exactly and for any mesh size: the
bytes of parameters, gradients and optimizer state (`state_bytes`). From the
train step compiled for the mesh on this process's (simulated) devices: its
arguments and temporaries and the collectives' bytes by mesh axis
(`compiled_figures`); the model's FLOPs from shapes (`step_model_flops`). Both
fill a `Plan`, for a built-in model (`build_model`); `jdp.plan` turns it into the
report, the accelerator's fit and the roofline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence


@dataclasses.dataclass
class Plan:
    """One model on one mesh: bytes per device, and what the compiled step says."""

    mesh: dict[str, int]
    params: int  # bytes per device
    grads: int
    optimizer: int
    parameters: int  # the model's parameter count
    temporaries: int | None = None  # bytes per device, compiled
    arguments: int | None = None  # the compiled step's arguments per device (state, batch)
    collectives: dict[str, int] | None = None  # "op over axes" -> bytes per device per step
    wire: float | None = None  # bytes each device sends per step (ring algorithms)
    flops: float | None = None  # per step, all devices

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def need(self) -> int:
        """Bytes a device needs: the compiled step's arguments (the state at rest, the
        batch) and temporaries (activations, gradients, gathered parameters), or, not
        compiled, parameters, gradients and optimizer state."""
        if self.arguments is not None and self.temporaries is not None:
            return self.arguments + self.temporaries
        return self.state


def build_model(
    name: str,
    size: str,
    *,
    vocab: int,
    seq_len: int,
    image: Sequence[int],
    remat: str = "none",
    unroll: bool = False,
    loss_chunks: int = 1,
    attention: str = "auto",
    fp8: bool = False,
):
    """The built-in model and one example's batch (numpy) to shape it: gpt as a run on
    a token corpus makes it (``remat``, ``unroll`` and ``loss_chunks``: `jdp.models.GPT`;
    ``attention``: gpt's and seq2seq's implementation; ``fp8``: gpt's products)."""
    import numpy as np

    from jdp.models import registry
    from jdp.models.adapters import classification, from_linen, sequence
    from jdp.models.objectives import language_model

    options = dict(registry.check_model(name, size).sizes[size])
    builtin = registry.MODELS[name]
    if "image" in builtin.data:
        model = from_linen(builtin.module(num_classes=10, **options), classification())
        batch = {"image": np.zeros((1, *image), np.float32), "label": np.zeros(1, np.int32)}
        return model, batch
    if name == "gpt":  # as a run sets them
        options.update(
            remat=remat, unroll=unroll, max_len=seq_len, loss_chunks=loss_chunks, fp8=fp8
        )
    if name in ("gpt", "seq2seq"):
        options.update(attention=attention)
    module = builtin.module(vocab_size=vocab, **options)
    if name == "gpt":  # windows of seq_len + 1 tokens, each predicting the next
        objective = language_model(chunked=loss_chunks > 1)
        model = from_linen(module, objective, inputs=registry._window_inputs)
        shape = {"tokens": (1, seq_len + 1)}
    else:
        model = from_linen(module, sequence(), inputs=lambda b: (b["source"], b["target"][:, :-1]))
        shape = {"source": (1, seq_len), "target": (1, seq_len + 1)}
    return model, {key: np.zeros(value, np.int32) for key, value in shape.items()}


def state_bytes(
    model,
    batch,
    mesh: Mapping[str, int],
    *,
    shard_optimizer: bool = False,
    rules=None,
    optimizer=None,
) -> Plan:
    """The exact per-device bytes of parameters, gradients (laid out as the parameters,
    in their dtype) and optimizer state (AdamW's unless ``optimizer``): shapes only."""
    import jax
    import optax

    from jdp.layout import bytes_per_device, optimizer_specs, param_specs

    optimizer = optimizer or optax.adamw(1e-3)
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    names = model.names(jax.random.key(0), batch) if model.names else None
    specs = param_specs(params, mesh, names=names, rules=rules)
    opt_specs = optimizer_specs(optimizer, params, specs, mesh, shard_optimizer=shard_optimizer)
    opt_state = jax.eval_shape(optimizer.init, params)
    param_bytes = bytes_per_device(params, specs, mesh)
    return Plan(
        mesh=dict(mesh),
        params=param_bytes,
        grads=param_bytes,
        optimizer=bytes_per_device(opt_state, opt_specs, mesh),
        parameters=sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)),
    )


_WIRE = {  # bytes a device sends, per byte of the op's result, in a ring of n devices
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def compiled_figures(
    plan: Plan, model, batch, batch_size: int, *, precision: str, shard_optimizer: bool, rules=None
) -> Plan:
    """Fills the compiled figures, on this process's (simulated) devices, which must be
    at least the mesh's; the step is lowered from shapes, nothing is allocated."""
    import jax
    import numpy as np
    import optax

    from jdp.collectives import collectives
    from jdp.layout import param_specs
    from jdp.mesh import make_mesh
    from jdp.precision import make_precision
    from jdp.state import create_train_state, placed, state_shardings
    from jdp.step import make_train_step

    spec = ",".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    mesh = make_mesh(spec)
    optimizer, precision_ = optax.adamw(1e-3), make_precision(precision)
    rows = {k: np.zeros((batch_size, *v.shape[1:]), v.dtype) for k, v in batch.items()}

    def state():
        params, model_state, specs = model.init_on_mesh(jax.random.key(0), batch, mesh, rules=rules)
        return create_train_state(
            params,
            optimizer,
            mesh,
            model_state=model_state,
            precision=precision_,
            param_specs=specs,
            shard_optimizer=shard_optimizer,
        )

    abstract = jax.eval_shape(state)
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    names = model.names(jax.random.key(0), batch) if model.names else None
    specs = param_specs(params, mesh, names=names, rules=rules)
    abstract = placed(
        abstract,
        state_shardings(
            params,
            optimizer,
            mesh,
            param_specs=specs,
            shard_optimizer=shard_optimizer,
            rng_impl=abstract.rng_impl,
        ),
    )
    step = make_train_step(
        model.loss_fn, optimizer, mesh, has_model_state=True, precision=precision_
    )
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=step.batch_sharding), rows
    )
    compiled = step.lower(abstract, shapes).compile()
    memory = compiled.memory_analysis()
    plan.temporaries = int(memory.temp_size_in_bytes)
    plan.arguments = int(memory.argument_size_in_bytes)
    by_kind: dict[str, int] = {}
    wire = 0.0
    for op in collectives(compiled.as_text(), mesh.devices.size, loops=True):
        axes = [axis for axis in mesh.axis_names if op.crosses(mesh, axis)] or ["none"]
        key = f"{op.op} over {'+'.join(axes)}"
        by_kind[key] = by_kind.get(key, 0) + op.nbytes
        size = max(len(group) for group in op.groups)
        wire += op.nbytes * _WIRE[op.op](size)
    plan.collectives, plan.wire = by_kind, wire
    plan.flops = step_model_flops(model, batch, batch_size)
    return plan


def step_model_flops(model, batch, batch_size: int) -> float:
    """The model FLOPs of a step of ``batch_size`` rows (`jdp.report.throughput.model_flops`)
    from one row's shapes. Not XLA's count, which counts a loop's body (a scanned layer)
    once and adds the optimizer."""
    import jax

    from jdp.report.throughput import model_flops

    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype), batch)
    params, model_state = jax.eval_shape(model.init, jax.random.key(0), one)
    return batch_size * model_flops(model, params, model_state, one)
