"""Where two train steps' device time goes: each arm's kernels, read from a JAX
profiler trace of a few of its steps, and what one arm runs that the other does not.

``python -m jdp.bench lm --profile DIR`` traces both arms of each cell after it is
measured. A kernel is named as the device's runtime names it (``nvjet_...`` for a
cuBLAS product, ``input_reduce_fusion_36`` for an XLA fusion, whose number is its
instruction's in the optimized program; ``XLA_FLAGS=--xla_dump_to=DIR`` writes the
programs, to look one up). Two programs built from the same model number most
fusions alike, so a kernel that one arm runs and the other does not, by name and
count, is the place to look first; the kernels both run give the ratio of their
time, which says whether the rest of the gap is the same work running slower.

On a CPU, XLA runs no kernels that the trace names: the table is empty there.
"""

from __future__ import annotations

import collections
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.profiler import ProfileData

# Kernels shown of each arm's own (the rest are summed in the line after them).
SHOWN = 12


def device_kernels(data: ProfileData) -> dict[str, list[float]]:
    """``{kernel: [launches, nanoseconds]}`` over every device plane's stream lines;
    and ``__busy__``: ``[0, ns]`` of the union of their intervals (the device's busy
    time, overlapping kernels counted once)."""
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue  # XLA's op and module lines repeat the streams' time
            for event in line.events:
                kernels[event.name][0] += 1
                kernels[event.name][1] += event.duration_ns
                spans.append((event.start_ns, event.start_ns + event.duration_ns))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return dict(kernels) | {"__busy__": [0, busy]}


def trace(loop: Callable[[int], None], steps: int, directory: str) -> dict[str, Any]:
    """``loop(steps)`` under JAX's profiler (its trace written under ``directory``):
    wall ms a step, and the device's kernels a step (`device_kernels`)."""
    loop(steps)  # settled: nothing of the trace is a first call's
    with jax.profiler.trace(directory):
        started = time.perf_counter()
        loop(steps)
        wall = time.perf_counter() - started
    (path,) = pathlib.Path(directory).rglob("*.xplane.pb")
    kernels = device_kernels(ProfileData.from_file(str(path)))
    _, busy = kernels.pop("__busy__")
    return {"steps": steps, "wall_ms": 1e3 * wall / steps, "busy_ms": busy / 1e6 / steps,
            "kernels": {name: [count / steps, ns / 1e6 / steps]
                        for name, (count, ns) in kernels.items()}}  # fmt: skip


def compare(traced: dict[str, dict[str, Any]]) -> list[str]:
    """Lines for two arms' traces (`trace`'s, by arm name): each arm's wall, busy and
    kernel time a step; the kernels both run (same name, same launches a step) and
    their time in each; then each arm's own kernels, the longest first."""
    (a, first), (b, second) = traced.items()
    ka, kb = first["kernels"], second["kernels"]
    if not ka and not kb:
        return ["kernels: none in the trace (XLA on a CPU runs none that it names)"]
    lines = []
    for arm, result in traced.items():
        total = sum(ms for _, ms in result["kernels"].values())
        launches = sum(count for count, _ in result["kernels"].values())
        lines.append(f"kernels {arm}: {result['wall_ms']:.3f} ms a step, device busy "
                     f"{result['busy_ms']:.3f} ms, {launches:.0f} kernels "
                     f"taking {total:.3f} ms")  # fmt: skip
    both = [name for name in ka if name in kb and ka[name][0] == kb[name][0]]
    in_a, in_b = sum(ka[n][1] for n in both), sum(kb[n][1] for n in both)
    ratio = f"{in_a / in_b:.3f}x" if in_b else "-"
    lines.append(f"kernels both run: {len(both)}, {in_a:.3f} ms {a}, {in_b:.3f} ms {b} ({ratio})")
    for arm, own, other in ((a, ka, kb), (b, kb, ka)):
        only = sorted((n for n in own if n not in both), key=lambda n: -own[n][1])
        for name in only[:SHOWN]:
            elsewhere = f"; {other[name][0]:g} in {b if arm == a else a}" if name in other else ""
            lines.append(f"  {arm} alone: {own[name][1]:8.3f} ms  {own[name][0]:g}x  "
                         f"{name[:90]}{elsewhere}")  # fmt: skip
        rest = sum(own[n][1] for n in only[SHOWN:])
        if rest:
            lines.append(f"  {arm} alone: {rest:8.3f} ms  in {len(only) - SHOWN} more kernels")
    return lines
