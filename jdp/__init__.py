"""jdp: data-parallel training in JAX.

A train step is compiled once over a device mesh: parameters are replicated, each
device takes its slice of the global batch, gradients are averaged with
``lax.pmean`` over the ``data`` axis, and an Optax optimizer applies the update.

Examples:
    >>> mesh = jdp.make_mesh("data=8")
    >>> def loss_fn(params, batch, rng):
    ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> params = {"w": jnp.zeros((4, 1))}
    >>> state = jdp.create_train_state(params, optax.adam(1e-3), mesh, rng=jax.random.key(0))
    >>> step = jdp.make_train_step(loss_fn, optax.adam(1e-3), mesh, backend="jit")
    >>> x, y = np.ones((64, 4), np.float32), np.ones((64, 1), np.float32)
    >>> state, metrics = step(state, jdp.shard_batch({"x": x, "y": y}, mesh))
    >>> int(state.step), float(metrics["loss"])
    (1, 1.0)
"""

from jdp import actions, data, distributed, layout, models
from jdp.actions import Action, Callback, EarlyStopping, PeriodicAction, Progress
from jdp.checkpoint import Checkpointer, load_params
from jdp.data.pipeline import Loader, eval_batches, train_batches
from jdp.data.sources import Split, load_split
from jdp.diloco import Outer, diloco  # the function; the package is jdp/diloco/
from jdp.errors import DataLedgerError, NonFiniteError, UsageError
from jdp.inference import LoadedModel, load_model, predict
from jdp.layout import param_specs
from jdp.mesh import make_mesh, shard_batch, simulate_cpu_devices
from jdp.models.summary import Summary, summary
from jdp.optim import make_optimizer, make_schedule
from jdp.precision import LossScale, Precision, make_precision
from jdp.report.console import Console
from jdp.state import GroupState, TrainState, create_train_state
from jdp.step import (
    CompiledStep,
    SyncStep,
    evaluate,
    make_eval_step,
    make_sync_step,
    make_train_step,
)
from jdp.training.config import TrainConfig
from jdp.training.loop import FitResult, fit
from jdp.version import __version__ as __version__

__all__ = [
    "Action",
    "Callback",
    "Checkpointer",
    "CompiledStep",
    "Console",
    "DataLedgerError",
    "EarlyStopping",
    "FitResult",
    "GroupState",
    "LoadedModel",
    "Loader",
    "LossScale",
    "NonFiniteError",
    "Outer",
    "PeriodicAction",
    "Precision",
    "Progress",
    "Split",
    "Summary",
    "SyncStep",
    "TrainConfig",
    "TrainState",
    "UsageError",
    "actions",
    "create_train_state",
    "data",
    "diloco",
    "distributed",
    "eval_batches",
    "evaluate",
    "fit",
    "load_model",
    "load_params",
    "load_split",
    "make_eval_step",
    "make_mesh",
    "make_optimizer",
    "make_precision",
    "make_schedule",
    "make_sync_step",
    "make_train_step",
    "layout",
    "models",
    "param_specs",
    "predict",
    "shard_batch",
    "simulate_cpu_devices",
    "summary",
    "train_batches",
]
