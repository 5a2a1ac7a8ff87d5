"""Set before JAX starts, for the tests and the docstring examples alike: 8 simulated
CPU devices, LLVM's optimization level (`pytest_configure`), implicit rank
promotion refused (a broadcast nobody asked for is a bug waiting in a model), and
a compilation cache for the session. Fresh processes the tests start inherit them
all.

Strict dtype promotion cannot be on everywhere: Optax's Adam raises under it (its
bias correction takes a float to an int32 count's power). tests/test_step.py runs
jdp's own step code under it instead."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"

# About 60 tests start fresh processes (the CLI, the launcher, the README's and the
# docs' commands), and each compiled the same programs again: the default MLP's
# step dozens of times, a ResNet-20 step in 35 s each time. One persistent
# compilation cache for the session, inherited by those processes, compiles each
# program once (ResNet-20's 20-step run: 38 s to 6.5 s). An executable read from
# the cache is the one compiled, so no figure changes. The cache lives as long as
# the session: a test run never depends on what an earlier one left behind.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jdp-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import pytest

pytest_plugins = ["tests.suite_report"]  # python -m pytest --suite-report FILE


def pytest_configure(config):
    """LLVM's optimization level, unless ``XLA_FLAGS`` gives one: 1 for the suite, 0 for
    a lane without the slow tests.

    Most tests compile more than they run. On the 2-core machine, the fast lane took
    406 s of CPU at the default level 3 and 326 s at level 1 (back to back), and
    276 s at 1 against 235 s at 0 an hour later; a 100-step seq2seq run was as fast
    at 1 as at 3, and 1.5x slower at 0, so the whole suite, whose slow tests train,
    stays at 1. Programs compiled alike agree bit for bit, as the equivalence tests
    compare them; one of the numerics fingerprint's twelve values (a loss) has other
    last bits than at 3, so the README's rows, compared with figures recorded at the
    default, drop the flag (`jdp.bench.readme.row_env`). Set here, before any test
    starts JAX's backend, and inherited by the fresh processes tests start."""
    if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        level = 0 if "not slow" in (config.option.markexpr or "") else 1
        os.environ["XLA_FLAGS"] += f" --xla_backend_optimization_level={level}"


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace, tmp_path):
    """What every docstring example may use without importing it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    doctest_namespace.update(jax=jax, jnp=jnp, np=np, optax=optax, jdp=jdp, tmp=str(tmp_path))
