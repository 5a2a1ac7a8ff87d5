"""Sharded layouts: fsdp, model (tensor parallel) and ZeRO-1 on the same mesh as data.

Every layout must compute what the unsharded step computes on the same global
batch, for jdp's models and for Linen and NNX modules as users write them (no
logical axis names: the default rule). Dropout draws one key per ``data``
replica whatever the other axes, so a model with dropout is compared with the
``data`` mesh of the same replica count, and models without it with one device.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, run_cli
from jax.sharding import PartitionSpec as P

import jdp
from jdp.data.formats import numbers2words
from jdp.errors import UsageError
from jdp.layout import MIN_SHARDED_BYTES, leaf_spec, param_specs
from jdp.models import classification, from_linen, from_nnx, get_model
from jdp.state import Placement

STEPS = 5
MESHES = ["fsdp=8", "data=2,fsdp=4", "data=4,model=2", "model=2"]


class UserNet(nn.Module):
    """A Linen module as a user writes it: no logical axis names."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


class UserNnx(nnx.Module):
    """An NNX module as a user writes it."""

    def __init__(self, rngs):
        self.hidden, self.out = nnx.Linear(64, 256, rngs=rngs), nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def _image_batches(steps=STEPS, rows=64):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.random((rows, 8, 8, 1), np.float32),
            "label": rng.integers(0, 10, rows).astype(np.int32),
        }
        for _ in range(steps)
    ]


def _gpt():
    train = numbers2words.generate("train")
    rng = np.random.default_rng(1)
    batches = [train.read(rng.integers(0, len(train), 32)) for _ in range(STEPS)]
    return get_model("gpt", train), batches


def _train(model, batches, spec, *, shard_optimizer=False, steps_per_call=1, accumulate=1):
    mesh = jdp.make_mesh(spec)
    optimizer = optax.sgd(0.1, momentum=0.9)
    params, model_state, specs = model.init_on_mesh(jax.random.key(0), batches[0], mesh)
    state = jdp.create_train_state(
        params,
        optimizer,
        mesh,
        model_state=model_state,
        param_specs=specs,
        shard_optimizer=shard_optimizer,
        rng=jax.random.key(1),
    )
    step = jdp.make_train_step(
        model.loss_fn,
        optimizer,
        mesh,
        has_model_state=True,
        steps_per_call=steps_per_call,
        accumulate=accumulate,
    )
    for start in range(0, len(batches), steps_per_call):
        chunk = batches[start : start + steps_per_call]
        if steps_per_call == 1:
            batch = jdp.shard_batch(chunk[0], mesh)
        else:
            stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *chunk)
            batch = jdp.shard_batch(stacked, mesh, stacked=True)
        state, _ = step(state, batch)
    return state, specs, mesh


def _expect_laid_out(state, specs, mesh):
    """Every parameter leaf lives where its spec says, on ``mesh``."""
    for leaf, spec in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
        strict=True,
    ):
        assert leaf.sharding.spec == spec and leaf.sharding.mesh.shape == mesh.shape


def _models_on_meshes():
    """Every model on every mesh; the fast lane keeps the MLP on each mesh and the Linen
    and NNX modules on one (each case compiles steps of its own: seconds)."""
    for which in ("mlp", "linen", "nnx"):
        for spec in MESHES:
            slow = () if which == "mlp" or spec == "data=2,fsdp=4" else pytest.mark.slow
            yield pytest.param(which, spec, id=f"{which}-{spec}", marks=slow)


@pytest.mark.parametrize("which, spec", list(_models_on_meshes()))
def test_a_sharded_step_computes_what_one_device_does(devices, which, spec):
    model = {
        "mlp": lambda: get_model("mlp", jdp.load_split("digits", "train")),
        "linen": lambda: from_linen(UserNet(), classification()),
        "nnx": lambda: from_nnx(UserNnx(nnx.Rngs(0)), classification()),
    }[which]()
    batches = _image_batches()
    reference, _, _ = _train(model, batches, "data=1")
    state, specs, mesh = _train(model, batches, spec)
    _expect_laid_out(state, specs, mesh)
    # SGD with momentum is linear in the gradient: summation order only (closeness.py).
    assert_trees_close(jax.device_get(state.params), jax.device_get(reference.params))


@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.slow
def test_gpt_on_every_layout_computes_what_its_replicas_do(devices, spec):
    """GPT has dropout: one key per data replica, so each layout is compared with the
    data mesh of as many replicas (fsdp=8 and model=2 with one device)."""
    model, batches = _gpt()
    state, specs, mesh = _train(model, batches, spec)
    reference, _, _ = _train(model, batches, f"data={mesh.shape['data']}")
    _expect_laid_out(state, specs, mesh)
    split = jdp.layout.split_counts(specs)
    for axis in ("fsdp", "model"):
        assert (axis in split) == (mesh.shape.get(axis, 1) > 1)
    # An attention key's bias has a zero gradient in exact arithmetic (softmax does
    # not see a constant added to every key's score): its values are rounding
    # noise, compared at atol (1e-6) like every element near zero.
    assert_trees_close(jax.device_get(state.params), jax.device_get(reference.params))


def test_the_rules_place_the_gpt_by_name(devices):
    model, batches = _gpt()
    mesh = jdp.make_mesh("data=2,fsdp=2,model=2")
    _, _, specs = model.init_on_mesh(jax.random.key(0), batches[0], mesh)
    block = specs["blocks"]  # the scanned layers: stacked on a leading axis, never split
    # Megatron's pairs: query/key/value split by heads, the output projection by its
    # input heads; the MLP column- then row-parallel; the width over fsdp.
    attention = block["MultiHeadDotProductAttention_0"]
    assert attention["query"]["kernel"] == P(None, "fsdp", "model")
    assert attention["out"]["kernel"] == P(None, "model", None, "fsdp")
    assert block["FeedForward_0"]["Dense_0"]["kernel"] == P(None, "fsdp", "model")
    assert block["FeedForward_0"]["Dense_1"]["kernel"] == P(None, "model", "fsdp")
    assert block["FeedForward_0"]["Dense_0"]["bias"] == P(None, "model")
    # LayerNorm's 128 floats are under the default rule's threshold but named: the
    # rules split them over fsdp.
    assert block["LayerNorm_0"]["scale"] == P(None, "fsdp")
    # The embedding is (vocab, embed): the rows over model when the vocabulary's size
    # divides by 2, else whole.
    vocab = specs["Embed_0"]["embedding"]
    assert vocab == (P("model", "fsdp") if len(numbers2words.VOCAB) % 2 == 0 else P(None, "fsdp"))


def test_rules_can_be_overridden(devices):
    model, batches = _gpt()
    mesh = jdp.make_mesh("data=4,model=2")
    _, _, specs = model.init_on_mesh(
        jax.random.key(0), batches[0], mesh, rules={"mlp": None, "heads": None, "vocab": None}
    )
    assert jdp.layout.split_counts(specs) == {}
    # A rule that would change nothing (a misspelt name, an axis the mesh lacks) is refused.
    params, names = {"w": jnp.zeros((8, 8))}, {"w": ("embed", "mlp")}
    with pytest.raises(jdp.UsageError, match=r"rules for mlpp: no parameter has that axis "):
        jdp.param_specs(params, mesh, names=names, rules={"mlpp": None})
    with pytest.raises(jdp.UsageError, match=r"rule mlp=fsdp: the mesh has no fsdp axis"):
        jdp.param_specs(params, mesh, names=names, rules={"mlp": "fsdp"})


def test_the_default_rule_for_a_model_without_names():
    shape_of = {"kernel": (784, 512), "wide": (10, 4096), "bias": (512,), "odd": (999, 7)}
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shape_of.items()}
    specs = param_specs(params, {"data": 2, "fsdp": 8, "model": 2})
    # The largest dimension the axis divides; small leaves whole; nothing on model.
    assert specs == {
        "kernel": P("fsdp"),
        "wide": P(None, "fsdp"),
        "bias": P(),
        "odd": P(),
    }
    assert 512 * 4 < MIN_SHARDED_BYTES <= 784 * 512 * 4


def test_named_dimensions_that_do_not_divide_stay_whole():
    assert leaf_spec((10, 6), ("vocab", "embed"), {"model": 4, "fsdp": 4}) == P()
    # An axis serves one dimension of a leaf at most.
    assert leaf_spec((8, 8), ("mlp", "heads"), {"model": 2}) == P("model")


@pytest.mark.slow
def test_zero1_splits_the_optimizer_state_over_data(devices):
    model = from_linen(UserNet(), classification())
    batches = _image_batches()
    reference, _, _ = _train(model, batches, "data=8")
    state, _, _ = _train(model, batches, "data=8", shard_optimizer=True)
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.is_fully_replicated
    split = [leaf for leaf in jax.tree.leaves(state.opt_state) if "data" in str(leaf.sharding.spec)]
    assert split, "no optimizer state leaf is split over data"
    for leaf in split:  # each device holds 1/8 of it
        assert leaf.addressable_shards[0].data.size * 8 == leaf.size
    assert_trees_close(jax.device_get(state.params), jax.device_get(reference.params))


def test_one_step_takes_each_state_by_its_placement(devices):
    """One jit step on data=8, given a replicated and a ZeRO-1 state in turn: each runs
    the program its placement names (the same maths), and each output carries its
    input's placement, so a loop reads it from the arrays once."""
    model = from_linen(UserNet(), classification())
    batch = _image_batches(steps=1)[0]
    mesh, optimizer = jdp.make_mesh("data=8"), optax.sgd(0.1, momentum=0.9)
    params, model_state, specs = model.init_on_mesh(jax.random.key(0), batch, mesh)
    states = {
        zero1: jdp.create_train_state(
            jax.tree.map(jnp.copy, params),
            optimizer,
            mesh,
            model_state=model_state,
            param_specs=specs,
            shard_optimizer=zero1,
        )
        for zero1 in (False, True)
    }
    assert {z: s.placement.kind for z, s in states.items()} == {
        False: "replicated",
        True: "sharded",
    }
    step = jdp.make_train_step(model.loss_fn, optimizer, mesh, has_model_state=True)
    for _ in range(2):
        for zero1, state in states.items():
            where = state.placement
            states[zero1], _ = step(state, jdp.shard_batch(batch, mesh))
            assert states[zero1].placement is where
            assert Placement.of(states[zero1]) == where  # and it is true
    assert_trees_close(jax.device_get(states[True].params), jax.device_get(states[False].params))


def test_the_pmap_backend_refuses_a_zero1_state_in_one_line(devices):
    model = from_linen(UserNet(), classification())
    batches = _image_batches(steps=1)
    mesh = jdp.make_mesh("data=8")
    optimizer = optax.adam(1e-3)
    params, model_state, specs = model.init_on_mesh(jax.random.key(0), batches[0], mesh)
    state = jdp.create_train_state(
        params,
        optimizer,
        mesh,
        model_state=model_state,
        param_specs=specs,
        shard_optimizer=True,
    )
    step = jdp.make_train_step(model.loss_fn, optimizer, mesh, has_model_state=True, backend="pmap")
    with pytest.raises(UsageError, match=r"replicated on every device.*use backend 'jit'"):
        step(state, jdp.shard_batch(batches[0], mesh))


@pytest.mark.parametrize("options", [{"steps_per_call": 5}, {"accumulate": 2}])
@pytest.mark.slow
def test_steps_per_call_and_accumulation_on_a_sharded_mesh(devices, options):
    model = from_linen(UserNet(), classification())
    batches = _image_batches()
    reference, _, _ = _train(model, batches, "data=1", accumulate=options.get("accumulate", 1))
    state, _, _ = _train(model, batches, "data=2,fsdp=2,model=2", **options)
    assert_trees_close(jax.device_get(state.params), jax.device_get(reference.params))


@pytest.mark.slow
def test_evaluation_on_a_sharded_state_equals_one_device(devices):
    model, batches = _gpt()
    sums = {}
    for spec in ("data=1", "data=2,fsdp=2,model=2"):
        mesh = jdp.make_mesh(spec)
        params, model_state, specs = model.init_on_mesh(jax.random.key(0), batches[0], mesh)
        state = jdp.create_train_state(
            params, optax.sgd(0.1), mesh, model_state=model_state, param_specs=specs
        )
        eval_step = jdp.make_eval_step(model.metrics_fn, mesh, has_model_state=True)
        sums[spec] = jdp.evaluate(eval_step, state, [jdp.shard_batch(b, mesh) for b in batches])
    # Sums of per-example losses over 160 rows: float32 reordering, 160 * EPS32 relative.
    for name, value in sums["data=1"].items():
        np.testing.assert_allclose(sums["data=2,fsdp=2,model=2"][name], value, rtol=2e-5)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("fsdp=4,data=2", "axes go in the order group, data, fsdp, model.*write data=2,fsdp=4"),
        ("model=2,data=4", "write data=4,model=2"),
    ],
)
def test_axes_out_of_order_are_refused(devices, spec, needle):
    with pytest.raises(jdp.UsageError, match=needle):
        jdp.make_mesh(spec)


def test_a_mesh_without_data_has_one_replica(devices):
    assert dict(jdp.make_mesh("fsdp=8").shape) == {"data": 1, "fsdp": 8}
    assert dict(jdp.make_mesh("model=2").shape) == {"data": 1, "model": 2}


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--mesh", "data=4,model=2", "--backend", "pmap"], "run with --backend jit"),
        (["--mesh", "data=8", "--shard-optimizer", "--backend", "pmap"], "--backend jit"),
        (["--mesh", "group=2,fsdp=4"], "DiLoCo groups train replicated parameters"),
        (
            ["--axis-rules", "mlp=tensor"],
            "axis rule mlp=tensor: parameters split over fsdp or model",
        ),
        (["--axis-rules", "embed=data"], "axis rule embed=data: parameters split over fsdp"),
        (["--axis-rules", "mlp"], "write NAME=AXIS"),
    ],
)
def test_cli_refuses_layouts_it_cannot_run(flags, needle):
    result = run_cli(*flags, "--steps", "2")
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_trains_a_sharded_layout(tmp_path):
    result = run_cli(
        *"--mesh data=2,fsdp=2,model=2 --steps 40 --eval-every 40".split(),
        "--shard-optimizer",
        devices=8,
    )
    assert result.returncode == 0, result.stderr
    line = "jdp: layout: 3 of 4 parameter leaves split (fsdp: 2, model: 3); optimizer state split"
    assert f"{line} over data (2)" in result.stdout
    assert "replicated over the 'model' axis" not in result.stdout


def _state_on(model, batch, spec, optimizer):
    mesh = jdp.make_mesh(spec)
    params, model_state, specs = model.init_on_mesh(jax.random.key(0), batch, mesh)
    return jdp.create_train_state(
        params, optimizer, mesh, model_state=model_state, param_specs=specs
    ), mesh


@pytest.mark.parametrize("target", ["data=8", "data=1", "data=2,model=2"])
@pytest.mark.slow
def test_a_checkpoint_restores_across_layouts_both_ways(devices, tmp_path, target):
    model = get_model("mlp", jdp.load_split("digits", "train"))
    batch, optimizer = _image_batches(1)[0], optax.adam(1e-3)
    state, mesh = _state_on(model, batch, "fsdp=8", optimizer)
    step = jdp.make_train_step(model.loss_fn, optimizer, mesh, has_model_state=True)
    state, _ = step(state, jdp.shard_batch(batch, mesh))  # moments that are not zeros
    saved = jax.device_get(state)
    with jdp.Checkpointer(tmp_path / "fsdp") as checkpoints:
        checkpoints.save(state, loader_step=1)
    like, _ = _state_on(model, batch, target, optimizer)
    with jdp.Checkpointer(tmp_path / "fsdp") as checkpoints:
        restored, _ = checkpoints.restore(like)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert got.sharding == want.sharding  # the target's layout, not the saved one
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
    # And back: saved in the target's layout, restored onto fsdp=8.
    with jdp.Checkpointer(tmp_path / "back") as checkpoints:
        checkpoints.save(restored, loader_step=1)
    like, _ = _state_on(model, batch, "fsdp=8", optimizer)
    with jdp.Checkpointer(tmp_path / "back") as checkpoints:
        back, _ = checkpoints.restore(like)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(like), strict=True):
        assert got.sharding == want.sharding
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), saved)


def test_the_replica_check_compares_each_shards_replicas(devices):
    from jdp.distributed import ReplicaMismatchError, check_replicas

    model = get_model("mlp", jdp.load_split("digits", "train"))
    state, _ = _state_on(model, _image_batches(1)[0], "data=2,fsdp=4", optax.sgd(0.1))
    check_replicas(state.params)  # 4 shards, each held by 2 replicas: they agree
    kernel = state.params["Dense_0"]["kernel"]
    shards = [shard.data for shard in kernel.addressable_shards]
    odd = kernel.addressable_shards[-1].device
    shards[-1] = jax.device_put(shards[-1] + 1e-3, odd)
    damaged = jax.make_array_from_single_device_arrays(kernel.shape, kernel.sharding, shards)
    with pytest.raises(ReplicaMismatchError, match=f"device {odd.id} "):
        check_replicas({"kernel": damaged})


@pytest.mark.slow
def test_cli_resumes_an_fsdp_run_on_data_parallelism(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ("--warmup-steps", "2", "--eval-every", "20", "--ckpt-dir", ckpt)
    first = run_cli("--mesh", "fsdp=8", "--steps", "20", *flags, devices=8)
    assert first.returncode == 0, first.stderr
    resumed = run_cli("--mesh", "data=8", "--steps", "40", *flags, devices=8)
    assert resumed.returncode == 0, resumed.stderr
    assert "resum" in resumed.stdout and "step 20" in resumed.stdout
    assert "jdp.train: steps=40" in resumed.stdout


@pytest.mark.parametrize("spec", ["data=2,fsdp=2", "data=2,model=2"])
@pytest.mark.slow
def test_batchnorm_on_a_sharded_layout_is_its_replicas(devices, spec):
    """The CNN normalises with the statistics of all its replicas' rows (BatchNorm's
    axis_name is ``data``), on a layout as on the data mesh of as many replicas."""
    model = get_model("cnn", jdp.load_split("digits", "train"))
    batches = _image_batches()
    reference, _, _ = _train(model, batches, "data=2")
    state, specs, _ = _train(model, batches, spec)
    assert jdp.layout.split_counts(specs)  # something is split
    assert_trees_close(jax.device_get(state.params), jax.device_get(reference.params))
    assert_trees_close(jax.device_get(state.model_state), jax.device_get(reference.model_state))


@pytest.mark.slow
def test_an_fsdp_axis_of_one_is_data_parallelism(devices):
    model = from_linen(UserNet(), classification())
    batches = _image_batches()
    reference, _, _ = _train(model, batches, "data=4")
    state, specs, _ = _train(model, batches, "data=4,fsdp=1,model=1")
    assert jdp.layout.split_counts(specs) == {}
    assert_trees_close(jax.device_get(state.params), jax.device_get(reference.params))


def test_names_written_as_mesh_axes_map_to_themselves():
    """``nn.with_partitioning(init, ("model", None))`` names the mesh axis itself."""
    assert leaf_spec((64, 64), ("model", None), {"model": 2}) == P("model")
    assert leaf_spec((64, 64), (None, "fsdp"), {"fsdp": 2}) == P(None, "fsdp")


def test_a_state_on_another_mesh_is_refused(devices):
    model = from_linen(UserNet(), classification())
    batch = _image_batches(1)[0]
    state, _ = _state_on(model, batch, "data=8", optax.sgd(0.1))
    step = jdp.make_train_step(
        model.loss_fn, optax.sgd(0.1), jdp.make_mesh("fsdp=8"), has_model_state=True
    )
    with pytest.raises(jdp.UsageError, match=r"this state lives on mesh \{'data': 8\}"):
        step(state, jdp.shard_batch(batch, jdp.make_mesh("fsdp=8")))


@pytest.mark.slow
def test_fsdp_gathers_one_scanned_layer_at_a_time(devices):
    """The scanned layers' parameters are gathered inside the scan's body and their
    gradients reduced there: once per layer per step, never the whole stack at once."""
    from jdp.collectives import _repeats, collectives

    model, batches = _gpt()
    mesh = jdp.make_mesh("fsdp=8")
    optimizer = optax.sgd(0.1)
    params, model_state, specs = model.init_on_mesh(jax.random.key(0), batches[0], mesh)
    state = jdp.create_train_state(
        params, optimizer, mesh, model_state=model_state, param_specs=specs
    )
    step = jdp.make_train_step(model.loss_fn, optimizer, mesh, has_model_state=True)
    text = step.lower(state, jdp.shard_batch(batches[0], mesh)).compile().as_text()
    layers = params["blocks"]["FeedForward_0"]["Dense_0"]["kernel"].shape[0]
    looped = {name for name, times in _repeats(text).items() if times == layers}
    inside: dict[str, int] = {}
    computation = None
    for line in text.splitlines():
        computation = line.split()[0].lstrip("%") if line.startswith("%") else computation
        for op in ("all-gather", "all-reduce"):
            if f" {op}(" in line and computation in looped:
                inside[op] = inside.get(op, 0) + 1
    assert inside.get("all-gather") and inside.get("all-reduce"), inside
    # Counted per iteration, the gathers move each split parameter once (forward; the
    # backward reads the gathered layer kept for it): at most the parameters' bytes.
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    gathered = sum(op.nbytes for op in collectives(text, 8, loops=True) if op.op == "all-gather")
    assert 0 < gathered <= whole
