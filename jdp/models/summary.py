"""``jdp.summary(model, batch, mesh)``: a model's parameters by module, their count and
bytes, what each device of a mesh holds to train it, and its FLOPs per example, from
shapes alone (nothing is allocated)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jdp.layout import Rules, bytes_per_device, optimizer_specs, param_specs
from jdp.models.model import Model
from jdp.report.throughput import model_flops


@dataclasses.dataclass(frozen=True)
class Module:
    """One module's parameters: its path, each leaf's name, shape and dtype, their count."""

    path: str
    leaves: tuple[tuple[str, tuple[int, ...], str], ...]
    count: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """What `summary` found; ``str()`` of it is the table ``--summary`` prints.

    Attributes:
        modules: the modules holding parameters, in the parameter tree's order.
        parameters: the parameters' count.
        param_bytes: their bytes, whole.
        flops_per_example: the model FLOPs of training on one example (forward and
            backward; `jdp.report.throughput.model_flops`).
        mesh: the mesh's axis sizes, when one was given.
        per_device: bytes each device holds of ``params``, ``grads`` and ``optimizer``
            state on the mesh (as `python -m jdp.plan` counts them).
    """

    modules: tuple[Module, ...]
    parameters: int
    param_bytes: int
    flops_per_example: float
    mesh: dict[str, int] | None = None
    per_device: dict[str, int] | None = None

    def __str__(self) -> str:
        width = max([len(module.path) for module in self.modules] + [6])
        lines = [
            f"model: {self.parameters:,} parameters ({_bytes(self.param_bytes)}), "
            f"{self.flops_per_example / 1e6:,.2f} MFLOPs per example (forward and backward)",
            f"  {'module':<{width}}  {'parameters':>12}  shapes",
        ]
        for module in self.modules:
            shapes = ", ".join(f"{name} {shape}" for name, shape, _ in module.leaves)
            lines.append(f"  {module.path:<{width}}  {module.count:>12,}  {shapes}")
        if self.mesh is not None and self.per_device is not None:
            mesh = ",".join(f"{axis}={size}" for axis, size in self.mesh.items())
            held = self.per_device
            lines.append(
                f"on mesh {mesh}, per device: {_bytes(held['params'])} parameters, "
                f"{_bytes(held['grads'])} gradients, {_bytes(held['optimizer'])} optimizer "
                f"state ({_bytes(sum(held.values()))} in all, before activations)"
            )
        return "\n".join(lines)


def summary(
    model: Model,
    batch: Any,
    mesh: Mesh | None = None,
    *,
    optimizer: optax.GradientTransformation | None = None,
    rules: Rules | None = None,
    shard_optimizer: bool = False,
) -> Summary:
    """A model's parameters by module, their bytes on ``mesh`` and its FLOPs per example.

    Args:
        model: a `jdp.models.Model` (a built-in one, `from_linen`, `from_nnx`).
        batch: a batch it reads (one row is enough; only shapes are used).
        mesh: the mesh to count bytes per device on (its layout: ``fsdp`` and ``model``
            axes split the parameters as training would, by ``rules``).
        optimizer: the optimizer whose state is counted (AdamW's when not given).
        shard_optimizer: ZeRO-1, the optimizer state split over ``data``.

    Examples:
        >>> model = jdp.models.get_model("mlp", jdp.load_split("digits", "train"))
        >>> batch = {"image": np.zeros((1, 8, 8, 1), np.float32), "label": np.zeros(1, np.int32)}
        >>> print(jdp.summary(model, batch, jdp.make_mesh("data=8")))  # doctest: +ELLIPSIS
        model: 38,410 parameters (150.0 KiB), 0.23 MFLOPs per example (forward and backward)
          module     parameters  shapes
          Dense_0        33,280  bias (512,), kernel (64, 512)
          Dense_1         5,130  bias (10,), kernel (512, 10)
        on mesh data=8, per device: 150.0 KiB parameters, 150.0 KiB gradients, 300.1 KiB ...
    """
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *np.shape(x)[1:]), x.dtype), batch)
    params, model_state = jax.eval_shape(model.init, jax.random.key(0), one)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    count = sum(leaf.size for _, leaf in leaves)
    found = Summary(
        modules=_modules(leaves),
        parameters=count,
        param_bytes=sum(leaf.size * leaf.dtype.itemsize for _, leaf in leaves),
        flops_per_example=model_flops(model, params, model_state, one),
    )
    if mesh is None:
        return found
    names = model.names(jax.random.key(0), one) if model.names else None
    specs = param_specs(params, mesh, names=names, rules=rules)
    optimizer = optimizer or optax.adamw(1e-3)
    opt_specs = optimizer_specs(optimizer, params, specs, mesh, shard_optimizer=shard_optimizer)
    param_bytes = bytes_per_device(params, specs, mesh)
    per_device = {
        "params": param_bytes,
        "grads": param_bytes,
        "optimizer": bytes_per_device(jax.eval_shape(optimizer.init, params), opt_specs, mesh),
    }
    return dataclasses.replace(found, mesh=dict(mesh.shape), per_device=per_device)


def _modules(leaves) -> tuple[Module, ...]:
    """The leaves grouped by the module that holds them (the path but its last name)."""
    groups: dict[str, list] = {}
    for path, leaf in leaves:
        names = [
            str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path
        ]
        module = "/".join(names[:-1]) or "(top)"
        groups.setdefault(module, []).append((names[-1], tuple(leaf.shape), str(leaf.dtype)))
    return tuple(
        Module(path, tuple(entries), sum(int(np.prod(shape)) for _, shape, _ in entries))
        for path, entries in groups.items()
    )


def _bytes(count: float) -> str:
    for size, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"
