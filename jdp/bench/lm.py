"""``python -m jdp.bench lm``: the ``gpt`` language model's train step, jdp's against one
written by hand.

Tokens/s, MFU and compile time of the built-in ``gpt`` model's training step at
the size and sequence length the flags give, for jdp's step as ``python -m
jdp.train`` builds it and for the step one writes with JAX and Optax alone in
nanoGPT's structure (`hand_written_lm_step`): the same `GPT` module, the same
AdamW, the same initial parameters and the same batch. Each cell (a mesh, a
``--remat``, an ``--attention``) runs in a process of its own with the devices
its mesh asks for, as `jdp.bench.step`'s cells do. In it the two arms run one
batch again and again (no input cost) in interleaved rounds
(`jdp.bench.arms.interleaved_rates`); the ratio is the median of the per-round
ratios, so the machine's drift between rounds cancels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
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

from jdp.bench import kernels
from jdp.bench.arms import interleaved_rates, jdp_loop, optimization_level, ratios_to, with_options
from jdp.bench.lm_cell import Cell, cells, resolve
from jdp.bench.lm_cell import add_arguments as add_arguments  # `jdp.bench`'s flags for lm
from jdp.bench.lm_hand import HandWritten, hand_lm_loop, hand_written_lm_step
from jdp.bench.step import first_batch
from jdp.errors import UsageError
from jdp.models.registry import LM_SIZES, MODELS, VOCAB_MULTIPLE
from jdp.models.transformer import GPT, flops_per_token
from jdp.precision import PRECISIONS
from jdp.report.console import Console
from jdp.report.throughput import peak_flops
from jdp.step.contract import bounded, train_loss
from jdp.training.config import TrainConfig
from jdp.training.run import Run, build, setup_devices

# Both arms' optimizer: AdamW at nanoGPT's GPT-2 learning rate and weight decay,
# held constant (a schedule changes no step's cost), with jdp's default betas (nanoGPT's
# b2 = 0.95 is --beta2's; no beta changes a step's cost), decaying the weight matrices
# and embeddings.
LR, WEIGHT_DECAY, B1, B2 = 6e-4, 0.1, 0.9, 0.999
ARMS = ("hand-written", "jdp")
PROFILE_STEPS = 6  # steps of each arm traced for --profile
CELL_TIMEOUT = 3600  # seconds; a default CPU cell takes about a minute


def synthetic_corpus(directory: str, cell: Cell) -> str:
    """``tokens:PATH`` of uniform random tokens (seed 0): one batch's windows."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cell.vocab_size, cell.batch_size * cell.seq_len + 1)
    path = f"{directory}/synthetic.npy"
    np.save(path, tokens.astype(np.uint16 if cell.vocab_size <= 2**16 else np.uint32))
    return f"tokens:{path}"


def jdp_run(cell: Cell, dataset: str) -> Run:
    """jdp's run, as ``python -m jdp.train`` builds it from the same flags."""
    config = TrainConfig(
        mesh=cell.mesh,
        model="gpt",
        model_size=cell.model_size,
        dataset=dataset,
        seq_len=cell.seq_len,
        vocab_size=cell.vocab_size,
        batch_size=cell.batch_size,
        remat=cell.remat,
        attention=cell.attention,
        precision=cell.precision,
        optimizer="adamw",
        lr=LR,
        schedule="constant",
        warmup_steps=0,
        weight_decay=WEIGHT_DECAY,
        unroll_layers=cell.unroll,
        loss_chunks=cell.loss_chunks,
        fp8=cell.fp8,
    )
    return build(config, Console(enabled=False))


def gpt_module(cell: Cell, vocab_size: int) -> GPT:
    """`GPT` at the cell's size, its vocabulary padded as the published sizes pad it."""
    multiple = VOCAB_MULTIPLE if cell.model_size in LM_SIZES else 1
    options = dict(MODELS["gpt"].sizes[cell.model_size], max_len=cell.seq_len)
    return GPT(
        vocab_size=-(-vocab_size // multiple) * multiple,
        remat=cell.remat,
        attention=cell.attention,
        unroll=cell.unroll,
        fp8=cell.fp8,
        **options,
    )


def first_losses(
    run: Run, step, hand: HandWritten, params, tokens, dtype
) -> tuple[dict[str, Any], dict[str, float]]:
    """Both arms' loss in their first step, from the same parameters on the same batch,
    and the tolerance within which they must agree; and each arm's seconds in that
    first call (trace, lower, compile and one step).

    The arms draw different dropout masks (jdp one key per replica and step), so
    the losses differ by dropout's noise: the tolerance is 5 standard deviations of
    the difference of two draws (sqrt 2 times the loss's, estimated over 8 dropout
    keys), and at least the compute dtype's rounding of the loss.
    """
    state, opt_state = jax.tree.map(jnp.copy, run.state), hand.start(params)
    started = time.perf_counter()
    _, metrics = step(state, {"tokens": tokens})
    jdp = float(metrics["loss"])
    first_s = {"jdp": time.perf_counter() - started}
    started = time.perf_counter()
    first = hand.step(jax.tree.map(jnp.copy, params), opt_state, hand.key(0), tokens)
    hand_loss = float(first[3])
    first_s["hand-written"] = time.perf_counter() - started
    # The draws reuse the step's program (its loss is the first step's): a program of
    # the loss alone was one more compile a cell.
    draws = [
        float(
            hand.step(jax.tree.map(jnp.copy, params), hand.start(params), hand.key(seed), tokens)[3]
        )
        for seed in range(8)
    ]
    tolerance = max(
        5 * math.sqrt(2) * statistics.stdev(draws), float(jnp.finfo(dtype).eps) * abs(hand_loss)
    )
    check = {
        "jdp": jdp,
        "hand-written": hand_loss,
        "tolerance": tolerance,
        "agree": abs(jdp - hand_loss) <= tolerance,
    }
    return check, first_s


def measure_cell(
    cell: Cell, peers: dict[str, Callable[[int], None]] | None = None
) -> dict[str, Any]:
    """One cell in this process (its devices set up for ``cell.mesh`` already): each
    arm's tokens/s per round and compile time, and the first-loss check. ``peers``:
    more arms (`jdp.bench.peers`), raced in the same rounds; their rates land in
    ``rates`` beside the two arms'."""
    with optimization_level(cell.optimization):
        return _measure_cell(cell, peers or {})


def _measure_cell(cell: Cell, peers: dict[str, Callable[[int], None]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        run = jdp_run(cell, cell.data or synthetic_corpus(scratch, cell))
        tokens = first_batch(run, cell.batch_size)["tokens"]
    module = gpt_module(cell, run.train.vocab_size)
    hand = hand_written_lm_step(
        module, run.mesh, PRECISIONS[cell.precision], lr=LR, weight_decay=WEIGHT_DECAY, b1=B1, b2=B2
    )
    init_rng, _ = jax.random.split(jax.random.key(run.config.seed))  # as jdp's run splits it
    params = hand.init(init_rng, tokens[:1])
    step = run.train_step
    if cell.xla:  # both arms' step programs under the same options, the rest as they were
        step = bounded(with_options(run.train_step.lower, cell.xla), train_loss)
        hand = hand._replace(step=with_options(hand.step.lower, cell.xla))
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(run.state.params), strict=True)
    same = all(np.array_equal(a, b) for a, b in pairs)
    batch = {"tokens": tokens}
    check, first_s = first_losses(run, step, hand, params, tokens, PRECISIONS[cell.precision])
    cpu: dict[str, list[float]] = {}
    arms = {
        "hand-written": _on_cpu_time(hand_lm_loop(hand, params, tokens), cpu, "hand-written"),
        "jdp": _on_cpu_time(jdp_loop(step, run, batch, run.optimizer), cpu, "jdp"),
    }
    rates = interleaved_rates(
        arms | peers,
        rounds=cell.rounds,
        round_seconds=0.0,
        rows=cell.batch_size * cell.seq_len,
        multiple=cell.steps,
    )
    # The first two calls of each arm settle (`interleaved_rates`).
    cpu_ms = {arm: 1e3 * statistics.median(cpu[arm][2:]) / cell.steps for arm in ARMS}
    # Compile time: the first call's seconds less one steady step's (each arm's program
    # is compiled once, by that call; the loops then reuse it).
    tokens_per_step = cell.batch_size * cell.seq_len
    compile_s = {
        arm: max(0.0, first_s[arm] - tokens_per_step / statistics.median(rates[arm]))
        for arm in ARMS
    }
    count = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    per_token = flops_per_token(
        count,
        layers=module.layers,
        width=module.width,
        seq_len=cell.seq_len,
        max_len=module.max_len,
    )
    kind = jax.devices()[0].device_kind
    traced = kernels.trace_arms(arms, PROFILE_STEPS, cell.profile) if cell.profile else {}
    return {"kernels": traced} | {
        "cell": dataclasses.asdict(cell),
        "kind": kind,
        "devices": run.mesh.devices.size,
        "params": int(count),
        "vocab": module.vocab_size,
        "flops_per_token": per_token,
        "peak": peak_flops(kind, cell.precision),
        "compile_s": compile_s,
        "check": check | {"same_params": same},
        "rates": rates,
        "cpu_ms": cpu_ms,
    }


def _on_cpu_time(
    loop: Callable[[int], None], seconds: dict[str, list[float]], arm: str
) -> Callable[[int], None]:
    """``loop`` that also appends the CPU seconds this process spent in each call (every
    thread's: on a CPU the devices' work, on an accelerator the host's) to ``seconds[arm]``.

    On the CPU it tells work from waiting: two steps of equal CPU time per step that
    take different wall time differ in how their threads wait or get the cores."""

    def timed(count: int) -> None:
        started = time.process_time()
        loop(count)
        seconds.setdefault(arm, []).append(time.process_time() - started)

    return timed


def _cell_in_own_process(
    args: argparse.Namespace, mesh: str, remat: str, attention: str
) -> dict[str, Any]:
    """`measure_cell`'s result, from ``python -m jdp.bench lm --cell`` started for it."""
    flags = {
        "--mesh": mesh,
        "--remat": remat,
        "--attention": attention,
        "--model-size": args.model_size,
        "--seq-len": args.seq_len,
        "--batch-size": args.batch_size,
        "--precision": args.precision,
        "--vocab-size": args.vocab_size,
        "--data": args.data,
        "--rounds": args.rounds,
        "--steps": args.steps,
        "--profile": args.profile,
    }
    command = [sys.executable, "-m", "jdp.bench", "lm", "--cell"]
    command += [part for flag, value in flags.items() if value for part in (flag, str(value))]
    name = f"the cell --mesh {mesh} --remat {remat} --attention {attention}"
    try:  # a hung cell must not hang the sweep
        result = subprocess.run(command, capture_output=True, text=True, timeout=CELL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise UsageError(f"{name} took over {CELL_TIMEOUT} s and was stopped") from None
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in said if re.match(r"[\w.]+(Error|Exception): ", line)]
        reason = (errors or said or [f"exit code {result.returncode}"])[-1]
        raise UsageError(f"{name} failed: {reason.removeprefix('jdp.bench: error: ')}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def header(result: dict[str, Any]) -> list[str]:
    """The lines before the table: what ran, and the FLOPs per token MFU counts."""
    cell = result["cell"]
    data = cell["data"] or "synthetic tokens (uniform, seed 0)"
    return [
        f"jdp.bench lm: gpt {cell['model_size']} ({result['params'] / 1e6:.2f}M parameters, "
        f"vocabulary {result['vocab']:,}), T = {cell['seq_len']}, {cell['precision']}, AdamW "
        f"(lr {LR:g} constant, weight decay {WEIGHT_DECAY:g}), {data}; {cell['rounds']} "
        f"interleaved rounds of {cell['steps']} steps per arm on one batch: median tokens/s, "
        "median per-round ratio (and its quartiles), median CPU ms/step (the process's CPU "
        "time, all threads); each cell in a process with its mesh's devices; "
        f"{result['kind']}",
        f"model FLOPs per token: {result['flops_per_token'] / 1e6:,.2f}M, PaLM's count "
        "(appendix B: 6N + 12 L T d, N the parameters but the position table); MFU is '-' "
        "where jdp knows no peak FLOP/s for the device (a CPU)",
        f"  {'mesh':<8}{'batch':>6}  {'remat':<6}{'attention':<11}{'arm':<14}{'tokens/s':>11}"
        f"{'ms/step':>9}{'CPU ms':>8}{'MFU':>7}{'compile s':>11}{'ratio':>9}  quartiles",
    ]


def rows(result: dict[str, Any]) -> list[str]:
    """A cell's rows, one per arm, and its first-loss check."""
    cell, rates, lines = result["cell"], result["rates"], []
    ratios = ratios_to(rates, "hand-written")
    for arm in ARMS:
        rate = statistics.median(rates[arm])
        mfu = "-"
        if result["peak"]:
            mfu = f"{result['flops_per_token'] * rate / (result['peak'] * result['devices']):.1%}"
        per_round = [a / b for a, b in zip(rates[arm], rates["hand-written"], strict=True)]
        low, high = _quartiles(per_round)
        lines.append(
            f"  {cell['mesh']:<8}{cell['batch_size']:>6}  {cell['remat']:<6}"
            f"{cell['attention']:<11}{arm:<14}{rate:>11,.0f}"
            f"{1e3 * cell['batch_size'] * cell['seq_len'] / rate:>9.1f}"
            f"{result['cpu_ms'][arm]:>8.0f}{mfu:>7}"
            f"{result['compile_s'][arm]:>11.1f}{ratios[arm]:>8.3f}x  {low:.3f}-{high:.3f}"
        )
    check = result["check"]
    lines.append(
        f"    first step's loss, same parameters and batch: jdp {check['jdp']:.5f}, "
        f"hand-written {check['hand-written']:.5f}: "
        f"{'agree' if check['agree'] else 'DISAGREE'} within {check['tolerance']:.5f} "
        "(dropout's noise); same initial parameters: " + ("yes" if check["same_params"] else "NO")
    )
    return lines + (kernels.compare(result["kernels"]) if result.get("kernels") else [])


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def run(args: argparse.Namespace) -> None:
    sweep = cells(args)
    if args.cell:
        ((mesh, remat, attention),) = sweep
        setup_devices(mesh)
        print(json.dumps(measure_cell(resolve(args, mesh, remat, attention))))
        return
    for index, (mesh, remat, attention) in enumerate(sweep):
        result = _cell_in_own_process(args, mesh, remat, attention)
        for line in (header(result) if index == 0 else []) + rows(result):
            print(line, flush=True)
