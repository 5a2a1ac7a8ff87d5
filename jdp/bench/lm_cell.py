"""What one cell of ``python -m jdp.bench lm`` runs: its flags, and the platform's
defaults for those left open."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, get_args

import jax

from jdp.bench.common import names
from jdp.errors import UsageError
from jdp.mesh import parse_mesh_spec
from jdp.models.attention import ATTENTION_IMPLEMENTATIONS
from jdp.models.registry import MODELS
from jdp.models.transformer import Remat

# Synthetic tokens' vocabulary: GPT-2's tokenizer's (the published sizes pad it to
# 50,304), but bytes for ``small``, as the bundled python_stdlib corpus: at a width of
# 128 a 50,257-token head is 87% of small's FLOPs, 2-4 s a step on 2 CPU cores.
GPT2_VOCAB, BYTES_VOCAB = 50257, 256
# What a cell runs when the flags leave it open: on a CPU, a step of 0.15-0.5 s on the
# 2-core development machine; on an accelerator, GPT-2 small at its context, in bf16.
CPU_DEFAULTS = {"model_size": "small", "seq_len": 128, "precision": "fp32", "batch_size": 16}
ACCELERATOR_DEFAULTS = {"model_size": "124m", "seq_len": 1024, "precision": "bf16"}
ACCELERATOR_ROWS_PER_DEVICE = 16


@dataclasses.dataclass(frozen=True)
class Cell:
    """What one cell measures, the platform's defaults filled in (`resolve`)."""

    mesh: str
    remat: str
    attention: str
    model_size: str
    seq_len: int
    batch_size: int
    precision: str
    vocab_size: int  # 0: the corpus's own
    data: str  # tokens:PATH, or "" for synthetic tokens
    rounds: int
    steps: int
    unroll: bool = False  # layers unrolled rather than under one `nn.scan`
    # XLA's options for both arms' step programs alone (`with_options`), and JAX's
    # effort level for every program of the cell ("": the platform's default).
    xla: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimization: str = ""
    loss_chunks: int = 1  # jdp's arm: the logits for the loss in chunks (--loss-chunks)
    fp8: bool = False  # both arms: the layers' products in FP8 while training (--fp8)
    profile: str = ""  # a folder: both arms' kernels traced into it (`jdp.bench.kernels`)


def resolve(args: argparse.Namespace, mesh: str, remat: str, attention: str) -> Cell:
    """The cell's settings: the flags, and the platform's defaults for those left at 0
    or "" (JAX must have started with the mesh's devices)."""
    accelerator = jax.default_backend() != "cpu"
    if attention == "cudnn" and jax.default_backend() != "gpu":
        raise UsageError(
            f"--attention cudnn is a GPU kernel; this cell's devices are {jax.default_backend()}"
        )
    defaults = ACCELERATOR_DEFAULTS if accelerator else CPU_DEFAULTS
    devices = math.prod(size for _, size in parse_mesh_spec(mesh) if size > 0)
    default_batch = ACCELERATOR_ROWS_PER_DEVICE * devices if accelerator else 0
    size = args.model_size or defaults["model_size"]
    synthetic_vocab = BYTES_VOCAB if size == "small" else GPT2_VOCAB
    return Cell(
        mesh=mesh,
        remat=remat,
        attention=attention,
        model_size=size,
        seq_len=args.seq_len or defaults["seq_len"],
        batch_size=args.batch_size or default_batch or defaults["batch_size"],
        precision=args.precision or defaults["precision"],
        vocab_size=args.vocab_size or (0 if args.data else synthetic_vocab),
        data=args.data,
        rounds=args.rounds,
        steps=args.steps,
        profile=args.profile and f"{args.profile}/{mesh}-{remat}-{attention}",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = "0 or '': the platform's,"
    parser.add_argument("--mesh", default="data=1,data=8", help="comma-separated, a cell each")
    parser.add_argument(
        "--model-size",
        default="",
        choices=("", *MODELS["gpt"].sizes),
        help=f"gpt's size ({default} small on CPU, else 124m)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help=f"tokens per window ({default} 128 on CPU, else 1024)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help=f"global batch ({default} 16 on CPU, else 16 per device)",
    )
    parser.add_argument(
        "--precision",
        default="",
        choices=("", "fp32", "bf16"),
        help=f"compute dtype ({default} fp32 on CPU, else bf16)",
    )
    remats, attentions = get_args(Remat), ATTENTION_IMPLEMENTATIONS
    parser.add_argument("--remat", default="none", help=f"comma-separated from {remats}")
    parser.add_argument("--attention", default="auto", help=f"comma-separated from {attentions}")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=2, help="steps per arm in a round")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--synthetic",
        action="store_true",
        help="uniform random tokens, seed 0 (the default without --data)",
    )
    source.add_argument("--data", default="", help="a token corpus instead, tokens:PATH")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help=f"the tokens' vocabulary (0: synthetic, {GPT2_VOCAB} or "
        f"{BYTES_VOCAB} for small; a corpus, its tokens.json)",
    )
    profile = "trace each arm's kernels into DIR; print where they differ"
    parser.add_argument("--profile", default="", metavar="DIR", help=profile)
    # One cell in this process, printed as JSON: what the sweep starts for each cell.
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)


def cells(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``(mesh, remat, attention)`` of each cell; UsageError for a flag that cannot work."""
    meshes, remats, attentions = names(args.mesh), names(args.remat), names(args.attention)
    for mesh in meshes:
        parse_mesh_spec(mesh)
    choices = (
        ("--remat", remats, get_args(Remat)),
        ("--attention", attentions, ATTENTION_IMPLEMENTATIONS),
    )
    for flag, chosen, allowed in choices:
        for value in chosen:
            if value not in allowed:
                raise UsageError(f"{flag} {value!r}; choose from: {', '.join(allowed)}")
    if args.data and not args.data.startswith("tokens:"):
        raise UsageError(f"--data {args.data}: give a token corpus as tokens:PATH")
    if min(args.rounds, args.steps) < 1:
        raise UsageError("--rounds and --steps must be at least 1")
    return [(mesh, remat, how) for mesh in meshes for remat in remats for how in attentions]
