"""``python -m jdp.bench memory``: what each device holds of a model on each layout.

For every mesh: the bytes per device of parameters and optimizer state (exact,
from the layout), the compiled step's arguments and temporaries (XLA's memory
analysis of the step compiled for that mesh on simulated CPU devices, lowered
from shapes: nothing is allocated), and its collectives' bytes per device by
the mesh axes they cross. Ratios are against the first mesh (``data=8``).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import get_args

from jdp.bench.common import names
from jdp.mesh import check_spec_fits_batch
from jdp.mesh_spec import MeshSpec
from jdp.plan import mesh_sizes
from jdp.plan_costs import build_model, compiled_figures, state_bytes
from jdp.training.choices import Remat
from jdp.training.run import setup_devices

MESHES = "data=8,fsdp=8,data=8+zero1,data=2;fsdp=4,data=4;model=2,data=2;fsdp=2;model=2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--model-size", default="standard")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=256, help="sequence models' tokens")
    parser.add_argument("--vocab-size", type=int, default=50257, help="sequence models")
    parser.add_argument("--remat", default="none", choices=get_args(Remat), help="gpt")
    parser.add_argument("--unroll-layers", action="store_true", help="gpt: a loop, not a scan")
    parser.add_argument("--loss-chunks", type=int, default=1, help="gpt: the logits in chunks")
    parser.add_argument(
        "--meshes",
        default=MESHES,
        help="comma-separated; ';' for ',' inside a mesh, +zero1 for --shard-optimizer",
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def run(args: argparse.Namespace) -> None:
    meshes = [item.replace(";", ",").partition("+") for item in names(args.meshes)]
    for spec, _, _ in meshes:
        check_spec_fits_batch(MeshSpec.parse(spec), args.batch_size)
    setup_devices(f"data={max(math.prod(mesh_sizes(spec).values()) for spec, _, _ in meshes)}")
    model, batch = build_model(
        args.model,
        args.model_size,
        vocab=args.vocab_size,
        seq_len=args.seq_len,
        image=(32, 32, 3),
        remat=args.remat,
        unroll=args.unroll_layers,
        loss_chunks=args.loss_chunks,
    )
    layers = "unrolled" if args.unroll_layers else "scanned"
    chunks = f", loss in {args.loss_chunks} chunks" if args.loss_chunks > 1 else ""
    print(
        f"{args.model} {args.model_size} ({layers} layers, remat {args.remat}{chunks}), "
        f"global batch {args.batch_size}"
        + (f" x {args.seq_len} tokens" if {"source", "tokens"} & set(batch) else "")
        + ", fp32, AdamW; MiB per device"
    )
    print(
        "| mesh | params | optimizer | params + optimizer | vs first | compiled arguments "
        "| temporaries | collectives (bytes per device per step) | compile s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    first = None
    for spec, _, zero in meshes:
        zero1 = zero == "zero1"
        plan = state_bytes(model, batch, mesh_sizes(spec), shard_optimizer=zero1)
        started = time.perf_counter()  # lowering and compiling the step, from shapes
        compiled_figures(
            plan, model, batch, args.batch_size, precision="fp32", shard_optimizer=zero1
        )
        seconds = time.perf_counter() - started
        held = plan.params + plan.optimizer
        first = first or held
        moved = ", ".join(f"{key} {nbytes:,}" for key, nbytes in sorted(plan.collectives.items()))
        print(
            f"| {spec}{' --shard-optimizer' if zero1 else ''} | {_mib(plan.params)} | "
            f"{_mib(plan.optimizer)} | {_mib(held)} | {held / first:.3f}x | "
            f"{_mib(plan.arguments)} | {_mib(plan.temporaries)} | {moved or 'none'} | "
            f"{seconds:.1f} |",
            flush=True,
        )
