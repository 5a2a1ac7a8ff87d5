"""Your own model, data and loop on jdp's step builders (public API only).

Mirrors the custom training loop of the reference documents (``strategy.run``
inside a ``tf.function`` over a distributed dataset): here the per-replica work
and the gradient all-reduce live in ``jdp.make_train_step``, and the loop is
plain Python. Runs on 8 simulated CPU devices when there is no accelerator.

    python examples/custom_loop.py            # full run, about 400 steps
    python examples/custom_loop.py --smoke    # a few steps, for tests
"""

import argparse

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    mesh = jdp.make_mesh(f"data={args.devices}")
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    images = (digits.images[order] / 16.0).astype(np.float32).reshape(-1, 64)
    labels = digits.target[order].astype(np.int32)
    x_train, y_train, x_test, y_test = images[:1500], labels[:1500], images[1500:], labels[1500:]

    model = nn.Sequential([nn.Dense(512), nn.relu, nn.Dense(10)])
    params = model.init(jax.random.key(0), x_train[:1])["params"]
    optimizer = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 40, 400))
    state = jdp.create_train_state(params, optimizer, mesh)

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    def metrics_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}

    train_step = jdp.make_train_step(loss_fn, optimizer, mesh, has_aux=True)
    eval_step = jdp.make_eval_step(metrics_fn, mesh)

    batch_size, steps = 128, 10 if args.smoke else 400
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        rows = rng.choice(len(x_train), batch_size, replace=False)
        batch = jdp.shard_batch({"x": x_train[rows], "y": y_train[rows]}, mesh)
        state, metrics = train_step(state, batch)
        if step % 100 == 0:
            print(f"step {step}: loss={float(metrics['loss']):.4f}")

    # Exact eval: pad the last batch and mark real rows with mask=1.
    def test_batches():
        for start in range(0, len(x_test), batch_size):
            rows = np.arange(start, start + batch_size)
            real = rows < len(x_test)
            rows = np.where(real, rows, 0)
            yield jdp.shard_batch(
                {"x": x_test[rows], "y": y_test[rows], "mask": real.astype(np.float32)}, mesh
            )

    result = jdp.evaluate(eval_step, state, test_batches())
    print(f"test_accuracy={result['accuracy']:.4f} on {result['count']} examples")


if __name__ == "__main__":
    main()
