"""Whether training is still finite: the run's guard (`GuardFinite`) and the checks that
the guard and the checkpoint action share (a state or a call's metrics, read on the host)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.actions import PeriodicAction, Progress
from jdp.diloco import has_groups
from jdp.errors import NonFiniteError
from jdp.precision import all_finite


def host_values(metrics: Any) -> Any:
    """``jax.device_get(metrics)`` for step outputs that are done: ``np.asarray`` of each,
    which on 3 scalars took the host 2 us against ``device_get``'s 30 (its copies
    started ahead of the reads help only arrays still being computed)."""
    return jax.tree.map(np.asarray, metrics)


_all_finite = jax.jit(all_finite)
_most = jax.jit(jnp.max)


def groups_finite(state: Any) -> bool:
    """Whether every DiLoCo group's parameters are finite. The train metrics are each
    process's own group's (another's NaN shows in them only after the next
    synchronisation), and processes must decide alike: this reads the global state
    (a scalar across groups, at saves and checks only). Every process calls it at
    the same steps."""
    return bool(_all_finite(state.groups.params))


def state_finite(state: Any) -> bool:
    """Whether the parameters, optimizer state and model state are finite: read on every
    process alike (a replicated scalar), at saves and checks only. The optimizer's
    state too: a gradient whose square overflows leaves Adam's second moment
    infinite and its update, and so the parameters, finite."""
    return bool(_all_finite((state.params, state.opt_state, state.model_state)))


def metrics_finite(call_metrics: Mapping[str, Any] | None) -> bool:
    """Whether a call's loss and gradient norm, when reported (every step of it), are finite."""
    if call_metrics is None:
        return True  # no step ran yet: the initial state
    values = jax.device_get(
        {k: call_metrics[k] for k in ("loss", "grad_norm") if k in call_metrics}
    )
    return all(bool(np.all(np.isfinite(value))) for value in values.values())


# fp16 skips a few steps at the start while its loss scale comes down from 2**15;
# the skipped fraction is judged from this many skips on.
_MIN_SKIPS = 20


class GuardFinite(PeriodicAction):
    """Stops the run (`jdp.errors.NonFiniteError`) when training stops being finite.

    Without skipping, a NaN or infinite loss (or gradient norm, when reported)
    stops it; with skipping (fp16 loss scaling, or ``--nan-policy skip``)
    skipped updates leave the state finite, and more than
    ``max_skipped_fraction`` of the steps (from 20 skips on) stops it. It reads
    the metrics of every ``every``-th step, and at the end: a read every call
    would make the host wait for each step. A due step's metrics are read after
    the next call, which waited for that step (`jdp.step.contract.bounded`), as
    the progress display reads them: read at once, they made the host wait with
    no call queued, and the device idle while the host went on. A non-finite
    parameter makes every later loss NaN, so nothing is missed between reads.
    At the end it reads at once, and also reads the state, once: a last
    gradient that was not finite, or one whose square overflows (Adam's second
    moment infinite, its update zero), leaves the loss finite and the state
    not. A pass over the state at every read would cost a large model's step
    on the CPU about a percent. `Checkpoint` never saves a non-finite state in
    any case (with DiLoCo groups, read on the state, this guard reads at once).

    A loss that is not finite at the run's first read, from parameters that
    started finite, is most often the data's doing: given ``inputs`` (step ->
    that step's host batch, `jdp.data.loader.readers.TrainReader`), the guard reads the
    batches since the start again and names the first step, row and feature that
    is not finite (a ``map`` of yours that returned NaN, say); else it says to
    look at the data before the learning rate.
    """

    def __init__(
        self,
        *,
        every: int,
        skipping: bool,
        max_skipped_fraction: float,
        ckpt_dir: str | None,
        inputs: Callable[[int], Mapping[str, np.ndarray]] | None = None,
    ):
        super().__init__(every, at_end=True)
        self.skipping, self.max_skipped_fraction = skipping, max_skipped_fraction
        self.ckpt_dir, self.inputs = ckpt_dir, inputs
        self._started: int | None = None  # the step the run started (or resumed) from
        self._started_finite = True  # its state then, read once
        self._finite_at = 0  # the last step read finite
        self._due: tuple[int, Any] | None = None  # (step, call metrics) to read

    def __call__(self, progress: Progress) -> bool:
        if self._started is None:  # the first pass, before the first call
            self._started = self._finite_at = progress.step
            # Read once, so a loss that is not finite from the start names them if they are.
            self._started_finite = has_groups(progress.state) or state_finite(progress.state)
        self._check_due()
        return super().__call__(progress)

    def quiet_through(self, progress: Progress) -> int:
        # Metrics due are read in the pass after the next call.
        return progress.step if self._due is not None else self._quiet_until_due(progress)

    def run(self, progress: Progress) -> None:
        if progress.call_metrics is None:
            return
        if has_groups(progress.state):
            self._check_groups(progress)
            return
        self._check_due()  # one not read yet (when called other than by the loop)
        self._due = (progress.step, progress.call_metrics)
        if not progress.final:
            return
        self._check_due()
        if not self.skipping and not state_finite(progress.state):
            raise NonFiniteError(
                f"the parameters or optimizer state are not finite after step "
                f"{progress.step}, though the loss is: a gradient was not finite, or its "
                f"square overflowed (--nan-policy stop); {self._kept}; lower --lr, add "
                "--clip-norm, or --nan-policy skip"
            )

    @property
    def _kept(self) -> str:
        if self.ckpt_dir:
            return f"the checkpoints in {self.ckpt_dir} are finite"
        return "nothing was saved (no --ckpt-dir)"

    def _check_due(self) -> None:
        if self._due is None:
            return
        (step, call_metrics), self._due = self._due, None
        values = host_values(call_metrics)
        if self.skipping:
            skipped = int(np.max(values["skipped_steps"]))
            if skipped > _MIN_SKIPS and skipped > self.max_skipped_fraction * step:
                raise NonFiniteError(
                    f"{skipped} of {step} updates were skipped for a non-finite loss or "
                    f"gradient (over --max-skipped-fraction {self.max_skipped_fraction:g}); "
                    f"{self._kept}; lower --lr or use fp32/bf16"
                )
            return
        for name in ("loss", "grad_norm"):
            per_step = np.atleast_1d(values.get(name, 0.0))  # (steps of the call,)
            if not np.all(np.isfinite(per_step)):
                value = float(per_step[~np.isfinite(per_step)][0])
                if self._finite_at == self._started:  # the run's first read
                    raise NonFiniteError(self._from_the_start(name, value, step))
                raise NonFiniteError(
                    f"{name} is {value} at step {step} (finite at step {self._finite_at}; "
                    f"--nan-policy stop); {self._kept}; lower --lr, add --clip-norm, or "
                    "--nan-policy skip"
                )
        self._finite_at = step

    def _from_the_start(self, name: str, value: float, step: int) -> str:
        """The line for a loss not finite in the run's first steps: the parameters named
        when they were not finite before it, the data when a batch since the start holds a
        value that is not finite."""
        if not self._started_finite:
            return (
                f"{name} is {value} at step {step}: the parameters themselves are not "
                f"finite (the initial or imported weights, before step "
                f"{self._started + 1}); {self._kept}"
            )
        for taken in range(self._started, step) if self.inputs is not None else ():
            batch = self.inputs(taken)
            for key, array in batch.items():
                array = np.asarray(array)
                if array.dtype.kind in "fc" and not np.all(np.isfinite(array)):
                    row = int(np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(1))[0])
                    return (
                        f"{name} is {value} at step {step}: the batch of step {taken + 1} has "
                        f"a value that is not finite in {key!r} at row {row} of this "
                        f"process's rows (after the split's map and transform); repair the "
                        f"data; {self._kept}"
                    )
        return (
            f"{name} is {value} at step {step}, within the run's first steps, from "
            f"parameters that were finite; the inputs read since step {self._started} are "
            "finite: look at the loss against the data (labels outside its classes, "
            "targets it cannot fit), then lower --lr or add --clip-norm (--nan-policy "
            f"stop); {self._kept}"
        )

    def _check_groups(self, progress: Progress) -> None:
        """With DiLoCo groups each process's metrics are its own group's, and processes
        that decided on them apart would leave the others waiting in a collective:
        the decision is made on the groups' state, which every process reads alike."""
        state, step, kept = progress.state, progress.step, self._kept
        if self.skipping:
            skipped = int(_most(state.groups.loss_scale.skipped))
            if skipped > _MIN_SKIPS and skipped > self.max_skipped_fraction * step:
                raise NonFiniteError(
                    f"{skipped} of {step} updates of a DiLoCo group were skipped for a "
                    f"non-finite loss or gradient (over --max-skipped-fraction "
                    f"{self.max_skipped_fraction:g}); {kept}; lower --lr or use fp32/bf16"
                )
        elif not groups_finite(state):
            raise NonFiniteError(
                f"a DiLoCo group's parameters are not finite at step {step} (finite at step "
                f"{self._finite_at}; --nan-policy stop); {kept}; lower --lr, add --clip-norm, "
                "or --nan-policy skip"
            )
        self._finite_at = step
