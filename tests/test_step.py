"""The data-parallel step must not change the math."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_drift_within
from helpers import BATCH, assert_trees_close, init_params, regression_data, regression_loss

import jdp
from jdp.models import MLP, classification, from_linen
from jdp.state import Placement

STEPS = 5


def _optimizer():
    return optax.sgd(0.05, momentum=0.9)


def _reference(batches, optimizer):
    """Plain JAX and Optax on one device, no jdp: the math data parallelism must keep."""
    params = init_params()
    opt_state = optimizer.init(params)
    for batch in batches:
        grads = jax.grad(regression_loss)(params, batch, None)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _train(mesh, backend, batches, optimizer):
    state = jdp.create_train_state(init_params(), optimizer, mesh, rng=jax.random.key(0))
    step = jdp.make_train_step(regression_loss, optimizer, mesh, backend=backend)
    for batch in batches:
        state, metrics = step(state, jdp.shard_batch(batch, mesh))
    return state, metrics


def test_data8_matches_one_device_on_the_same_global_batch(mesh8, backend):
    batches = [regression_data(seed) for seed in range(STEPS)]
    expected = _reference(batches, _optimizer())
    state, _ = _train(mesh8, backend, batches, _optimizer())
    assert int(state.step) == STEPS
    assert_trees_close(jax.device_get(state.params), expected)


def test_batches_of_changing_size_match_one_device(mesh8, backend):
    # The pmap backend keeps one program per batch layout and must pick the right one.
    batches = [regression_data(seed, rows=64 if seed % 2 else 32) for seed in range(STEPS)]
    state, _ = _train(mesh8, backend, batches, _optimizer())
    assert_trees_close(jax.device_get(state.params), _reference(batches, _optimizer()))


def test_data1_mesh_matches_reference(mesh1, backend):
    batches = [regression_data(seed) for seed in range(STEPS)]
    state, _ = _train(mesh1, backend, batches, _optimizer())
    assert_trees_close(jax.device_get(state.params), _reference(batches, _optimizer()))


def test_jit_and_pmap_backends_agree(mesh8):
    batches = [regression_data(seed) for seed in range(STEPS)]
    jit_state, jit_metrics = _train(mesh8, "jit", batches, optax.adam(1e-2))
    pmap_state, pmap_metrics = _train(mesh8, "pmap", batches, optax.adam(1e-2))
    assert int(jit_state.step) == int(pmap_state.step) == STEPS
    # Adam: two compiled programs may round differently (closeness.py).
    for field in ("params", "opt_state"):
        assert_drift_within(
            jax.device_get(getattr(jit_state, field)), jax.device_get(getattr(pmap_state, field))
        )
    # The loss is a mean of 64 non-negative terms: at most 64 * 1.2e-7 apart.
    np.testing.assert_allclose(jit_metrics["loss"], pmap_metrics["loss"], rtol=1e-5)


def test_metrics_loss_is_the_global_batch_loss(mesh8, backend):
    batch = regression_data()
    _, metrics = _train(mesh8, backend, [batch], _optimizer())
    expected = regression_loss(init_params(), batch, None)
    # A mean of 64 non-negative terms, summed in two orders: at most 64 * 1.2e-7 apart.
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)


def test_every_replica_holds_identical_params(mesh8, backend):
    batches = [regression_data(seed) for seed in range(STEPS)]
    state, _ = _train(mesh8, backend, batches, optax.adam(1e-2))
    for leaf in jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state):
        shards = leaf.addressable_shards
        assert len(shards) == 8
        first = np.asarray(shards[0].data)
        for shard in shards[1:]:
            np.testing.assert_array_equal(np.asarray(shard.data), first)


def test_state_keeps_the_replicated_sharding(mesh8, backend):
    state, _ = _train(mesh8, backend, [regression_data()], _optimizer())
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding == jdp.mesh.replicated(mesh8)


def test_the_output_state_carries_the_inputs_placement(mesh8, backend):
    state = jdp.create_train_state(init_params(), _optimizer(), mesh8)
    where = state.placement
    step = jdp.make_train_step(regression_loss, _optimizer(), mesh8, backend=backend)
    for _ in range(2):
        state, _ = step(state, jdp.shard_batch(regression_data(), mesh8))
        assert state.placement is where  # not read from the arrays again
    assert where.kind == "replicated" and where == Placement.of(state)


def test_input_state_is_donated(mesh8, backend):
    state = jdp.create_train_state(init_params(), _optimizer(), mesh8)
    step = jdp.make_train_step(regression_loss, _optimizer(), mesh8, backend=backend)
    old_w = state.params["w1"]
    step(state, jdp.shard_batch(regression_data(), mesh8))
    assert old_w.is_deleted()


def test_one_gradient_all_reduce_and_no_all_gather(mesh8):
    state = jdp.create_train_state(init_params(), _optimizer(), mesh8)
    step = jdp.make_train_step(regression_loss, _optimizer(), mesh8)
    hlo = step.lower(state, jdp.shard_batch(regression_data(), mesh8)).compile().as_text()
    assert "all-gather" not in hlo
    # What the compiled program all-reduces, in elements: every gradient once and the
    # loss (here all small, so packed into one buffer on CPU), nothing else.
    reduced = re.findall(r"= f32\[(\d+)\]\{0\} all-reduce\(", hlo)
    gradients = sum(np.size(leaf) for leaf in jax.tree.leaves(init_params()))
    assert [int(size) for size in reduced] == [gradients + 1], hlo


def test_long_loop_does_not_deadlock(mesh8, backend):
    """Unbounded async dispatch of a collective step used to abort on a 2-core CPU."""
    state = jdp.create_train_state(init_params(), _optimizer(), mesh8)
    step = jdp.make_train_step(regression_loss, _optimizer(), mesh8, backend=backend)
    batch = jdp.shard_batch(regression_data(), mesh8)
    for _ in range(3000):
        state, metrics = step(state, batch)
    assert int(state.step) == 3000
    assert np.isfinite(float(metrics["loss"]))


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, *, train=False):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, axis_name="data" if train else None
        )(x)
        return nn.Dense(3)(x)


def _batchnorm_loss(module):
    def loss_fn(params, model_state, batch, rng):
        out, updated = module.apply(
            {"params": params, **model_state}, batch["x"], train=True, mutable=["batch_stats"]
        )
        return jnp.mean((out - batch["y"]) ** 2), {}, updated

    return loss_fn


def test_batchnorm_statistics_are_global_batch_statistics(mesh8, mesh1, backend):
    module = _BatchNormNet()
    batch = regression_data()
    batch["x"][: BATCH // 2] += 3.0  # replicas see very different local statistics
    variables = module.init(jax.random.key(1), batch["x"], train=False)
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    def one_step(mesh):
        state = jdp.create_train_state(params, _optimizer(), mesh, model_state=model_state)
        step = jdp.make_train_step(
            _batchnorm_loss(module), _optimizer(), mesh, backend=backend, has_model_state=True
        )
        state, _ = step(state, jdp.shard_batch(batch, mesh))
        return jax.device_get(state.model_state["batch_stats"]["BatchNorm_0"])

    dense = params["Dense_0"]
    features = batch["x"] @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    expected_mean = 0.1 * features.mean(0)
    expected_var = 0.9 * 1.0 + 0.1 * features.var(0)
    for mesh in (mesh8, mesh1):
        stats = one_step(mesh)
        np.testing.assert_allclose(stats["mean"], expected_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats["var"], expected_var, rtol=1e-5, atol=1e-6)


def _mlp_setup(mesh):
    module = MLP(num_classes=4, hidden=(16,))
    rng = np.random.default_rng(3)
    images = rng.normal(size=(37, 3, 3, 1)).astype(np.float32)  # 37: not a multiple of 8
    labels = rng.integers(0, 4, size=37).astype(np.int32)
    model = from_linen(module, classification())
    params, model_state = jax.jit(model.init)(jax.random.key(0), {"image": images[:1]})
    state = jdp.create_train_state(params, optax.sgd(0.1), mesh, model_state=model_state)
    return module, model, images, labels, state


def test_exact_eval_counts_every_example_once(mesh8, mesh1, backend):
    from jdp.data.loader.pipeline import eval_batches
    from jdp.data.splits.sources import Split

    results = []
    for mesh in (mesh8, mesh1):
        module, model, images, labels, state = _mlp_setup(mesh)
        eval_step = jdp.make_eval_step(
            model.metrics_fn, mesh, backend=backend, has_model_state=True
        )
        split = Split(images, labels, num_classes=4)
        results.append(jdp.evaluate(eval_step, state, eval_batches(split, mesh, batch_size=16)))
    logits = module.apply({"params": jax.device_get(state.params)}, images)
    expected_accuracy = float(np.mean(np.argmax(logits, -1) == labels))
    expected_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())
    for result in results:
        assert result["count"] == 37
        assert result["accuracy"] == pytest.approx(expected_accuracy, abs=1e-6)
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_eval_takes_batch_means_with_their_weights(mesh8, mesh1):
    """A script's evaluation that returns batch means: each with its weight (here the real
    rows it averaged), the same means as per-example values give, on a padded split."""
    from jdp.data.loader.pipeline import eval_batches
    from jdp.data.splits.sources import Split

    def means(metrics_fn):
        def weighted(params, model_state, batch):
            mask = batch["mask"].astype(jnp.float32)
            rows = jnp.sum(mask)
            per_example = metrics_fn(params, model_state, batch)
            return {
                k: (jnp.sum(v * mask) / jnp.maximum(rows, 1), rows) for k, v in per_example.items()
            }

        return weighted

    for mesh in (mesh8, mesh1):
        _, model, images, labels, state = _mlp_setup(mesh)
        split = Split(images, labels, num_classes=4)
        results = [
            jdp.evaluate(
                jdp.make_eval_step(fn, mesh, has_model_state=True),
                state,
                eval_batches(split, mesh, batch_size=16),
            )
            for fn in (model.metrics_fn, means(model.metrics_fn))
        ]
        assert results[1].keys() == results[0].keys()
        # The same 37 terms summed in another order (per replica, means times rows): at
        # most 37 EPS32 = 4.4e-6 relative for non-negative terms (tests/closeness.py).
        for name in ("loss", "accuracy"):
            assert results[1][name] == pytest.approx(results[0][name], rel=5e-6)
    wrong = jdp.make_eval_step(lambda params, batch: {"m": jnp.ones(2)}, mesh1)
    with pytest.raises(jdp.UsageError, match=r"or a mean over the real rows with its weight"):
        wrong(state, jdp.shard_batch({"x": np.ones((4, 1), np.float32)}, mesh1))


def test_classification_trains_the_mlp(mesh8, backend):
    _, model, images, labels, state = _mlp_setup(mesh8)
    step = jdp.make_train_step(
        model.loss_fn, optax.sgd(0.1), mesh8, backend=backend, has_model_state=True
    )
    batch = jdp.shard_batch({"image": images[:32], "label": labels[:32]}, mesh8)
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert set(metrics) == {"loss", "accuracy"}  # grad_norm only when asked for


@pytest.mark.parametrize(
    "hidden", [16, pytest.param(1024, marks=pytest.mark.slow)], ids=["small", "shared-norm"]
)
def test_the_gradient_norm_when_asked_changes_no_parameter(mesh8, mesh1, backend, hidden):
    """``grad_norm=True`` adds the norm and leaves the update bitwise as it was, on one
    device and on eight; 1024 hidden units make a 4.2 MB gradient, whose norm each
    of the 8 replicas takes a share of (`jdp.reduce.SHARED_NORM_BYTES`)."""
    module = MLP(num_classes=4, hidden=(hidden,))
    rng = np.random.default_rng(5)
    images = rng.normal(size=(32, 32, 32, 1)).astype(np.float32)
    labels = rng.integers(0, 4, size=32).astype(np.int32)
    model = from_linen(module, classification())
    params, model_state = jax.jit(model.init)(jax.random.key(0), {"image": images[:1]})
    optimizer = optax.adam(1e-2)  # Adam squares the gradient, as the norm does
    for mesh in (mesh1, mesh8):
        batch = jdp.shard_batch({"image": images, "label": labels}, mesh)
        results = []
        for grad_norm in (False, True):
            state = jdp.create_train_state(params, optimizer, mesh, model_state=model_state)
            step = jdp.make_train_step(
                model.loss_fn,
                optimizer,
                mesh,
                backend=backend,
                has_model_state=True,
                grad_norm=grad_norm,
            )
            for _ in range(3):
                state, metrics = step(state, batch)
            assert ("grad_norm" in metrics) == grad_norm
            results.append(jax.device_get(state.params))
        for without, with_norm in zip(*map(jax.tree.leaves, results), strict=True):
            np.testing.assert_array_equal(without, with_norm)


@pytest.mark.parametrize("spec", ["data=2,fsdp=4", "group=2,data=4"])
def test_the_gradient_norm_on_sharded_and_group_meshes(devices, spec):
    """The norm where XLA partitions the update (``fsdp``) and in DiLoCo groups (each
    group's own, from its block of the rows): there only when asked for, and the
    norm of the gradient one device computes on those rows."""
    mesh = jdp.make_mesh(spec)
    grouped = spec.startswith("group")
    outer = jdp.diloco(sync_every=4) if grouped else None
    batch = regression_data(3)
    rows = {k: v[: BATCH // 2] for k, v in batch.items()} if grouped else batch  # group 0's
    expected = optax.tree.norm(jax.grad(regression_loss)(init_params(), rows, None))
    for grad_norm in (False, True):
        state = jdp.create_train_state(init_params(), optax.sgd(0.05), mesh, outer=outer)
        step = jdp.make_train_step(regression_loss, optax.sgd(0.05), mesh, grad_norm=grad_norm)
        _, metrics = step(state, jdp.shard_batch(batch, mesh))
        assert ("grad_norm" in metrics) == grad_norm
    # float32 sums of squares in another order: a few units in the last place (6e-8).
    assert float(metrics["grad_norm"]) == pytest.approx(float(expected), rel=1e-5)


def test_has_aux_metrics_are_averaged(mesh8, backend):
    def loss_fn(params, batch, rng):
        return regression_loss(params, batch, rng), {"mean_x": jnp.mean(batch["x"])}

    batch = regression_data()
    state = jdp.create_train_state(init_params(), _optimizer(), mesh8)
    step = jdp.make_train_step(loss_fn, _optimizer(), mesh8, backend=backend, has_aux=True)
    _, metrics = step(state, jdp.shard_batch(batch, mesh8))
    np.testing.assert_allclose(metrics["mean_x"], batch["x"].mean(), rtol=1e-5)


def test_rng_differs_per_replica_and_per_step(mesh8, backend):
    def loss_fn(params, batch, rng):
        noise = jax.random.uniform(rng, ())
        loss = regression_loss(params, batch, rng)
        # The mean of 8 replicas' draws is not any single replica's draw.
        return loss, {"noise": noise, "noise_sq": noise**2}

    state = jdp.create_train_state(init_params(), _optimizer(), mesh8, rng=jax.random.key(7))
    step = jdp.make_train_step(loss_fn, _optimizer(), mesh8, backend=backend, has_aux=True)
    batch = jdp.shard_batch(regression_data(), mesh8)
    state, first = step(state, batch)
    state, second = step(state, batch)
    # Var of the 8 draws = E[u^2] - E[u]^2 > 0 only if the replicas drew differently.
    assert float(first["noise_sq"]) - float(first["noise"]) ** 2 > 1e-4
    assert float(first["noise"]) != float(second["noise"])


@pytest.mark.parametrize(
    "key", [jax.random.key(3), jax.random.key(3, impl="rbg"), jax.random.PRNGKey(3)]
)
def test_the_state_holds_its_key_as_plain_data(mesh8, key):
    # A typed key among a step's arguments sends every call through Python to
    # rebuild it; the state keeps raw key data and its implementation's name.
    state = jdp.create_train_state(init_params(), _optimizer(), mesh8, rng=key)
    assert not any(
        jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) for leaf in jax.tree.leaves(state)
    )
    typed = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
    assert jax.random.key_impl(state.key) == jax.random.key_impl(typed)
    np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(typed))

    # The step draws from that key: the replicas' first draws are the key's own.
    def loss_fn(params, batch, rng):
        return regression_loss(params, batch, rng), {"u": jax.random.uniform(rng, ())}

    step = jdp.make_train_step(loss_fn, _optimizer(), mesh8, has_aux=True)
    _, metrics = step(state, jdp.shard_batch(regression_data(), mesh8))
    step0 = jax.random.fold_in(typed, 0)
    draws = [jax.random.uniform(jax.random.fold_in(step0, i), ()) for i in range(8)]
    # A mean of 8 float32 draws in [0, 1): a few float32 eps of rounding.
    np.testing.assert_allclose(metrics["u"], np.mean(draws), rtol=1e-6)


def test_pmap_refuses_a_two_axis_mesh(devices):
    mesh = jdp.make_mesh("data=4,model=2")
    with pytest.raises(jdp.UsageError, match="use backend 'jit'"):
        jdp.make_train_step(regression_loss, _optimizer(), mesh, backend="pmap")


def test_jit_trains_on_a_two_axis_mesh(devices):
    mesh = jdp.make_mesh("data=4,model=2")
    batches = [regression_data(seed) for seed in range(STEPS)]
    state, _ = _train(mesh, "jit", batches, _optimizer())
    assert_trees_close(jax.device_get(state.params), _reference(batches, _optimizer()))


def test_unknown_backend(mesh8):
    with pytest.raises(jdp.UsageError, match="unknown backend 'tpu'"):
        jdp.make_train_step(regression_loss, _optimizer(), mesh8, backend="tpu")


@pytest.mark.parametrize(
    "options",
    [{}, {"precision": "bf16"}, {"precision": "fp16"}, {"accumulate": 2}, {"steps_per_call": 2}],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()) or "fp32",
)
def test_the_step_makes_no_implicit_dtype_promotion(mesh8, backend, options):
    """jdp's own step code under strict promotion (SGD: Optax's Adam is not strict-clean)."""
    precision = jdp.make_precision(options.get("precision", "fp32"))
    calls = options.get("steps_per_call", 1)
    optimizer = optax.sgd(0.05)
    with jax.numpy_dtype_promotion("strict"):
        state = jdp.create_train_state(init_params(), optimizer, mesh8, precision=precision)
        step = jdp.make_train_step(
            regression_loss,
            optimizer,
            mesh8,
            backend=backend,
            precision=precision,
            accumulate=options.get("accumulate", 1),
            steps_per_call=calls,
            lr_schedule=optax.constant_schedule(0.05),
        )
        batch = regression_data()
        if calls > 1:
            batch = jax.tree.map(lambda x: np.stack([x] * calls), batch)
        state, metrics = step(state, jdp.shard_batch(batch, mesh8, stacked=calls > 1))
    assert int(state.step) == calls and np.all(np.isfinite(jax.device_get(metrics["loss"])))


@pytest.mark.parametrize("steps", [1, 4])
def test_a_batch_the_replicas_cannot_split_is_one_line(mesh8, backend, steps):
    # Checked while the step is traced (once per batch shape), not on every call.
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh8)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh8, backend=backend, steps_per_call=steps
    )
    batch = regression_data(rows=12)
    if steps > 1:
        batch = jax.tree.map(lambda x: np.stack([x] * steps), batch)
    with pytest.raises(jdp.UsageError, match="does not split over 8 replicas"):
        step(state, batch)
    good = regression_data()
    if steps > 1:
        good = jax.tree.map(lambda x: np.stack([x] * steps), good)
    step(state, jdp.shard_batch(good, mesh8, stacked=steps > 1))


def test_a_state_already_given_to_a_step_is_refused(mesh8, backend):
    # Passed again, donated arrays crash the process under XLA:CPU with several
    # devices; the step refuses them first, and so does evaluation.
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh8)
    step = jdp.make_train_step(regression_loss, optimizer, mesh8, backend=backend)
    batch = jdp.shard_batch(regression_data(), mesh8)
    after, _ = step(state, batch)
    with pytest.raises(jdp.UsageError, match="pass on the state that step returned"):
        step(state, batch)
    evaluate = jdp.make_eval_step(
        lambda params, batch: {"y": batch["y"].sum(axis=1)}, mesh8, backend=backend
    )
    with pytest.raises(jdp.UsageError, match="donated its arrays"):
        evaluate(state, batch)
    jax.block_until_ready(step(after, batch))
