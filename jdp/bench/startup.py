"""``python -m jdp.bench startup``: what a fresh process pays before its first line of
work: ``import jax`` against ``import jdp``, the public API's first use and
``python -m jdp.train --help``, each in a process of its own, in interleaved rounds.

Each figure is the median wall time of the rounds, Python's own start included (the
same in every row); the last column is each row's median over ``import jax``'s.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata

from jdp.errors import UsageError

# (what a user runs, its arguments to python)
COMMANDS = (
    ('python -c "import jax"', ("-c", "import jax")),
    ('python -c "import jdp"', ("-c", "import jdp")),
    (
        "import jdp; the step's API named",
        (
            "-c",
            "import jdp; jdp.make_mesh, jdp.create_train_state, jdp.make_train_step, "
            "jdp.shard_batch",
        ),
    ),
    ("python -m jdp.train --help", ("-m", "jdp.train", "--help")),
)


def _wall(arguments: tuple[str, ...]) -> float:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise UsageError(f"{' '.join(arguments)} failed: {result.stderr.strip()[-300:]}")
    return elapsed


def measure(rounds: int) -> dict[str, list[float]]:
    """Each command's wall times, one a round, the commands' order rotated each round so
    that no command always runs first (a cold file cache) or last."""
    times: dict[str, list[float]] = {name: [] for name, _ in COMMANDS}
    for turn in range(rounds):
        for name, arguments in COMMANDS[turn % len(COMMANDS) :] + COMMANDS[: turn % len(COMMANDS)]:
            times[name].append(_wall(arguments))
    return times


def report(times: dict[str, list[float]]) -> list[str]:
    medians = {name: statistics.median(walls) for name, walls in times.items()}
    base = medians[COMMANDS[0][0]]
    rounds = len(next(iter(times.values())))
    lines = [
        f"jdp.bench startup: median of {rounds} fresh processes each, interleaved "
        f"(Python {platform.python_version()}, JAX {metadata.version('jax')})",
        f"  {'command':<40} {'wall':>8}  vs import jax",
    ]
    for name, median in medians.items():
        lines.append(f"  {name:<40} {median:>6.2f} s  {median / base:.2f}x")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per command")


def run(args: argparse.Namespace) -> None:
    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    for line in report(measure(args.rounds)):
        print(line, flush=True)
