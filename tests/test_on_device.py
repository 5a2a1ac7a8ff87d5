"""Splits on the devices (`jdp.data.loader.on_device`): the host loader's batches, bitwise, gathered
where the data lives; the same training; auto's choice and on's refusal.

Runs on 2 processes use the default (auto, the digits placed) in test_distributed's
two-process tests, and a kill -9 and resume in test_checkpoint's: with the equivalence
to the host path here, those hold for data on the devices too.
"""

import jax
import numpy as np
import pytest
from helpers import cli

import jdp
from jdp.data.loader import on_device
from jdp.data.loader.on_device import OnDevice, cannot_place, place
from jdp.data.splits.ledger import TOTAL, TOTAL_BYTES
from jdp.errors import UsageError

QUIET = jdp.Console(enabled=False)


def _images(rows=300, seed=0):
    """Images augmented as CIFAR-10's are (normalised, padded crops, flips); 300 rows make
    an uneven last evaluation batch of 64."""
    rng = np.random.default_rng(seed)
    transform = jdp.data.Transform(
        mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.25), crop_padding=2, flip=True
    )
    return jdp.data.ArraySplit(
        {
            "image": rng.integers(0, 256, (rows, 8, 8, 3), dtype=np.uint8),
            "label": rng.integers(0, 10, rows).astype(np.int32),
        },
        num_classes=10,
        transform=transform,
    )


def _same(host, device) -> None:
    for key, value in host.items():
        expected, got = np.asarray(value), np.asarray(device[key])
        assert got.dtype == expected.dtype and np.array_equal(got, expected), key


def test_batches_on_the_devices_are_the_host_loaders_bitwise(mesh8, mesh1):
    split = _images()
    for mesh in (mesh8, mesh1):
        placed = OnDevice(split, mesh)
        for calls in (1, 4):  # a chunk of steps gathered at once; steps stacked for a call
            kwargs = dict(batch_size=64, seed=3, steps_per_call=calls, ledger="bytes")
            with (
                jdp.train_batches(split, mesh, **kwargs) as host,
                jdp.train_batches(placed, mesh, workers=1, **kwargs) as device,
            ):
                for _ in range(7):  # 7 x 64 rows: two epochs of 300
                    batch = next(device)
                    _same(next(host), batch)
                assert (
                    batch["image"].sharding
                    == jdp.shard_batch(
                        {"x": np.zeros((calls, 64) if calls > 1 else 64)}, mesh, stacked=calls > 1
                    )["x"].sharding
                )
                assert device.marks() == host.marks()  # the data ledger's digests
        evaluated = list(jdp.eval_batches(placed, mesh, batch_size=64))
        expected = list(jdp.eval_batches(split, mesh, batch_size=64))
        assert [int(batch["mask"].sum()) for batch in evaluated] == [64] * 4 + [44]
        for host, device in zip(expected, evaluated, strict=True):
            _same(host, device)


@pytest.mark.parametrize("steps", [None, 64])
def test_a_short_runs_chunks_come_from_the_host_copy_bitwise(mesh8, mesh1, steps):
    """A training loader of fewer than `COMPILE_STEPS` steps reads its chunks from the
    host's copy of the split (cropped and flipped there) and compiles no chunk's gather
    (0.7 s for 64 digits steps, more than the step's compile); a longer one, or one of
    steps not given, gathers them on the devices: the same bits and placement."""
    from jdp.data.loader import gathers

    split = _images()
    short = steps is not None and steps < gathers.COMPILE_STEPS
    # place=False: the loop's on one CPU device, where the step's call places the batch
    for mesh, calls, placing in (
        (mesh8, 1, True),
        (mesh8, 4, True),
        (mesh1, 1, True),
        (mesh1, 1, False),
        (mesh1, 4, False),
    ):
        placed = OnDevice(split, mesh)
        kwargs = dict(batch_size=64, seed=3, steps_per_call=calls, steps=steps, ledger="bytes")
        kwargs["place"] = placing
        with (
            jdp.train_batches(split, mesh, **kwargs) as host,
            jdp.train_batches(placed, mesh, **kwargs) as device,
        ):
            for _ in range(70 // calls):  # past the first chunk of 64 steps; epochs of 300
                batch, expected = next(device), next(host)
                assert batch.keys() == expected.keys()
                _same(expected, batch)
                if short and not placing:  # left on the host, as the host loader's
                    assert isinstance(batch["image"], np.ndarray)
                    continue
                placement = jdp.shard_batch(expected, mesh, stacked=calls > 1)
                assert batch["image"].sharding == placement["image"].sharding
            assert device.marks() == host.marks()  # the data ledger's digests
        chunks = [key for key in placed.gathers._jitted if key[1]]  # chunk programs made
        assert (chunks == []) == short


def test_each_device_gathers_its_rows_from_its_own_copy(mesh8):
    placed = OnDevice(_images(), mesh8)
    with jdp.train_batches(placed, mesh8, batch_size=64, seed=0) as batches:
        next(batches)
    assert (False, True, 1) in placed.gathers._jitted  # the chunk's program the loader ran
    gather = placed.gathers.jitted(chunk=True)
    index = {
        "rows": np.zeros((2, 64), np.int32),
        "offsets": np.zeros((2, 64, 2), np.int32),
        "flips": np.zeros((2, 64), bool),
    }
    index = jdp.shard_batch(index, mesh8, stacked=True)  # as the loader places a chunk's
    program = gather.lower(placed.arrays, index).compile().as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        assert collective not in program


def _fit(on, **flags):
    config = jdp.TrainConfig(
        **{
            "steps": 16,
            "warmup_steps": 2,
            "log_every": 4,
            "eval_every": 8,
            "data_on_device": on,
            **flags,
        }
    )
    return jdp.fit(config, console=QUIET)


def _figures(result):
    timings = ("time", "examples_per_sec", "steps_per_sec")
    return [
        {key: value for key, value in record.items() if key not in timings}
        for record in result.history
    ]


@pytest.mark.slow
def test_fit_on_the_devices_trains_bitwise_as_on_the_host(monkeypatch):
    # A run of 16 steps reads its chunks from the host's copy (`jdp.data.loader.gathers`);
    # the last pass has every run compile the chunk's gather, as a long run does.
    for compiled, flags in (
        (False, {"mesh": "data=8", "steps_per_call": 8, "data_ledger": "bytes"}),
        (False, {"mesh": "data=1"}),
        (True, {"mesh": "data=8", "data_ledger": "bytes"}),
    ):
        if compiled:
            monkeypatch.setattr(on_device, "COMPILE_STEPS", 0)
        host, device = _fit("off", **flags), _fit("on", **flags)
        assert _figures(device) == _figures(host)  # losses, evaluations, the ledger's digests
        assert TOTAL in host.history[0] and (TOTAL_BYTES in host.history[0]) == (
            "data_ledger" in flags
        )
        for a, b in zip(
            jax.tree.leaves(host.state.params), jax.tree.leaves(device.state.params), strict=True
        ):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_auto_leaves_what_does_not_fit_on_the_host_and_on_refuses_it(mesh8, monkeypatch):
    train, test = _images(), _images(rows=100)
    row = 8 * 8 * 3 * 4 + 4  # float32 pixels and an int32 label: 772 bytes
    said = []
    splits = {"train": train, "validation": None, "test": test}
    placed = place("auto", splits, mesh8, state_bytes=0, say=said.append)
    assert isinstance(placed["train"], OnDevice) and isinstance(placed["test"], OnDevice)
    # the host's copy, for a short run's chunks: the training split's alone
    assert placed["train"].gathers._host is not None and placed["test"].gathers._host is None
    assert said[-1] == (
        "jdp: data on each device: train 300 examples (226.2 KiB), test 100 "
        "examples (75.4 KiB), each step's rows gathered there "
        "(--data-on-device auto)"
    )
    # Room, at auto's share of what the state leaves, for the training split alone.
    monkeypatch.setattr(on_device, "device_bytes", lambda mesh: 4 * 350 * row + 2 * 1000)
    placed = place("auto", splits, mesh8, state_bytes=1000, say=said.append)
    assert isinstance(placed["train"], OnDevice) and placed["test"] is test
    assert said[-1].endswith(
        "(226.2 KiB); test on the host, each step's rows gathered there (--data-on-device auto)"
    )
    monkeypatch.setattr(on_device, "device_bytes", lambda mesh: 350 * row + 2 * 1000)
    with pytest.raises(
        UsageError,
        match=r"^--data-on-device on: the test split cannot go on "
        r"the devices: 301\.6 KiB with the splits before it, and a device has "
        r"263\.9 KiB for data \(265\.8 KiB, less 2 x 1\.0 KiB of training "
        r"state\); use --data-on-device auto \(or off\) to read it on the host$",
    ):
        place("on", splits, mesh8, state_bytes=1000)
    monkeypatch.setattr(on_device, "device_bytes", lambda mesh: 100 * row)
    assert place("auto", splits, mesh8, state_bytes=0, say=said.append) is splits
    assert said[-1] == (
        "jdp: data on the host: the train split stays there: 226.2 KiB, and a "
        "device has 18.8 KiB for data (75.4 KiB, less 2 x 0.0 KiB of training "
        "state, times 0.25)"
    )
    assert place("auto", splits, mesh8, state_bytes=0, workers=2, say=said.append) is splits
    assert said[-1] == "jdp: data on the host (--loader-workers asks for host workers)"
    assert place("off", splits, mesh8, state_bytes=0, say=said.append) is splits
    monkeypatch.undo()
    place("on", {"train": train}, mesh8, state_bytes=0, workers=2, say=said.append)
    assert said[-1].endswith("(--data-on-device on; --loader-workers unused)")


def test_what_runs_on_the_host_stays_there(tmp_path, mesh8):
    mapped = jdp.data.from_arrays(
        np.zeros((8, 2), np.float32), np.zeros(8, np.int32), map=lambda example, rng: example
    )
    assert cannot_place(mapped, corpus=True) == "its map= function runs on the host"
    stream = jdp.data.from_batches([{"image": np.zeros((8, 2)), "label": np.zeros(8)}])
    assert cannot_place(stream, corpus=True) == "its batches come from an iterable of your own"
    np.save(tmp_path / "train.npy", np.arange(400, dtype=np.uint16))
    corpus = jdp.data.from_tokens(tmp_path / "train.npy", seq_len=8, vocab_size=400)
    assert "token corpus" in cannot_place(corpus, corpus=False)
    assert cannot_place(corpus, corpus=True) is None  # --data-on-device on reads it whole
    windows = OnDevice(corpus, mesh8)
    assert np.array_equal(
        np.asarray(windows.arrays["tokens"]), corpus.read(np.arange(49))["tokens"]
    )
    with pytest.raises(UsageError, match=r"^this split cannot go on the devices: its map="):
        jdp.data.on_devices(mapped, mesh8)
    with pytest.raises(
        UsageError,
        match="--data-on-device on: the train split cannot go on the "
        "devices: its map= function runs on the host",
    ):
        place("on", {"train": mapped}, mesh8, state_bytes=0)


@pytest.mark.slow
def test_on_a_split_that_does_not_fit_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setattr(on_device, "device_bytes", lambda mesh: 2**20)
    result = cli("--mesh", "data=8", "--steps", "2", "--data-on-device", "on")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "jdp.train: error: --data-on-device on: the train split cannot go "
        "on the devices: 365.1 KiB, and a device has "
    )
