"""Bring your own Flax NNX model: BatchNorm over the global batch and dropout, on jdp.

The NNX counterpart of ``linen_model.py``, and like it the reference documents'
model defined once and replicated by the strategy: an ``nnx.Module`` built with its own
``nnx.Rngs`` goes through ``jdp.models.from_nnx``. Its ``nnx.Param`` variables
are trained, BatchNorm's statistics travel as model state, and its rng streams
are reseeded on every replica and step, so dropout masks differ across replicas.
After ``fit`` the module holds the trained values.
Training sets ``deterministic=False`` and ``use_running_average=False`` on the
sub-modules that have them; evaluation sets both True.

    python examples/nnx_model.py                  # bundled digits, 600 steps
    python examples/nnx_model.py --dataset mnist  # full size (MNIST prepared in TFDS)
    python examples/nnx_model.py --smoke          # a few steps, for tests
"""

import argparse

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--dataset", default="digits", help="digits, mnist or fashion_mnist")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators

    from flax import nnx

    class Net(nnx.Module):
        """Conv -> BatchNorm -> ReLU, twice; pooled; dropout; logits."""

        def __init__(self, channels: int, num_classes: int, *, rngs: nnx.Rngs):
            self.layers = nnx.List()
            for width in (32, 64):
                conv = nnx.Conv(channels, width, (3, 3), use_bias=False, rngs=rngs)
                norm = nnx.BatchNorm(width, axis_name=jdp.models.DATA_AXIS, rngs=rngs)
                self.layers.append(nnx.Sequential(conv, norm, nnx.relu))
                channels = width
            self.dropout = nnx.Dropout(0.2, rngs=rngs)
            self.head = nnx.Linear(channels, num_classes, rngs=rngs)

        def __call__(self, images):
            x = images
            for layer in self.layers:
                x = layer(x)
            return self.head(self.dropout(x.mean(axis=(1, 2))))

    channels = 3 if args.dataset == "cifar10" else 1
    net = Net(channels, 10, rngs=nnx.Rngs(0))
    model = jdp.models.from_nnx(net, jdp.models.classification(), inputs="image")
    config = jdp.TrainConfig(
        mesh="data=-1",  # every device: 8 simulated CPUs, or the accelerators
        dataset=args.dataset,
        steps=20 if args.smoke else 600,
        warmup_steps=5 if args.smoke else 40,
        lr=1e-2,
        eval_every=0 if args.smoke else 200,
    )
    result = jdp.fit(config, model=model)
    print(result.summary_line())

    # fit put the trained values back into the module: use it as it is.
    import numpy as np

    test = jdp.load_split(args.dataset, "test")
    evaluating = nnx.view(net, deterministic=True, use_running_average=True)
    images = test.transform(test.image)
    accuracy = np.mean(np.argmax(evaluating(images), -1) == test.label)
    print(f"the trained module itself: test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
