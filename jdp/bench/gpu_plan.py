"""What `python -m jdp.plan` predicts for a GPU benchmark's GPT-2 cell, beside what the
cell measured: the planner is how a user sizes a cluster they do not have, so each GPU
run holds it to the measure. The plan compiles on the machine's CPU in a process of its
own (``JAX_PLATFORMS=cpu``: it never touches the accelerator the cell is timing), started
as the cell starts and read when it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

# The planner's accelerators (`jdp.plan.DEVICES`) by the device kind JAX reports.
KINDS = {"H100": "h100", "H200": "h200", "A100": "a100"}
WAIT_S = 600  # a plan of GPT-2 124M compiles in about 15 s on 2 CPU cores


def start(cell, vocab_size: int, kind: str) -> subprocess.Popen | None:
    """``python -m jdp.plan --json`` for ``cell`` (a `jdp.bench.lm_cell.Cell` on one
    device) and the accelerator named in ``kind``, running; None where it cannot start."""
    argv = [
        sys.executable,
        *"-m jdp.plan --json --model gpt --model-size".split(),
        cell.model_size,
        "--mesh",
        cell.mesh,
        "--batch-size",
        str(cell.batch_size),
        "--seq-len",
        str(cell.seq_len),
        "--vocab-size",
        str(vocab_size),
        "--precision",
        cell.precision or "fp32",
        "--remat",
        cell.remat,
        "--attention",
        cell.attention,
        "--loss-chunks",
        str(cell.loss_chunks),
        *(["--fp8"] if cell.fp8 else []),
    ]
    argv += ["--unroll-layers"] if cell.unroll else []
    device = next((name for key, name in KINDS.items() if key in kind), None)
    argv += ["--device", device] if device else []
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        return subprocess.Popen(argv, env=env, text=True, **pipes)
    except OSError:
        return None


def read(process: subprocess.Popen | None) -> dict[str, Any]:
    """The plan's figures, or ``{"error": ...}``."""
    if process is None:
        return {"error": "the planner did not start"}
    try:
        out, err = process.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return {"error": f"the planner ran past {WAIT_S} s"}
    if process.returncode != 0:
        return {"error": (err.strip().splitlines() or ["exit code"])[-1][:300]}
    return json.loads(out.strip().splitlines()[-1])


def line(cell: dict[str, Any]) -> str | None:
    """The plan against the measure, for the table: the bytes it says a device needs, the
    cell's own peak where it is its own (the first cell), and the roofline's step."""
    plan = cell.get("plan")
    if not plan:
        return None
    if "error" in plan:
        return f"    plan: {plan['error']}"
    text = f"    plan: needs {plan['need'] / 2**30:.1f} GiB"
    if cell.get("own_peak") and cell.get("peak_bytes"):
        text += f" (measured peak {cell['peak_bytes'] / 2**30:.1f} GiB, "
        text += f"{plan['need'] / cell['peak_bytes']:.2f}x)"
    if "roofline_s" in plan:
        text += f", roofline step {plan['roofline_s']['step'] * 1e3:.1f} ms"
    return text
