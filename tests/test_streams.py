"""Data in the form users hold it: indexable sources read in jdp's order (a Hugging Face
dataset, a Grain MapDataset), and iterables of batches read in theirs."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import grain
import jax
import numpy as np
import pytest
from closeness import assert_drift_within
from helpers import interop, subprocess_env

import jdp

QUIET = jdp.Console(enabled=False)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(640, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)
TEST = jdp.data.from_arrays(X[:128], Y[:128])


def _batches():  # a generator function: a fresh pass each call
    for start in range(0, len(X), 32):
        yield {"image": X[start : start + 32], "label": Y[start : start + 32]}


def _fit(train, mesh, **overrides):
    config = jdp.TrainConfig(
        **({"mesh": mesh, "steps": 30, "batch_size": 32, "warmup_steps": 2} | overrides)
    )
    return jdp.fit(config, train=train, test=TEST, console=QUIET)


def _params(result):
    return jax.tree.map(np.asarray, result.state.params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: _batches,
        lambda: list(_batches()),
        lambda: (
            grain.MapDataset.source([{"image": X[i], "label": Y[i]} for i in range(len(X))])
            .batch(32)
            .to_iter_dataset()
        ),
    ],
    ids=["generator-function", "list", "grain-iter-dataset"],
)
def test_an_iterable_of_batches_trains_alike_on_8_devices_and_1(make):
    one = _fit(jdp.data.from_batches(make(), num_classes=2), "data=1")
    eight = _fit(jdp.data.from_batches(make(), num_classes=2), "data=8")
    assert_drift_within(_params(eight), _params(one))
    # 30 steps of 20 batches: the second pass of the source is the next epoch.
    assert one.steps == 30 and np.isfinite(one.test_loss)


@pytest.mark.slow
@pytest.mark.interop
def test_indexable_sources_are_read_in_jdps_order_as_arrays_are():
    (datasets,) = interop("datasets")

    arrays = _fit(jdp.data.from_arrays(X, Y), "data=8")
    hugging = datasets.Dataset.from_dict({"image": X, "label": Y}).with_format("numpy")
    mapped = grain.MapDataset.source([{"image": X[i], "label": Y[i]} for i in range(len(X))])
    for source in (hugging, mapped):
        split = jdp.data.from_indexable(source)
        assert split.num_classes == 2
        got = _fit(split, "data=8")
        # The same examples in the same order: bitwise the run on the arrays.
        for a, b in zip(
            jax.tree.leaves(_params(got)), jax.tree.leaves(_params(arrays)), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    assert_drift_within(_params(_fit(jdp.data.from_indexable(hugging), "data=1")), _params(arrays))


def test_streams_say_what_they_cannot_do():
    stream = jdp.data.from_batches(_batches, num_classes=2)
    with pytest.raises(jdp.UsageError, match=r"your batches have 32 rows and the global batch "):
        _fit(stream, "data=2", batch_size=64)
    with pytest.raises(jdp.UsageError, match=r"from_batches is for training; give the test"):
        jdp.fit(
            jdp.TrainConfig(mesh="data=2", steps=2, batch_size=32),
            train=stream,
            test=stream,
            console=QUIET,
        )
    with pytest.raises(jdp.UsageError, match=r"--validation-fraction and --epochs need"):
        _fit(stream, "data=2", validation_fraction=0.1)
    once = jdp.data.from_batches(iter(list(_batches())), num_classes=2)
    with pytest.raises(jdp.UsageError, match=r"the batches ran out after \d+: a one-shot"):
        _fit(once, "data=2", steps=40)
    spoilt = list(_batches())
    spoilt[3] = {"image": spoilt[3]["image"], "label": np.full(32, 5)}
    with pytest.raises(jdp.UsageError, match=r"^label 5 of example 0 of the batch 4 of the stream"):
        _fit(jdp.data.from_batches(spoilt, num_classes=2), "data=2")
    with pytest.raises(jdp.UsageError, match=r"from_indexable: a generator has no len"):
        jdp.data.from_indexable(_batches())


RESUMABLE = textwrap.dedent("""
    import sys
    import numpy as np
    import jdp

    def batches():  # seeded: the same batches each pass, so a resume goes on exactly
        rng = np.random.default_rng(0)
        for _ in range(25):
            x = rng.normal(size=(32, 4)).astype(np.float32)
            yield {"image": x, "label": (x[:, 0] > 0).astype(np.int32)}

    config = jdp.TrainConfig(mesh="data=2", steps=300, batch_size=32, warmup_steps=2,
                             ckpt_dir=sys.argv[1], ckpt_every=10)
    jdp.fit(config, train=jdp.data.from_batches(batches, num_classes=2),
            console=jdp.Console(enabled=False))
""")


@pytest.mark.slow
def test_a_killed_run_on_a_stream_resumes_to_the_unbroken_runs_result(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RESUMABLE)
    run = [sys.executable, str(script)]
    unbroken = subprocess.run(
        [*run, str(tmp_path / "unbroken")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert unbroken.returncode == 0, unbroken.stderr
    killed = subprocess.Popen(
        [*run, str(tmp_path / "killed")],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "killed").is_dir() or not [
        n for n in os.listdir(tmp_path / "killed") if n.isdigit() and int(n) >= 50
    ]:
        assert killed.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = subprocess.run(
        [*run, str(tmp_path / "killed")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    ends = [jdp.load_params(str(tmp_path / name)) for name in ("unbroken", "killed")]
    for a, b in zip(jax.tree.leaves(ends[0]), jax.tree.leaves(ends[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
