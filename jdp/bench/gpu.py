"""``python -m jdp.bench gpu``: every accelerator figure from one command, within a wall budget.

In this order, each part printed and written to ``--out`` (JSON) the moment it is
done, so a run cut short keeps the parts before it:

1. ``machine``: the device, driver, JAX/jaxlib/CUDA/cuDNN versions, and the
   measured bf16 matrix-product rate (an 8192-cube product) beside the data
   sheet's peak;
2. ``gpt2``: GPT-2 124M at T = 1024 in bf16, jdp's step against a hand-written
   JAX + Optax step of the same model in the same process (`jdp.bench.lm`'s
   cells), tokens/s and MFU by both counts (PaLM's 6N + 12LdT, and attention
   halved for causality, 6N + 6LdT), over attention ``cudnn``/``xla``, remat
   ``none``/``dots``, scanned/unrolled layers, the loss in chunks, FP8 products
   and XLA's GPU settings (the latency-hiding scheduler, effort level O1), each
   cell one setting away from the first;
3. ``resnet50``: ResNet-50 (v1.5) in bf16 on synthetic 224 px images, jdp's
   step against a hand-written one;
4. ``loader``: the JPEG loader's images/s on this machine's cores (generated
   JPEGs of ImageNet's sizes) and how many cores one device needs at part 3's rate;
5. ``sweep``: the small models of ``bench step`` on ``data=1``, with
   ``--steps-per-call 4``, and fed each step's batch from the host and from the
   split on the device (``--data-on-device``), against a hand-written one-device step;
6. ``correctness``: 20 steps of ``gpt`` small on the accelerator against the
   same 20 steps on its CPU (a process of its own, started with the run so that
   it runs on the host's cores beside the other parts), in fp32 with exact matrix
   products, within a tolerance derived from the CPU run's own sensitivity.

``--smoke`` runs every part at toy sizes, on a CPU too, in seconds. From a checkout,
``python -m tools.bundle DIR`` writes the wheels an offline machine needs, and
``python -m tools.gpu_docs`` turns the JSON into the docs' GPU section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any

import jax

from jdp.bench import levers, peers
from jdp.bench.gpu_host import (
    CORRECTNESS_STEPS,
    SWEEP_CASES,
    correctness_losses,
    part_correctness,
    part_loader,
    part_sweep,
    start_cpu_reference,
)
from jdp.bench.gpu_models import (
    GPT2_CELLS,
    RESNET_ROWS,
    part_gpt2,
    part_machine,
    part_resnet50,
    versions,
)
from jdp.bench.gpu_table import table
from jdp.errors import UsageError
from jdp.report.writers import output_file

# The parts, in the order they run, and each one's share of the budget that it may
# start within (the GPT-2 cells stop starting new cells past theirs).
PARTS = ("machine", "gpt2", "resnet50", "loader", "sweep", "correctness")
GPT2_SHARE = 0.5
# GPT-2 cells: the first is the tuned default; each later one changes one setting.


@dataclasses.dataclass
class Sizes:
    """What the parts run: the full sizes on an accelerator, toy ones with ``--smoke``."""

    matmul: int = 8192
    gpt_size: str = "124m"
    seq_len: int = 1024
    gpt_rows: int = 0  # 0: by the device's memory
    gpt_rounds: int = 7
    gpt_steps: int = 3
    gpt_precision: str = "bf16"
    gpt_vocab: int = 0  # 0: GPT-2's tokenizer's
    resnet_size: str = "standard"
    resnet_px: int = 224
    resnet_rows: int = RESNET_ROWS
    resnet_rounds: int = 7
    resnet_precision: str = "bf16"
    jpegs: int = 256
    jpeg_rows: int = 32
    sweep_rows: int = 128
    sweep_rounds: int = 9
    round_seconds: float = 0.5
    gpt_cells: int = len(GPT2_CELLS)
    gpt_picks: tuple[int, ...] = ()  # --gpt2-cells: cell numbers from 1, in their order
    gpt_profile: bool = False  # --gpt2-profile
    sweep_cases: tuple[str, ...] = SWEEP_CASES
    correctness_steps: int = CORRECTNESS_STEPS
    smoke: bool = False
    peers: tuple[str, ...] = ()  # the PyTorch arms that race (`jdp.bench.peers`)
    nanogpt: str = ""  # --nanogpt DIR: a checkout of karpathy/nanoGPT
    levers: tuple[str, ...] = ()  # --levers: the parts whose levers race (`jdp.bench.levers`)


# The smoke run computes in fp32: XLA:CPU compiles bf16 programs several times slower.
# Its GPT-2 cell has `bench lm`'s small vocabulary of bytes: GPT-2's 50,257 made each of
# its 20-odd steps 0.18 s with XLA's optimizations off.
SMOKE = Sizes(
    matmul=256,
    gpt_size="small",
    seq_len=32,
    gpt_rows=4,
    gpt_rounds=2,
    gpt_steps=1,
    gpt_precision="fp32",
    gpt_vocab=256,
    resnet_size="toy",
    resnet_px=32,
    resnet_precision="fp32",
    resnet_rows=4,
    resnet_rounds=2,
    jpegs=8,
    jpeg_rows=4,
    sweep_rows=16,
    sweep_rounds=2,
    round_seconds=0.01,
    gpt_cells=1,
    sweep_cases=SWEEP_CASES[:1],
    correctness_steps=4,
    smoke=True,
)


class Report:
    """The JSON file the parts land in, rewritten whole after each part."""

    def __init__(self, path: str, budget: float, smoke: bool):
        self.started, self.budget = time.monotonic(), budget
        self.path = output_file(path, "--out")  # a link's target, never a FIFO or device
        self.data: dict[str, Any] = {
            "command": " ".join(["python -m jdp.bench gpu", *sys.argv[2:]]),
            "date": datetime.date.today().isoformat(),
            "budget_s": budget,
            "smoke": smoke,
            "parts": {},
        }

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def land(self, part: str, result: dict[str, Any]) -> None:
        self.data["parts"][part] = result | {"at_s": round(self.elapsed(), 1)}
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        temporary = self.path + ".part"
        with open(temporary, "w") as handle:
            json.dump(self.data, handle, indent=1)
        os.replace(temporary, self.path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=float, default=480.0, help="wall seconds for all parts")
    parser.add_argument("--out", default="jdp-gpu.json", help="the JSON file the parts land in")
    parser.add_argument(
        "--smoke", action="store_true", help="every part at toy sizes (on a CPU too), in seconds"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from these")
    parser.add_argument(
        "--gpt2-share",
        type=float,
        default=GPT2_SHARE,
        help="the share of the budget within which GPT-2 cells may start",
    )
    parser.add_argument(
        "--gpt2-cells",
        default="",
        help=f"the GPT-2 cells to run, by number (1 to {len(GPT2_CELLS)}, the table's order), "
        "comma-separated, in the order given (default: all)",
    )
    parser.add_argument(
        "--gpt2-profile",
        action="store_true",
        help="trace each GPT-2 cell's two arms: their kernels land in the JSON, and the "
        "kernels one arm runs alone are printed (jdp.bench lm --profile's)",
    )
    parser.add_argument(
        "--peers",
        default="auto",
        help="the PyTorch arms raced in the same rounds, comma-separated, from "
        f"{', '.join(peers.ALL)}; auto: each this machine can run; none",
    )
    parser.add_argument(
        "--nanogpt",
        default="",
        metavar="DIR",
        help="a checkout of karpathy/nanoGPT: its model.py races GPT-2 as the nanogpt arm",
    )
    parser.add_argument(
        "--levers",
        default="",
        help="the parts whose XLA options race as more arms of jdp's step, comma-separated "
        "(sweep, resnet50) or all (jdp.bench.levers)",
    )
    parser.add_argument(
        "--gpt-rows",
        type=int,
        default=0,
        help="GPT-2 rows per device (0: 32 on devices of 40 GB or more, else 16)",
    )
    # One process's CPU reference for the correctness part, printed as JSON.
    parser.add_argument("--cpu-reference", type=int, default=0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from jdp.bench.common import names

    if args.cpu_reference:
        print(json.dumps(correctness_losses(args.cpu_reference, (False, True))))
        return 0
    parts = names(args.parts)
    if not parts:
        raise UsageError(f"--parts {args.parts!r} names no part; choose from: {', '.join(PARTS)}")
    for part in parts:
        if part not in PARTS:
            raise UsageError(f"--parts: unknown part {part!r}; choose from: {', '.join(PARTS)}")
    if not args.budget > 0:
        raise UsageError(f"--budget {args.budget}: give more than 0")
    racing, left_out = peers.choose(args.peers, args.nanogpt)
    # Before JAX starts: the process may take 92% of an accelerator's memory, not 75%;
    # with peers racing, only what it uses, so that their processes have the rest.
    if racing:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    sizes = dataclasses.replace(
        SMOKE if args.smoke else Sizes(),
        **({"gpt_rows": args.gpt_rows} if args.gpt_rows else {}),
        gpt_picks=_picks(args.gpt2_cells),
        gpt_profile=args.gpt2_profile,
        peers=tuple(racing),
        nanogpt=os.path.abspath(args.nanogpt) if args.nanogpt else "",
        levers=levers.chosen(args.levers),
    )
    if not args.smoke and jax.default_backend() == "cpu":
        print(
            "jdp.bench gpu: no accelerator here (JAX's platform is cpu); the full sizes "
            "would take hours: run it where one is, or pass --smoke",
            file=sys.stderr,
        )
        return 2
    report = Report(args.out, args.budget, args.smoke)
    report.data["peers"] = {"racing": racing, "left_out": left_out}
    # The device and versions, whatever --parts asks: the machine part may be left out.
    report.data["where"] = {"kind": jax.devices()[0].device_kind, "versions": versions()}

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"jdp.bench gpu: parts {', '.join(parts)}; budget {args.budget:.0f} s; -> {args.out}")
    left = "".join(f"; {name} left out ({why})" for name, why in left_out.items())
    say(f"jdp.bench gpu: PyTorch peers {', '.join(racing) or 'none'}{left}")
    with _compiles_for(args.smoke):
        _run_parts(args, parts, sizes, report, say)
    say(f"--- jdp.bench gpu, {report.elapsed():.0f} s, {report.data['date']} ---")
    for line in table(report.data):
        say(line)
    return 1 if failed_parts(report.data["parts"]) else 0


def _picks(said: str) -> tuple[int, ...]:
    if said.strip() and not said.replace(",", "").strip():
        raise UsageError(
            f"--gpt2-cells {said!r} names no cell; give numbers from 1 to "
            f"{len(GPT2_CELLS)}, or leave it out for all"
        )
    picks: list[int] = []
    for word in filter(None, (w.strip() for w in said.split(","))):
        if word not in {str(n) for n in range(1, len(GPT2_CELLS) + 1)} or int(word) in picks:
            raise UsageError(
                f"--gpt2-cells: {word!r} is not a cell number from 1 to "
                f"{len(GPT2_CELLS)} named once"
            )
        picks.append(int(word))
    return tuple(picks)


@contextlib.contextmanager
def _compiles_for(smoke: bool):
    """The smoke run's programs compiled with most of XLA's optimizations off (its
    figures are not figures; its compiles are most of its time: 65 s to 43 s on the
    2-core machine), then this process's caches emptied, so that no program of it
    is reused afterwards. The CPU reference process inherits the setting."""
    if not smoke or jax.config.read("jax_disable_most_optimizations"):
        yield
        return
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)
        jax.clear_caches()


def _run_parts(args, parts: list[str], sizes: Sizes, report: Report, say) -> None:
    # The correctness part's CPU reference runs from the start, on the host's cores
    # beside the accelerator's parts, and is waited for by that part (stopped if the
    # run ends first): on an H100 it was 30 of that part's 36 s, last in the budget.
    reference = None
    if "correctness" in parts:
        reference = start_cpu_reference(sizes.correctness_steps)
    try:
        _each_part(args, parts, sizes, report, say, reference)
    finally:
        if reference is not None and reference.poll() is None:
            reference.kill()
            reference.communicate()


def _each_part(args, parts: list[str], sizes: Sizes, report: Report, say, reference) -> None:
    resnet_rate = None
    for part in parts:
        if part != "machine" and report.left() <= 0:
            report.land(part, {"error": "not run: the budget was spent"})
            continue
        started = time.monotonic()
        try:
            if part == "machine":
                result = part_machine(sizes)
            elif part == "gpt2":
                result = part_gpt2(sizes, report, args.gpt2_share * args.budget, say)
            elif part == "resnet50":
                result = part_resnet50(sizes)
                resnet_rate = result["jdp"]
            elif part == "loader":
                result = part_loader(sizes, resnet_rate)
            elif part == "sweep":
                result = part_sweep(sizes, report, report.elapsed() + 0.5 * report.left(), say)
            else:
                result = part_correctness(sizes.correctness_steps, reference)
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"[:1000]}
        result["seconds"] = round(time.monotonic() - started, 1)
        report.land(part, result)
        if part not in ("gpt2", "sweep") or "error" in result:  # those said each row as it came
            for line in table({"parts": {part: result}}):
                say(line)


def failed_parts(parts: dict[str, Any]) -> list[str]:
    """The parts that failed: an error, every GPT-2 cell failing or its arms' first
    losses disagreeing, or the accelerator outside the CPU's tolerance."""
    failed = [part for part, result in parts.items() if "error" in result]
    cells = parts.get("gpt2", {}).get("cells", [])
    if cells and all("error" in cell or not cell["check"]["agree"] for cell in cells):
        failed.append("gpt2")
    if parts.get("correctness", {}).get("within") is False:
        failed.append("correctness")
    return failed
