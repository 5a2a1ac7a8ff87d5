"""What `python -m jdp.plan` compiles on the CPU in an accelerator's place, so that the
step's memory is the accelerator's: the compiler's flags (`compile_flags`), cuDNN's fused
attention (`planned_attention`) and a GPU's fusions (`planned_remat`), and the lines
that say so (`stand_ins`). How close the result comes to a GPU's measured peak is in
docs/sharding.md."""

from __future__ import annotations

import argparse

GPUS = ("a100", "h100", "h200")  # of jdp.plan.DEVICES, where cuDNN's attention runs


# XLA's CPU scheduler orders a program for the CPU's threads, keeping more alive at once;
# an accelerator's orders it for memory. GPT-2 124M's unrolled step (32 rows of 1,024 bf16
# tokens): 104 GiB of temporaries under the first, 57 under the second.
MEMORY_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# The CPU computes bf16 in fp32, and loop-invariant code motion then converts a scanned
# layer's stacked residuals to fp32 whole, before the backward loop (for GPT-2 124M at 32
# rows of 1,024 tokens, six of 4.5 GiB), which no accelerator with bf16 arithmetic does.
NO_HOISTING = "while-loop-invariant-code-motion"


def compile_flags(flags: str) -> str:
    """``XLA_FLAGS`` for the plan's compile: the user's, `MEMORY_SCHEDULE`, and
    `NO_HOISTING` added to the passes they disable."""
    parts, passes = [], [NO_HOISTING]
    for flag in flags.split():
        if flag.startswith("--xla_disable_hlo_passes="):
            passes += [p for p in flag.split("=", 1)[1].split(",") if p and p != NO_HOISTING]
        else:
            parts.append(flag)
    return " ".join([*parts, MEMORY_SCHEDULE, f"--xla_disable_hlo_passes={','.join(passes)}"])


def planned_attention(args: argparse.Namespace) -> str:
    """The attention the step is compiled with: ``blocked`` (`jdp.models.blocked`, which
    keeps what a fused kernel keeps) where a run on the target takes cuDNN's fused
    kernel, which the CPU cannot compile: ``cudnn``, or ``auto`` for gpt on a GPU in bf16
    or fp16 with a head width the kernel takes (`jdp.models.attention.implementation`;
    seq2seq's attention has a padding mask, which keeps it on XLA's)."""
    if args.attention != "auto":
        return "blocked" if args.attention == "cudnn" else args.attention
    half = args.device in GPUS and args.precision in ("bf16", "fp16")
    return "blocked" if half and _gpt_head_width(args) in range(8, 129, 8) else "xla"


def _gpt_head_width(args: argparse.Namespace) -> int | None:
    from jdp.models import registry

    if args.model != "gpt":
        return None
    options = registry.check_model(args.model, args.model_size).sizes[args.model_size]
    return options["width"] // options["heads"]


def planned_remat(args: argparse.Namespace) -> str:
    """The ``--remat`` the step is compiled with: ``dots`` in place of ``none`` for gpt's
    unrolled layers on a GPU. There XLA fuses the elementwise work between a layer's
    matmuls into the fusions that use it, the backward pass's too, so what a layer keeps
    is about its matmuls' outputs; the CPU's compiler keeps each elementwise result
    (in fp32 where the model is bf16). A scanned layer keeps what JAX names, on any
    backend: its residuals leave the loop as arrays."""
    unrolled_gpu = args.device in GPUS and args.model == "gpt" and args.unroll_layers
    return "dots" if unrolled_gpu and args.remat == "none" else args.remat


def stand_ins(args: argparse.Namespace) -> list[str]:
    """A line for each choice compiled in the target's place."""
    lines = []
    if planned_attention(args) == "blocked" and args.attention != "blocked":
        lines.append("  (compiled with --attention blocked: cuDNN's attention keeps no scores)")
    if planned_remat(args) != args.remat:
        lines.append(
            "  (compiled with --remat dots: a GPU's fusions recompute an unrolled "
            "layer's elementwise work)"
        )
    return lines
