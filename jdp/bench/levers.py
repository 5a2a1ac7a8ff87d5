"""XLA's GPU options that ``python -m jdp.bench gpu --levers`` races as more arms of jdp's
step, in the same rounds as the step compiled as a run compiles it: each lever is a set
of options for that step's program alone (`jdp.bench.arms.with_options`), with the
source that suggests it. The GPT-2 cells turn theirs one cell at a time
(`jdp.bench.gpu_models.GPT2_CELLS`); these are the small models' and ResNet-50's.

A lever that wins on the accelerators becomes the recipes' default; one that loses is
kept here, measured, so that nobody has to ask again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# XLA's default command buffers (CUDA graphs): these kinds of work, in runs of at least
# 5 operations (openxla/xla, xla/debug_options_flags.cc).
DEFAULT_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str  # the arm's name after "jdp, "
    options: dict[str, Any]  # XLA's, as XLA_FLAGS names them without the dashes
    source: str
    steps_per_call: int = 1  # the arm's call: one step, or this many in a scan


LEVERS: dict[str, tuple[Lever, ...]] = {
    "sweep": (
        Lever(
            "command buffers of any size",
            {"xla_gpu_graph_min_graph_size": 1},
            "a small step launches few kernels, each run of them shorter than XLA's least "
            "(5) for a CUDA graph: PyTorch's answer to small steps is a CUDA graph of the "
            "whole step (torch.compile's reduce-overhead mode)",
        ),
        Lever(
            "4 steps per call in one CUDA graph",
            {
                "xla_gpu_graph_min_graph_size": 1,
                "xla_gpu_enable_command_buffer": f"{DEFAULT_COMMANDS},WHILE,CONDITIONAL",
            },
            "XLA's command buffers take a loop whole where WHILE and CONDITIONAL are on (off "
            "by default): the scan of --steps-per-call 4 launched as one graph",
            steps_per_call=4,
        ),
    ),
    "resnet50": (
        Lever(
            "NHWC convolutions forced",
            {"xla_gpu_force_conv_nhwc": True},
            "cuDNN's tensor-core convolutions run fastest channels-last (NVIDIA's deep "
            "learning performance guide; PyTorch's channels_last); XLA picks the layout "
            "per convolution unless forced",
        ),
        Lever(
            "no autotuning",
            {"xla_gpu_autotune_level": 0},
            "what XLA's autotuning of cuDNN's convolutions and the matmuls buys (on by "
            "default, level 4), as PyTorch's cudnn.benchmark does for its convolutions",
        ),
    ),
}
PARTS = tuple(LEVERS)


def chosen(text: str) -> tuple[str, ...]:
    """The parts ``--levers`` names (comma-separated; ``all``; empty for none)."""
    from jdp.errors import UsageError

    names = tuple(part for part in text.split(",") if part)
    if names == ("all",):
        return PARTS
    unknown = [part for part in names if part not in LEVERS]
    if unknown:
        raise UsageError(
            f"--levers: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)} or all"
        )
    return names
