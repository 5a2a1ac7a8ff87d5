"""``python -m jdp.bench readme``: runs the commands of README.md's figures table.

Each row's command runs in a fresh process, as a user runs it, and its summary
line gives the row: test accuracy, wall time, examples/s. ``--write`` rewrites
the rows and the settings line above the table; ``--check`` exits 1 naming every
row whose accuracy differs from what its command printed. Accuracies are
compared exactly where the table's recorded settings (JAX version and CPU) are
this machine's; elsewhere float32 sums reorder and a borderline test example
may flip, so there only the presence of each figure is checked. Speeds vary
between runs and are never compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys

import jax

HEADER = "| command | test accuracy | wall | examples/s |"
ROW = re.compile(
    r"^\| `(?P<command>[^`]+)` \| (?P<accuracy>[\d.]+)(?P<note>[^|]*?) \| "
    r"(?P<wall>[\d.]+) s \| (?P<rate>[\d,]+) \|$"
)
SUMMARY = re.compile(
    r"^(?:\[0\] )?jdp\.train: steps=\d+ train_loss=\S+ test_loss=\S+ "
    r"test_accuracy=(?P<accuracy>[\d.]+) examples/s=(?P<rate>\d+) input_wait=\S+ "
    r"wall=(?P<wall>[\d.]+)s$",
    re.M,
)
SETTINGS = re.compile(r"^Recorded with: (?P<settings>.+)\.$", re.M)


@dataclasses.dataclass(frozen=True)
class Row:
    command: str
    accuracy: str
    note: str  # e.g. " (exact match)"
    wall: str
    rate: str

    def line(self) -> str:
        return f"| `{self.command}` | {self.accuracy}{self.note} | {self.wall} s | {self.rate} |"


def settings() -> str:
    """What the figures depend on beyond the command: the JAX version and the CPU."""
    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if "model name" in line]
        model = names[0] if names else model
    return f"JAX {jax.__version__}, {os.cpu_count()} x {model}"


def table(text: str) -> list[Row]:
    """The figures table's rows, in order."""
    start = text.index(HEADER)
    rows = []
    for line in text[start:].splitlines()[2:]:
        match = ROW.match(line)
        if not match:
            break
        rows.append(Row(**match.groupdict()))
    return rows


def measure(row: Row) -> Row:
    """The row as its command prints it now."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    command = [sys.executable if word == "python" else word for word in shlex.split(row.command)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    found = SUMMARY.findall(result.stdout)
    if result.returncode or not found:
        output = result.stdout[-2000:] + result.stderr[-2000:]
        raise RuntimeError(f"{row.command} failed:\n{output}")
    accuracy, rate, wall = found[-1]
    wall, rate = f"{float(wall):.1f}", f"{int(rate):,}"
    return dataclasses.replace(row, accuracy=accuracy, wall=wall, rate=rate)


def rewrite(text: str, old: list[Row], new: list[Row]) -> str:
    for before, after in zip(old, new, strict=True):
        text = text.replace(before.line(), after.line(), 1)
    return SETTINGS.sub(f"Recorded with: {settings()}.", text, count=1)


def check(text: str, measured: list[Row]) -> list[str]:
    """The rows whose accuracy differs from the measurement (exactly, on the recorded
    settings); an empty list when the table holds."""
    recorded = SETTINGS.search(text)
    exact = recorded is not None and recorded.group("settings") == settings()
    wrong = []
    for written, now in zip(table(text), measured, strict=True):
        if exact and written.accuracy != now.accuracy:
            wrong.append(f"{written.command}: README {written.accuracy}, printed {now.accuracy}")
    return wrong


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--readme", default="README.md", help="the README to read")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="rewrite the table's rows")
    what.add_argument("--check", action="store_true", help="exit 1 on a stale accuracy")
    parser.add_argument("--rows", default="", help="only these rows (comma-separated, from 0)")


def run(args: argparse.Namespace) -> int:
    with open(args.readme) as file:
        text = file.read()
    rows = table(text)
    chosen = [int(part) for part in args.rows.split(",") if part] or range(len(rows))
    measured = list(rows)
    for index in chosen:
        measured[index] = measure(rows[index])
        print(measured[index].line(), flush=True)
    if args.write:
        with open(args.readme, "w") as file:
            file.write(rewrite(text, rows, measured))
        print(f"jdp.bench readme: {len(chosen)} rows rewritten in {args.readme}")
    if args.check:
        wrong = check(text, measured)
        for line in wrong:
            print(f"jdp.bench readme: stale: {line}", file=sys.stderr)
        print(f"jdp.bench readme: {len(chosen) - len(wrong)} of {len(chosen)} rows hold")
        return 1 if wrong else 0
    return 0
