"""``python -m jdp.plot RUN_DIR [RUN_DIR ...]``: curves of runs, side by side, as a PNG.

Reads each run directory's ``metrics.jsonl`` (written with ``--log-dir``) and
draws, against the step, one line per run and split: the loss and the
evaluation's figure (a classifier's accuracy; a language model's bits per byte
or perplexity) for training, with the validation and test splits' as points,
the learning rate, and examples/s (tokens/s for a language model). A run's label
gives its goodput (`jdp.report.goodput`), and a line for each says where its wall time
went.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from jdp.errors import UsageError
from jdp.report.goodput import describe
from jdp.report.writers import output_file
from jdp.tool import command

# (record kinds, key, panel title, y label, log scale): each panel draws the first
# of its choices that some run logged.
_PANELS = (
    ((("train", "val", "eval"), "loss", "Loss (train; val and test as points)",
      "cross-entropy", True),),
    (
        (("train", "val", "eval"), "accuracy", "Accuracy (train; val and test as points)",
         "accuracy", False),
        (("train", "val", "eval"), "bits_per_byte", "Bits per byte (train; val and test)",
         "bits / byte", False),
        (("val", "eval"), "perplexity", "Perplexity (val and test)", "perplexity", True),
    ),
    ((("train",), "lr", "Learning rate", "learning rate", False),),
    (
        (("train",), "tokens_per_sec", "Throughput", "tokens / s", False),
        (("train",), "examples_per_sec", "Throughput", "examples / s", False),
    ),
)  # fmt: skip
_KIND_NAMES = {"train": "", "val": " val", "eval": " test"}
# The train curve a line; the evaluations as points, each split its own marker.
_STYLES = {"val": {"marker": "o", "linestyle": "--"}, "eval": {"marker": "s", "linestyle": ":"}}


def read_run(run_dir: str) -> dict[str, dict[int, dict]]:
    """A run's records by kind and step; a step logged twice (after a resume) keeps the last.

    Raises:
        UsageError: the directory has no metrics.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(
            f"{run_dir} has no metrics.jsonl; train with --log-dir {run_dir} to write one"
        )
    records: dict[str, dict[int, dict]] = {}
    damaged = 0
    # Bytes that are not UTF-8 (a line written over, a disk's damage) make that line
    # unreadable, as a line cut short is: skipped and counted.
    with open(path, encoding="utf-8", errors="replace") as file:
        for line in file:
            if not line.strip():
                continue
            try:
                if "\ufffd" in line:
                    raise ValueError("not UTF-8")
                record = json.loads(line)
                step = record["step"]
            except (ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
                damaged += 1  # a line cut short when a run was killed
                continue
            values = {key: value for key, value in record.items() if value is not None}
            records.setdefault(record.get("kind", "train"), {})[step] = values
    if damaged:
        print(f"jdp.plot: skipped {damaged} unreadable line(s) in {path}", file=sys.stderr)
    if not records:
        raise UsageError(f"{path} holds no records; was it written by jdp?")
    return records


def plot_runs(run_dirs: Sequence[str], out: str) -> str:
    """Draws the runs' curves into ``out`` (PNG); returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    runs = {
        _label(run_dir, run_dirs) + _goodput(run_dir): read_run(run_dir) for run_dir in run_dirs
    }
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, ylabel, log, key, lines) in zip(axes.flat, panels(runs), strict=True):
        for color, kind, name, steps, values in lines:
            ax.plot(steps, values, color=f"C{color}", label=name, **_STYLES.get(kind, {}))
        drawn = bool(lines)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if log and drawn:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter("{x:.3g}")  # 0.1, not 10^-1
            low, high = ax.get_ylim()
            # Within a decade only minor ticks fall inside: label them; over more, they crowd.
            ax.yaxis.set_minor_formatter("{x:.3g}" if high < 10 * low else "")
        if key.endswith("_per_sec"):
            ax.yaxis.set_major_formatter("{x:,.0f}")
            ax.set_ylim(bottom=0)
        if drawn:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def panels(runs: dict[str, dict[str, dict[int, dict]]]) -> list[tuple]:
    """What each of the four panels draws, for runs by label (`read_run`'s records):
    ``(title, y label, log scale, key, lines)``, each line ``(run's color, record kind,
    name, steps, values)``: the training curve and every split evaluated."""
    drawn = []
    for choices in _PANELS:
        kinds, key, title, ylabel, log = _choose(choices, runs)
        lines = []
        for color, (label, records) in enumerate(runs.items()):
            for kind in kinds:
                logged = records.get(kind, {}).items()
                points = sorted((step, record[key]) for step, record in logged if key in record)
                if points:
                    steps, values = zip(*points, strict=True)
                    name = label + (_KIND_NAMES[kind] if len(kinds) > 1 else "")
                    lines.append((color, kind, name, steps, values))
        drawn.append((title, ylabel, log, key, lines))
    return drawn


def _choose(choices: tuple, runs: dict) -> tuple:
    """A panel's first choice that some run logged (else its first, drawn as not logged)."""
    for kinds, key, *rest in choices:
        for records in runs.values():
            if any(key in record for kind in kinds for record in records.get(kind, {}).values()):
                return (kinds, key, *rest)
    return choices[0]


def _label(run_dir: str, run_dirs: Sequence[str]) -> str:
    """A run's legend label: its directory, as short as still tells runs apart."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    name = os.path.basename(os.path.normpath(run_dir))
    return name if names.count(name) == 1 else os.path.normpath(run_dir)


def read_goodput(run_dir: str) -> dict | None:
    """The run's goodput accounting from its ``run.json`` (`jdp.report.goodput`), or None."""
    try:
        with open(os.path.join(run_dir, "run.json")) as file:
            accounting = json.load(file)["goodput"]
        return accounting if isinstance(accounting.get("goodput"), float) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _goodput(run_dir: str) -> str:
    """`` (goodput 91.2%)``, a run's legend label's end, when it has the figure."""
    accounting = read_goodput(run_dir)
    return f" (goodput {accounting['goodput']:.1%})" if accounting else ""


@command("jdp.plot")
def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="jdp.plot", description=description)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories of --log-dir")
    parser.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    # Without a suffix the plotting library adds ".png": the path it writes is that one.
    out = args.out if os.path.splitext(args.out)[1] else f"{args.out}.png"
    path = plot_runs(args.run_dirs, output_file(out, "--out"))
    for run_dir in args.run_dirs:
        if accounting := read_goodput(run_dir):
            print(f"jdp.plot: {run_dir}: {describe(accounting)}")
    print(f"jdp.plot: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
