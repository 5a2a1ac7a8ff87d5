"""Named configurations: the README's runs and the workloads jdp's users come from.

Each preset is a plain function returning a `TrainConfig`; ``--preset NAME``
starts from it and any other flag overrides it (``--preset digits-cnn --mesh
data=1``). Add your own by writing such a function.
"""

from __future__ import annotations

from collections.abc import Callable

from jdp.training.config import TrainConfig


def digits_mlp() -> TrainConfig:
    """The default run: the 38k-parameter MLP (the Keras MirroredStrategy model) on the
    bundled digits, Adam with warmup and cosine decay, 400 steps of 128."""
    return TrainConfig()


def digits_cnn() -> TrainConfig:
    """The Keras tutorials' small CNN on the bundled digits."""
    return TrainConfig(model="cnn")


def digits_resnet20() -> TrainConfig:
    """ResNet-20 (BatchNorm, statistics averaged over replicas) on the bundled digits."""
    return TrainConfig(model="resnet20", lr=1e-2)


def mnist_mlp() -> TrainConfig:
    """The TensorFlow data-parallelism tutorials' workload: Dense(512) and Dense(10) on
    MNIST, Keras's Adam (1e-3, constant), global batch 64, 10 epochs of 937 full
    batches, evaluated each epoch (needs MNIST through TFDS: a download)."""
    return TrainConfig(
        dataset="mnist",
        batch_size=64,
        steps=9370,
        eval_every=937,
        lr=1e-3,
        schedule="constant",
        warmup_steps=0,
    )


def numbers2words_seq2seq() -> TrainConfig:
    """The PyTorch DDP tutorial's workload: an encoder-decoder Transformer translating
    numbers into words (generated data)."""
    return TrainConfig(model="seq2seq", dataset="numbers2words")


def numbers2words_gpt() -> TrainConfig:
    """A decoder-only Transformer on the same task."""
    return TrainConfig(model="gpt", dataset="numbers2words")


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "digits-mlp": digits_mlp,
    "digits-cnn": digits_cnn,
    "digits-resnet20": digits_resnet20,
    "mnist-mlp": mnist_mlp,
    "numbers2words-seq2seq": numbers2words_seq2seq,
    "numbers2words-gpt": numbers2words_gpt,
}
