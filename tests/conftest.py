"""The tests' shared fixtures (the devices are set up in the repository's conftest.py)."""

import os

import jax
import pytest

import jdp


@pytest.fixture(autouse=True, scope="session")
def _tfds_data_dir(tmp_path_factory):
    """Keep prepared datasets out of the user's ~/tensorflow_datasets."""
    path = tmp_path_factory.mktemp("tensorflow_datasets")
    previous = os.environ.get("TFDS_DATA_DIR")
    os.environ["TFDS_DATA_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("TFDS_DATA_DIR", None)
    else:
        os.environ["TFDS_DATA_DIR"] = previous


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "tests expect 8 simulated CPU devices"
    return jax.devices()


@pytest.fixture(scope="session")
def mesh8(devices):
    return jdp.make_mesh("data=8")


@pytest.fixture(scope="session")
def mesh1(devices):
    return jdp.make_mesh("data=1")


@pytest.fixture(params=["jit", "pmap"])
def backend(request):
    return request.param


# The fast lane (-m "not slow") is tests of about 3 s or less; one that grows past this
# limit (40 times that, for a loaded machine) fails here instead of slowing every run of
# the lane unseen: mark it slow, or make it cheaper. Tests with their own timeout keep it.
FAST_LANE_TIMEOUT = 120


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_LANE_TIMEOUT))
    _scheduled_lane_apart(config, items)


def _scheduled_lane_apart(config, items):
    """The scheduled lane's tests run only where ``-m`` names the lane (``python -m pytest
    -m scheduled``) or the command names the test itself: the README's test command, the
    fast lane and the interop lane leave them out. Each is a long end-to-end run whose
    code path a per-change test already exercises (docs/testing.md)."""
    if "scheduled" in (config.option.markexpr or ""):
        return
    named = [arg for arg in config.args if "::" in arg]
    kept, left = [], []
    for item in items:
        asked = any(
            item.nodeid == arg or item.nodeid.startswith((f"{arg}[", f"{arg}::")) for arg in named
        )
        scheduled = item.get_closest_marker("scheduled") is not None
        (left if scheduled and not asked else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
