"""The parts of ``python -m jdp.bench gpu`` that train models on the accelerator: the
machine's matrix-product rate, GPT-2 124M's cells (jdp's step against a hand-written one,
`jdp.bench.lm`'s) and ResNet-50 against a hand-written step."""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jdp.bench import gpu_plan, kernels, peers
from jdp.bench.arms import interleaved_rates, ratios_to, with_options
from jdp.bench.gpu_table import gpt_line, peer_lines, setting_text
from jdp.bench.levers import LEVERS
from jdp.mesh_spec import DATA_AXIS
from jdp.report.throughput import peak_flops

# A part's ``sizes`` is a `jdp.bench.gpu.Sizes`, its ``report`` the run's `jdp.bench.gpu.Report`.
Sizes = Report = Any

# XLA's settings for GPUs that JAX documents for performance, each a cell of its own:
# the latency-hiding scheduler ("GPU performance tips"; NVIDIA's JAX containers turn it
# on), per program as XLA_FLAGS would set it for all; and XLA's effort level O1
# (JAX_OPTIMIZATION_LEVEL), which turns on a set of XLA:GPU's performance options at
# once (openxla.org/xla/effort_levels).
COMPILER_SETTINGS = (
    {"xla": {"xla_gpu_enable_latency_hiding_scheduler": True}},
    {"optimization": "O1"},
)
TUNED = {"attention": "cudnn", "remat": "none", "unroll": False}
# In the order of what they tell a user, as cells stop starting past --gpt2-share of the
# budget: on an H100 the scanned cells took about 33 s each and the unrolled one 197 s
# (its compile; it is the fastest, the gpt2-124m recipe's), so the default budget ends
# the part after it and the last two keep the figures of the run that measured them.
GPT2_CELLS = (
    TUNED,
    *(TUNED | setting for setting in COMPILER_SETTINGS),
    TUNED | {"unroll": True},
    TUNED | {"attention": "xla", "rows": 0.5},
    TUNED | {"remat": "dots"},
    # The loss over chunks of the logits (`jdp.models.head`), and with it the rows that
    # fill an 80 GB card: llm.c trains 124M with 64 rows of 1,024 tokens on an H100.
    TUNED | {"loss_chunks": 8},
    TUNED | {"loss_chunks": 8, "rows": 2},
    # The layers' products in FP8 (`jdp.models.fp8`): nanochat saw no gain at its
    # smallest size, so it is measured before it is anyone's default.
    TUNED | {"fp8": True},
)
# Rows per device at T = 1024: llm.c trains 124M with 64 on an 80 GB H100. jdp's 32
# take 63 GB with XLA's attention, which keeps the (B, H, T, T) scores of every layer
# (measured on an H100, 2026-11-27): that cell runs half as many ("rows": 0.5).
GPT2_ROWS, GPT2_ROWS_SMALL_DEVICE = 32, 16
RESNET_ROWS = 256  # NVIDIA's ResNet-50 mixed-precision batch per A100/H100
# --- the machine ------------------------------------------------------------------


def versions() -> dict[str, str]:
    import jaxlib

    found = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }
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
    return {
        "platform": jax.default_backend(),
        "kind": device.device_kind,
        "devices": jax.device_count(),
        "cores": os.cpu_count(),
        "versions": versions(),
        "matmul_n": sizes.matmul,
        "matmul_flops": rate,
        "peak_flops": peak_flops(device.device_kind, "bf16"),
    }


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


def gpt_cells(smoke: bool = False, picks: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """The GPT-2 cells this platform can run (``picks``: those of these numbers, from 1
    in `GPT2_CELLS`' order): cuDNN's attention is a GPU kernel. The smoke run's first
    cell turns every compiler setting at once (XLA:CPU takes XLA:GPU's options), so
    that their path runs in every smoke run at no extra compile."""
    cells = [dict(GPT2_CELLS[n - 1]) for n in picks] or [dict(c) for c in GPT2_CELLS]
    if jax.default_backend() != "gpu":
        cells = [cell | {"attention": "xla"} for cell in cells if cell["attention"] == "cudnn"]
    if smoke and cells:  # and the loss in chunks, and FP8
        turned = {key: value for s in COMPILER_SETTINGS for key, value in s.items()}
        cells[0] = cells[0] | turned | {"loss_chunks": 8, "fp8": True}
    return cells


def part_gpt2(
    sizes: Sizes, report: Report, share_end: float, on_line: Callable[[str], None]
) -> dict[str, Any]:
    from jdp.bench import lm, lm_cell

    rows = gpt_rows(sizes)  # on one device: every part's mesh is data=1
    cells, skipped = [], []
    chosen = gpt_cells(sizes.smoke, sizes.gpt_picks)[: sizes.gpt_cells]
    ran = {
        "cells": cells,
        "skipped_for_budget": skipped,
        "rows": rows,
        "seq_len": sizes.seq_len,
        "size": sizes.gpt_size,
        "precision": sizes.gpt_precision,
    }
    for index, setting in enumerate(chosen):
        if index and report.elapsed() > share_end:
            skipped.append(setting)
            continue
        options = {key: value for key, value in setting.items() if key != "rows"}
        batch = max(1, int(rows * setting.get("rows", 1)))
        cell = lm_cell.Cell(
            mesh="data=1",
            model_size=sizes.gpt_size,
            seq_len=sizes.seq_len,
            batch_size=batch,
            precision=sizes.gpt_precision,
            vocab_size=sizes.gpt_vocab or lm_cell.GPT2_VOCAB,
            data="",
            rounds=sizes.gpt_rounds,
            steps=sizes.gpt_steps,
            **options,
        )
        started = time.monotonic()
        module = lm.gpt_module(cell, cell.vocab_size)
        planning = gpu_plan.start(cell, module.vocab_size, jax.devices()[0].device_kind)
        # The PyTorch peers race the first cell, the tuned default.
        racing = [arm for arm in sizes.peers if arm in peers.ARMS["gpt2"]] if not index else []
        spec = gpt2_peer_spec(cell, sizes) if racing else {}
        try:
            with (
                tempfile.TemporaryDirectory() as traces,
                peers.racing(racing, lambda arm, spec=spec: spec) as (built, failed),
            ):
                if sizes.gpt_profile:
                    cell = dataclasses.replace(cell, profile=traces)
                result = lm.measure_cell(cell, built)
                if racing:
                    result["peers"] = peers.results(built, failed, result["rates"])
        except Exception as error:
            gpu_plan.read(planning)
            cells.append({"setting": setting, "error": f"{type(error).__name__}: {error}"[:500]})
            on_line(f"  gpt2 {setting_text(setting)}: {cells[-1]['error'][:200]}")
            continue
        result["flops_per_token_causal"] = causal_flops_per_token(
            result["flops_per_token"], module.layers, module.width, cell.seq_len
        )
        result["setting"], result["seconds"] = setting, round(time.monotonic() - started, 1)
        stats = jax.devices()[0].memory_stats() or {}
        result["peak_bytes"] = stats.get("peak_bytes_in_use")
        result["bytes_limit"] = stats.get("bytes_limit")
        # The peak is the process's so far: a cell's own where it rose above every cell's before.
        before = max((done.get("peak_bytes") or 0 for done in cells), default=0)
        result["own_peak"] = (result["peak_bytes"] or 0) > before
        result["plan"] = gpu_plan.read(planning)
        cells.append(result)
        on_line(gpt_line(result))
        if gpu_plan.line(result):
            on_line(gpu_plan.line(result))
        for line in peer_lines(result.get("peers", {}), "tokens", result):
            on_line(line)
        for line in kernels.compare(result["kernels"]) if result["kernels"] else []:
            on_line(f"    {line}")
        report.land("gpt2", ran | {"partial": True})  # a run cut short keeps its cells
        gc.collect()
        jax.clear_caches()
    return ran


def gpt2_peer_spec(cell, sizes: Sizes) -> dict[str, Any]:
    """What a PyTorch peer trains for a GPT-2 cell: the same rows, tokens, layers,
    widths and dropout, and the cell's AdamW; nanoGPT pads the vocabulary to a multiple
    of 64 as its train.py does (GPT-2's 50,257 to 50,304)."""
    from jdp.bench import lm

    module = lm.gpt_module(cell, cell.vocab_size)
    return {
        "rows": cell.batch_size,
        "seq_len": cell.seq_len,
        "vocab": cell.vocab_size,
        "nanogpt_vocab": -(-cell.vocab_size // 64) * 64,
        "layers": module.layers,
        "width": module.width,
        "heads": module.heads,
        "hidden": module.hidden,
        "dropout": module.dropout,
        "lr": lm.LR,
        "weight_decay": lm.WEIGHT_DECAY,
        "betas": [lm.B1, lm.B2],
        "precision": cell.precision,
        "smoke": sizes.smoke,
        "nanogpt": sizes.nanogpt,
    }


# --- 3. ResNet-50 ------------------------------------------------------------------


# The smoke run's ResNet: ResNet-50's kinds of layers (the ImageNet stem, bottleneck
# blocks, a strided stage's projection) with one narrow block in each of two stages,
# to compile in seconds on a CPU (four stages took 2.7 s more of the smoke run).
TOY_RESNET = {"stages": (1, 1), "widths": (8, 8), "bottleneck": True, "imagenet_stem": True}


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
        logits, updated = module.apply(
            {"params": cast, "batch_stats": stats},
            batch["image"].astype(dtype),
            train=True,
            mutable=["batch_stats"],
        )
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
    mapped = jax.shard_map(
        replica, mesh=mesh, in_specs=(whole, whole, whole, rows), out_specs=whole
    )
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
    host = {
        "image": rng.normal(size=(rows, px, px, 3)).astype(np.float32),
        "label": rng.integers(0, 1000, rows).astype(np.int32),
    }
    batch = shard_batch(host, mesh)
    module = resnet_module(sizes.resnet_size)
    model = from_linen(module, classification())
    params, model_state = jax.jit(model.init)(jax.random.key(0), batch)  # one program, not ops
    optimizer = optax.sgd(0.1, momentum=0.9)
    precision = make_precision(sizes.resnet_precision)
    step = make_train_step(
        model.loss_fn, optimizer, mesh, has_aux=True, has_model_state=True, precision=precision
    )

    def fresh_state():  # each jdp arm's own: the step donates it
        return create_train_state(
            jax.tree.map(jnp.copy, params),
            optimizer,
            mesh,
            rng=jax.random.key(0),
            model_state=model_state,
            precision=precision,
        )

    hand = hand_written_resnet_step(module, optimizer, precision.compute_dtype, mesh)
    arms = {
        "hand-written": _hand_resnet_arm(hand, mesh, params, model_state, optimizer, batch),
        "jdp": _step_arm(step, fresh_state(), batch),
    }
    for lever in LEVERS["resnet50"] if "resnet50" in sizes.levers else ():
        program = with_options(step.lower, lever.options)
        arms[f"jdp, {lever.name}"] = _step_arm(program, fresh_state(), batch)
    racing = [arm for arm in sizes.peers if arm in peers.ARMS["resnet50"]]
    # torchvision's ResNet-50 at the same rows and pixels, SGD as the hand-written step's.
    spec = {
        "rows": rows,
        "px": px,
        "lr": 0.1,
        "momentum": 0.9,
        "precision": sizes.resnet_precision,
        "smoke": sizes.smoke,
    }
    with peers.racing(racing, lambda arm: spec) as (built, failed):
        rates = interleaved_rates(
            arms | built,
            rounds=sizes.resnet_rounds,
            round_seconds=sizes.round_seconds,
            rows=rows,
            multiple=1,
        )
        raced = peers.results(built, failed, rates)
    count = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    result = {
        "rows": rows,
        "px": px,
        "size": sizes.resnet_size,
        "params": int(count),
        "precision": sizes.resnet_precision,
        "rates": rates,
        "jdp": statistics.median(rates["jdp"]),
        "hand": statistics.median(rates["hand-written"]),
        "ratio": ratios_to(rates, "hand-written")["jdp"],
    }
    if racing:
        result["peers"] = raced
    if "resnet50" in sizes.levers:
        result["levers"] = {lever.name: lever.source for lever in LEVERS["resnet50"]}
    gc.collect()
    jax.clear_caches()
    return result


def _hand_resnet_arm(hand, mesh, params, model_state, optimizer, batch) -> Callable[[int], None]:
    """``count -> None``: ``count`` calls of the hand-written ResNet step, going on from
    the last."""
    # On the mesh as the step returns them, so that its second call compiles nothing new.
    whole = NamedSharding(mesh, PartitionSpec())
    carry = (params, model_state["batch_stats"], optimizer.init(params))
    hand_carry = list(jax.device_put(jax.tree.map(jnp.copy, carry), whole))

    def arm(count: int) -> None:
        value = None
        for _ in range(count):
            *carry, value = hand(*hand_carry, batch)
            hand_carry[:] = carry
        jax.block_until_ready(value)

    return arm


def _step_arm(step, state, batch) -> Callable[[int], None]:
    """``count -> None``: ``count`` calls of ``step`` on ``batch``, going on from the last."""
    carry = [state]

    def arm(count: int) -> None:
        metrics = None
        for _ in range(count):
            carry[0], metrics = step(carry[0], batch)
        jax.block_until_ready(metrics)

    return arm
