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
   ``none``/``dots`` and scanned/unrolled layers, each cell one setting away
   from the first;
3. ``resnet50``: ResNet-50 (v1.5) in bf16 on synthetic 224 px images, jdp's
   step against a hand-written one;
4. ``loader``: the JPEG loader's images/s on this machine's cores (generated
   JPEGs of ImageNet's sizes) and how many cores one device needs at part 3's rate;
5. ``sweep``: the small models of ``bench step`` on ``data=1``, with
   ``--steps-per-call 4``, against a hand-written one-device step;
6. ``correctness``: 20 steps of ``gpt`` small on the accelerator against the
   same 20 steps on its CPU (a process of its own), in fp32 with exact matrix
   products, within a tolerance derived from the CPU run's own sensitivity.

``--smoke`` runs every part at toy sizes, on a CPU too, in seconds. ``--bundle
DIR`` instead writes the wheels an offline machine needs (`jdp.bench.bundle`);
``python -m jdp.bench.gpu_docs`` turns the JSON into the docs' GPU section.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jdp.bench.arms import interleaved_rates, jdp_loop, ratios_to
from jdp.errors import UsageError
from jdp.mesh_spec import DATA_AXIS
from jdp.report.throughput import peak_flops

# The parts, in the order they run, and each one's share of the budget that it may
# start within (the GPT-2 cells stop starting new cells past theirs).
PARTS = ("machine", "gpt2", "resnet50", "loader", "sweep", "correctness")
GPT2_SHARE = 0.5
# GPT-2 cells: the first is the tuned default; each later one changes one setting.
GPT2_CELLS = (
    {"attention": "cudnn", "remat": "none", "unroll": False},
    {"attention": "xla", "remat": "none", "unroll": False, "rows": 0.5},
    {"attention": "cudnn", "remat": "dots", "unroll": False},
    {"attention": "cudnn", "remat": "none", "unroll": True},
)
# Rows per device at T = 1024: llm.c trains 124M with 64 on an 80 GB H100. jdp's 32
# take 63 GB with XLA's attention, which keeps the (B, H, T, T) scores of every layer
# (measured on an H100, 2026-11-27): that cell runs half as many ("rows": 0.5).
GPT2_ROWS, GPT2_ROWS_SMALL_DEVICE = 32, 16
RESNET_ROWS = 256  # NVIDIA's ResNet-50 mixed-precision batch per A100/H100
SWEEP_CASES = ("mlp-38k", "mlp-0.7m", "mlp-10m", "gpt-small")
CORRECTNESS_STEPS = 20


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
    sweep_cases: tuple[str, ...] = SWEEP_CASES
    correctness_steps: int = CORRECTNESS_STEPS


# The smoke run computes in fp32: XLA:CPU compiles bf16 programs several times slower.
SMOKE = Sizes(matmul=256, gpt_size="small", seq_len=32, gpt_rows=4, gpt_rounds=2,
              gpt_steps=1, gpt_precision="fp32", resnet_size="toy", resnet_px=32,
              resnet_precision="fp32", resnet_rows=4, resnet_rounds=2, jpegs=8, jpeg_rows=4,
              sweep_rows=16, sweep_rounds=2, round_seconds=0.01,
              gpt_cells=1, sweep_cases=SWEEP_CASES[:1], correctness_steps=4)  # fmt: skip


class Report:
    """The JSON file the parts land in, rewritten whole after each part."""

    def __init__(self, path: str, budget: float, smoke: bool):
        self.path, self.started, self.budget = path, time.monotonic(), budget
        self.data: dict[str, Any] = {
            "command": " ".join(["python -m jdp.bench gpu", *sys.argv[2:]]),
            "date": datetime.date.today().isoformat(),
            "budget_s": budget, "smoke": smoke, "parts": {},
        }  # fmt: skip

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


# --- 1. the machine ------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import jaxlib

    found = {"python": platform.python_version(), "jax": jax.__version__,
             "jaxlib": jaxlib.__version__}  # fmt: skip
    try:  # private, and absent without CUDA: the versions are a courtesy
        from jax._src.lib import cuda_versions

        if cuda_versions is not None:
            found["cuda"] = str(cuda_versions.cuda_runtime_get_version())
            found["cudnn"] = str(cuda_versions.cudnn_get_version())
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
        said = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
        if said.strip():
            driver, memory = (part.strip() for part in said.splitlines()[0].split(","))
            found |= {"driver": driver, "memory": memory}
    return found


def matmul_rate(n: int, repeats: int = 10) -> float:
    """FLOP/s of an ``n``-cube bf16 product on the default device (random data)."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
    product = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        product(a, b).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        out = product(a, b)
    out.block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - started)


def part_machine(sizes: Sizes) -> dict[str, Any]:
    device = jax.devices()[0]
    rate = matmul_rate(sizes.matmul)
    return {"platform": jax.default_backend(), "kind": device.device_kind,
            "devices": jax.device_count(), "cores": os.cpu_count(),
            "versions": _versions(), "matmul_n": sizes.matmul, "matmul_flops": rate,
            "peak_flops": peak_flops(device.device_kind, "bf16")}  # fmt: skip


# --- 2. GPT-2 124M -----------------------------------------------------------------


def causal_flops_per_token(palm: float, layers: int, width: int, seq_len: int) -> float:
    """PaLM's count with attention's score and value products halved (a causal mask
    leaves half of them): 6N + 12LdT becomes 6N + 6LdT."""
    return palm - 6 * layers * width * seq_len


def gpt_rows(sizes: Sizes) -> int:
    if sizes.gpt_rows:
        return sizes.gpt_rows
    stats = jax.devices()[0].memory_stats() or {}
    return GPT2_ROWS if stats.get("bytes_limit", 0) >= 40e9 else GPT2_ROWS_SMALL_DEVICE


def gpt_cells() -> list[dict[str, Any]]:
    """The GPT-2 cells this platform can run: cuDNN's attention is a GPU kernel."""
    if jax.default_backend() == "gpu":
        return [dict(cell) for cell in GPT2_CELLS]
    return [cell | {"attention": "xla"} for cell in GPT2_CELLS if cell["attention"] == "cudnn"]


def part_gpt2(sizes: Sizes, report: Report, share_end: float,
              on_line: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    from jdp.bench import lm

    rows = gpt_rows(sizes)  # on one device: every part's mesh is data=1
    cells, skipped = [], []
    for index, setting in enumerate(gpt_cells()[: sizes.gpt_cells]):
        if index and report.elapsed() > share_end:
            skipped.append(setting)
            continue
        options = {key: value for key, value in setting.items() if key != "rows"}
        batch = max(1, int(rows * setting.get("rows", 1)))
        cell = lm.Cell(mesh="data=1", model_size=sizes.gpt_size, seq_len=sizes.seq_len,
                       batch_size=batch, precision=sizes.gpt_precision,
                       vocab_size=lm.GPT2_VOCAB, data="",
                       rounds=sizes.gpt_rounds, steps=sizes.gpt_steps, **options)  # fmt: skip
        started = time.monotonic()
        try:
            result = lm.measure_cell(cell)
        except Exception as error:
            cells.append({"setting": setting, "error": f"{type(error).__name__}: {error}"[:500]})
            on_line(f"  gpt2 {_setting(setting)}: {cells[-1]['error'][:200]}")
            continue
        module = lm.gpt_module(cell, lm.GPT2_VOCAB)
        result["flops_per_token_causal"] = causal_flops_per_token(
            result["flops_per_token"], module.layers, module.width, cell.seq_len
        )
        result["setting"], result["seconds"] = setting, round(time.monotonic() - started, 1)
        stats = jax.devices()[0].memory_stats() or {}
        result["peak_bytes"] = stats.get("peak_bytes_in_use")
        result["bytes_limit"] = stats.get("bytes_limit")
        cells.append(result)
        on_line(gpt_line(result))
        gc.collect()
        jax.clear_caches()
    return {"cells": cells, "skipped_for_budget": skipped, "rows": rows,
            "seq_len": sizes.seq_len, "size": sizes.gpt_size,
            "precision": sizes.gpt_precision}  # fmt: skip


def _setting(setting: dict[str, Any]) -> str:
    layers = "unrolled" if setting["unroll"] else "scanned"
    return f"attention {setting['attention']}, remat {setting['remat']}, {layers}"


def gpt_numbers(result: dict[str, Any]) -> dict[str, float]:
    rates = result["rates"]
    jdp, hand = statistics.median(rates["jdp"]), statistics.median(rates["hand-written"])
    numbers = {"jdp": jdp, "hand": hand, "ratio": ratios_to(rates, "hand-written")["jdp"]}
    peak = result["peak"]
    if peak:
        numbers["mfu"] = result["flops_per_token"] * jdp / peak
        numbers["mfu_causal"] = result["flops_per_token_causal"] * jdp / peak
    return numbers


def gpt_line(result: dict[str, Any]) -> str:
    n = gpt_numbers(result)
    mfu = f", MFU {n['mfu']:.1%} (causal {n['mfu_causal']:.1%})" if "mfu" in n else ""
    check = "agree" if result["check"]["agree"] else "DISAGREE"
    return (f"  gpt2 {_setting(result['setting'])}: jdp {n['jdp']:,.0f} tokens/s, hand-written "
            f"{n['hand']:,.0f}, {n['ratio']:.3f}x{mfu}; first losses {check}")  # fmt: skip


# --- 3. ResNet-50 ------------------------------------------------------------------


# The smoke run's ResNet: ResNet-50's kinds of layers (the ImageNet stem, bottleneck
# blocks, four stages) with one narrow block a stage, to compile in seconds on a CPU.
TOY_RESNET = {"stages": (1, 1, 1, 1), "widths": (8, 8, 8, 8), "bottleneck": True,
              "imagenet_stem": True}  # fmt: skip


def resnet_module(size: str):
    from jdp.models.registry import MODELS
    from jdp.models.resnet import ResNet

    options = TOY_RESNET if size == "toy" else MODELS["resnet50"].sizes[size]
    return ResNet(num_classes=1000, **options)


def hand_written_resnet_step(module, optimizer, dtype, mesh):
    """The data-parallel step one writes for a BatchNorm model with Flax and Optax alone:
    ``jit`` over ``shard_map``, the parameters and images cast to ``dtype`` in the loss,
    ``mutable=["batch_stats"]`` (the module's BatchNorm averages its statistics over
    ``data``), ``jax.value_and_grad``, ``pmean`` of the gradients and loss, the Optax
    update, the state donated."""

    def loss(params, stats, batch):
        cast = jax.tree.map(lambda leaf: leaf.astype(dtype), params)
        logits, updated = module.apply({"params": cast, "batch_stats": stats},
                                       batch["image"].astype(dtype), train=True,
                                       mutable=["batch_stats"])  # fmt: skip
        labels = batch["label"]
        value = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        return value.mean(), updated["batch_stats"]

    def replica(params, stats, opt_state, batch):
        varying = jax.lax.pcast(params, DATA_AXIS, to="varying")
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(varying, stats, batch)
        grads, value = jax.lax.pmean((grads, value), DATA_AXIS)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value

    whole, rows = PartitionSpec(), PartitionSpec(DATA_AXIS)
    mapped = jax.shard_map(replica, mesh=mesh, in_specs=(whole, whole, whole, rows),
                           out_specs=whole)  # fmt: skip
    return jax.jit(mapped, donate_argnums=(0, 1, 2))


def part_resnet50(sizes: Sizes) -> dict[str, Any]:
    from jdp.mesh import make_mesh, shard_batch
    from jdp.models import classification, from_linen
    from jdp.precision import make_precision
    from jdp.state import create_train_state
    from jdp.step import make_train_step

    mesh = make_mesh("data=1")
    rows, px = sizes.resnet_rows, sizes.resnet_px
    rng = np.random.default_rng(0)
    host = {"image": rng.normal(size=(rows, px, px, 3)).astype(np.float32),
            "label": rng.integers(0, 1000, rows).astype(np.int32)}  # fmt: skip
    batch = shard_batch(host, mesh)
    module = resnet_module(sizes.resnet_size)
    model = from_linen(module, classification())
    params, model_state = jax.jit(model.init)(jax.random.key(0), batch)  # one program, not ops
    optimizer = optax.sgd(0.1, momentum=0.9)
    precision = make_precision(sizes.resnet_precision)
    step = make_train_step(model.loss_fn, optimizer, mesh, has_aux=True, has_model_state=True,
                           precision=precision)  # fmt: skip
    state = create_train_state(jax.tree.map(jnp.copy, params), optimizer, mesh,
                               rng=jax.random.key(0), model_state=model_state,
                               precision=precision)  # fmt: skip
    hand = hand_written_resnet_step(module, optimizer, precision.compute_dtype, mesh)
    # On the mesh as the step returns them, so that its second call compiles nothing new.
    whole = NamedSharding(mesh, PartitionSpec())
    carry = (params, model_state["batch_stats"], optimizer.init(params))
    hand_carry = list(jax.device_put(jax.tree.map(jnp.copy, carry), whole))
    jdp_carry = [state]

    def hand_arm(count: int) -> None:
        value = None
        for _ in range(count):
            *carry, value = hand(*hand_carry, batch)
            hand_carry[:] = carry
        jax.block_until_ready(value)

    def jdp_arm(count: int) -> None:
        metrics = None
        for _ in range(count):
            jdp_carry[0], metrics = step(jdp_carry[0], batch)
        jax.block_until_ready(metrics)

    arms = {"hand-written": hand_arm, "jdp": jdp_arm}
    rates = interleaved_rates(arms, rounds=sizes.resnet_rounds, round_seconds=sizes.round_seconds,
                              rows=rows, multiple=1)  # fmt: skip
    count = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    result = {"rows": rows, "px": px, "size": sizes.resnet_size, "params": int(count),
              "precision": sizes.resnet_precision,
              "rates": rates, "jdp": statistics.median(rates["jdp"]),
              "hand": statistics.median(rates["hand-written"]),
              "ratio": ratios_to(rates, "hand-written")["jdp"]}  # fmt: skip
    gc.collect()
    jax.clear_caches()
    return result


# --- 4. the JPEG loader ----------------------------------------------------------------


def part_loader(sizes: Sizes, device_rate: float | None) -> dict[str, Any]:
    import pathlib

    from jdp.bench.images import decode_rates, loader_rate, write_tree
    from jdp.data.image_sources import from_images

    workers = max(1, min(8, (os.cpu_count() or 2) - 1))
    root = tempfile.mkdtemp(prefix="jdp-gpu-jpegs-")
    platforms = os.environ.get("JAX_PLATFORMS")
    # Grain's worker processes start JAX of their own: on the CPU, so that none of them
    # reaches for the accelerator this process holds.
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        size = write_tree(root, {"train": sizes.jpegs}, classes=10)
        train = os.path.join(root, "train")
        blobs = [pathlib.Path(d, n).read_bytes() for d, _, ns in sorted(os.walk(train)) for n in ns]
        decoders = decode_rates(blobs, rounds=2)
        split = from_images(train)
        batches = max(2, sizes.jpegs // sizes.jpeg_rows)
        one = loader_rate(split, batch_size=sizes.jpeg_rows, workers=0, batches=batches)
        many = loader_rate(split, batch_size=sizes.jpeg_rows, workers=workers, batches=batches)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if platforms is None:
            os.environ.pop("JAX_PLATFORMS")
        else:
            os.environ["JAX_PLATFORMS"] = platforms
    result = {"jpegs": len(blobs), "mean_kb": size / len(blobs) / 1e3, "decoders": decoders,
              "per_core": one, "workers": workers, "with_workers": many,
              "cores": os.cpu_count()}  # fmt: skip
    if device_rate:
        result["device_rate"] = device_rate
        result["cores_per_device"] = device_rate / one
    return result


# --- 5. the small-model sweep ------------------------------------------------------------


def part_sweep(sizes: Sizes, report: Report, end: float,
               on_line: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    from jdp.bench.arms import hand_loop, hand_written_step
    from jdp.bench.step import CASES, _params, case_run, first_batch
    from jdp.mesh import batch_sharded

    rows, results, skipped = sizes.sweep_rows, [], []
    for name in sizes.sweep_cases:
        if results and report.elapsed() > end:
            skipped.append(name)
            continue
        run = case_run(CASES[name], "data=1", rows)
        stacked = case_run(CASES[name], "data=1", rows, steps_per_call=4)
        batch = first_batch(run, rows)
        four = jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * 4), batch),
                              batch_sharded(run.mesh, stacked=True))  # fmt: skip
        hand = hand_written_step(run.model, run.optimizer, run.mesh, kind="one-device")
        arms = {"hand-written": hand_loop(hand, run, batch),
                "jdp": jdp_loop(run.train_step, run, batch, run.optimizer),
                "jdp, 4 steps per call": jdp_loop(stacked.train_step, run, four, run.optimizer,
                                                  per_call=4)}  # fmt: skip
        rates = interleaved_rates(arms, rounds=sizes.sweep_rounds,
                                  round_seconds=sizes.round_seconds, rows=rows)  # fmt: skip
        ratios = ratios_to(rates, "hand-written")
        opt_state = run.optimizer.init(run.state.params)
        overhead = {
            "hand-written": step_overhead(hand, (run.state.params, opt_state), batch),
            "jdp": step_overhead(run.train_step.unbounded, run.state, batch, run.train_step.lower),
        }
        results.append({"case": name, "params": _params(run), "rows": rows,
                        "rates": {arm: statistics.median(r) for arm, r in rates.items()},
                        "ratios": ratios, "overhead": overhead})  # fmt: skip
        on_line(
            f"  sweep {name} ({_params(run)}): hand-written "
            f"{results[-1]['rates']['hand-written']:,.0f} examples/s; jdp "
            f"{ratios['jdp']:.3f}x, 4 steps per call {ratios['jdp, 4 steps per call']:.3f}x"
        )
        del run, stacked, arms
        gc.collect()
    return {"cases": results, "skipped_for_budget": skipped}


def kernels(compiled_text: str) -> int:
    """The launches in a compiled program's entry computation: its fusions, custom
    calls (cuBLAS, cuDNN), copies and collectives."""
    entry = compiled_text.split("\nENTRY ", 1)[-1].split("\n}\n", 1)[0]
    launches = ("fusion(", "custom-call(", "copy(", "all-reduce(", "all-reduce-start(",
                "dynamic-update-slice(", "scatter(", "while(", "conditional(")  # fmt: skip
    return sum(1 for line in entry.splitlines() if any(f" {op}" in line for op in launches))


def step_overhead(step, first, batch, lower=None) -> dict[str, float]:
    """A step's kernels and host microseconds per call (dispatch alone, not waiting
    for it), on copies of its state: where a small model's step time goes."""
    state = jax.tree.map(jnp.copy, first)
    single = not isinstance(first, tuple)
    lower = lower or step.lower
    lowered = lower(state, batch) if single else lower(*state, batch)
    count = kernels(lowered.compile().as_text())
    times = []
    for _ in range(60):
        started = time.perf_counter()
        out = step(state, batch) if single else step(*state, batch)
        times.append(time.perf_counter() - started)
        jax.block_until_ready(out)
        state = out[0] if single else out[:-1]
    return {"kernels": count, "dispatch_us": 1e6 * statistics.median(times[10:])}


# --- 6. correctness: the accelerator against its CPU --------------------------------------


def correctness_losses(steps: int, perturbs: tuple[float, ...] = (0.0,)) -> list[list[float]]:
    """For each of ``perturbs``, the losses of ``steps`` steps of ``gpt`` small (fp32,
    XLA attention, exact fp32 matrix products) on this process's default platform,
    every initial parameter first scaled by ``1 + perturb``. One step program serves all."""
    from jdp.data.pipeline import train_batches
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.run import build

    config = TrainConfig(mesh="data=1", model="gpt", model_size="small",
                         dataset="numbers2words", batch_size=16, precision="fp32",
                         attention="xla", steps=steps, warmup_steps=2, lr=1e-3)  # fmt: skip
    runs = []
    with jax.default_matmul_precision("highest"):
        run = build(config, Console(enabled=False))
        with train_batches(run.train, run.mesh, batch_size=config.batch_size, seed=0) as loader:
            batches = [batch for _, batch in zip(range(steps), loader, strict=False)]
        for perturb in perturbs:
            state, losses = jax.tree.map(jnp.copy, run.state), []
            if perturb:
                scaled = jax.tree.map(functools.partial(jnp.multiply, 1 + perturb), state.params)
                state = state.replace(params=scaled)
            for batch in batches:
                state, metrics = run.train_step(state, batch)
                losses.append(float(metrics["loss"]))
            runs.append(losses)
    return runs


def part_correctness(steps: int) -> dict[str, Any]:
    """This platform's losses against a CPU process's, with the tolerance derived there.

    Both runs compute in fp32 with exact products (no TF32), so they differ only in
    the order of their sums: differences of a few fp32 roundings that training then
    grows. The CPU process measures that growth: its own run against the same run
    with every parameter moved by one fp32 rounding (2^-24, relative). The
    tolerance at each step is 100 times that difference (many roundings differ
    between two platforms, not one; a wrong gradient differs by orders more),
    and never below 64 roundings of the loss.
    """
    (accelerator,) = correctness_losses(steps)
    command = [sys.executable, "-m", "jdp.bench", "gpu", "--cpu-reference", str(steps)]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the CPU reference failed: {done.stderr.strip()[-400:]}")
    cpu, nudged = json.loads(done.stdout.strip().splitlines()[-1])
    eps = float(np.finfo(np.float32).eps)
    tolerance = [max(100 * abs(a - b), 64 * eps * abs(a)) for a, b in zip(cpu, nudged, strict=True)]
    differences = [abs(a - b) for a, b in zip(accelerator, cpu, strict=True)]
    within = all(d <= t for d, t in zip(differences, tolerance, strict=True))
    return {"steps": steps, "accelerator": accelerator, "cpu": cpu, "cpu_nudged": nudged,
            "tolerance": tolerance, "differences": differences, "within": within,
            "worst": max(d / t for d, t in zip(differences, tolerance, strict=True))}  # fmt: skip


# --- the table ---------------------------------------------------------------------------


def table(data: dict[str, Any]) -> list[str]:
    """The run's figures as printed at its end (and by ``python -m jdp.bench.gpu_docs``)."""
    parts, lines = data["parts"], []
    machine = parts.get("machine")
    if machine:
        v = machine["versions"]
        extra = ", ".join(f"{k} {v[k]}" for k in ("driver", "cuda", "cudnn") if k in v)
        peak = machine["peak_flops"]
        lines.append(f"{machine['kind']} ({machine['platform']}), {machine['cores']} cores; "
                     f"JAX {v['jax']}, jaxlib {v['jaxlib']}, Python {v['python']}"
                     + (f", {extra}" if extra else ""))  # fmt: skip
        lines.append(f"bf16 {machine['matmul_n']}-cube product: "
                     f"{machine['matmul_flops'] / 1e12:,.1f} TFLOP/s"
                     + (f" ({machine['matmul_flops'] / peak:.0%} of the data sheet's "
                        f"{peak / 1e12:,.0f})" if peak else ""))  # fmt: skip
    gpt = parts.get("gpt2")
    if gpt:
        lines.append(f"GPT-2 {gpt['size']}, T = {gpt['seq_len']}, {gpt['rows']} rows, "
                     f"{gpt.get('precision', 'bf16')}:")  # fmt: skip
        lines.append(
            f"  {'attention':<10}{'remat':<6}{'layers':<10}{'rows':>5}{'jdp tokens/s':>13}"
            f"{'hand tokens/s':>14}{'ratio':>8}{'MFU':>7}{'causal':>8}{'peak mem':>9}"
        )
        for index, cell in enumerate(gpt["cells"]):
            s = cell["setting"]
            layers = "unrolled" if s["unroll"] else "scanned"
            if "error" in cell:
                lines.append(
                    f"  {s['attention']:<10}{s['remat']:<6}{layers:<10}  {cell['error'][:60]}"
                )
                continue
            n = gpt_numbers(cell)
            mfu = f"{n['mfu']:>7.1%}{n['mfu_causal']:>8.1%}" if "mfu" in n else f"{'-':>7}{'-':>8}"
            # The process's peak so far: a cell's own only for the first.
            memory = f"{'-':>9}"
            if index == 0 and cell.get("peak_bytes"):
                memory = f"{cell['peak_bytes'] / 2**30:>7.1f}GB"
            rows = cell["cell"]["batch_size"]
            lines.append(f"  {s['attention']:<10}{s['remat']:<6}{layers:<10}{rows:>5}"
                         f"{n['jdp']:>13,.0f}{n['hand']:>14,.0f}{n['ratio']:>7.3f}x{mfu}"
                         f"{memory}")  # fmt: skip
        for s in gpt["skipped_for_budget"]:
            lines.append(f"  {_setting(s)}: not run (budget)")
    resnet = parts.get("resnet50")
    if resnet and "error" not in resnet:
        lines.append(f"ResNet-50 {resnet['size']}, {resnet['px']} px synthetic, {resnet['rows']} "
                     f"rows, {resnet.get('precision', 'bf16')}: jdp {resnet['jdp']:,.0f} "
                     f"images/s, hand-written {resnet['hand']:,.0f}, "
                     f"{resnet['ratio']:.3f}x")  # fmt: skip
    loader = parts.get("loader")
    if loader and "error" not in loader:
        need = (
            f"; one device at {loader['device_rate']:,.0f} images/s needs "
            f"{loader['cores_per_device']:.1f} such cores"
            if "device_rate" in loader
            else ""
        )
        lines.append(f"JPEG loader ({loader['jpegs']} JPEGs of ImageNet's sizes, "
                     f"{loader['mean_kb']:.0f} KB): {loader['per_core']:,.0f} images/s on one "
                     f"core, {loader['with_workers']:,.0f} with {loader['workers']} workers"
                     f"{need}")  # fmt: skip
    sweep = parts.get("sweep")
    if sweep and "error" not in sweep:
        for case in sweep["cases"]:
            r = case["ratios"]
            o = case.get("overhead")
            where = (f"; kernels {o['hand-written']['kernels']} vs {o['jdp']['kernels']}, host "
                     f"{o['hand-written']['dispatch_us']:.0f} vs {o['jdp']['dispatch_us']:.0f} "
                     "us a call" if o else "")  # fmt: skip
            lines.append(f"sweep {case['case']} ({case['params']}), {case['rows']} rows: "
                         f"hand-written {case['rates']['hand-written']:,.0f} examples/s; jdp "
                         f"{r['jdp']:.3f}x, 4 steps per call {r['jdp, 4 steps per call']:.3f}x"
                         f"{where}")  # fmt: skip
    check = parts.get("correctness")
    if check and "error" not in check:
        lines.append(
            f"correctness: {check['steps']} steps of gpt small, fp32: "
            f"{'within' if check['within'] else 'OUTSIDE'} the derived tolerance "
            f"(worst step at {check['worst']:.2f} of it; last loss "
            f"{check['accelerator'][-1]:.6f} here, {check['cpu'][-1]:.6f} on the CPU)"
        )
    for part, result in parts.items():
        if "error" in result:
            lines.append(f"{part}: FAILED: {result['error'][:300]}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=float, default=480.0, help="wall seconds for all parts")
    parser.add_argument("--out", default="jdp-gpu.json", help="the JSON file the parts land in")
    parser.add_argument("--smoke", action="store_true",
                        help="every part at toy sizes (on a CPU too), in seconds")  # fmt: skip
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from these")
    parser.add_argument(
        "--gpt2-share",
        type=float,
        default=GPT2_SHARE,
        help="the share of the budget within which GPT-2 cells may start",
    )
    parser.add_argument(
        "--gpt-rows",
        type=int,
        default=0,
        help="GPT-2 rows per device (0: 32 on devices of 40 GB or more, else 16)",
    )
    from jdp.bench import bundle

    bundle.add_arguments(parser)
    # One process's CPU reference for the correctness part, printed as JSON.
    parser.add_argument("--cpu-reference", type=int, default=0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from jdp.bench import bundle
    from jdp.bench.common import names

    if args.bundle or args.resolve_only:
        return bundle.run(args)
    if args.cpu_reference:
        eps = float(np.finfo(np.float32).eps) / 2  # one rounding, relative
        steps = args.cpu_reference
        print(json.dumps(correctness_losses(steps, (0.0, eps))))
        return 0
    parts = names(args.parts)
    for part in parts:
        if part not in PARTS:
            raise UsageError(f"--parts: unknown part {part!r}; choose from: {', '.join(PARTS)}")
    if args.budget <= 0:
        raise UsageError("--budget must be positive (seconds)")
    # Before JAX starts: the process may take 92% of an accelerator's memory, not 75%.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    sizes = dataclasses.replace(SMOKE if args.smoke else Sizes(), **(
        {"gpt_rows": args.gpt_rows} if args.gpt_rows else {}))  # fmt: skip
    if not args.smoke and jax.default_backend() == "cpu":
        print(
            "jdp.bench gpu: no accelerator here (JAX's platform is cpu); the full sizes "
            "would take hours: run it where one is, or pass --smoke",
            file=sys.stderr,
        )
        return 2
    report = Report(args.out, args.budget, args.smoke)

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"jdp.bench gpu: parts {', '.join(parts)}; budget {args.budget:.0f} s; -> {args.out}")
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
                result = part_correctness(sizes.correctness_steps)
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"[:1000]}
        result["seconds"] = round(time.monotonic() - started, 1)
        report.land(part, result)
        if part not in ("gpt2", "sweep") or "error" in result:  # those said each row as it came
            for line in table({"parts": {part: result}}):
                say(line)
    say(f"--- jdp.bench gpu, {report.elapsed():.0f} s, {report.data['date']} ---")
    for line in table(report.data):
        say(line)
    failed = [part for part, result in report.data["parts"].items() if "error" in result]
    return 1 if failed else 0
