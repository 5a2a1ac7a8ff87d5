"""FLOPs per step, devices' peak FLOP/s, and MFU's inputs.

Two counts of a step's FLOPs. The model's (`model_flops`), MFU's numerator: a
formula where the model gives one (the language model's, PaLM's appendix B), else
the matrix products and convolutions of the traced forward pass, times 3 for the
backward pass; neither counts recomputation (remat), the optimizer's update or
what a replica repeats. The hardware's (`step_flops`): XLA's cost analysis of the
compiled step on every device, which counts all of that, and which some
backends misreport (products dropped from fused GPU kernels).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

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


def peak_flops(device_kind: str, dtype: str = "bf16") -> float | None:
    """Peak dense FLOP/s of a device kind in the compute dtype (``bf16``, ``fp16``,
    ``fp32``), or None when jdp has no figure (CPUs, unknown kinds).

    fp16 runs at bf16's rate. fp32 products run on a GPU's tensor cores as TF32 (JAX's
    default precision), at half of it, and on a TPU as bf16 passes (bf16's peak).
    """
    kind = device_kind.lower()
    for name, flops in PEAK_FLOPS:
        if name.lower() in kind:
            if flops and dtype == "fp32" and "tpu" not in kind:
                return flops / 2
            return flops
    return None


def forward_flops(fn: Callable[..., Any], *args: Any) -> float:
    """FLOPs of the matrix products and convolutions in ``fn(*args)``'s traced program
    (2 per multiply-add; a scan's body times its length). ``args`` may be shapes
    (`jax.ShapeDtypeStruct`): nothing is computed."""
    return _count(jax.make_jaxpr(fn)(*args).jaxpr)


def _count(jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        shapes = [getattr(var.aval, "shape", ()) for var in eqn.invars]
        out = math.prod(eqn.outvars[0].aval.shape) if eqn.outvars else 0
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            total += 2.0 * out * math.prod(shapes[0][d] for d in contracting)
        elif name == "conv_general_dilated":
            kernel = shapes[1]
            outputs = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * out * math.prod(kernel) / outputs
        inner = [_count(sub) for sub in _subjaxprs(eqn.params)]
        if inner:  # a cond runs one branch: the largest; a scan its body `length` times
            total += max(inner) * eqn.params.get("length", 1)
    return total


def _subjaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr


def model_flops(model, params: Any, model_state: Any, batch: Any) -> float:
    """The model FLOPs of one training step on ``batch`` (forward and backward): the
    model's own count (`jdp.models.Model.flops`) or 3 times its forward pass's
    products (the backward pass computes two products for each one forward).
    Arguments may be shapes."""
    if model.flops is not None:
        return float(model.flops(params, batch))

    def forward(params, model_state, batch):
        return model.apply(params, model_state, batch, train=False)[0]

    return 3.0 * forward_flops(forward, params, model_state, batch)


def step_flops(
    lowered: jax.stages.Lowered, devices: int, *, per_step_loops: int = 0
) -> float | None:
    """Hardware FLOPs of one step on all devices, from XLA's cost analysis of the step,
    or None when the step loops.

    The data-parallel step is one program per device (its slice of the batch, and
    the optimizer update every replica repeats), so it is counted ``devices`` times.
    XLA counts a loop's body once: the program's loops undercount it (scanned
    layers by their number, the micro-batches of ``--accumulate``), so a program
    with more loops than ``per_step_loops`` (1 for ``--steps-per-call``'s, whose
    body is the step) gets no figure rather than a wrong one.
    """
    if lowered.as_text().count("stablehlo.while") > per_step_loops:
        return None
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
    flops_per_step: float | None = None  # the model's (`model_flops`), for MFU
    peak_flops: float | None = None  # of all devices together
    tokens_per_example: int | None = None  # a language model's window, for tokens/s
