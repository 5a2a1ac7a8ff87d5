"""What the benchmarks share: the flags that make a run, the run's config, timing helpers.

Every benchmark builds its runs the library's way (`jdp.training.run.build` on a
`TrainConfig`), from the same flags.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jdp.errors import UsageError
from jdp.training.config import TrainConfig


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that names each flag's default (flags without help text get one line too)."""

    def _format_action(self, action):
        if action.help is None and action.option_strings and action.default is not None:
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and "default" not in text:
            text = f"{text} (default: %(default)s)".strip()
        return text


def add_run_flags(
    parser: argparse.ArgumentParser,
    *,
    mesh: str | None,
    model_size: bool = False,
    dataset: bool = False,
    dataset_default: str | None = "digits",
) -> None:
    """The flags of the run a benchmark measures, named and read as `jdp.train`'s."""
    if mesh is not None:
        parser.add_argument("--mesh", default=mesh)
    parser.add_argument("--model", default="mlp")
    if model_size:
        parser.add_argument("--model-size", default="small")
    if dataset:
        help_text = None if dataset_default else "default: digits, or numbers2words for sequences"
        parser.add_argument("--dataset", default=dataset_default, help=help_text)
        parser.add_argument("--data-dir", default=None)
    parser.add_argument("--batch-size", type=int, default=128)


def config_from(args: argparse.Namespace, **overrides: Any) -> TrainConfig:
    """The `TrainConfig` of `add_run_flags`' flags, with ``overrides``."""
    fields = {
        name: getattr(args, name)
        for name in ("mesh", "model", "model_size", "dataset", "data_dir", "batch_size")
        if getattr(args, name, None) is not None
    }
    return TrainConfig(**(fields | overrides))


def report_lines(on_line: Callable[[str], None]) -> tuple[list[str], Callable[[str], None]]:
    """A report's lines, and ``emit(line)``: keeps a line and passes it to ``on_line``."""
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        on_line(line)

    return lines, emit


def names(text: str) -> list[str]:
    """A comma-separated list."""
    return [part.strip() for part in text.split(",") if part.strip()]


def counts(text: str, flag: str) -> list[int]:
    """A comma-separated list of whole numbers, each at least 1 (``--sync-every 1,10``).

    Raises:
        UsageError: an item that is not one, naming ``flag``.
    """
    items = names(text)
    bad = [item for item in items if not (item.isdigit() and int(item) >= 1)]
    if bad or not items:
        raise UsageError(f"{flag} {text!r}: give whole numbers of 1 or more, e.g. 1,4,8")
    return [int(item) for item in items]


def batches_per_sec(batches: Iterable, count: int, *, warm: int = 1) -> float:
    """Batches per second over ``count`` batches, after the first ``warm`` (start-up)."""
    iterator = iter(batches)
    for _ in range(warm):
        next(iterator)
    started = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return count / (time.perf_counter() - started)


def worker_window(workers: int, batches: int) -> tuple[int, int]:
    """``(warm, timed)`` batches to time a loader of ``workers`` Grain worker processes by.

    Batch ``i`` comes from worker ``i % workers``, and the workers start one after
    another, each importing jdp and its split: timed from the first batch, the next
    ones wait on the workers still starting. Over the 8 batches after the first, 4
    workers on the 2-core machine read 563-1,103 images/s in three runs, 1,014-1,033
    over 24 batches after those. So each worker gives two batches first (its start,
    then what it buffered meanwhile), and at least four a worker are timed."""
    return max(1, 2 * workers), max(batches, 4 * workers)


def steps_per_sec(run, batch, count: int) -> float:
    """Train steps per second on one batch fed again and again (no input cost)."""
    state = run.state
    for _ in range(3):  # compile and settle
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(count):
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    return count / (time.perf_counter() - started)


# Counts a benchmark cannot run without one of (a median of no rounds, no steps, a loss
# in no chunks); a batch size of 0 some choose for themselves.
_AT_LEAST_ONE = {"rounds", "steps", "repeats", "loss_chunks"}
# Amounts a benchmark cannot run within at 0: the seconds it is given, a corpus's size.
_POSITIVE = {"budget", "gigabytes"}


def out_of_range(args: argparse.Namespace) -> str | None:
    """The line for a count below what it can be: a number of anything is never negative,
    and rounds and steps are at least 1; None when every one is in range."""
    for name, value in sorted(vars(args).items()):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if name in _POSITIVE and not value > 0:  # NaN too
            return f"--{name.replace('_', '-')} {value}: give more than 0"
        low = 1 if name in _AT_LEAST_ONE else 0
        if not value >= low:  # NaN too
            least = "1 or more" if low else "0 or more"
            return f"--{name.replace('_', '-')} {value}: give {least}"
    return None
