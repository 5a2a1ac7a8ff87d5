"""The arms the step benchmarks race: hand-written steps, jdp's, and their timing.

The data-parallel steps a careful engineer writes with plain JAX and Optax
(`hand_written_step`); loops that run such a step, or jdp's, for a number of
steps, going on from where the last call stopped (`hand_loop`, `jdp_loop`); and
interleaved rounds that time the arms side by side, read as ratios within a
round so that the machine's drift cancels (`interleaved_rates`, `ratios_to`).
Shared by ``python -m jdp.bench step``, ``dispatch`` and ``multihost``.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec

from jdp.mesh import DATA_AXIS
from jdp.models import Model
from jdp.state import create_train_state
from jdp.training.run import Run

# The hand-written steps: each gradient leaf all-reduced, the gradients raveled into
# one vector and all-reduced, and (on one device) plain ``jit`` with no collective.
HAND_WRITTEN = ("per-leaf", "raveled", "one-device")


def hand_kinds(mesh) -> tuple[str, ...]:
    """The hand-written steps that apply on ``mesh``: one-device only on one device."""
    return HAND_WRITTEN if mesh.devices.size == 1 else HAND_WRITTEN[:2]


def hand_written_step(model: Model, optimizer: optax.GradientTransformation, mesh, *, kind: str):
    """The data-parallel step a careful engineer writes with plain JAX and Optax.

    ``jit`` over ``shard_map``: each replica's gradient of the model's loss (and
    its metrics, as jdp's step gets them from the same function) on its rows,
    ``pmean`` of the gradients, loss and metrics over ``data`` (``kind``
    "per-leaf": each leaf; "raveled": the gradients raveled into one vector),
    the Optax update; donated state. "one-device": ``jit`` of the gradient and
    the update alone, what one writes for one device (on XLA:CPU faster than a
    ``pmean`` over one device). It returns the averaged loss and metrics, as a
    training loop that reports them must (metrics it did not return, XLA would
    not compute). What it leaves out, jdp's step adds: the learning rate, the
    step count and a key per step and replica (and the gradient norm, with
    ``grad_norm``).
    """

    update = functools.partial(_update, model, optimizer)
    if kind == "one-device":
        return jax.jit(update, donate_argnums=(0, 1))

    def average(grads, loss, metrics):
        if kind == "raveled":
            vector, unravel = ravel_pytree(grads)
            vector, loss, metrics = lax.pmean((vector, loss, metrics), DATA_AXIS)
            return unravel(vector), loss, metrics
        return lax.pmean((grads, loss, metrics), DATA_AXIS)

    def replica(params, opt_state, batch):
        # Marked varying so the gradient stays this replica's until the pmean.
        vary = lambda params: lax.pcast(params, DATA_AXIS, to="varying")  # noqa: E731
        return update(params, opt_state, batch, average, vary)

    mapped = jax.shard_map(
        replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(DATA_AXIS)),
        out_specs=PartitionSpec(),
    )
    return jax.jit(mapped, donate_argnums=(0, 1))


def _update(
    model: Model,
    optimizer: optax.GradientTransformation,
    params,
    opt_state,
    batch,
    average=lambda *averaged: averaged,
    vary=lambda params: params,
):
    """The hand-written steps' gradient (of ``vary(params)``), ``average``, and update."""

    def loss_fn(params):
        loss, metrics, _ = model.loss_fn(params, {}, batch, jax.random.key(0))
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(vary(params))
    grads, loss, metrics = average(grads, loss, metrics)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}


def jdp_scalars() -> tuple[jax.Array, ...]:
    """The arrays jdp's state holds besides parameters, optimizer and model state: the
    step count, the key's data and the loss scale's three (`jdp.TrainState`)."""
    count = jnp.zeros((), jnp.int32)
    key = jax.random.key_data(jax.random.key(0))
    return count, key, jnp.ones((), jnp.float32), jnp.zeros_like(count), jnp.zeros_like(count)


def hand_written_with_scalars(model: Model, optimizer: optax.GradientTransformation):
    """The one-device hand-written step carrying `jdp_scalars` too (donated, the count
    advanced) and returning a learning rate as jdp's step does: what those arrays cost
    a call, apart from jdp's own code. ``step(params, opt_state, scalars, batch)``."""

    def step(params, opt_state, scalars, batch):
        params, opt_state, metrics = _update(model, optimizer, params, opt_state, batch)
        count, key, scale, good, skipped = scalars
        metrics["lr"] = 1e-3 * count.astype(jnp.float32)
        return params, opt_state, (count + 1, key, scale, good + 1, skipped), metrics

    return jax.jit(step, donate_argnums=(0, 1, 2))


def hand_loop(step, run: Run, batch) -> Callable[[int], None]:
    """``count -> None``: runs a hand-written step ``count`` times, going on from the last call."""
    carry = list(jax.tree.map(jnp.copy, (run.state.params, run.state.opt_state)))

    def loop(count: int) -> None:
        params, opt_state = carry
        previous = metrics = None
        for _ in range(count):
            params, opt_state, metrics = step(params, opt_state, batch)
            if previous is not None:  # at most two steps in flight: the CPU rendezvous hazard
                jax.block_until_ready(previous)
            previous = metrics
        jax.block_until_ready(metrics)
        carry[:] = params, opt_state

    return loop


def jdp_loop(step, run: Run, batch, optimizer, *, per_call: int = 1) -> Callable[[int], None]:
    """``count -> None``: runs jdp's step for ``count`` optimizer steps, going on from the last.
    ``batch``: one batch for every call, or an iterator (a `jdp.data.loader.pipeline.Loader`) giving
    each call's, as a run's loader gives the step its input."""
    params = jax.tree.map(jnp.copy, run.state.params)
    carry = [create_train_state(params, optimizer, run.mesh, rng=jax.random.key(0))]
    fed = isinstance(batch, Iterator)

    def loop(count: int) -> None:
        state, metrics = carry[0], None
        for _ in range(count // per_call):
            state, metrics = step(state, next(batch) if fed else batch)
        jax.block_until_ready(metrics)
        carry[0] = state

    return loop


# By default arms run whole multiples of this many steps: any steps per call up to
# 8 divides it.
STEP_MULTIPLE = 8


def interleaved_rates(
    arms: dict[str, Callable[[int], None]],
    *,
    rounds: int,
    round_seconds: float,
    rows: int,
    multiple: int = STEP_MULTIPLE,
) -> dict[str, list[float]]:
    """Examples/s of each arm in each of ``rounds`` rounds, the arms' order alternating.

    Every arm runs the same number of steps a round (a multiple of ``multiple``),
    about ``round_seconds`` of the slowest arm (timed on a warm call), so small and
    large models get comparable statistics.
    """
    slowest = 0.0
    for arm in arms.values():
        arm(multiple)  # compile and settle
        started = time.perf_counter()
        arm(multiple)
        slowest = max(slowest, (time.perf_counter() - started) / multiple)
    calls = max(1, min(400 // multiple, round(round_seconds / slowest / multiple)))
    steps = calls * multiple
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(rounds):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for name in order:
            started = time.perf_counter()
            arms[name](steps)
            rates[name].append(steps * rows / (time.perf_counter() - started))
    return rates


def ratios_to_best(rates: dict[str, list[float]], baselines: Sequence[str]) -> tuple[str, dict]:
    """The fastest baseline (by median) and each arm's median per-round ratio to it.

    Ratios are taken within a round, between arms run next to each other, so the
    machine's drift between rounds cancels.
    """
    best = max(baselines, key=lambda name: statistics.median(rates[name]))
    return best, ratios_to(rates, best)


def ratios_to(rates: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Each arm's median per-round ratio to ``baseline``."""
    return {
        name: statistics.median(a / b for a, b in zip(values, rates[baseline], strict=True))
        for name, values in rates.items()
    }


def with_options(lower: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """The program ``lower`` lowers, compiled on its first call with XLA's ``options``
    (the names XLA_FLAGS takes, without the dashes): for this program alone, so that
    one process can measure a step under several settings and each arm under the same."""
    compiled = None

    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = lower(*args).compile(dict(options))
        return compiled(*args)

    return call


@contextlib.contextmanager
def optimization_level(level: str):
    """JAX's effort level (``jax_optimization_level``: O0-O3) for the programs compiled
    inside; part of each program's cache key, so none compiled outside is reused."""
    if not level:
        yield
        return
    before = jax.config.jax_optimization_level
    jax.config.update("jax_optimization_level", level)
    try:
        yield
    finally:
        jax.config.update("jax_optimization_level", before)


def kernels(compiled_text: str) -> int:
    """The launches in a compiled program's entry computation: its fusions, custom
    calls (cuBLAS, cuDNN), copies and collectives."""
    entry = compiled_text.split("\nENTRY ", 1)[-1].split("\n}\n", 1)[0]
    launches = (
        "fusion(",
        "custom-call(",
        "copy(",
        "all-reduce(",
        "all-reduce-start(",
        "dynamic-update-slice(",
        "scatter(",
        "while(",
        "conditional(",
    )
    return sum(1 for line in entry.splitlines() if any(f" {op}" in line for op in launches))


def step_overhead(step, first, batch, lower=None, *, count_kernels=True) -> dict[str, float]:
    """A step's kernels and host microseconds per call (dispatch alone, not waiting
    for it), on copies of its state: where a small model's step time goes. Without
    ``count_kernels`` the step is not compiled a second time to count them."""
    state = jax.tree.map(jnp.copy, first)
    single = not isinstance(first, tuple)
    count = None
    if count_kernels:
        lower = lower or step.lower
        lowered = lower(state, batch) if single else lower(*state, batch)
        count = kernels(lowered.compile().as_text())
    times = []
    for _ in range(60):
        started = time.perf_counter()
        out = step(state, batch) if single else step(*state, batch)
        times.append(time.perf_counter() - started)
        jax.block_until_ready(out)
        state = out[0] if single else out[:-1]
    return {"kernels": count, "dispatch_us": 1e6 * statistics.median(times[10:])}
