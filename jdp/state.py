"""The training state: one pytree holding everything a step reads and writes."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jdp.mesh import replicated
from jdp.precision import LossScale, Precision


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training, as one pytree of arrays.

    Attributes:
        step: number of steps taken (int32 scalar); an fp16 step whose update
            was skipped for a non-finite gradient still counts, since it consumed
            its batch.
        params: the model parameters.
        opt_state: the optimizer's state.
        model_state: non-trained model variables, e.g. BatchNorm statistics
            (``{"batch_stats": ...}``); an empty dict for models without any.
        rng: the base PRNG key as raw key data (``jax.random.key_data``); the step
            derives a fresh key per step and replica from it. `key` is the typed key.
        loss_scale: dynamic loss-scale state (scale 1 unless fp16 loss scaling is on).
        rng_impl: the name of ``rng``'s PRNG implementation (static, not an array).

    The key is held as raw data because a typed key array costs the host a
    Python round trip on every call of a compiled step (its pytree is rebuilt
    in Python), which was a third of the dispatch time of a small model's step.

    Update it with ``state.replace(...)``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    loss_scale: LossScale
    rng_impl: str = flax.struct.field(pytree_node=False, default="threefry2x32")

    @property
    def key(self) -> jax.Array:
        """The base PRNG key, typed (``rng`` wrapped with its implementation)."""
        return jax.random.wrap_key_data(self.rng, impl=self.rng_impl)


def create_train_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    rng: jax.Array | None = None,
    model_state: Any = None,
    precision: Precision | None = None,
) -> TrainState:
    """Creates a `TrainState` replicated on every device of ``mesh``.

    The optimizer state is created on the mesh by a compiled ``optimizer.init``,
    so it never passes through one device first.

    Args:
        params: the model parameters (a pytree of arrays).
        optimizer: any ``optax.GradientTransformation``.
        mesh: the training mesh.
        rng: base PRNG key for dropout and other randomness, typed
            (``jax.random.key``) or raw (``jax.random.PRNGKey``);
            ``jax.random.key(0)`` when omitted.
        model_state: non-trained variables such as BatchNorm statistics.
        precision: the step's `Precision`; with fp16 loss scaling the state starts
            at its initial scale.

    Returns:
        A `TrainState` at step 0, every leaf replicated on ``mesh``.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> params = {"w": jnp.zeros((4, 1))}
        >>> state = jdp.create_train_state(params, optax.adam(1e-3), mesh, rng=jax.random.key(0))
        >>> int(state.step), state.params["w"].sharding.is_fully_replicated
        (0, True)
    """
    sharding = replicated(mesh)
    rng = jax.random.key(0) if rng is None else rng
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng_impl, rng = jax.random.key_impl(rng), jax.random.key_data(rng)
    else:
        rng_impl = jax.config.jax_default_prng_impl  # what a raw jax.random.PRNGKey holds
    model_state = {} if model_state is None else model_state

    def build(params, model_state, rng):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            model_state=model_state,
            rng=rng,
            loss_scale=LossScale.create(precision),
            rng_impl=rng_impl,
        )

    return jax.jit(build, out_shardings=sharding)(params, model_state, rng)
