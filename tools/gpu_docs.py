"""``python -m tools.gpu_docs JSON...``: the GPU section of the docs, from the JSON files
``python -m jdp.bench gpu`` wrote; nothing in it is typed by hand.

Runs on one kind of device are merged: each file's parts replace the same parts of the
files before it (a later run that measured only ``gpt2`` replaces that part alone). Each
kind of device gets a table of its own, the newest first; the README's line and the
recipes' throughput are the newest kind's. It rewrites the section of
``docs/performance.md`` between its two markers, and the ``throughput`` line of
the ``gpt2-124m`` and ``imagenet-resnet50`` recipes. ``--check`` rewrites
nothing and exits 1 when a file differs from what the JSON says.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from typing import Any

from jdp.bench.gpu_host import SWEEP_CASES
from jdp.bench.gpu_models import GPT2_CELLS
from jdp.bench.gpu_table import gpt_numbers, setting_text, table
from jdp.errors import UsageError
from jdp.tool import command, key_of, read_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = "docs/performance.md"
BEGIN, END = "<!-- jdp.bench gpu: begin -->", "<!-- jdp.bench gpu: end -->"
README = "README.md"  # one line of it, between its own pair of markers
README_BEGIN, README_END = "<!-- gpu: begin -->", "<!-- gpu: end -->"
RECIPES = {"gpt2-124m": "gpt2", "imagenet-resnet50": "resnet50"}
_WHAT = ("a file jdp.bench gpu wrote", "give the JSON its --out wrote")

# What each figure is held to, and where the bar comes from.
TARGETS = {
    "gpt2_tokens": (400_000, "llm.c's GPT-2 124M runs about 468k tokens/s a GPU on 8 H100s"),
    "gpt2_ratio": (0.97, "jdp's step against the hand-written one"),
    "resnet_images": (2_500, "NVIDIA's PyTorch ResNet-50, mixed precision: 2,470 on an A100"),
    "sweep_ratio": (0.9, "the small models' step against the hand-written one"),
    "gpt2_peer": (1.0, "jdp's GPT-2 against the best PyTorch arm on the same GPU"),
    "resnet_peer": (1.0, "jdp's ResNet-50 against torchvision's under torch.compile"),
    "sweep_peer": (1.0, "the small models: jdp against PyTorch with CUDA graphs"),
}


def best_peer(peers: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The fastest PyTorch arm that ran (``jdp.bench.peers``), by its median rate."""
    ran = [(arm, peer) for arm, peer in peers.items() if "error" not in peer]
    return max(ran, key=lambda item: item[1]["rate"], default=None)


def merge(paths: list[str], kind: str = "?") -> dict[str, Any]:
    """The runs' parts, later files' parts replacing earlier ones', each part with the
    date, device, versions and command of the run that measured it."""
    merged: dict[str, Any] = {"parts": {}, "runs": []}
    for path in paths:
        data = read_json(path, *_WHAT)
        for key in ("parts", "date", "command"):
            key_of(data, path, [key], *_WHAT)
        machine = _where(data)
        run = {
            "file": path,
            "date": data["date"],
            "command": data["command"],
            "kind": machine.get("kind", kind),
            "versions": machine.get("versions", {}),
        }
        merged["runs"].append(run)
        for part, result in data["parts"].items():
            earlier = merged["parts"].get(part)
            if "error" in result and earlier:
                continue  # a failed part leaves an earlier run's figures standing
            result = result | {"run": run}
            if (
                part in ROWS and "error" not in result
            ):  # by row: a later run's row replaces the same row and failures
                key, rows, order = ROWS[part]
                result[rows] = [row | {"run": run} for row in result[rows]]
                if earlier and rows in earlier:
                    later = {key(row) for row in result[rows]}
                    kept = [
                        row for row in earlier[rows] if key(row) not in later and "error" not in row
                    ]
                    result[rows] = sorted(kept + result[rows], key=order)
                    result["skipped_for_budget"] = _still_skipped(part, earlier, result)
            merged["parts"][part] = result
    return merged


def by_device(paths: list[str]) -> list[dict[str, Any]]:
    """One merge of the runs per kind of device, newest first: a run's kind is its
    machine part's, or its ``where``'s (every run's since it was recorded), or else the
    run's before it."""
    kinds: dict[str, list[str]] = {}
    kind = "?"
    for path in paths:
        data = read_json(path, *_WHAT)
        parts = key_of(data, path, ["parts"], *_WHAT)
        if not isinstance(parts, dict):
            raise UsageError(f"{path} is not {_WHAT[0]}: its 'parts' is not an object; {_WHAT[1]}")
        kind = _where(data).get("kind", kind)
        kinds.setdefault(kind, []).append(path)
        kinds[kind] = kinds.pop(kind)  # the newest kind last
    return [merge(group, kind) for kind, group in reversed(kinds.items())]


def _where(data: dict[str, Any]) -> dict[str, Any]:
    """The run's device and versions: its machine part's, or its ``where``'s (a run that
    left the machine part out, or whose machine part failed), or none."""
    for said in (data["parts"].get("machine"), data.get("where")):
        if isinstance(said, dict) and "kind" in said:
            return said
    return {}


# The parts merged row by row: what names a row, the rows' list, the rows' order.
ROWS = {
    "gpt2": (lambda cell: _cell(cell), "cells", lambda cell: _order(GPT2_CELLS, cell["setting"])),
    "sweep": (lambda case: case["case"], "cases", lambda case: _order(SWEEP_CASES, case["case"])),
}


def _still_skipped(part: str, earlier: dict[str, Any], later: dict[str, Any]) -> list[Any]:
    """Both runs' rows skipped for the budget, but those either run measured."""
    key, rows, _ = ROWS[part]
    name = (lambda s: key({"setting": s})) if part == "gpt2" else str
    measured = {key(row) for row in later[rows]}
    skipped: dict[str, Any] = {}
    for item in earlier.get("skipped_for_budget", []) + later.get("skipped_for_budget", []):
        if name(item) not in measured:
            skipped.setdefault(name(item), item)
    return list(skipped.values())


def _order(known: tuple, item: Any) -> int:
    return known.index(item) if item in known else len(known)


def _cell(cell: dict[str, Any]) -> str:
    return f"cell ({setting_text(cell['setting'])})"


def best_gpt(merged: dict[str, Any], *, raced: bool = False) -> dict[str, Any] | None:
    """The GPT-2 cell whose jdp step ran fastest; ``raced``: of those a PyTorch arm ran
    beside (``--peers``, which races one cell)."""
    cells = [c for c in merged["parts"].get("gpt2", {}).get("cells", []) if "error" not in c]
    if raced:
        cells = [cell for cell in cells if best_peer(cell.get("peers", {}))]
    return max(cells, key=lambda cell: gpt_numbers(cell)["jdp"], default=None)


def gpt_peer(merged: dict[str, Any]) -> tuple[str, dict[str, Any], str] | None:
    """``(arm, figures, layers)``: the best PyTorch arm raced beside a GPT-2 cell, and
    that cell's layers ("scanned" or "unrolled"), or None where none ran."""
    raced = best_gpt(merged, raced=True)
    if raced is None:
        return None
    arm, figures = best_peer(raced["peers"])
    return arm, figures, "unrolled" if raced["setting"]["unroll"] else "scanned"


def targets(merged: dict[str, Any]) -> list[str]:
    """Each target, its figure and met or missed; a part not measured says so."""
    parts, lines = merged["parts"], []

    def line(key: str, value: float | None, shown: str) -> None:
        bar, why = TARGETS[key]
        if value is None:
            lines.append(f"| {why} | at least {bar:,} | not measured | - |")
            return
        lines.append(
            f"| {why} | at least {bar:,} | {shown} | {'met' if value >= bar else 'missed'} |"
        )

    best = best_gpt(merged)
    numbers = gpt_numbers(best) if best else {}
    line("gpt2_tokens", numbers.get("jdp"), f"{numbers.get('jdp', 0):,.0f} tokens/s")
    line("gpt2_ratio", numbers.get("ratio"), f"{numbers.get('ratio', 0):.3f}x")
    resnet = parts.get("resnet50", {})
    rate = resnet.get("jdp")
    line("resnet_images", rate, f"{rate or 0:,.0f} images/s")
    cases = parts.get("sweep", {}).get("cases", [])
    worst = min((case["ratios"]["jdp"] for case in cases), default=None)
    line("sweep_ratio", worst, f"{worst or 0:.3f}x (the worst case)")
    peer = gpt_peer(merged)
    ratio = peer[1]["jdp_over_peer"] if peer else None
    arm, layers = (peer[0], peer[2]) if peer else ("-", "-")
    line("gpt2_peer", ratio, f"{ratio or 0:.3f}x ({arm}, beside jdp's {layers} layers)")
    torchvision = resnet.get("peers", {}).get("torchvision", {})
    ratio = torchvision.get("jdp_over_peer")
    line("resnet_peer", ratio, f"{ratio or 0:.3f}x")
    graphs = [
        case["peers"]["torch graphs"]["jdp_over_peer"]
        for case in cases
        if "jdp_over_peer" in case.get("peers", {}).get("torch graphs", {})
    ]
    worst = min(graphs, default=None)
    line("sweep_peer", worst, f"{worst or 0:.3f}x (the worst case)")
    return lines


def section(groups: list[dict[str, Any]], root: pathlib.Path) -> str:
    """The markdown between the markers: a table for each kind of device. The files are
    named from ``root`` (the checkout), however the command named them."""
    files = [_from(run["file"], root) for merged in reversed(groups) for run in merged["runs"]]
    body = [
        f"<!-- made by `python -m tools.gpu_docs {' '.join(files)}`: edit the JSON's "
        "run, not this -->",
        "",
        "Measured by the runs below; their JSON files are in [gpu/](gpu/).",
    ]
    for merged in groups:
        body += ["", f"### {merged['runs'][-1]['kind']}", "", *_device_section(merged)]
    return "\n".join(body)


def _from(file: str, root: pathlib.Path) -> str:
    """``file`` relative to ``root`` when it lies in it, else absolute."""
    path = os.path.abspath(file)
    relative = os.path.relpath(path, os.path.abspath(root))
    return path if relative.startswith(os.pardir) else relative


def _device_section(merged: dict[str, Any]) -> list[str]:
    runs = merged["runs"]
    provenance = []
    for run in runs:
        v = run["versions"]
        said = ", ".join(
            f"{k} {v[k]}" for k in ("jax", "jaxlib", "python", "driver", "cuda", "cudnn") if k in v
        )
        parts = [p for p, r in merged["parts"].items() if r["run"] is run]
        parts += [
            f"{p}'s {row.get('case') or _cell(row)}"
            for p, (_, rows, _) in ROWS.items()
            for row in merged["parts"].get(p, {}).get(rows, [])
            if row.get("run") is run and merged["parts"][p]["run"] is not run
        ]
        provenance.append(
            f"- {run['date']}, {run['kind']} ({said}): `{run['command']}`; "
            f"the parts {', '.join(parts) or 'none (replaced later)'}"
        )
    return [
        *provenance,
        "",
        "```",
        *table(merged),
        "```",
        "",
        "| target | bar | measured | |",
        "| --- | --- | --- | --- |",
        *targets(merged),
    ]


def recipe_line(merged: dict[str, Any], part: str) -> str | None:
    """The ``throughput = "..."`` line of a recipe, from its part, or None unmeasured."""
    result = merged["parts"].get(part)
    if not result or "error" in result:
        return None
    run = result["run"]
    where = f"one {run['kind']}, python -m jdp.bench gpu, {run['date']}"
    if part == "gpt2":
        best = best_gpt(merged)
        if best is None:
            return None
        n = gpt_numbers(best)
        said = (
            f"{n['jdp']:,.0f} tokens/s a device ({n['ratio']:.3f}x hand-written; "
            f"{setting_text(best['setting'])}, "
            f"{best['cell']['batch_size']} rows of {best['cell']['seq_len']}); "
            f"{where}"
        )
    else:
        said = (
            f"{result['jdp']:,.0f} images/s a device (synthetic {result['px']} px, "
            f"{result['rows']} rows, {result['ratio']:.3f}x hand-written); "
            f"{where}"
        )
    return f'throughput = "{said}"'


def readme_line(merged: dict[str, Any]) -> str:
    """The README's sentence: the headline figures, where they were measured."""
    best, resnet = best_gpt(merged), merged["parts"].get("resnet50", {})
    if best is None or "jdp" not in resnet:
        return "No accelerator figure yet: `python -m jdp.bench gpu` measures them."
    n, run = gpt_numbers(best), best.get("run") or merged["parts"]["gpt2"]["run"]
    mfu = f", {n['mfu']:.1%} MFU" if "mfu" in n else ""
    against = vision = ""
    peer = gpt_peer(merged)
    if peer:
        name, figures, layers = peer
        against = (
            f", {figures['jdp_over_peer']:.3f}x the best PyTorch arm "
            f"({name}, {figures['rate']:,.0f}; {layers} layers)"
        )
    torchvision = resnet.get("peers", {}).get("torchvision", {})
    if "jdp_over_peer" in torchvision:
        vision = f", {torchvision['jdp_over_peer']:.3f}x torchvision's ({torchvision['rate']:,.0f})"
    return (
        f"On one {run['kind']} (`python -m jdp.bench gpu`, {run['date']}): GPT-2 124M "
        f"(T = 1024, bf16) at {n['jdp']:,.0f} tokens/s, {n['ratio']:.3f}x a hand-written "
        f"step{mfu}{against}; ResNet-50 at {resnet['jdp']:,.0f} images/s{vision} "
        "([performance](docs/performance.md#accelerator-figures))."
    )


def _between(text: str, begin: str, end: str, body: str, name: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"tools.gpu_docs: {name} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1]


def rewrite(groups: list[dict[str, Any]], root: pathlib.Path) -> dict[pathlib.Path, str]:
    """``{path: new text}`` of every file the figures land in."""
    doc, readme, merged = root / DOC, root / README, groups[0]
    new = {
        doc: _between(doc.read_text(), BEGIN, END, section(groups, root), DOC),
        readme: _between(readme.read_text(), README_BEGIN, README_END, readme_line(merged), README),
    }
    for name, part in RECIPES.items():
        path = root / "jdp" / "recipes" / f"{name}.toml"
        recipe = path.read_text()
        line = recipe_line(merged, part)
        recipe = re.sub(r'^throughput = ".*"\n', "", recipe, flags=re.M)
        if line:  # after the status line of the [recipe] table
            status = re.search(r"^status = .*\n", recipe, flags=re.M)
            recipe = recipe[: status.end()] + line + "\n" + recipe[status.end() :]
        new[path] = recipe
    return new


@command("tools.gpu_docs")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools.gpu_docs", description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="jdp.bench gpu's files, oldest first")
    parser.add_argument("--check", action="store_true", help="change nothing; 1 when stale")
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose docs to write")
    args = parser.parse_args(argv)
    for path in args.json:
        if not pathlib.Path(path).is_file():
            print(f"tools.gpu_docs: {path}: no such file", file=sys.stderr)
            return 2
    new = rewrite(by_device(args.json), pathlib.Path(args.root))
    stale = [path for path, text in new.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"tools.gpu_docs: {path} differs from the JSON's figures", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(new[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
