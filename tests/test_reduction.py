"""What the step's gradient all-reduce packs together, read from the program it emits."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec

import jdp
from jdp.mesh import DATA_AXIS
from jdp.reduce import (
    BUCKET_BYTES,
    PACK_LEAF_BYTES,
    SHARED_NORM_BYTES,
    global_norm,
    reduction_buckets,
)

KIB = 1024


def _leaf(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_small_leaves_share_buckets_by_dtype_and_large_ones_go_alone():
    leaves = [
        _leaf(64, 512),  # 128 KiB: packed
        _leaf(512),
        _leaf(1024, 1024),  # 4 MiB: alone
        _leaf(100, dtype=jnp.bfloat16),  # another dtype: its own bucket
        _leaf(10),
    ]
    buckets = reduction_buckets(leaves, pack_leaf_bytes=256 * KIB, bucket_bytes=4096 * KIB)
    assert buckets == [[0, 1, 4], [2], [3]]


def test_a_bucket_is_closed_at_its_size_cap():
    leaves = [_leaf(50 * KIB)] * 5  # 200 KiB each
    assert reduction_buckets(leaves, pack_leaf_bytes=256 * KIB, bucket_bytes=512 * KIB) == [
        [0, 1],
        [2, 3],
        [4],
    ]


def test_nothing_is_packed_when_packing_is_off():
    leaves = [_leaf(3), _leaf(0), _leaf(4)]
    assert reduction_buckets(leaves, pack_leaf_bytes=0) == [[0], [1], [2]]


def test_the_sizes_are_a_leaf_below_a_bucket():
    assert 0 < PACK_LEAF_BYTES < BUCKET_BYTES


# A model with one leaf above PACK_LEAF_BYTES (96k floats = 384 KiB) and small ones.
_BIG = (96, 1024)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w_in": jnp.asarray(rng.normal(size=(6, 96)) * 0.1, jnp.float32),
        "b_in": jnp.zeros((96,), jnp.float32),
        "w_big": jnp.asarray(rng.normal(size=_BIG) * 0.01, jnp.float32),
        "w_out": jnp.asarray(rng.normal(size=(1024, 3)) * 0.01, jnp.float32),
    }


def _loss(params, batch, rng):
    hidden = jnp.tanh(batch["x"] @ params["w_in"] + params["b_in"][None, :])
    return jnp.mean((jnp.tanh(hidden @ params["w_big"]) @ params["w_out"] - batch["y"]) ** 2)


def _all_reduce_operands(mesh, backend="jit"):
    """The all-reduced operands' types, in the program jdp emits (before XLA's passes)."""
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(_params(), optimizer, mesh)
    step = jdp.make_train_step(_loss, optimizer, mesh, backend=backend)
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(64, 6)).astype(np.float32),
        "y": rng.normal(size=(64, 3)).astype(np.float32),
    }
    text = step.lower(state, jdp.shard_batch(batch, mesh)).as_text()
    operands = re.findall(r'"stablehlo\.all_reduce"\(.*?\}\) : \(([^)]*)\) ->', text, re.S)
    return sorted(t for found in operands for t in re.findall(r"tensor<[^>]*>", found))


def test_on_cpu_replicas_the_large_leaf_goes_alone_and_the_small_ones_in_one_buffer(mesh8):
    small = 6 * 96 + 96 + 1024 * 3 + 1  # the small gradients and the loss
    assert _all_reduce_operands(mesh8) == sorted(
        [f"tensor<{_BIG[0]}x{_BIG[1]}xf32>", f"tensor<{small}xf32>"]
    )


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_on_one_device_nothing_is_all_reduced(mesh1, backend):
    # An all-reduce over one device is not free on XLA:CPU (docs/performance.md).
    assert _all_reduce_operands(mesh1, backend) == []


def test_the_shared_gradient_norm_is_the_global_norm(mesh8):
    """Above SHARED_NORM_BYTES each replica squares a share; the shares add to the norm."""
    rng = np.random.default_rng(2)
    grads = {
        "big": jnp.asarray(rng.normal(size=(1100, 1001)), jnp.float32),  # 4.2 MiB, 1101100 % 8 = 4
        # Large values, so that a share counted twice or not at all shows: 13 values
        # in shares of 2 (the last clamped over the 7th), and fewer values than replicas.
        "odd": jnp.asarray(300 * rng.normal(size=(13,)), jnp.float32),
        "tiny": jnp.asarray(1000 * rng.normal(size=(3,)), jnp.float32),
    }
    assert sum(leaf.nbytes for leaf in grads.values()) >= SHARED_NORM_BYTES

    def norm(tree):
        return global_norm(lax.pcast(tree, DATA_AXIS, to="varying"), replicas=8)

    shared = jax.jit(
        jax.shard_map(norm, mesh=mesh8, in_specs=PartitionSpec(), out_specs=PartitionSpec())
    )(grads)
    expected = np.sqrt(sum(np.sum(np.float64(leaf) ** 2) for leaf in grads.values()))
    # 1.1M squares (no cancellation) summed in float32 by XLA's tree reductions:
    # about log2(1.1M) = 20 roundings of 6e-8 each, far within 1e-4.
    np.testing.assert_allclose(float(shared), expected, rtol=1e-4)


def _big_leaf_ops(compiled_text: str) -> list[str]:
    """The ops of the compiled program's entry that make an array of the big leaf's shape."""
    entry = compiled_text[compiled_text.index("ENTRY") :]
    shape = rf"f32\[{_BIG[0]},{_BIG[1]}\]"
    ops = re.findall(rf"^\s*(?:ROOT )?%\S+ = {shape}\S* ([\w-]+)\(", entry, re.M)
    return sorted(op for op in ops if op not in ("parameter", "get-tuple-element", "bitcast"))


def test_the_gradient_norm_adds_no_pass_that_writes_the_gradients_out(mesh1):
    # Adam squares the gradient too; were the norm's squares merged with Adam's,
    # XLA:CPU would write them out as an array of the leaf's shape and read them
    # back. jdp's step must make no more arrays of a leaf's shape than a plain step
    # with the same loss and optimizer that reports no norm.
    optimizer = optax.adam(1e-3)
    state = jdp.create_train_state(_params(), optimizer, mesh1)
    rng = np.random.default_rng(1)
    batch = jdp.shard_batch(
        {
            "x": rng.normal(size=(64, 6)).astype(np.float32),
            "y": rng.normal(size=(64, 3)).astype(np.float32),
        },
        mesh1,
    )
    step = jdp.make_train_step(_loss, optimizer, mesh1, grad_norm=True)

    def plain(params, opt_state, batch):  # as one writes it for one device
        loss, grads = jax.value_and_grad(_loss)(params, batch, None)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    plain_step = jax.jit(plain, donate_argnums=(0, 1))
    ours = _big_leaf_ops(step.lower(state, batch).compile().as_text())
    theirs = _big_leaf_ops(
        plain_step.lower(state.params, state.opt_state, batch).compile().as_text()
    )
    assert ours == theirs, (ours, theirs)
