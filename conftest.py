"""Set before JAX starts, for the tests and the docstring examples alike: 8 simulated
CPU devices, and implicit rank promotion refused (a broadcast nobody asked for is a
bug waiting in a model). Fresh processes the tests start inherit both.

Strict dtype promotion cannot be on everywhere: Optax's Adam raises under it (its
bias correction takes a float to an int32 count's power). tests/test_step.py runs
jdp's own step code under it instead."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"

import pytest


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace, tmp_path):
    """What every docstring example may use without importing it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    doctest_namespace.update(jax=jax, jnp=jnp, np=np, optax=optax, jdp=jdp, tmp=str(tmp_path))
