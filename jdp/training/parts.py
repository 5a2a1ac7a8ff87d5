"""What `build` takes and returns: a run's data, what the user brought, the run itself.

They live apart from `build` (``run.py``) so that the lines saying what was built
(``messages.py``) can name them, and ``run.py`` can call those lines, without an
import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax
from jax.sharding import Mesh

from jdp.data.splits import Split
from jdp.models import Model
from jdp.state import TrainState
from jdp.step import CompiledStep, SyncStep
from jdp.training.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Data:
    """A run's splits: ``train``, and ``validation`` and ``test`` when it has them."""

    train: Split
    validation: Split | None = None
    test: Split | None = None


@dataclasses.dataclass(frozen=True)
class Yours:
    """What the user brought to `jdp.fit` in place of the config's named choices."""

    model: Model | None = None
    data: Data | None = None
    optimizer: optax.GradientTransformation | None = None
    lr_schedule: optax.Schedule | float | None = None


@dataclasses.dataclass(frozen=True)
class Run:
    """A configured run before its first step: mesh, data, initial state and step functions.

    ``config`` is the run's resolved config (``--epochs`` as steps, a clamped
    warmup); ``recorded`` what checkpoints and run files record of it.
    """

    config: TrainConfig
    mesh: Mesh
    train: Split
    test: Split | None
    model: Model
    state: TrainState
    train_step: CompiledStep
    eval_step: CompiledStep
    schedule: optax.Schedule | None
    optimizer: optax.GradientTransformation
    validation: Split | None = None
    recorded: dict | None = None
    sync_step: SyncStep | None = None  # DiLoCo's synchronisation, on a mesh with groups
    # ``step_for(steps_per_call)``: the run's train step, scanning that many steps a call
    # (``jdp.replay`` steps inside a call of the run's with it).
    step_for: Callable[[int], CompiledStep] | None = None
