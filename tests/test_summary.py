"""``jdp.summary``: a model's parameters by module, their bytes on a mesh and its FLOPs
per example, for built-in models and the user's Linen and NNX modules."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.plan_costs import state_bytes


class LinenMLP(nn.Module):  # as a user writes one
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden, self.out = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape((x.shape[0], -1)))))


def _digits_batch():
    return {"image": np.zeros((2, 8, 8, 1), np.float32), "label": np.zeros(2, np.int32)}


def _models():
    digits = jdp.load_split("digits", "train")
    yield "mlp", jdp.models.get_model("mlp", digits), _digits_batch()
    yield "cnn", jdp.models.get_model("cnn", digits), _digits_batch()
    yield "linen", jdp.models.from_linen(LinenMLP(), jdp.models.classification()), _digits_batch()
    nnx_model = NnxMLP(nnx.Rngs(0))
    yield "nnx", jdp.models.from_nnx(nnx_model, jdp.models.classification()), _digits_batch()
    from jdp.plan_costs import build_model

    gpt, batch = build_model("gpt", "small", vocab=256, seq_len=32, image=(8, 8, 1))
    yield "gpt", gpt, batch


@pytest.mark.parametrize("mesh_spec", ["data=8", "fsdp=8", "data=2,model=4"])
def test_counts_are_the_parameter_trees_and_bytes_the_planners(mesh_spec, devices):
    mesh = jdp.make_mesh(mesh_spec)
    for name, model, batch in _models():
        found = jdp.summary(model, batch, mesh)
        params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
        leaves = jax.tree.leaves(params)
        assert found.parameters == sum(leaf.size for leaf in leaves), name
        assert sum(module.count for module in found.modules) == found.parameters, name
        assert found.param_bytes == sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
        plan = state_bytes(model, batch, dict(mesh.shape))
        assert found.per_device == {
            "params": plan.params,
            "grads": plan.grads,
            "optimizer": plan.optimizer,
        }, name
        assert found.flops_per_example > 0
        table = str(found)
        assert table.startswith(f"model: {found.parameters:,} parameters")
        axes = ",".join(f"{axis}={size}" for axis, size in mesh.shape.items())
        assert table.splitlines()[-1].startswith(f"on mesh {axes}, per device: "), table


def test_fsdp_splits_what_each_device_holds(devices):
    digits = jdp.load_split("digits", "train")
    model = jdp.models.get_model("mlp", digits)
    whole = jdp.summary(model, _digits_batch(), jdp.make_mesh("data=8"))
    split = jdp.summary(model, _digits_batch(), jdp.make_mesh("fsdp=8"))
    zero1 = jdp.summary(model, _digits_batch(), jdp.make_mesh("data=8"), shard_optimizer=True)
    assert split.per_device["params"] < whole.per_device["params"] / 4
    assert zero1.per_device["params"] == whole.per_device["params"]
    assert zero1.per_device["optimizer"] < whole.per_device["optimizer"] / 4
    sgd = jdp.summary(model, _digits_batch(), jdp.make_mesh("data=8"), optimizer=optax.sgd(0.1))
    assert sgd.per_device["optimizer"] == 0
    assert jdp.summary(model, _digits_batch()).per_device is None  # no mesh: no devices


def test_the_cli_prints_the_summary_before_training():
    from helpers import run_cli

    result = run_cli("--mesh", "data=2", "--steps", "1", "--summary", timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("model: 38,410 parameters"))
    assert lines[first + 2].split()[:2] == ["Dense_0", "33,280"]
    assert lines[first + 4].startswith("on mesh data=2, per device: 150.0 KiB parameters")
    assert first < lines.index("jdp: compiling the train step")
