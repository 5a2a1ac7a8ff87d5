"""What `jdp.replay` finds and writes of the step it replayed: each example's loss and each
parameter's gradient norm, from one more float32 pass over the global batch, and the
update norms, into ``step.json`` and ``batch.npz``."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jdp.data.loader import TrainReader, global_batch_indices
from jdp.mesh import DATA_AXIS
from jdp.rngs import RowKey, step_key
from jdp.training.run import Run


def norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def diagnose(run: Run, state, batch) -> tuple[np.ndarray, dict]:
    """Per-example losses and each parameter's gradient norm on the global batch."""
    model = run.model

    def diagnose(params, model_state, batch, rng):
        def losses(params):
            outputs, _ = model.apply(params, model_state, batch, train=True, rng=rng)
            per_example = model.objective.loss(outputs, batch).astype(jnp.float32)
            return per_example.mean(), per_example

        (_, per_example), grads = jax.value_and_grad(losses, has_aux=True)(params)
        return per_example, grads

    def whole_batch(params, model_state, batch, rng):
        # BatchNorm averages over the data axis in training: one "replica" holding the
        # whole global batch binds it (its mean is the identity).
        one = jax.vmap(diagnose, in_axes=(None, None, 0, None), axis_name=DATA_AXIS)
        per_example, grads = one(params, model_state, batch, rng)
        return per_example[0], jax.tree.map(lambda g: norm(g[0]), grads)

    replicated = NamedSharding(run.mesh, PartitionSpec())
    # The step's rng as one replica holding the whole global batch gets it.
    key = step_key(state)
    rng = RowKey(key, jnp.int32(0)) if run.model.row_keys else jax.random.fold_in(key, 0)
    stacked = jax.tree.map(lambda x: x[None], batch)
    per_example, norms = jax.jit(whole_batch, out_shardings=replicated)(
        state.params, state.model_state, stacked, rng
    )
    host = lambda x: np.asarray(x.addressable_data(0))  # noqa: E731 (replicated everywhere)
    return host(per_example), jax.tree.map(host, norms)


def _names(tree) -> dict[str, float]:
    """``{"Dense_0/kernel": value, ...}`` for a tree of scalars."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path): float(
            np.asarray(value.addressable_data(0) if isinstance(value, jax.Array) else value)
        )
        for path, value in flat
    }


def write(
    out: str,
    run: Run,
    step: int,
    loss: float,
    seen,
    updates,
    start: int,
    checked: list[int],
    top: int,
) -> list[tuple[int, float]]:
    """Writes ``step.json`` and ``batch.npz`` in ``out`` (process 0); the examples with the
    ``top`` largest losses."""
    config, (per_example, grads) = run.config, seen
    indices = global_batch_indices(config.seed, step - 1, config.batch_size, len(run.train))
    order = np.argsort(-per_example, kind="stable")
    largest = [(int(indices[row]), float(per_example[row])) for row in order[:top]]
    if jax.process_index() != 0:
        return largest
    os.makedirs(out, exist_ok=True)
    batch = TrainReader(
        run.train, batch_size=config.batch_size, seed=config.seed, rows=slice(None)
    )(step - 1)
    np.savez(
        os.path.join(out, "batch.npz"),
        index=indices,
        loss=per_example,
        **{f"batch.{name}": value for name, value in batch.items()},
    )
    grad_norms = _names(grads)
    summary = {
        "step": step,
        "loss": loss,
        "started_from": start,
        "checked_steps": checked,
        "grad_norm": float(np.sqrt(sum(v * v for v in grad_norms.values()))),
        "grad_norms": grad_norms,
        "update_norms": _names(updates),
        "largest_losses": [
            {"index": index, "row": int(row), "loss": value}
            for (index, value), row in zip(largest, order, strict=False)
        ],
    }
    with open(os.path.join(out, "step.json"), "w") as file:
        json.dump(summary, file, indent=1)
    return largest
