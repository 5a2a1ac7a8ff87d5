"""The hand-written arm of ``python -m jdp.bench lm``: the ``gpt`` model's train step
as one writes it with JAX and Optax alone, in nanoGPT's structure, and its loop.

Nothing of jdp's step is in it: the `GPT` module is the one both arms train, so
that the two steps differ only in what wraps the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.models.transformer import GPT


class HandWritten(NamedTuple):
    """The hand-written arm: ``step(params, opt_state, key, tokens) -> (params,
    opt_state, key, loss)``, ``init(key, tokens) -> params``, ``start(params) ->
    opt_state`` and ``key(seed)``, each jitted (``key``
    placed as the step returns its key, so that the step's second call compiles
    nothing new); and its ``optimizer``."""

    step: Any
    init: Callable[..., Any]
    start: Callable[..., Any]
    optimizer: optax.GradientTransformation
    key: Callable[[int], Any]


def hand_written_lm_step(
    module: GPT,
    mesh: Mesh,
    compute_dtype: Any,
    *,
    lr: float,
    weight_decay: float,
    b1: float,
    b2: float,
) -> HandWritten:
    """The step one writes for ``module`` with JAX and Optax alone, in nanoGPT's structure.

    AdamW at a constant ``lr``, decaying the weight matrices and embeddings (nanoGPT's
    rule); the mean cross-entropy of ``module.apply`` on ``tokens[:, :-1]``
    against ``tokens[:, 1:]``, the parameters cast to ``compute_dtype`` inside the
    loss, so that the fp32 master weights get fp32 gradients (as jdp's precision
    policy); ``jax.value_and_grad``;
    ``optax.apply_updates``; the dropout key split inside the step. One ``jax.jit``
    that donates the state, with the batch's rows split over ``data`` and the rest
    replicated: ``jit`` partitions the step over the mesh, the natural hand-written
    data-parallel step.
    """

    # nanoGPT decays its weight matrices and embeddings (its rule, two or more dimensions,
    # says that of unstacked parameters): here by their names, as scanned layers stack
    # every parameter on a leading axis.
    def decayed(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", "") in ("kernel", "embedding"), params
        )

    optimizer = optax.adamw(
        optax.constant_schedule(lr),
        b1=b1,
        b2=b2,
        weight_decay=weight_decay,
        mask=decayed,
    )

    def loss(params, tokens, key):
        params = jax.tree.map(lambda leaf: leaf.astype(compute_dtype), params)
        logits = module.apply({"params": params}, tokens[:, :-1], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]
        ).mean()

    def step(params, opt_state, key, tokens):
        key, dropout = jax.random.split(key)
        value, grads = jax.value_and_grad(loss)(params, tokens, dropout)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, value

    def init(key, tokens):
        return nn.meta.unbox(module.init({"params": key}, tokens[:, :-1])["params"])

    whole = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("data"))  # the mesh's replica axis
    return HandWritten(
        jax.jit(
            step,
            in_shardings=(whole, whole, whole, rows),
            out_shardings=whole,
            donate_argnums=(0, 1, 2),
        ),
        jax.jit(init, out_shardings=whole),
        jax.jit(optimizer.init, out_shardings=whole),
        optimizer,
        jax.jit(jax.random.key, out_shardings=whole),
    )


def hand_lm_loop(hand: HandWritten, params, tokens) -> Callable[[int], None]:
    """``count -> None``: runs the hand-written step ``count`` times, going on from the last."""
    carry = [jax.tree.map(jnp.copy, params), hand.start(params), hand.key(0)]

    def loop(count: int) -> None:
        params, opt_state, key = carry
        previous = loss = None
        for _ in range(count):
            params, opt_state, key, loss = hand.step(params, opt_state, key, tokens)
            if previous is not None:  # at most two steps in flight, as jdp's step keeps it
                jax.block_until_ready(previous)
            previous = loss
        jax.block_until_ready(loss)
        carry[:] = params, opt_state, key

    return loop
