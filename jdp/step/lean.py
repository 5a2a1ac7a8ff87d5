"""A replicated train step's call on what the step changes, and nothing else.

A hand-written step takes the parameters and the optimizer's state and returns
them; jdp's `TrainState` holds more (the step count, the key, the loss scale),
and each array a call passes and gets back costs the host about a microsecond,
a few percent of a small model's call. So the program of a replicated state
takes the fields the step changes (the step count, parameters, optimizer and
model state; the loss scale only where fp16 scaling or ``skip_nonfinite`` moves
it) and reads the key (and the skipped count, for the schedule's count) without
taking them over; the call puts the `TrainState` back together around its
outputs. The key is read only where the step's outputs depend on it (a model
that draws: dropout's masks): the first call traces the program, and where JAX's
dead-code elimination drops the key, the program called is that traced program
without it. A state whose `Placement` says otherwise (ZeRO-1's) takes the whole
state's program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from jdp.precision import LossScale, Precision
from jdp.state import TrainState
from jdp.step.contract import check_rows, refuse_donated
from jdp.step.keyless import without_key


class Lean(NamedTuple):
    """What a train step's program takes of the state besides the step count and the
    parameters, optimizer and model state.

    Attributes:
        carries_scale: the loss scale, changed by the step (fp16 loss scaling or
            ``skip_nonfinite``).
        reads_skipped: the skipped count alone, read (a schedule's count is the updates
            applied: the step count less those skipped by an earlier run).
    """

    carries_scale: bool
    reads_skipped: bool

    @classmethod
    def of(cls, *, precision: Precision, skip_nonfinite: bool, lr_schedule: Any, **_) -> Lean:
        """What a step of these options (`jdp.replica.train_step_parts`') takes."""
        carries = precision.loss_scaling or skip_nonfinite
        return cls(carries, reads_skipped=lr_schedule is not None and not carries)


def lean_program(
    replica_fn: Callable[..., Any], *, carries_scale: bool, reads_skipped: bool, rng_impl: str
) -> Callable[..., Any]:
    """``replica_fn(state, batch) -> (state, metrics)`` as ``program(changed, read, batch)
    -> (changed, metrics)``: ``changed`` the step count, parameters, optimizer and model
    state (and the loss scale, ``carries_scale``), ``read`` the key (and the skipped
    count, ``reads_skipped``)."""

    def program(changed, read, batch):
        step, params, opt_state, model_state, *scale = changed
        rng, *skipped = read
        if not carries_scale:  # constant: scaling is off and no update is skipped
            one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32)
            scale = [LossScale(one, zero, skipped[0] if reads_skipped else zero)]
        state = TrainState(step, params, opt_state, model_state, rng, scale[0], None, rng_impl)
        new, metrics = replica_fn(state, batch)
        out = (new.step, new.params, new.opt_state, new.model_state)
        return (*out, new.loss_scale) if carries_scale else out, metrics

    return program


_set_fields = object.__setattr__


def _runner(
    programs: Programs,
    check: Callable[..., None],
    *,
    carries_scale: bool,
    reads_skipped: bool,
    whole: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``run(state, batch)``: ``programs[rng_impl]`` on the fields of a replicated
    ``state`` it takes, the `TrainState` put back together around its outputs (and
    ``whole(state, batch)`` on any other state, where given); ``check(state, batch)``
    says in one line why a refused call was refused. One Python frame over the
    program's own call: each more costs a small model's step a few tenths of a
    microsecond, more where the step's last call left the host's caches cold."""

    def run(state, batch):
        try:
            fields = state.__dict__
            loss_scale = fields["loss_scale"]
        except (AttributeError, KeyError):  # not a TrainState: `check` says so
            check(state, batch)
            raise
        if whole is not None and state.placement.kind != "replicated":
            return whole(state, batch)
        changed = (fields["step"], fields["params"], fields["opt_state"], fields["model_state"])
        if carries_scale:
            changed = (*changed, loss_scale)
        keyed = (fields["rng"], loss_scale.skipped) if reads_skipped else (fields["rng"],)
        try:
            impl = fields["rng_impl"]
            program, reads_key = programs.get(impl) or programs.first(impl, changed, keyed, batch)
            out, metrics = program(changed, keyed if reads_key else keyed[1:], batch)
        except (ValueError, RuntimeError):
            check(state, batch)
            raise
        # A copy of the state's fields (its placement too), the changed ones replaced:
        # the dataclass's own constructor costs the host a microsecond a call.
        copied = fields.copy()
        if carries_scale:
            step, params, opt_state, model_state, copied["loss_scale"] = out
        else:
            step, params, opt_state, model_state = out
        copied["step"], copied["params"] = step, params
        copied["opt_state"], copied["model_state"] = opt_state, model_state
        new = object.__new__(TrainState)
        _set_fields(new, "__dict__", copied)  # the frozen dataclass's own refuses
        return new, metrics

    return run


def lean_call(
    programs: Programs,
    whole: Callable[..., Any],
    *,
    lean: Lean,
    replicas: int,
    batch_axis: int,
    steps: int,
) -> Callable[..., Any]:
    """``call(state, batch)``: ``programs[rng_impl]`` (the jitted `lean_program`) on a
    replicated state, ``whole(state, batch)`` on any other."""

    def check(state, batch):
        refuse_donated(state)
        check_rows(batch, replicas, batch_axis=batch_axis, steps=steps)

    return _runner(programs, check, whole=whole, **lean._asdict())


def lean_lower(
    programs: Programs, whole_lower: Callable[..., Any], *, lean: Lean
) -> Callable[..., Any]:
    """``lower(state, batch)`` of the program `lean_call` runs for ``state``: a
    `jax.stages.Lowered` whose compiled program is called as the step is."""

    def lower(state, batch):
        if state.placement.kind != "replicated":
            return whole_lower(state, batch)
        changed = (state.step, state.params, state.opt_state, state.model_state)
        if lean.carries_scale:
            changed = (*changed, state.loss_scale)
        keyed = (state.rng, state.loss_scale.skipped) if lean.reads_skipped else (state.rng,)
        impl = state.rng_impl
        program, reads_key = programs.get(impl) or programs.first(impl, changed, keyed, batch)
        lowered = program.lower(changed, keyed if reads_key else keyed[1:], batch)
        return _Lowered(lowered, lean, reads_key)

    return lower


class _Lowered:
    """A lean program's `jax.stages.Lowered` (every attribute its own), whose ``compile``
    gives a program called as the step is, ``compiled(state, batch)``."""

    def __init__(self, lowered: Any, lean: Lean, reads_key: bool):
        self._lowered, self._lean, self._reads_key = lowered, lean, reads_key

    def compile(self, *args: Any, **kwargs: Any) -> _Compiled:
        compiled = self._lowered.compile(*args, **kwargs)
        only = _Only((compiled, self._reads_key))
        run = _runner(only, lambda *_: None, **self._lean._asdict())
        return _Compiled(compiled, run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


class _Compiled:
    """A lean program's `jax.stages.Compiled`, called as ``compiled(state, batch)``."""

    def __init__(self, compiled: Any, run: Callable[..., Any]):
        self._compiled, self._run = compiled, run

    def __call__(self, state: Any, batch: Any) -> Any:
        return self._run(state, batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


class Programs(dict):
    """``programs[rng_impl]``: a step's program for a key implementation (a static part
    of the state) and whether it reads the key, made at the first call (`first`); then
    a dictionary's lookup, with no Python frame of its own.

    ``make(rng_impl)``: the `jax.jit` of the `lean_program`; ``jit(fn)``: ``fn`` compiled
    as ``make``'s program is (its shardings and donation)."""

    def __init__(self, make: Callable[[str], Any], jit: Callable[[Callable], Any]):
        super().__init__()
        self._make, self._jit = make, jit

    def first(self, rng_impl: str, changed: Any, keyed: Any, batch: Any) -> tuple[Any, bool]:
        """The program for these arguments (``keyed``: the key, then the rest ``read``)
        and whether it takes the key: where the outputs do not depend on it, the traced
        program without it (`jdp.step.keyless`)."""
        program = self._make(rng_impl)
        keyless = without_key(program, changed, keyed, batch)
        entry = self[rng_impl] = (program, True) if keyless is None else (self._jit(keyless), False)
        return entry


class _Only(dict):
    """A compiled program's entry for any key implementation (its state's, lowered)."""

    def __init__(self, entry: tuple[Any, bool]):
        super().__init__()
        self._entry = entry

    def get(self, _rng_impl: str, _default: Any = None) -> tuple[Any, bool]:
        return self._entry
