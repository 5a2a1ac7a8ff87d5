"""``--steps-per-call auto``: the steps a call, chosen by the run before its first step.

A call of one small step leaves the device idle while the host dispatches the next one;
a call of K steps, scanned on the device, pays that once per K. The run times a few
one-step calls on a copy of its state (one, where the run is too short for any longer
call to repay its compile even were the whole call the host's), takes the smallest K
that brings the host's share of a call under `HOST_SHARE`, and keeps it only where the
host's time it saves over the run's steps is more than compiling the call takes (a short
run keeps one step a call, compiling nothing more) and a call of K steps is bitwise K
single steps (it computes both from a copy of the state over the run's first K batches):
otherwise one step a call, so that ``auto`` never changes a number.
K divides every period at which an action runs (``--log-every``, ``--eval-every``,
``--ckpt-every``, ``--check-replicas-every``, the profile's window), the steps and the
step the run starts from, so no call crosses one. Process 0's timings decide for all.
A K forced by ``--steps-per-call K`` need not divide them: a shorter call closes a call's
gap up to a period (`call_bounds`, `jdp.data.loader.call_steps`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdp.actions import PeriodicAction
from jdp.data.loader import (
    BatchStream,
    CallBounds,
    places_ahead,
    state_bytes,
    train_batches,
)
from jdp.distributed.agree import all_ok, from_process_0
from jdp.mesh import GROUP_AXIS
from jdp.report.console import Console
from jdp.state import TrainState
from jdp.training.config import TrainConfig
from jdp.training.parts import Run

# The host's share of a call that ``auto`` brings a call under, and the most steps a call
# holds (its batches stacked on the devices: K global batches at once).
HOST_SHARE, MOST_STEPS = 0.03, 64
# One-step calls timed (after one that compiles); the median is kept.
TIMED_CALLS = 8
# The largest state (bytes a device) whose calls are timed and checked: those hold copies
# of it, and a state this large steps for far longer than the host takes to dispatch.
MOST_STATE_BYTES = 1 << 30


def call_bounds(config: TrainConfig, callbacks: Sequence = ()) -> CallBounds:
    """Where the run acts between calls, which no call crosses (`jdp.data.loader.call_steps`):
    every multiple of ``--steps``, ``--log-every``, ``--eval-every``, ``--ckpt-every``,
    ``--check-replicas-every``, DiLoCo's ``--sync-every`` and your ``callbacks``'
    ``every`` (`PeriodicAction`'s), and the profile's window (the step before its
    first, and its last)."""
    periods = [config.steps, config.log_every, config.eval_every, config.ckpt_every]
    periods.append(config.check_replicas_every)
    if config.mesh_spec.has(GROUP_AXIS):
        periods.append(config.resolved_sync_every)
    periods += [each.every for each in callbacks if isinstance(each, PeriodicAction)]
    first, last = config.profile_window or (0, 0)
    return CallBounds(tuple(periods), points=(first - 1, last) if config.profile_window else ())


def say_gaps(config: TrainConfig, console: Console, callbacks: Sequence = ()) -> None:
    """For a forced K > 1 (``--steps-per-call K``), a line naming the periods K does not
    divide (the config's, your ``callbacks``'), up to each multiple of which a shorter
    call closes a call's gap."""
    calls = config.steps_per_call
    if calls == "auto" or calls == 1:
        return
    flags = {
        "--steps": config.steps,
        "--log-every": config.log_every,
        "--eval-every": config.eval_every,
        "--ckpt-every": config.ckpt_every,
        "--check-replicas-every": config.check_replicas_every,
    }
    gaps = [f"{flag} {value}" for flag, value in flags.items() if value > 0 and value % calls]
    everys = {each.every for each in callbacks if isinstance(each, PeriodicAction)}
    gaps += [f"a callback's every {every}" for every in sorted(everys) if every % calls]
    first, last = config.profile_window or (1, 0)  # a call ends before the first, at the last
    if (first - 1) % calls or last % calls:
        gaps.append(f"--profile-steps {config.profile_steps}")
    if gaps:
        console.line(
            f"jdp: --steps-per-call {calls}: {calls} does not divide {', '.join(gaps)}; "
            "a shorter call closes each call's gap up to where they act"
        )


def longest_call(config: TrainConfig, start: int, periods: Sequence[int] = ()) -> int:
    """The most steps a call may hold where every call holds as many: the greatest common
    divisor of the run's `call_bounds`, ``periods`` (your callbacks') and ``start``, at
    most `MOST_STEPS`."""
    bounds = call_bounds(config)
    periods = [*periods, *bounds.periods, *bounds.points, start]
    return max(k for k in range(1, MOST_STEPS + 1) if math.gcd(*periods) % k == 0)


def callback_periods(callbacks: Sequence) -> list[int] | None:
    """The periods of ``callbacks`` (`PeriodicAction`'s ``every``), or None where one has
    rules of its own (any callable, or a `PeriodicAction` with its own ``due`` or call)."""
    periods = []
    for callback in callbacks:
        kind = type(callback)
        if not isinstance(callback, PeriodicAction) or (kind.due, kind.__call__) != (
            PeriodicAction.due,
            PeriodicAction.__call__,
        ):
            return None
        periods.append(callback.every)
    return periods


def steps_for_share(host_us: float, call_us: float, longest: int) -> int:
    """The smallest K dividing ``longest`` whose call leaves the host under `HOST_SHARE` of
    it, a one-step call taking ``call_us`` of which the host ``host_us`` (the host's time
    paid once a call, the device's K times); ``longest`` if none does."""
    device_us = max(call_us - host_us, 1e-3)
    for k in range(1, longest + 1):
        if longest % k == 0 and host_us / (host_us + k * device_us) < HOST_SHARE:
            return k
    return longest


def choose_steps_per_call(
    run: Run, state: TrainState, start: int, console: Console, callbacks: Sequence = ()
) -> Run:
    """``run`` with ``--steps-per-call auto`` resolved to a number of steps (the run's
    config, recorded config and train step), saying which and why in one line.
    ``callbacks``: your actions, whose periods no call crosses."""
    config, periods = run.config, callback_periods(callbacks)
    longest = longest_call(config, start, periods or ())
    if config.mesh_spec.has(GROUP_AXIS):
        steps, why = 1, "DiLoCo's groups keep one step a call"
    elif periods is None:
        steps, why = 1, "a callback that is not a periodic action (jdp.actions) sees every step"
    elif isinstance(run.train, BatchStream):
        steps, why = 1, "your stream of batches is read once, in its order: not timed"
    elif longest == 1:
        steps, why = 1, "the steps, the start and the actions' periods leave no longer call"
    elif (held := state_bytes(state)) > MOST_STATE_BYTES:
        steps, why = 1, f"a state of {held / 2**30:.1f} GiB a device steps long: not timed"
    else:
        steps, why = _timed_choice(run, state, start, longest)
    console.line(f"jdp: --steps-per-call auto: {steps} step{'s' * (steps > 1)} a call ({why})")
    return dataclasses.replace(
        run,
        config=dataclasses.replace(config, steps_per_call=steps),
        train_step=run.step_for(steps) if steps > 1 else run.train_step,
        recorded={**(run.recorded or {}), "steps_per_call": steps},
    )


def _timed_choice(run: Run, state: TrainState, start: int, longest: int) -> tuple[int, str]:
    """``(K, why)`` from one-step calls timed on a copy of ``state``, K kept only where a
    call of K steps is bitwise K single steps."""
    config = run.config
    remaining = config.steps - start
    loader = train_batches(
        run.train,
        run.mesh,
        batch_size=config.batch_size,
        seed=config.seed,
        start_step=start,
        place=places_ahead(run.mesh),
        steps=remaining,  # as the run's loader: a short run's chunks from the host
    )

    def cannot_repay(first_s: float, call_us: float) -> bool:
        # Were the whole call the host's, the longest call would still save less than
        # compiling it takes: more timed calls cannot change the choice.
        return saving(call_us, longest, remaining) < first_s

    with loader as batches:
        first_s, host_us, call_us = _one_step_call(
            run.train_step, state, next(batches), enough=cannot_repay
        )
        share = host_us / call_us
        timed = f"the host took {share:.0%} of a one-step call, {host_us:.0f} of {call_us:.0f} us"
        steps = steps_for_share(host_us, call_us, longest)
        saved_s = saving(host_us, steps, remaining)
        if steps > 1 and saved_s < first_s:
            timed += (
                f"; {steps} steps a call would save {saved_s:.2f} s over the run's "
                f"{remaining} steps, less than compiling it takes (~{first_s:.2f} s)"
            )
            steps = 1
        # Process 0 decides (and says why), before any process checks the call (a check
        # all processes make).
        steps = from_process_0([steps])[0]
        if steps == 1:
            return 1, timed
        made = [next(batches) for _ in range(steps)]
    if not same_bits(run, state, made):
        return 1, (
            f"{timed}; a call of {steps} steps rounds otherwise than {steps} single steps with "
            "this model here, and auto keeps the numbers of one step a call"
        )
    return steps, f"{timed}; a call of {steps} is bitwise {steps} single steps here"


def saving(host_us: float, steps: int, remaining: int) -> float:
    """The seconds ``steps`` steps a call save over ``remaining`` steps: the host's time
    of a call, paid once every ``steps`` steps instead of every step."""
    return remaining * host_us * 1e-6 * (1 - 1 / steps)


def _one_step_call(
    step: Callable, state: TrainState, batch, enough: Callable[[float, float], bool]
) -> tuple[float, float, float]:
    """``(first s, host us, call us)``: the first one-step call on a copy of ``state``
    (it compiles, as a call of several steps would: the run's own first call finds the
    program compiled), then the median of `TIMED_CALLS` more, each waited for: the
    host's time until the call returns, and the whole. Only one more where
    ``enough(first_s, call_us)`` holds for it in process 0: one call settles a short run's
    choice, and the timed calls are steps the run does not take (seconds where a step is
    long)."""
    copy = _copy(state)
    started = time.perf_counter()
    copy, _ = jax.block_until_ready(step(copy, batch))
    first = time.perf_counter() - started
    host, whole = [], []
    for _ in range(TIMED_CALLS):
        started = time.perf_counter()
        out = step(copy, batch)
        host.append(time.perf_counter() - started)
        copy, _ = jax.block_until_ready(out)
        whole.append(time.perf_counter() - started)
        # Every process calls the step as often (its collectives meet): process 0 decides.
        if len(whole) == 1 and from_process_0([enough(first, 1e6 * whole[0])])[0]:
            break
    return first, 1e6 * statistics.median(host), 1e6 * statistics.median(whole)


def same_bits(run: Run, state: TrainState, batches: list) -> bool:
    """Whether one call of ``len(batches)`` steps gives bitwise the state and losses of as
    many one-step calls, from copies of ``state`` (every process agreeing)."""
    steps = len(batches)
    single, losses = _copy(state), []
    for batch in batches:
        single, metrics = run.train_step(single, batch)
        losses.append(metrics["loss"])
    scanned_step = run.step_for(steps)
    stack = jax.jit(
        lambda *made: jax.tree.map(lambda *leaves: jnp.stack(leaves), *made),
        out_shardings=scanned_step.batch_sharding,
    )
    scanned, metrics = scanned_step(_copy(state), stack(*batches))
    same = _held(single) == _held(scanned) and _held(losses) == _held(list(metrics["loss"]))
    return all_ok(same)


def _copy(tree):
    """A copy of ``tree``'s arrays in buffers of their own, in place (a call may donate it):
    a transfer, with no program to compile for each array's shape, as `jnp.copy` has."""
    return jax.tree.map(lambda leaf: jax.device_put(leaf, leaf.sharding, may_alias=False), tree)


def _held(tree) -> list[bytes]:
    """The bytes of every array this process holds of ``tree``, in order."""
    leaves = jax.tree.leaves(tree)
    return [
        np.asarray(shard.data).tobytes() for leaf in leaves for shard in leaf.addressable_shards
    ]
