"""jdp: data-parallel training in JAX.

A train step is compiled once over a device mesh: parameters are replicated, each
device takes its slice of the global batch, gradients are averaged with
``lax.pmean`` over the ``data`` axis, and an Optax optimizer applies the update.

Examples:
    >>> mesh = jdp.make_mesh("data=8")
    >>> state = jdp.create_train_state(params, optax.adam(1e-3), mesh, rng=key)
    >>> step = jdp.make_train_step(loss_fn, optax.adam(1e-3), mesh, backend="jit")
    >>> state, metrics = step(state, jdp.shard_batch({"x": x, "y": y}, mesh))
"""

from jdp import distributed, models
from jdp.checkpoint import Checkpointer, load_params
from jdp.config import TrainConfig
from jdp.data.pipeline import Loader, eval_batches, train_batches
from jdp.data.sources import Split, load_split
from jdp.errors import UsageError
from jdp.loop import FitResult, fit
from jdp.mesh import make_mesh, shard_batch, simulate_cpu_devices
from jdp.optim import make_optimizer, make_schedule
from jdp.precision import LossScale, Precision, make_precision
from jdp.state import TrainState, create_train_state
from jdp.step import evaluate, make_eval_step, make_train_step

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "FitResult",
    "Loader",
    "LossScale",
    "Precision",
    "Split",
    "TrainConfig",
    "TrainState",
    "UsageError",
    "create_train_state",
    "distributed",
    "eval_batches",
    "evaluate",
    "fit",
    "load_params",
    "load_split",
    "make_eval_step",
    "make_mesh",
    "make_optimizer",
    "make_precision",
    "make_schedule",
    "make_train_step",
    "models",
    "shard_batch",
    "simulate_cpu_devices",
    "train_batches",
]
