"""Set before JAX starts, for the tests and the docstring examples alike: 8 simulated
CPU devices, XLA's quickest compiles (`pytest_configure`), implicit rank
promotion refused (a broadcast nobody asked for is a bug waiting in a model), and
a compilation cache for the session. Fresh processes the tests start inherit them
all.

Strict dtype promotion cannot be on everywhere: Optax's Adam raises under it (its
bias correction takes a float to an int32 count's power). tests/test_step.py runs
jdp's own step code under it instead."""

import atexit
import os
import shutil
import subprocess
import sys
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
# the session: a test run never depends on what an earlier one left behind. Every
# program goes in, however quick its compile at the suite's settings: a fresh
# `--steps 2` run of the default model on data=8 took 0.1-1.1 s less CPU (five pairs
# alternated) than with the programs compiled in under 0.2 s left out.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jdp-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import pytest

pytest_plugins = ["tests.suite_report"]  # python -m pytest --suite-report FILE

QUICK_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def pytest_configure(config):
    """XLA's quickest compiles, unless ``XLA_FLAGS`` gives an optimization level:
    `QUICK_COMPILE`, LLVM's level 0, XLA's older CPU emitters for fusions (the newer
    ones compile slower) and one LLVM module per program, not split for threads.

    Most tests compile far more than they run. A tiny GPT's train step compiled for
    three meshes and run 3 steps each took 37 s of CPU at LLVM's level 1 (the suite's
    setting before), 29 s at 0, 17 s at 0 with the older emitters and 14.5 s with one
    module as well; a 100-step seq2seq run, which trains, took 84 s at 1 and 124 s
    with all three (its steps ran 3x slower). The per-change lane took 5,320 s of
    CPU at level 1 and 4,095 s with these (2026-11-29, the 2-core machine), the
    fast lane less too. Programs compiled alike agree bit for bit, as the
    equivalence tests compare them; figures recorded at XLA's defaults (the README's
    rows, the numerics fingerprint) are compared with runs that drop these flags
    (`tools.readme.row_env`). Set here, before any test starts JAX's backend,
    and inherited by the fresh processes tests start."""
    if "--xla_backend_optimization_level" in os.environ["XLA_FLAGS"]:
        return
    flags = " ".join(QUICK_COMPILE)
    if not _xla_knows(flags):  # a JAX whose XLA renamed one: the level alone
        flags = QUICK_COMPILE[0]
    os.environ["XLA_FLAGS"] += f" {flags}"


def _xla_knows(flags: str) -> bool:
    """Whether this JAX's XLA takes ``flags``: it ends the process on one it does not
    know, so a fresh process is asked (once a session, about 2 s)."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {flags}"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace, tmp_path):
    """What every docstring example may use without importing it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    doctest_namespace.update(jax=jax, jnp=jnp, np=np, optax=optax, jdp=jdp, tmp=str(tmp_path))
