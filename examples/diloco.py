"""DiLoCo: groups of devices that train on their own and synchronise every H steps.

jdp's answer to the asynchronous data parallelism of the reference documents
(``ParameterServerStrategy``, where each worker updates the model independently,
for clusters whose links are slow): instead of stale gradients, each group of
devices trains its own copy with the inner optimizer (AdamW) on its share of every
global batch, all-reducing only inside the group; every H steps the groups
average their parameters, and an outer Nesterov optimizer applies the averaged
change (Douillard et al. 2023). Between synchronisations nothing crosses between
groups; put each group on its own host (``--mesh group=HOSTS,data=...`` with
``jdp.launch`` or a cluster) and the slow link carries 1/H of what synchronous
training sends. The loop below is plain Python on jdp's step builders;
``python -m jdp.train --mesh group=2,data=4 --sync-every 50`` does the same run
with checkpoints and evaluation.

    python examples/diloco.py            # full run: 600 steps, 2 groups of 4 devices
    python examples/diloco.py --smoke    # a few steps, for tests
"""

import argparse

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--devices-per-group", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=50, help="H, steps between syncs")
    args = parser.parse_args()
    # Before any JAX computation; a no-op on accelerators.
    jdp.simulate_cpu_devices(args.groups * args.devices_per_group)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    mesh = jdp.make_mesh(f"group={args.groups},data={args.devices_per_group}")
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    images = (digits.images[order] / 16.0).astype(np.float32).reshape(-1, 64)
    labels = digits.target[order].astype(np.int32)
    x_train, y_train, x_test, y_test = images[:1500], labels[:1500], images[1500:], labels[1500:]

    model = nn.Sequential([nn.Dense(512), nn.relu, nn.Dense(10)])
    params = model.init(jax.random.key(0), x_train[:1])["params"]
    steps, sync_every = (8, 4) if args.smoke else (600, args.sync_every)
    inner = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 3e-3, steps // 10, steps), weight_decay=1e-4
    )
    outer = jdp.diloco(sync_every=sync_every)  # Nesterov, lr 0.7, momentum 0.9
    state = jdp.create_train_state(params, inner, mesh, outer=outer)

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def metrics_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}

    train_step = jdp.make_train_step(loss_fn, inner, mesh)  # each group's own step
    sync = jdp.make_sync_step(outer, mesh)  # the only communication between groups
    eval_step = jdp.make_eval_step(metrics_fn, mesh)  # on the synchronised parameters

    batch_size = 128  # group g trains on the g-th block of each global batch's rows
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        rows = rng.choice(len(x_train), batch_size, replace=False)
        state, metrics = train_step(
            state, jdp.shard_batch({"x": x_train[rows], "y": y_train[rows]}, mesh)
        )
        if step % sync.every == 0:
            state = sync(state)
        if step % 100 == 0:
            print(f"step {step}: loss={float(metrics['loss']):.4f} (group 0's share)")

    if steps % sync.every:  # the steps since the last synchronisation count too
        state = sync(state)

    # Exact eval: pad the last batch and mark real rows with mask=1.
    def test_batches():
        for start in range(0, len(x_test), batch_size):
            rows = np.arange(start, start + batch_size)
            real = rows < len(x_test)
            yield jdp.shard_batch(
                {
                    "x": x_test[np.where(real, rows, 0)],
                    "y": y_test[np.where(real, rows, 0)],
                    "mask": real.astype(np.float32),
                },
                mesh,
            )

    result = jdp.evaluate(eval_step, state, test_batches())
    print(
        f"{args.groups} groups, synchronised every {sync.every} steps: "
        f"test_accuracy={result['accuracy']:.4f} on {result['count']} examples"
    )


if __name__ == "__main__":
    main()
