"""``python -m tools.readme``: runs the commands of README.md's figures table.

Each row's command runs in a fresh process, as a user runs it, and its summary
line gives the row: test accuracy (a language model's validation bits per
byte), wall time, examples/s. ``--write`` rewrites
the rows and the settings line above the table; ``--check`` exits 1 naming every
row whose accuracy is not what its command printed. Speeds vary between runs and
are never compared.

How accuracies are compared depends on the numerics fingerprint recorded with
the table (`tools.numerics`): where it is this machine's, the runs are
bit-identical and the accuracy must be the same to the last digit; elsewhere
float32 sums reorder, a trajectory moves after a few hundred steps, and each row
must be within its "on another CPU" tolerance. ``--spread`` measures those
tolerances: it reruns each row with other seeds and with other vector code
(``--xla_cpu_max_isa``), prints the figures, and with ``--write`` records each
row's tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

import jax

from jdp.tool import command
from jdp.training.recipes import load_recipe, recipe_names
from tools import command_line

HEADER = "| command | test accuracy | on another CPU | wall | examples/s |"
ROW = re.compile(
    r"^\| `(?P<command>[^`]+)` \| (?P<accuracy>[\d.]+)(?P<note>[^|]*?) \| "
    r"±(?P<tolerance>[\d.]+) \| (?P<wall>[\d.]+) s \| (?P<rate>[\d,]+) \|$"
)
SUMMARY = re.compile(
    r"^(?:\[0\] )?jdp\.train: steps=\d+ train_loss=\S+ (?:test_loss=\S+ "
    r"test_accuracy=(?P<accuracy>[\d.]+)|val_loss=\S+ val_bits_per_byte=(?P<bits>[\d.]+)) "
    r"examples/s=(?P<rate>\d+) (?:tokens/s=\d+ )?input_wait=\S+ (?:goodput=\S+ )?"
    r"wall=(?P<wall>[\d.]+)s$",
    re.M,
)
# The evaluated split's size, from the line saying what was built; a language
# model's validation split counts windows, and its figure is not a count of them.
TEST_COUNT = re.compile(r"\b(?P<count>[\d,]+) (?P<split>test|validation)\)")
SETTINGS = re.compile(r"^Recorded with: (?P<settings>.+)\.$", re.M)
FINGERPRINT = re.compile(r"numerics (?P<key>[0-9a-f]{12})")
# Each row chooses its own device count, and compiles with XLA's defaults as a user's
# command does (the test suite compiles with less effort, which gives some results
# other last bits).
_NOT_CARRIED = re.compile(
    r"--xla_force_host_platform_device_count=\d+|--xla_backend_optimization_level=\d+"
    r"|--xla_cpu_use_fusion_emitters=\w+|--xla_cpu_parallel_codegen_split_count=\d+"
)

# The reruns --spread makes of each row: other seeds (another initialisation and
# data order: how far the figure moves when the trajectory is another one) and
# other vector code on this CPU (AVX: the float reorderings another CPU makes;
# SSE4.2 cannot compile float16 conversions, so the fp16 row could not run there).
VARIANTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("seed 1", ("--seed", "1"), ""),
    ("seed 2", ("--seed", "2"), ""),
    ("seed 3", ("--seed", "3"), ""),
    ("AVX", (), "--xla_cpu_max_isa=AVX"),
)


@dataclasses.dataclass(frozen=True)
class Row:
    command: str
    accuracy: str
    note: str  # e.g. " (exact match)"
    tolerance: str  # how far another CPU's figure may be from this one
    wall: str
    rate: str

    def line(self) -> str:
        return (
            f"| `{self.command}` | {self.accuracy}{self.note} | ±{self.tolerance} | "
            f"{self.wall} s | {self.rate} |"
        )


@dataclasses.dataclass(frozen=True)
class Printed:
    """What one run of a row's command printed."""

    accuracy: str
    rate: str
    wall: str
    test_count: int


def row_env(xla_flags: str = "") -> dict[str, str]:
    """The rows' environment: each command chooses its own device count and runs at
    XLA's default optimization level; other ``XLA_FLAGS`` (and ``xla_flags``) apply
    to the rows and the fingerprint alike."""
    env = dict(os.environ)
    flags = " ".join([_NOT_CARRIED.sub("", env.get("XLA_FLAGS", "")), xla_flags]).split()
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def machine_numerics(env: dict[str, str] | None = None) -> str:
    """This machine's numerics fingerprint, computed in a fresh process as the rows run."""
    command = [sys.executable, "-m", "tools.numerics"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env or row_env()
    )
    if result.returncode:
        raise RuntimeError(f"the numerics fingerprint failed:\n{result.stderr[-2000:]}")
    return result.stdout.split()[-1]


def settings(key: str) -> str:
    """The settings line's text: JAX version, CPU, and the numerics fingerprint ``key``."""
    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if "model name" in line]
        model = names[0] if names else model
    return f"JAX {jax.__version__}, {os.cpu_count()} x {model}, numerics {key}"


def recorded_numerics(text: str) -> str | None:
    """The fingerprint recorded above the table, or None (a table from before them)."""
    line = SETTINGS.search(text)
    found = line and FINGERPRINT.search(line.group("settings"))
    return found.group("key") if found else None


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


def run_command(command: str, *, flags: tuple[str, ...] = (), env=None) -> Printed:
    """Runs a row's command (with ``flags`` appended) and reads its summary line."""
    words = [sys.executable if word == "python" else word for word in shlex.split(command)]
    result = subprocess.run(
        [*words, *flags], capture_output=True, text=True, timeout=600, env=env or row_env()
    )
    found = list(SUMMARY.finditer(result.stdout))
    count = TEST_COUNT.search(result.stdout)
    if result.returncode or not found or not count:
        output = result.stdout[-2000:] + result.stderr[-2000:]
        raise RuntimeError(f"{command} {' '.join(flags)} failed:\n{output}")
    last = found[-1]
    test_count = int(count.group("count").replace(",", "")) if count["split"] == "test" else 0
    return Printed(
        last["accuracy"] or last["bits"],
        f"{int(last['rate']):,}",
        f"{float(last['wall']):.1f}",
        test_count,
    )


def measure(row: Row) -> Row:
    """The row as its command prints it now."""
    now = run_command(row.command)
    return dataclasses.replace(row, accuracy=now.accuracy, wall=now.wall, rate=now.rate)


def rewrite(text: str, old: list[Row], new: list[Row], key: str) -> str:
    """``text`` with the ``new`` rows and this machine's settings, fingerprint ``key``."""
    for before, after in zip(old, new, strict=True):
        text = text.replace(before.line(), after.line(), 1)
    return SETTINGS.sub(f"Recorded with: {settings(key)}.", text, count=1)


def tolerance(accuracies: list[str], test_count: int) -> str:
    """How far another CPU's figure may be from the recorded one.

    Two machines' runs are two draws of the row's figure, so they may differ by
    as much as the figure ranges over the reruns: the range of ``accuracies``, in
    whole test examples (the figures are rounded to 4 decimals). It is at least one
    example, since a single borderline example may flip between any two
    trajectories, and is rounded up to the table's 4 decimals. A figure that is
    not a fraction of examples (``test_count`` 0: bits per byte) takes its range,
    at least the table's last digit.
    """
    values = [float(accuracy) for accuracy in accuracies]
    if not test_count:
        return f"{max(math.ceil(round((max(values) - min(values)) * 1e4, 6)), 1) / 1e4:.4f}"
    examples = max(round((max(values) - min(values)) * test_count), 1)
    return f"{math.ceil(round(examples / test_count * 1e4, 6)) / 1e4:.4f}"


def _units(figure: str) -> int:
    return round(float(figure) * 1e4)


def check(text: str, measured: list[Row], key: str) -> list[str]:
    """The rows whose accuracy is not the measurement's (exactly, where the table's
    fingerprint is ``key``; within each row's tolerance elsewhere); an empty list
    when the table holds."""
    exact = recorded_numerics(text) == key
    wrong = []
    for written, now in zip(table(text), measured, strict=True):
        if exact and written.accuracy != now.accuracy:
            wrong.append(f"{written.command}: README {written.accuracy}, printed {now.accuracy}")
        # The table's figures and the printed ones are each rounded to 4 decimals,
        # so their difference is the true one within 1e-4: one unit of slack.
        elif abs(_units(written.accuracy) - _units(now.accuracy)) > _units(written.tolerance) + 1:
            wrong.append(
                f"{written.command}: README {written.accuracy} ±{written.tolerance} on another "
                f"CPU, printed {now.accuracy}"
            )
    return wrong


def spread(row: Row) -> tuple[list[str], str]:
    """Each variant's accuracy for ``row`` (in VARIANTS' order) and the tolerance they give."""
    printed = [
        run_command(row.command, flags=flags, env=row_env(xla_flags))
        for _, flags, xla_flags in VARIANTS
    ]
    accuracies = [run.accuracy for run in printed]
    return accuracies, tolerance([row.accuracy, *accuracies], printed[0].test_count)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--readme", default="README.md", help="the README to read")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="rewrite the table's rows")
    what.add_argument("--check", action="store_true", help="exit 1 on a stale accuracy")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="rerun each row with other seeds and vector code; with --write, record the "
        "tolerances they give",
    )
    parser.add_argument("--rows", default="", help="only these rows (comma-separated, from 0)")


def _print_spread(rows: list[Row], chosen, text: str) -> str:
    """Measures the chosen rows' spread, prints it as a table; the text with the
    tolerances rewritten."""
    names = " | ".join(name for name, _, _ in VARIANTS)
    print(f"| command | recorded | {names} | tolerance |", flush=True)
    print("| --- " * (len(VARIANTS) + 3) + "|", flush=True)
    for index in chosen:
        accuracies, limit = spread(rows[index])
        print(
            f"| `{rows[index].command}` | {rows[index].accuracy} | "
            f"{' | '.join(accuracies)} | ±{limit} |",
            flush=True,
        )
        text = text.replace(
            rows[index].line(), dataclasses.replace(rows[index], tolerance=limit).line(), 1
        )
    return text


def synced_recipe(text: str, row: Row, hardware: str) -> str:
    """A recipe file's text (`jdp.training.recipes`) stating ``row``'s figures: the
    expected value, its tolerance, the wall time and the hardware, comments kept."""
    values = {
        "expected": row.accuracy,
        "tolerance": row.tolerance,
        "wall": f'"{row.wall} s"',
        "hardware": f'"{hardware}"',
    }
    head, tables = text.split("[flags]", 1) if "[flags]" in text else (text, None)
    for key, value in values.items():
        head = re.sub(rf"^{key} = [^#\n]*?(?=\s*(#|$))", f"{key} = {value}", head, flags=re.M)
    return head if tables is None else f"{head}[flags]{tables}"


def _sync_recipes(rows: list[Row], key: str) -> None:
    """Each measured recipe's stated figures, from the row that checks it."""
    hardware = settings(key).split(", ")[1]
    by_command = {row.command: row for row in rows}
    for name in recipe_names():
        recipe = load_recipe(name)
        row = by_command.get(recipe.statement.get("checked_by", ""))
        if row is not None:
            path = importlib.resources.files("jdp") / "recipes" / f"{name}.toml"
            path.write_text(synced_recipe(path.read_text(), row, hardware))


def run(args: argparse.Namespace) -> int:
    with open(args.readme) as file:
        text = file.read()
    rows = table(text)
    chosen = [int(part) for part in args.rows.split(",") if part] or range(len(rows))
    if args.spread:
        text = _print_spread(rows, chosen, text)
        if args.write:
            with open(args.readme, "w") as file:
                file.write(text)
        return 0
    key = machine_numerics()
    measured = list(rows)
    for index in chosen:
        measured[index] = measure(rows[index])
        print(measured[index].line(), flush=True)
    if args.write:
        with open(args.readme, "w") as file:
            file.write(rewrite(text, rows, measured, key))
        _sync_recipes(measured, key)
        print(
            f"tools.readme: {len(chosen)} rows rewritten in {args.readme}, and the recipes "
            "they check"
        )
    if args.check:
        exact = recorded_numerics(text) == key
        how = "exactly" if exact else "within each row's tolerance on another CPU"
        print(f"tools.readme: this machine's numerics {key}: accuracies compared {how}")
        wrong = check(text, measured, key)
        for line in wrong:
            print(f"tools.readme: stale: {line}", file=sys.stderr)
        print(f"tools.readme: {len(chosen) - len(wrong)} of {len(chosen)} rows hold")
        return 1 if wrong else 0
    return 0


@command("tools.readme")
def main(argv: Sequence[str] | None = None) -> int:
    return command_line("tools.readme", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
