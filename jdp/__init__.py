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

from jdp import lazy
from jdp.version import __version__ as __version__

# Each public name is imported on first use: ``import jdp`` costs no more than the names a
# program touches (``python -c "import jdp"`` loads none of JAX, Orbax, Grain or TFDS).
__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.actions": ("Action", "Callback", "EarlyStopping", "PeriodicAction", "Progress"),
        "jdp.checkpoint": ("Checkpointer", "load_params"),
        "jdp.data.loader": ("Loader", "eval_batches", "train_batches"),
        "jdp.data.splits": ("Split", "load_split"),
        "jdp.diloco": ("Outer", "diloco"),  # the function; the package is jdp/diloco/
        "jdp.errors": ("DataLedgerError", "NonFiniteError", "UsageError"),
        "jdp.inference": ("LoadedModel", "load_model", "predict"),
        "jdp.layout": ("param_specs",),
        "jdp.mesh": ("make_mesh", "shard_batch", "simulate_cpu_devices"),
        "jdp.models.summary": ("Summary", "summary"),
        "jdp.optim": ("make_optimizer", "make_schedule"),
        "jdp.precision": ("LossScale", "Precision", "make_precision"),
        "jdp.report.console": ("Console",),
        "jdp.state": ("GroupState", "TrainState", "create_train_state"),
        "jdp.step": (
            "CompiledStep",
            "SyncStep",
            "data_parallel_step",
            "evaluate",
            "make_eval_step",
            "make_sync_step",
            "make_train_step",
        ),
        "jdp.training.config": ("TrainConfig",),
        "jdp.training.loop": ("FitResult", "fit"),
    },
    submodules=("actions", "data", "distributed", "layout", "models"),
)
