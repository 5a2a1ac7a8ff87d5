"""The reference Keras ``MirroredStrategy`` MLP on MNIST, the jdp way.

The reference builds ``Dense(512, relu) -> Dense(10)`` inside
``strategy.scope()``, compiles it with Adam and sparse categorical
cross-entropy and calls ``model.fit(x_train, y_train, epochs=10,
batch_size=32)``. In jdp the strategy is the mesh (``data=-1``: every device
holds a replica and a slice of each batch), and ``jdp.fit`` is ``model.fit``:
the same MLP (``--model mlp``), Adam at Keras's 1e-3, 10 epochs.

The global batch is 32 per replica (256 on 8 devices), as the reference's
advice to scale the batch with the replicas; ``--lr-scaling`` would scale the
learning rate with it.

    python examples/mnist_mirrored.py                     # MNIST, 10 epochs
    python examples/mnist_mirrored.py --dataset digits    # the bundled digits, offline
    python examples/mnist_mirrored.py --smoke             # a few steps, for tests

MNIST must be prepared in TFDS (``python -m jdp.data prepare mnist`` where the
network reaches it); without it the example says why and uses the digits.
"""

import argparse
import sys

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--dataset", default="mnist", help="mnist, fashion_mnist or digits")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators

    import jax

    dataset = "digits" if args.smoke else args.dataset
    try:
        train = jdp.load_split(dataset, "train")
    except jdp.UsageError as error:
        print(f"{error}\nusing the bundled digits instead", file=sys.stderr)
        dataset, train = "digits", jdp.load_split("digits", "train")

    batch_size = 32 * len(jax.devices())  # 32 per replica
    steps = 10 if args.smoke else args.epochs * len(train) // batch_size
    config = jdp.TrainConfig(
        mesh="data=-1",
        model="mlp",
        dataset=dataset,
        batch_size=batch_size,
        steps=steps,
        optimizer="adam",
        lr=1e-3,
        schedule="constant",
        warmup_steps=0,
        eval_every=0 if args.smoke else len(train) // batch_size,  # every epoch
    )
    result = jdp.fit(config)
    print(result.summary_line())


if __name__ == "__main__":
    main()
