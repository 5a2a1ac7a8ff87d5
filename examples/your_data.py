"""Your own data, model and optimizer in jdp, and the trained model back.

The reference's ``tf.data.Dataset.from_tensor_slices((X_train, y_train))`` under a
strategy, in jdp: NumPy arrays (or a folder of images, one subfolder per class)
become splits with ``jdp.data``, a Flax Linen model written with no ``train``
keyword goes through ``jdp.models.from_linen``, an Optax optimizer of your own
through ``fit(optimizer=...)``. A validation split held out of the training data
chooses the best checkpoint; ``jdp.load_model`` reads it back and ``jdp.predict``
runs it, data-parallel, over the test split.

    python examples/your_data.py                  # scikit-learn's digits as NumPy arrays
    python examples/your_data.py --folder PATH    # PATH/train/CLASS/*.png, PATH/test/CLASS/*.png
    python examples/your_data.py --smoke          # a few steps, for tests
"""

import argparse
import tempfile

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--folder", help="images in class folders, with train/ and test/")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators

    import flax.linen as nn
    import numpy as np
    import optax

    if args.folder:
        train = jdp.data.from_folder(f"{args.folder}/train")
        test = jdp.data.from_folder(f"{args.folder}/test", classes=train.classes)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()  # 1,797 8x8 images, values 0..16, as NumPy arrays
        x, y = digits.images[..., None].astype(np.float32) / 16.0, digits.target
        train, test = jdp.data.holdout(jdp.data.from_arrays(x, y), 0.2, seed=0)

    class Net(nn.Module):  # no train keyword: from_linen reads the signature
        num_classes: int

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(128)(x.reshape((x.shape[0], -1))))
            return nn.Dense(self.num_classes)(x)

    model = jdp.models.from_linen(Net(train.num_classes), jdp.models.classification())
    ckpt_dir = tempfile.mkdtemp(prefix="jdp-your-data-")
    steps = 40 if args.smoke else 400
    config = jdp.TrainConfig(
        mesh="data=-1",  # every device: 8 simulated CPUs, or the accelerators
        steps=steps,
        batch_size=128,
        validation_fraction=0.1,  # held out of train: chooses the best checkpoint
        eval_every=steps // 4,
        ckpt_dir=ckpt_dir,
        ckpt_every=steps // 4,
    )
    result = jdp.fit(
        config, model=model, train=train, test=test,
        optimizer=optax.adamw(3e-3, weight_decay=1e-4), lr_schedule=3e-3,
    )  # fmt: skip
    print(result.summary_line())

    best = jdp.load_model(ckpt_dir, "best", model=model)
    logits = jdp.predict(best.model, best.params, test, batch_size=config.batch_size)
    accuracy = np.mean(np.argmax(logits, -1) == test.features["label"])
    print(
        f"best checkpoint: step {best.step} (validation accuracy "
        f"{best.metrics['accuracy']:.4f}); its test accuracy {accuracy:.4f}"
    )


if __name__ == "__main__":
    main()
