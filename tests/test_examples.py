import pathlib

import pytest
import tensorflow_datasets as tfds
from catalog import prepare
from helpers import run_python

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


def _run(script, *flags):
    result = run_python(script, "--smoke", *flags)
    assert result.returncode == 0, result.stderr
    assert "test_accuracy=" in result.stdout
    return result


# The reference's mixed precision, which the example picks only on a GPU.
SMOKE_FLAGS = {"seq2seq_transformer.py": ["--precision", "fp16"]}


# The seq2seq example (fp16, 8 devices, 10 steps and a 2,000-example evaluation: 60-90 s) is
# in the scheduled lane: per change tests/test_cli.py trains seq2seq from the CLI, the loss
# scale has its tests (tests/test_accumulate_precision.py) and `translate` decodes in
# tests/test_models.py. So is the CIFAR ResNet's smoke form (ResNet-20 on the bundled
# digits, 10 steps at batch 128: 30-50 s): per change the same script trains on CIFAR-10
# (`test_cifar_resnet_trains_on_augmented_cifar10`); the smoke form adds only the fallback
# to the digits where CIFAR-10 is not prepared.
SCHEDULED = {"seq2seq_transformer.py", "cifar_resnet.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(path, marks=[pytest.mark.scheduled] if path.name in SCHEDULED else [])
        for path in EXAMPLES
    ],
    ids=lambda path: path.name,
)
@pytest.mark.slow
def test_example_runs_in_smoke_mode(script):
    _run(script, *SMOKE_FLAGS.get(script.name, []))


# What each example's docstring must name: the reference workload it mirrors.
MIRRORS = {
    "mnist_mirrored.py": "MirroredStrategy",
    "custom_loop.py": "strategy.run",
    "seq2seq_transformer.py": "DistributedDataParallel",
    "cifar_resnet.py": "MirroredStrategy",
    "linen_model.py": "strategy.scope()",
    "nnx_model.py": "replicated by the strategy",
    "your_data.py": "from_tensor_slices",
    "diloco.py": "ParameterServerStrategy",
}


def test_example_docstrings_name_the_reference_and_the_full_run():
    assert sorted(MIRRORS) == sorted(script.name for script in EXAMPLES)
    for script in EXAMPLES:
        doc = script.read_text().split('"""')[1]
        assert MIRRORS[script.name] in doc, f"{script.name}: which reference workload it mirrors"
        assert f"python examples/{script.name} " in doc, f"{script.name}: its full-size command"


@pytest.mark.slow
def test_cifar_resnet_trains_on_augmented_cifar10(tmp_path):
    """The full example's data path: CIFAR-10 from TFDS with crop and flip augmentation."""
    prepare(tfds.image_classification.Cifar10, tmp_path, {"train": 160, "test": 40}, (32, 32, 3))
    result = _run(
        EXAMPLES[[p.name for p in EXAMPLES].index("cifar_resnet.py")],
        "--data-dir",
        str(tmp_path),
        "--batch-size",
        "32",
    )
    assert "cifar10: 160 training images, augmented: True" in result.stdout
