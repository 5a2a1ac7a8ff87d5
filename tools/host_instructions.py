"""The host's instructions a call of jdp's step and of the hand-written ones, counted.

``python -m tools.host_instructions --cases mlp-38k --meshes data=1,data=8`` counts what
`jdp.bench.step`'s host column times, without the machine's noise: the instructions the
main thread runs for one call of jdp's step as a run calls it, and for the hand-written
step of the fewest instructions (``one-device`` on one device, else ``per-leaf``), called
as ``host_us`` calls them (`host_calls`). Each cell
runs in a process of its own under Valgrind's callgrind, counting off while it starts
and compiles; then, for each arm in turn, it counts ``--calls`` calls and twice as many
(each call waits for its loss before the next, as ``host_us`` waits outside its timing) and prints
the difference a call, free of what starting and stopping the count costs. The device's
work runs on XLA:CPU's other threads and is not counted.

It also says where jdp's call runs more instructions than the hand-written one's, by
the part of the process each function's own instructions belong to (`PARTS`): the C
library's allocator, Python (its interpreter and objects: jdp's Python and the tuples
and dictionaries it builds and frees), jaxlib (JAX's C++, which flattens the arguments
and calls the program, and XLA's runtime) and the rest.

All of a call's instructions repeat to about ±2% from process to process (the C
library allocator's state differs); those outside the allocator, to about ±0.3%. Timed,
the same ratio moved ±5% and more on the 2-core development machine. Needs Valgrind
(``apt install valgrind``); a cell takes a few minutes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

# Calls each arm makes before the count starts: the first compiles; the rest bring the
# host's caches and the allocator to their steady state.
WARM_CALLS = 20
_PART = re.compile(r"\.(\d+)-01$")  # a dump's part, the main thread's file
# A function's line in `callgrind_annotate`'s listing: its count, its share, its name.
_FUNCTION = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*)$", re.M)
_OBJECT = re.compile(r"\[([^\]]*)\]\s*$")  # the function's object file, ending its name
# The parts of the process a function's own instructions are counted in (`part_of`).
PARTS = ("the allocator", "Python", "jaxlib", "the rest")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default="mlp-38k", help="comma-separated, as jdp.bench step")
    parser.add_argument("--meshes", default="data=1,data=8", help="comma-separated")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--calls", type=int, default=30, help="the first count's calls")
    parser.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)  # CASE MESH, under callgrind


def run(args: argparse.Namespace) -> int:
    if args.cell:
        return _cell(*args.cell, batch_size=args.batch_size, calls=args.calls)
    from jdp.bench.common import names
    from jdp.bench.step import check_cases
    from jdp.errors import UsageError

    try:
        check_cases(names(args.cases))
    except UsageError as error:
        return _refuse(str(error))
    if args.calls < 1 or args.batch_size < 1:
        return _refuse(f"--calls {args.calls}, --batch-size {args.batch_size}: give 1 or more")
    if not (shutil.which("valgrind") and shutil.which("callgrind_annotate")):
        return _refuse("needs Valgrind (apt install valgrind)")
    print(
        f"tools.host_instructions: the main thread's instructions a call (callgrind), "
        f"{args.calls} calls and {2 * args.calls} counted, global batch {args.batch_size}"
    )
    print(f"  {'case':<10}{'mesh':<8}{'arm':<12}{'instructions':>14}{'/ hand':>9}", end="")
    print(f"{'without the allocator':>24}{'/ hand':>9}")
    more = {}
    for case in names(args.cases):
        for mesh in names(args.meshes):
            counts = measure(case, mesh, batch_size=args.batch_size, calls=args.calls)
            hand = next(count for arm, count in counts.items() if arm != "jdp")
            for arm, count in counts.items():
                print(f"  {case:<10}{mesh:<8}{arm:<12}{count[0]:>14,.0f}", end="")
                print(f"{count[0] / hand[0]:>8.3f}x{count[1]:>24,.0f}{count[1] / hand[1]:>8.3f}x")
            more[case, mesh] = [jdp - own for jdp, own in zip(counts["jdp"], hand, strict=True)]
    _say_parts(more)
    return 0


def _say_parts(more: dict[tuple[str, str], list[float]]) -> None:
    """Each cell's instructions a call jdp's arm ran more than the hand-written one's, in
    all and in each of `PARTS`."""
    print("  jdp's call less the hand-written one's, by the part of the process counting them:")
    print(f"  {'case':<10}{'mesh':<8}{'all':>9}" + "".join(f"{part:>15}" for part in PARTS))
    for (case, mesh), counts in more.items():
        print(f"  {case:<10}{mesh:<8}{counts[0]:>+9,.0f}", end="")
        print("".join(f"{count:>+15,.0f}" for count in counts[2:]))


def _refuse(line: str) -> int:
    print(f"tools.host_instructions: {line}", file=sys.stderr)
    return 2


def measure(case: str, mesh: str, *, batch_size: int, calls: int) -> dict[str, tuple]:
    """``{arm: instructions a call}`` for one cell, ``jdp`` and the hand-written kind:
    all of them, those outside the allocator and those of each of `PARTS` (`per_call`)."""
    devices = 1
    for axis in mesh.split(","):
        devices *= int(axis.split("=")[1])
    with tempfile.TemporaryDirectory() as directory:
        out = pathlib.Path(directory, "callgrind.out")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        command += ["--separate-threads=yes", f"--callgrind-out-file={out}", sys.executable]
        command += ["-m", "tools.host_instructions", "--cell", case, mesh]
        command += ["--calls", str(calls), "--batch-size", str(batch_size)]
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        finished = subprocess.run(command, env=env, capture_output=True, text=True)
        if finished.returncode:
            raise SystemExit(f"tools.host_instructions: {case} {mesh}: {finished.stderr[-2000:]}")
        arms = finished.stdout.split()  # the arms, in the order the cell counted them
        return per_call(directory, arms, calls)


def per_call(directory: str, arms: list[str], calls: int) -> dict[str, tuple[float, ...]]:
    """Each arm's instructions a call, from its two dumps (``calls`` calls, then twice
    as many): the second's counts (`_counts`) less the first's, over ``calls``."""
    counts = {}
    for path in pathlib.Path(directory).iterdir():
        if part := _PART.search(path.name):
            counts[int(part.group(1))] = _counts(path)
    parts = [counts[number] for number in sorted(counts)]
    if len(parts) < 2 * len(arms):
        raise SystemExit(f"tools.host_instructions: {len(parts)} dumps for {len(arms)} arms")
    counted = {}
    for i, arm in enumerate(arms):
        first, second = parts[2 * i], parts[2 * i + 1]
        counted[arm] = tuple((b - a) / calls for a, b in zip(first, second, strict=True))
    return counted


def _counts(path: pathlib.Path) -> tuple[int, ...]:
    """A dump's instructions: all, those outside ``malloc.c`` (the allocator's count
    moves with its state from process to process), then those of each of `PARTS`."""
    listed = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    parts = part_counts(listed)
    return (*split_counts(parts), *parts)


def split_counts(parts: tuple[int, ...]) -> tuple[int, int]:
    """A listing's `part_counts` as ``(all, outside malloc.c)``."""
    return sum(parts), sum(parts) - parts[PARTS.index("the allocator")]


def part_counts(listed: str) -> tuple[int, ...]:
    """``callgrind_annotate``'s listing of functions as the instructions of each of
    `PARTS`, in order."""
    counts = dict.fromkeys(PARTS, 0)
    for count, where in _FUNCTION.findall(listed):
        if not where.startswith("PROGRAM TOTALS"):
            counts[part_of(where)] += int(count.replace(",", ""))
    return tuple(counts.values())


def part_of(where: str) -> str:
    """The part of `PARTS` whose instructions a function of the listing counts in, from
    its file (the allocator's: ``malloc.c``) and its object file (Python's, jaxlib's)."""
    if "malloc.c:" in where:
        return "the allocator"
    found = _OBJECT.search(where)
    obj = found.group(1) if found else ""
    if "jaxlib" in obj or os.path.basename(obj).startswith(("libjax", "xla_extension")):
        return "jaxlib"
    if os.path.basename(obj).startswith(("libpython", "python")):
        return "Python"
    return "the rest"


def _cell(case: str, mesh: str, *, batch_size: int, calls: int) -> int:
    """Under callgrind: warms each arm, then counts it (`per_call`'s two dumps)."""
    from jdp.bench.step import CASES, case_run, first_batch, host_calls

    run = case_run(CASES[case], mesh, batch_size)
    batch = first_batch(run, batch_size)
    kind = "one-device" if run.mesh.devices.size == 1 else "per-leaf"
    arms, states = host_calls(run, {kind: kind})

    def steps(arm: str, count: int) -> None:
        for _ in range(count):  # waits on one array: the same instructions for every arm
            states[arm], metrics = arms[arm](states[arm], batch)
            metrics["loss"].block_until_ready()

    for arm in arms:
        steps(arm, WARM_CALLS)
    _control("--instr=on")
    for arm in arms:
        for count in (calls, 2 * calls):
            steps(arm, count)
            _control("--dump")
    _control("--instr=off")
    print(" ".join(arms))
    return 0


def _control(option: str) -> None:
    """Tells this process's callgrind ``option``: the command waits for its answer, and
    the pause after it (idle, no instructions) is a margin."""
    subprocess.run(["callgrind_control", option, str(os.getpid())], capture_output=True)
    time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    from tools import command_line

    return command_line("tools.host_instructions", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
