"""DiLoCo's outer loop: the optimizer that applies the groups' averaged change."""

from __future__ import annotations

import dataclasses

import optax

from jdp.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Outer:
    """The outer loop of DiLoCo: the optimizer that applies the groups' averaged change
    every ``sync_every`` steps. Make one with `jdp.diloco`."""

    optimizer: optax.GradientTransformation
    sync_every: int


OUTER_OPTIMIZERS = ("nesterov", "sgd")


def diloco(
    *, sync_every: int, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> Outer:
    """DiLoCo's outer loop (defaults as in the paper); local SGD with ``lr=1, momentum=0``.

    The outer optimizer is SGD on the outer gradient (the parameters of the last
    synchronisation minus the groups' average), with ``momentum`` (Nesterov's
    when ``nesterov``).

    Raises:
        UsageError: ``sync_every`` below 1, a learning rate that is not positive,
            or a momentum outside [0, 1).

    Examples:
        >>> outer = jdp.diloco(sync_every=50)
        >>> outer.sync_every
        50
    """
    if sync_every < 1:
        raise UsageError(f"sync_every must be at least 1 step, got {sync_every}")
    if not lr > 0 or not 0 <= momentum < 1:
        raise UsageError(
            f"the outer optimizer needs lr > 0 and momentum in [0, 1), got {lr} and {momentum}"
        )
    optimizer = optax.sgd(lr, momentum=momentum or None, nesterov=nesterov and momentum > 0)
    return Outer(optimizer, sync_every)


def outer_from_flags(name: str, *, sync_every: int, lr: float, momentum: float) -> Outer:
    """`diloco` from ``--outer-optimizer nesterov|sgd``, ``--outer-lr``, ``--outer-momentum``."""
    if name not in OUTER_OPTIMIZERS:
        raise UsageError(
            f"unknown outer optimizer {name!r}; choose one of: {', '.join(OUTER_OPTIMIZERS)}"
        )
    return diloco(sync_every=sync_every, lr=lr, momentum=momentum, nesterov=name == "nesterov")
