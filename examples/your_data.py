"""Your own data, model and optimizer in jdp, and the trained model back.

The reference's ``tf.data.Dataset.from_tensor_slices((X_train, y_train))`` under a
strategy, in jdp, from each of the three ways in: NumPy arrays
(``jdp.data.from_arrays``), a TFDS builder of your own (``jdp.data.from_tfds``;
defined in a script, it sets ``pkg_dir_path``, as TFDS otherwise looks for its
files in a package), or a folder of images, one subfolder per class
(``jdp.data.from_folder``). A Flax Linen model written with no ``train`` keyword
goes through ``jdp.models.from_linen``, an Optax optimizer of your own through
``fit(optimizer=...)``. A validation split held out of the training data chooses
the best checkpoint; ``jdp.load_model`` reads it back and ``jdp.predict`` runs it,
data-parallel, over the test split.

    python examples/your_data.py                  # scikit-learn's digits as NumPy arrays
    python examples/your_data.py --source tfds    # the same digits as a TFDS builder of yours
    python examples/your_data.py --folder PATH    # PATH/train/CLASS/*.png, PATH/test/CLASS/*.png
    python examples/your_data.py --smoke          # a few steps from each of the three, for tests
"""

import argparse
import tempfile

import jdp


def digits_arrays():
    """scikit-learn's 1,797 8x8 digits (values 0..16) as NumPy arrays, scaled to [0, 1]."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images[..., None].astype(np.float32) / 16.0, digits.target


def from_a_builder(data_dir: str):
    """The digits as a TFDS builder of your own, prepared as array_record in ``data_dir``."""
    import pathlib

    import numpy as np
    import tensorflow_datasets as tfds

    class MyDigits(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")
        pkg_dir_path = pathlib.Path(__file__).parent  # TFDS's files: here, not in a package

        def _info(self):
            features = {
                "pixels": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.float32),
                "digit": tfds.features.ClassLabel(num_classes=10),
            }
            return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(features))

        def _split_generators(self, dl_manager):
            x, y = digits_arrays()
            order = np.random.default_rng(0).permutation(len(y))
            cut = len(y) // 5
            return {
                "train": self._generate_examples(x, y, order[cut:]),
                "test": self._generate_examples(x, y, order[:cut]),
            }

        def _generate_examples(self, x, y, rows):
            for row in rows:
                yield int(row), {"pixels": x[row], "digit": int(y[row])}

    builder = MyDigits(data_dir=data_dir, file_format="array_record")
    return jdp.data.from_tfds(builder, "train"), jdp.data.from_tfds(builder, "test")


def a_folder(root: str) -> str:
    """The digits as PNG files in ``root/{train,test}/CLASS/``; returns ``root``."""
    import pathlib

    import numpy as np
    from PIL import Image

    x, y = digits_arrays()
    test = np.random.default_rng(0).permutation(len(y))[: len(y) // 5]
    for row in range(len(y)):
        folder = pathlib.Path(root, "test" if row in test else "train", str(y[row]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((x[row, :, :, 0] * 255).astype(np.uint8)).save(folder / f"{row}.png")
    return root


def splits(source: str, folder: str | None):
    """``(train, test)`` from one of the three ways in."""
    if source == "tfds":
        return from_a_builder(tempfile.mkdtemp(prefix="jdp-tfds-"))
    if source == "folder":
        root = folder or a_folder(tempfile.mkdtemp(prefix="jdp-images-"))
        train = jdp.data.from_folder(f"{root}/train")
        return train, jdp.data.from_folder(f"{root}/test", classes=train.classes)
    x, y = digits_arrays()
    return jdp.data.holdout(jdp.data.from_arrays(x, y), 0.2, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps from each source")
    parser.add_argument("--source", choices=("arrays", "tfds", "folder"), default="arrays")
    parser.add_argument("--folder", help="images in class folders, with train/ and test/")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators
    sources = (
        ("arrays", "tfds", "folder") if args.smoke else ("folder" if args.folder else args.source,)
    )
    for source in sources:
        train, test = splits(source, args.folder)
        print(f"{source}: {len(train)} training and {len(test)} test examples")
        train_and_predict(train, test, steps=40 if args.smoke else 400)


def train_and_predict(train, test, *, steps: int) -> None:
    import flax.linen as nn
    import numpy as np
    import optax

    class Net(nn.Module):  # no train keyword: from_linen reads the signature
        num_classes: int

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(128)(x.reshape((x.shape[0], -1))))
            return nn.Dense(self.num_classes)(x)

    # Names are mapped, not renamed: the model reads the split's input, the loss its label.
    model = jdp.models.from_linen(
        Net(train.num_classes),
        jdp.models.classification(label=train.label_key),
        inputs=train.input_key,
    )
    ckpt_dir = tempfile.mkdtemp(prefix="jdp-your-data-")
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
        config,
        model=model,
        train=train,
        test=test,
        optimizer=optax.adamw(3e-3, weight_decay=1e-4),
        lr_schedule=3e-3,
    )
    print(result.summary_line())

    best = jdp.load_model(ckpt_dir, "best", model=model)
    logits = jdp.predict(best.model, best.params, test, batch_size=config.batch_size)
    labels = test.features[test.label_key]
    accuracy = np.mean(np.argmax(logits, -1) == labels)
    print(
        f"best checkpoint: step {best.step} (validation accuracy "
        f"{best.metrics['accuracy']:.4f}); its test accuracy {accuracy:.4f}"
    )


if __name__ == "__main__":
    main()
