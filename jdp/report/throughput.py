"""FLOPs per step (XLA's cost analysis), devices' peak FLOP/s, and MFU's inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

# Peak dense bf16 FLOP/s of one device, from the vendors' datasheets, for MFU.
# Matched in order against `jax.Device.device_kind`; the first match wins.
PEAK_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v6 lite", 918e12),  # v6e
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v4 lite", None),  # v4i: no figure here
    ("TPU v4", 275e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of a device kind, or None when jdp has no figure (CPUs, unknown kinds)."""
    kind = device_kind.lower()
    for name, flops in PEAK_FLOPS:
        if name.lower() in kind:
            return flops
    return None


def step_flops(lowered: jax.stages.Lowered, devices: int) -> float | None:
    """FLOPs of one step on all devices, from XLA's cost analysis of the lowered step.

    The data-parallel step is one program per device (its slice of the batch, and
    the optimizer update every replica repeats), so it is counted ``devices`` times.
    XLA counts a loop's body once: for a step that loops (gradient accumulation)
    the figure is too low, and callers leave it out.
    """
    flops = _flops(lowered.cost_analysis())
    if flops is None:  # some backends (GPU in JAX 0.11) analyse only the compiled program
        flops = _flops(lowered.compile().cost_analysis())
    return flops * devices if flops is not None else None


def _flops(analysis) -> float | None:
    if isinstance(analysis, Sequence):
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns step rates into examples/s, tokens/s, FLOP/s and MFU."""

    batch_size: int
    flops_per_step: float | None = None
    peak_flops: float | None = None  # of all devices together
    tokens_per_example: int | None = None  # a language model's window, for tokens/s
