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

Figures are a step's and a device's: with several devices, the mean over those
that ran kernels. On a CPU, XLA runs no kernels that the trace names: the table
is empty there.
"""

from __future__ import annotations

import collections
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.profiler import ProfileData

# Kernels shown of each arm's own (the rest are summed in the line after them).
SHOWN = 12


def device_kernels(data: ProfileData) -> tuple[dict[str, list[float]], float, int]:
    """``{kernel: [launches, nanoseconds]}`` over every device plane's stream lines,
    the devices' busy nanoseconds (each device's kernels' intervals united, so that
    overlapping kernels count once, summed over the devices), and how many devices
    ran kernels."""
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    busy, devices = 0.0, 0
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        spans = []
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue  # XLA's op and module lines repeat the streams' time
            for event in line.events:
                kernels[event.name][0] += 1
                kernels[event.name][1] += event.duration_ns
                spans.append((event.start_ns, event.start_ns + event.duration_ns))
        end = float("-inf")
        for start, stop in sorted(spans):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        devices += bool(spans)
    return dict(kernels), busy, devices


def trace(loop: Callable[[int], None], steps: int, directory: str) -> dict[str, Any]:
    """``loop(steps)`` under JAX's profiler (its trace written in a new folder under
    ``directory``): wall ms a step, and a device's busy ms and kernels a step (the
    mean over the devices that ran kernels)."""
    loop(steps)  # settled: nothing of the trace is a first call's
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="trace-", dir=directory)
    with jax.profiler.trace(folder):
        started = time.perf_counter()
        loop(steps)
        wall = time.perf_counter() - started
    paths = list(pathlib.Path(folder).rglob("*.xplane.pb"))
    if len(paths) != 1:
        raise RuntimeError(f"the trace in {folder} wrote {len(paths)} .xplane.pb files, not 1")
    kernels, busy, devices = device_kernels(ProfileData.from_file(str(paths[0])))
    per = steps * max(devices, 1)
    return {
        "steps": steps,
        "devices": devices,
        "wall_ms": 1e3 * wall / steps,
        "busy_ms": busy / 1e6 / per,
        "kernels": {name: [count / per, ns / 1e6 / per] for name, (count, ns) in kernels.items()},
    }


def trace_arms(
    arms: dict[str, Callable[[int], None]], steps: int, directory: str
) -> dict[str, Any]:
    """`trace` of each arm, in ``directory/ARM``; a trace that fails is its arm's
    ``{"error": ...}``, so that a cell's measured figures stand without it."""
    traced: dict[str, Any] = {}
    for arm, loop in arms.items():
        try:
            traced[arm] = trace(loop, steps, f"{directory}/{arm}")
        except Exception as error:  # the profiler's, whatever it raises
            traced[arm] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return traced


def compare(traced: dict[str, dict[str, Any]]) -> list[str]:
    """Lines for two arms' traces (`trace`'s, by arm name): each arm's wall, busy and
    kernel time a step; the kernels both run (same name, same launches a step) and
    their time in each; then each arm's own kernels, the longest first."""
    failed = [
        f"kernels {arm}: {result['error']}" for arm, result in traced.items() if "error" in result
    ]
    if failed:
        return failed
    (a, first), (b, second) = traced.items()
    ka, kb = first["kernels"], second["kernels"]
    if not ka and not kb:
        return [
            "kernels: none in the trace (a CPU's XLA names none; on a GPU, its tracer "
            "did not start)"
        ]
    lines = []
    for arm, result in traced.items():
        total = sum(ms for _, ms in result["kernels"].values())
        launches = sum(count for count, _ in result["kernels"].values())
        lines.append(
            f"kernels {arm}: {result['wall_ms']:.3f} ms a step; a device "
            f"busy {result['busy_ms']:.3f} ms, {launches:.0f} kernels "
            f"taking {total:.3f} ms"
        )
    both = [name for name in ka if name in kb and ka[name][0] == kb[name][0]]
    in_a, in_b = sum(ka[n][1] for n in both), sum(kb[n][1] for n in both)
    ratio = f"{in_a / in_b:.3f}x" if in_b else "-"
    lines.append(f"kernels both run: {len(both)}, {in_a:.3f} ms {a}, {in_b:.3f} ms {b} ({ratio})")
    for arm, own, other in ((a, ka, kb), (b, kb, ka)):
        only = sorted((n for n in own if n not in both), key=lambda n: -own[n][1])
        for name in only[:SHOWN]:
            elsewhere = f"; {other[name][0]:g} in {b if arm == a else a}" if name in other else ""
            lines.append(
                f"  {arm} alone: {own[name][1]:8.3f} ms  {own[name][0]:g}x  {name[:90]}{elsewhere}"
            )
        rest = sum(own[n][1] for n in only[SHOWN:])
        if rest:
            lines.append(f"  {arm} alone: {rest:8.3f} ms  in {len(only) - SHOWN} more kernels")
    return lines
