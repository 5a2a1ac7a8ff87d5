"""What limited a finished run, from its own timings (the goodput ledger's parts and the
steady steps' pace), and which flag would help: one line before the summary.

``examples/s`` counts the steady training steps alone; in a short run they may be a
few percent of the wall time (start-up, compiling and evaluation the rest), and the
line says so.
"""

from __future__ import annotations

from jdp.training.config import TrainConfig
from jdp.training.results import FitResult

# What a part of the ledger is called here, and what would take less of it.
PARTS = {
    "startup": ("start-up", "more --steps amortise it"),
    "compile": ("compiling", "more --steps amortise it (a rerun with --ckpt-dir reads the "
                "compiled programs back)"),
    "input": ("waiting for batches", "--loader-workers 2 (or more), or --data-on-device on "
              "for a split that fits the devices"),
    "evaluate": ("evaluation", "a larger --eval-every, or --eval-batches N"),
    "checkpoint": ("checkpoint saves", "a larger --ckpt-every"),
    "other": ("closing the run", ""),
    "stalled": ("a stall", ""),
    "restart": ("restarts", ""),
    "recomputed": ("steps computed again after a restart", "a smaller --ckpt-every"),
}  # fmt: skip
# A steady step shorter than this, one per call: the host's dispatch of each call (tens
# of microseconds to a tenth of a millisecond, docs/performance.md) is a share of it.
SHORT_STEP_SECONDS = 0.002


def what_limited(config: TrainConfig, result: FitResult) -> str | None:
    """The line, or None where there is nothing to say (no ledger: another process)."""
    if not result.goodput or result.preempted or result.evaluated_only:
        return None
    parts, wall = result.goodput["parts"], result.goodput["wall"]
    if wall <= 0:
        return None
    shown = sorted((s, name) for name, s in parts.items() if s >= 0.05 * wall or name == "step")
    where = ", ".join(_part(name, seconds) for seconds, name in reversed(shown))
    _, most = max((s, name) for name, s in parts.items())
    limited = _limited(config, result, most)
    return f"jdp: where the {wall:.1f} s from the process's start went: {where}; {limited}"


def _part(name: str, seconds: float) -> str:
    if name == "step":
        return f"training steps {seconds:.1f} s (what examples/s measures)"
    return f"{PARTS.get(name, (name, ''))[0]} {seconds:.1f} s"


def _limited(config: TrainConfig, result: FitResult, most: str) -> str:
    if most != "step":
        what, fix = PARTS.get(most, (most, ""))
        return f"most of it went to {what}" + (f": {fix}" if fix else "")
    step = config.batch_size / result.examples_per_sec if result.examples_per_sec > 0 else 0.0
    if config.steps_per_call in (1, "auto") and 0 < step < SHORT_STEP_SECONDS:
        short = (
            f"most of it went to training steps of {step * 1e3:.2f} ms each, short enough that "
            "the host's dispatch of each call is a share of them"
        )
        if config.steps_per_call == "auto":  # it said what it chose, and why
            return f"{short} (--steps-per-call auto's line says how many steps a call it chose)"
        return f"{short}: --steps-per-call auto chooses how many steps one call scans"
    return "most of it went to training steps, the model's own compute"
