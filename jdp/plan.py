"""``python -m jdp.plan``: what a model costs each device on a mesh, without that cluster.

Per device, exactly, from shapes and the layout (`jdp.layout`), for any mesh
size and no devices: the bytes of parameters, gradients and optimizer state,
and the model's FLOPs per step (`jdp.report.throughput.model_flops`: PaLM's count
for gpt). From the train step compiled for that mesh on simulated CPU devices
(meshes of at most `MAX_COMPILED` devices): the temporaries (activations and
what XLA keeps between ops) and the collectives' bytes per step by mesh axis.
For a named accelerator (`DEVICES`): whether it fits, a roofline step time and
MFU. ``--suggest`` compares the layouts of the same device count. The figures
are worked out in `jdp.plan_costs`; here: the accelerators, the roofline, the
report and the command line.

Example: ``python -m jdp.plan --mesh data=8,fsdp=8 --model gpt --model-size
standard --batch-size 512 --precision bf16 --device h100``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import get_args

from jdp.errors import UsageError
from jdp.mesh_spec import child_environment
from jdp.plan_costs import Plan as Plan
from jdp.plan_costs import build_model as build_model
from jdp.plan_costs import compiled_figures as compiled_figures
from jdp.plan_costs import state_bytes as state_bytes
from jdp.plan_costs import step_model_flops
from jdp.plan_stand_ins import GPUS as GPUS
from jdp.plan_stand_ins import compile_flags, planned_attention, planned_remat, stand_ins
from jdp.tool import command
from jdp.training.choices import Attention, Remat

# Meshes up to this many devices are compiled on simulated CPU devices.
MAX_COMPILED = 64


@dataclasses.dataclass(frozen=True)
class Device:
    """An accelerator's datasheet figures (one chip / GPU)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory: float  # bytes of HBM
    memory_bandwidth: float  # HBM bytes/s
    link_bandwidth: float  # interconnect bytes/s per direction (NVLink, ICI)
    source: str


# Link bandwidths are per direction: half the bidirectional figure vendors quote.
DEVICES = {
    "h100": Device("NVIDIA H100 SXM5 80GB", 989e12, 80e9, 3.35e12, 450e9,
                   "NVIDIA H100 Tensor Core GPU datasheet (dense BF16; NVLink 900 GB/s)"),
    "h200": Device("NVIDIA H200 SXM 141GB", 989e12, 141e9, 4.8e12, 450e9,
                   "NVIDIA H200 Tensor Core GPU datasheet (dense BF16; NVLink 900 GB/s)"),
    "a100": Device("NVIDIA A100 SXM4 80GB", 312e12, 80e9, 2.039e12, 300e9,
                   "NVIDIA A100 Tensor Core GPU datasheet (dense BF16; NVLink 600 GB/s)"),
    "v5e": Device("Google TPU v5e", 197e12, 16e9, 819e9, 200e9,
                  "cloud.google.com/tpu/docs/v5e (ICI 400 GB/s bidirectional)"),
    "v5p": Device("Google TPU v5p", 459e12, 95e9, 2.765e12, 300e9,
                  "cloud.google.com/tpu/docs/v5p (ICI 4800 Gbps, taken as both directions)"),
}  # fmt: skip

DEFAULT_VOCAB = 50257  # GPT-2's


def mesh_sizes(spec: str) -> dict[str, int]:
    """The axis sizes a mesh spec asks for, with no devices (``data`` added as 1 where
    only sharding axes are named), in the mesh's axis order."""
    from jdp.mesh import DATA_AXIS, KNOWN_AXES, SHARDING_AXES, MeshSpec

    axes = MeshSpec.parse(spec).sizes
    if any(size == -1 for size in axes.values()):
        raise UsageError(f"--mesh {spec}: give every axis a size (the plan has no devices)")
    if DATA_AXIS not in axes and any(axis in axes for axis in SHARDING_AXES):
        axes[DATA_AXIS] = 1
    return {axis: axes[axis] for axis in KNOWN_AXES if axis in axes}


@dataclasses.dataclass(frozen=True)
class Roofline:
    compute: float  # seconds
    memory: float
    communication: float

    @property
    def step(self) -> float:
        return max(self.compute, self.memory, self.communication)


def roofline(plan: Plan, device: Device) -> Roofline | None:
    """The step's time by compute, by HBM (reading and writing the parameters and
    optimizer state once, the temporaries twice) and by the interconnect (the
    collectives' ring traffic over one link bandwidth for every axis), each alone;
    with perfect overlap the step takes the largest. An estimate: the collectives
    are the CPU program's (see docs/sharding.md). None without compiled figures."""
    if plan.flops is None or plan.temporaries is None or plan.wire is None:
        return None
    hbm = 2 * (plan.params + plan.optimizer) + 2 * plan.temporaries
    return Roofline(
        compute=plan.flops / plan.devices / device.peak_flops,
        memory=hbm / device.memory_bandwidth,
        communication=plan.wire / device.link_bandwidth,
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.3f} GiB"


def _bytes(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({_gib(nbytes)})"


def report(plan: Plan, device: Device | None, *, batch_size: int) -> list[str]:
    mesh = ",".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    lines = [
        f"mesh {mesh} ({plan.devices} devices), {plan.parameters:,} parameters, "
        f"global batch {batch_size}",
        f"  per device, exact: parameters {_bytes(plan.params)}, gradients "
        f"{_bytes(plan.grads)}, optimizer state {_bytes(plan.optimizer)}",
    ]
    if plan.temporaries is None:
        lines.append(
            f"  activations and temporaries, collectives: not compiled (meshes of at most "
            f"{MAX_COMPILED} devices are)"
        )
        if plan.flops is not None:
            lines.append(f"  model FLOPs per step: {plan.flops:.4g} (all devices)")
    else:
        lines.append(
            f"  activations and temporaries: {_bytes(plan.temporaries)} per device "
            "(the compiled step's memory analysis)"
        )
        for key, nbytes in sorted(plan.collectives.items()):
            lines.append(f"  collective {key}: {nbytes:,} bytes per device per step")
        if plan.flops is not None:
            lines.append(f"  model FLOPs per step: {plan.flops:.4g} (all devices)")
    if device is not None:
        need = plan.need
        fits = "fits" if need <= device.memory else "does NOT fit"
        known = "" if plan.temporaries is not None else " (state alone)"
        lines.append(f"  {device.name}: needs {_gib(need)}{known} of {_gib(device.memory)}: {fits}")
        bound = roofline(plan, device)
        if bound is None and plan.flops is not None:
            compute = plan.flops / plan.devices / device.peak_flops
            lines.append(
                f"  compute at peak: {compute * 1e3:.2f} ms per step (HBM and interconnect "
                "not compiled: no roofline)"
            )
        if bound is not None:
            mfu = plan.flops / plan.devices / device.peak_flops / bound.step
            lines.append(
                f"  roofline step {bound.step * 1e3:.4g} ms (compute {bound.compute * 1e3:.3g}, "
                f"HBM {bound.memory * 1e3:.3g}, interconnect {bound.communication * 1e3:.3g}), "
                f"MFU at most {mfu:.0%}"
            )
    return lines


def figures(
    plan: Plan, device: Device | None, *, remat: str, attention: str, fp8: bool = False
) -> dict:
    """The plan as ``--json`` prints it: bytes per device, FLOPs per step, what was
    compiled in the target's place, and for a ``device`` whether it fits and the
    roofline's seconds."""
    out = dataclasses.asdict(plan) | {
        "need": plan.need,
        "remat_compiled": remat,
        "attention_compiled": attention,
        "fp8": fp8,
    }
    if device is not None:
        out["device"], out["fits"] = device.name, plan.need <= device.memory
        bound = roofline(plan, device)
        if bound is not None:
            out["roofline_s"] = dataclasses.asdict(bound) | {"step": bound.step}
    return out


def _candidates(devices: int) -> list[str]:
    """The layouts of ``devices`` devices ``--suggest`` compares."""
    out = []
    for model in (1, 2, 4, 8):
        for fsdp in (1, 2, 4, 8, 16, 32, 64):
            if devices % (model * fsdp):
                continue
            data = devices // (model * fsdp)
            parts = [f"data={data}", f"fsdp={fsdp}", f"model={model}"]
            out.append(",".join(p for p in parts if not p.endswith("=1") or p == parts[0]))
    return out


def plan_for(spec: str, args: argparse.Namespace, *, compile_step: bool) -> Plan:
    model, batch = build_model(
        args.model,
        args.model_size,
        vocab=args.vocab_size,
        seq_len=args.seq_len,
        image=args.image_shape,
        remat=planned_remat(args),
        unroll=args.unroll_layers,
        loss_chunks=args.loss_chunks,
        attention=planned_attention(args),
        fp8=args.fp8,
    )
    sizes = mesh_sizes(spec)
    from jdp.mesh import check_spec_fits_batch
    from jdp.mesh import parse_axis_rules as parse_rules
    from jdp.mesh_spec import MeshSpec

    rules = parse_rules(args.axis_rules)
    check_spec_fits_batch(MeshSpec.parse(spec), args.batch_size)
    plan = state_bytes(model, batch, sizes, shard_optimizer=args.shard_optimizer, rules=rules)
    if compile_step:
        compiled_figures(
            plan,
            model,
            batch,
            args.batch_size,
            precision=args.precision,
            shard_optimizer=args.shard_optimizer,
            rules=rules,
        )
    elif not args.no_compile:  # too many devices to simulate: the FLOPs from shapes
        plan.flops = step_model_flops(model, batch, args.batch_size)
    return plan


def _compile_in_child(argv: Sequence[str], devices: int) -> int:
    """Runs this command again in a process with ``devices`` simulated CPU devices,
    compiling with `compile_flags` where this JAX's XLA knows them."""
    env = child_environment(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["JDP_PLAN_CHILD"] = "1"
    scheduled = {**env, "XLA_FLAGS": compile_flags(env.get("XLA_FLAGS", ""))}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]  # XLA ends on a flag it lacks
    if subprocess.run(probe, env=scheduled, capture_output=True).returncode == 0:
        env = scheduled
    return subprocess.call([sys.executable, "-m", "jdp.plan", *argv], env=env)


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    """The command line, read and checked (a bad value ends the command as argparse does)."""
    parser = argparse.ArgumentParser(prog="jdp.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=8", help="e.g. data=64,fsdp=8")
    parser.add_argument("--model", default="gpt")
    parser.add_argument(
        "--model-size", default="standard", help="small, standard (gpt: 124m, 350m, 774m, 1.3b)"
    )
    parser.add_argument("--remat", default="none", choices=get_args(Remat), help="gpt")
    parser.add_argument(
        "--attention",
        default="auto",
        choices=get_args(Attention),
        help="gpt and seq2seq, as jdp.train's",
    )
    parser.add_argument("--unroll-layers", action="store_true", help="gpt: a loop, not a scan")
    parser.add_argument("--fp8", action="store_true", help="gpt: its layers' products in FP8")
    parser.add_argument("--loss-chunks", type=int, default=1, help="gpt: the logits in chunks")
    parser.add_argument("--batch-size", type=int, default=512, help="global batch")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1")
    parser.add_argument("--axis-rules", default="", help="as jdp.train's --axis-rules")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="sequence models")
    parser.add_argument("--seq-len", type=int, default=1024, help="sequence models' tokens")
    parser.add_argument(
        "--image-shape",
        type=lambda s: tuple(int(d) for d in s.split("x")),
        default=(32, 32, 3),
        help="image models' HxWxC",
    )
    parser.add_argument("--device", choices=sorted(DEVICES), help="an accelerator to fit")
    parser.add_argument("--no-compile", action="store_true", help="shapes only")
    parser.add_argument(
        "--suggest", action="store_true", help="compare the layouts of the mesh's device count"
    )
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.json and args.suggest:
        parser.error("--json gives one mesh's figures; leave out --suggest")
    for name in ("batch_size", "vocab_size", "seq_len", "loss_chunks"):
        if not 1 <= getattr(args, name) < 2**31:  # ids and positions are int32
            parser.error(
                f"--{name.replace('_', '-')} must be in [1, 2**31), got {getattr(args, name)}"
            )
    if len(args.image_shape) != 3 or min(args.image_shape) < 1:
        parser.error(f"--image-shape must be HxWxC, each at least 1, got {args.image_shape}")
    return args


@command("jdp.plan")
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _arguments(argv)
    try:
        sizes = mesh_sizes(args.mesh)
        devices = math.prod(sizes.values())
        compile_step = not args.no_compile and devices <= MAX_COMPILED
        if compile_step and not os.environ.get("JDP_PLAN_CHILD"):
            return _compile_in_child(argv, devices)
        device = DEVICES.get(args.device) if args.device else None
        specs = _candidates(devices) if args.suggest else [args.mesh]
        best = None
        for spec in specs:
            try:
                plan = plan_for(spec, args, compile_step=compile_step)
            except UsageError as error:
                if not args.suggest:
                    raise
                print(f"mesh {spec}: {error}")
                continue
            if args.json:
                compiled = {"remat": planned_remat(args), "attention": planned_attention(args)}
                print(json.dumps(figures(plan, device, **compiled, fp8=args.fp8)))
                return 0
            print("\n".join(report(plan, device, batch_size=args.batch_size)))
            if compile_step:
                print("\n".join(stand_ins(args)))
            if args.suggest and device is not None:
                need = plan.need
                bound = roofline(plan, device)
                score = bound.step if bound is not None else plan.state
                if need <= device.memory and (best is None or score < best[0]):
                    best = (score, spec)
        if args.suggest:
            if device is None:
                print("jdp.plan: --suggest picks for a --device; name one")
            elif best is None:
                print(f"jdp.plan: no layout of {devices} devices fits a {device.name}")
            else:
                print(f"jdp.plan: suggest --mesh {best[1]}")
        if device is not None:
            print(f"({device.name}: {device.source})")
    except UsageError as error:
        print(f"jdp.plan: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
