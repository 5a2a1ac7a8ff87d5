"""Set before JAX starts, for the tests and the docstring examples alike: 8 simulated
CPU devices compiled at LLVM's optimization level 1, implicit rank promotion
refused (a broadcast nobody asked for is a bug waiting in a model), and a
compilation cache for the session. Fresh processes
the tests start inherit them all.

Strict dtype promotion cannot be on everywhere: Optax's Adam raises under it (its
bias correction takes a float to an int32 count's power). tests/test_step.py runs
jdp's own step code under it instead."""

import atexit
import os
import shutil
import tempfile

# Most tests compile more than they run. LLVM's optimization level 1 in place of the
# default 3 took a fifth off the fast lane's CPU time (406 s to 326 s) and left a
# 100-step seq2seq run as fast; level 0 saved more but ran that run 1.5x slower.
# Programs compiled alike still agree bit for bit, which is what the equivalence
# tests compare; but one of the numerics fingerprint's twelve values (a loss) gets
# other last bits than at level 3, so the README's rows, compared with figures
# recorded at the default, drop the flag.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"
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


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace, tmp_path):
    """What every docstring example may use without importing it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    doctest_namespace.update(jax=jax, jnp=jnp, np=np, optax=optax, jdp=jdp, tmp=str(tmp_path))
