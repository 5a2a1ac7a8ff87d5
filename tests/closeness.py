"""How close two trainings that differ only in summation order must be, and why.

Data parallelism changes the order in which float32 values are added: per-replica
means, then an all-reduce (XLA's in one process, gloo's across processes), instead
of one mean over the batch. The results are then equal to rounding, not bitwise,
and how far rounding goes depends on the optimizer and on the CPU's code path.

* Optimizers linear in the gradient (SGD, momentum): a reordered sum of B terms
  moves by at most about B * EPS32 of the sum of the terms' magnitudes (Higham,
  recursive summation), and the update scales it by the learning rate. A few steps
  stay within ``rtol=1e-5`` (64 rows: 64 * 1.2e-7 = 7.6e-6) and ``atol=1e-6`` for
  elements near zero. Element by element is safe there.
* Adam and its kin divide each coordinate's gradient by its own running RMS. A
  coordinate whose gradient is within rounding of zero can then step by up to the
  learning rate either way: one element may differ by 1e-5 after 120 steps on one
  CPU and by 2e-7 on another. Element-wise tolerances fail on such a coordinate,
  so these comparisons take the relative L2 distance of the whole tree, which the
  few amplified coordinates barely move (`ADAM_DRIFT`).
* Losses and gradient norms over the first steps: the loss is a mean of
  non-negative terms (no cancellation), so reordering moves it by at most
  B * EPS32 relatively, and the norm is dominated by the large coordinates.
  While the learning-rate warmup keeps the parameters' drift small, they agree to
  `EARLY_STEPS` (see there).
"""

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7

# Relative L2 distance of parameter trees after an Adam run that differs only in
# summation order. Seen: 6e-8 (120 steps, MLP on digits, 1 process vs 2, and
# data=8 vs data=1). On another CPU one of the 38k coordinates moved by 1e-5,
# 4e-7 of the tree's norm (25) by itself, the others within element-wise 1e-5.
# The bound leaves two orders of magnitude above that, and a real error is two
# above the bound: one row of the 128 shifted in one process's slice gives 1.5e-2
# after the same 120 steps.
ADAM_DRIFT = 1e-4

# Relative difference of a step's loss or gradient norm over the first steps of a
# run with warmup: 128 rows (or gradient coordinates dominated by a few hundred
# large ones) summed in another order move by at most 128 * EPS32 = 1.5e-5; seen
# 2e-7. A real error (one row shifted) moves the 10th step's loss by 2e-3.
EARLY_STEPS = 3e-5


def relative_distance(actual, desired) -> float:
    """``||actual - desired|| / ||desired||`` over all leaves of two pytrees, in float64."""
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True)
    difference = desired_norm = 0.0
    for a, d in pairs:
        a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
        assert a.shape == d.shape, (a.shape, d.shape)
        difference += float(np.sum((a - d) ** 2))
        desired_norm += float(np.sum(d**2))
    return float(np.sqrt(difference / desired_norm))


def assert_drift_within(actual, desired, bound: float = ADAM_DRIFT) -> None:
    """Fails when the trees' relative L2 distance exceeds ``bound``."""
    distance = relative_distance(actual, desired)
    assert distance <= bound, f"relative L2 distance {distance:.3g} > {bound:.3g}"


def assert_sequences_close(actual, desired, rtol: float = EARLY_STEPS) -> None:
    """Per-step values (losses, gradient norms) equal to ``rtol``, with the step named."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, (actual.shape, desired.shape)
    relative = np.abs(actual - desired) / np.maximum(np.abs(desired), np.finfo(np.float32).tiny)
    worst = int(np.argmax(relative))
    assert relative[worst] <= rtol, (
        f"step {worst + 1}: {actual[worst]!r} vs {desired[worst]!r}, "
        f"relative difference {relative[worst]:.3g} > {rtol:.3g}"
    )
