"""``python -m jdp.bench corpus``: training on a token corpus larger than memory allows
loading, memory-mapped: the process's memory growth and the loop's input waiting.

It writes a corpus of ``--gigabytes`` of uint16 tokens as llm.c shards (drawn
from a seed; all of it the training split, so no evaluation), then trains
``gpt`` on it once per mesh, each run in a process of its own (the devices a
mesh asks for are set before JAX starts). Each run reports its resident memory
(``VmRSS`` of ``/proc/self/status``) before the run, after its first step (the
step compiled: XLA's compiler, not the data, makes the process's peak) and the
most over the steps after it, read at each step: the growth from reading the
corpus. At the end, the file-backed part (``RssFile``: the corpus's pages
mapped in, which the kernel may drop at any time) apart from the anonymous
part (``RssAnon``: what the process itself holds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from jdp.data.formats import write_llmc, write_meta
from jdp.mesh_spec import child_environment

SHARD_TOKENS = 100_000_000  # llm.c's shard size
# A small language model's vocabulary: the logits of GPT-2's 50,257 at batch 16 and
# sequence 256 would take 0.8 GB by themselves, and this measures the data's memory.
VOCAB = 8192


def write_corpus(directory: str, gigabytes: float, seed: int = 0) -> int:
    """Writes ``gigabytes`` of uint16 tokens as llm.c shards and ``tokens.json``; returns
    the token count. Drawn a shard at a time: the writer never holds the corpus either."""
    total = int(gigabytes * 1e9 / 2)
    rng = np.random.default_rng(seed)
    written, number = 0, 0
    while written < total:
        count = min(SHARD_TOKENS, total - written)
        tokens = rng.integers(0, VOCAB, size=count, dtype=np.uint16)
        write_llmc(os.path.join(directory, f"bench_train_{number:06d}.bin"), tokens)
        written += len(tokens)
        number += 1
    write_meta(directory, {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer": None})
    return written


def status() -> dict[str, int]:
    """This process's memory figures from ``/proc/self/status``, in bytes."""
    figures = {}
    with open("/proc/self/status") as file:
        for line in file:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                figures[name] = int(value.split()[0]) * 1024
    return figures


def measure(args: argparse.Namespace) -> None:
    """One run (in a process of its own): trains, prints a JSON line of its figures: the
    memory before the run, after its first step (compiled, the loader started) and the
    most it held during the steps after that (read each step)."""
    from jdp.actions import Callback
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.loop import fit

    config = TrainConfig(
        model="gpt",
        dataset=f"tokens:{args.dir}",
        seq_len=args.seq_len,
        mesh=args.mesh,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup_steps=args.steps // 10,
        eval_every=0,
    )
    figures: dict = {"before": status()}

    def sample(progress) -> None:
        now = status()
        if progress.step == 1:
            figures["compiled"] = now
        figures["most"] = max(figures.get("most", 0), now["VmRSS"])

    result = fit(config, console=Console(enabled=False), callbacks=[Callback(sample, every=1)])
    figures |= {
        "after": status(),
        "input_wait": result.input_wait,
        "tokens_per_sec": result.tokens_per_sec,
    }
    print(json.dumps(figures))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gigabytes", type=float, default=2.2, help="corpus size on disk (GB)")
    parser.add_argument("--meshes", default="data=1,data=8", help="meshes to train on, ;-separated")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--dir", help="where to write the corpus (default: a temporary directory)")
    parser.add_argument("--mesh", help=argparse.SUPPRESS)  # one measured run's (internal)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """0, or 1 where a mesh's run failed (its row says why)."""
    if args.measure:
        return measure(args) or 0
    failed = False
    directory = args.dir or tempfile.mkdtemp(prefix="jdp-corpus-")
    try:
        os.makedirs(directory, exist_ok=True)
        tokens = write_corpus(directory, args.gigabytes)
        size = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))
        print(
            f"jdp.bench corpus: {tokens:,} tokens in {size / 2**30:.2f} GiB of llm.c shards; gpt "
            f"small, --seq-len {args.seq_len}, global batch {args.batch_size}, {args.steps} steps"
        )
        for mesh in args.meshes.replace(";", ",").split(","):
            row = _one_run(args, directory, mesh.strip())
            failed |= ": failed (exit " in row
            print(row)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return int(failed)


def _one_run(args: argparse.Namespace, directory: str, mesh: str) -> str:
    command = [
        sys.executable,
        *"-m jdp.bench corpus --measure --dir".split(),
        directory,
        "--mesh",
        mesh,
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=child_environment(), check=False
    )
    if done.returncode:
        return f"  mesh {mesh}: failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    before, compiled, after = figures["before"], figures["compiled"], figures["after"]
    mib = 2**20
    return (
        f"  mesh {mesh:<7} resident {before['VmRSS'] / mib:,.0f} MiB before the run, "
        f"{compiled['VmRSS'] / mib:,.0f} MiB after step 1 (compiled), at most "
        f"{figures['most'] / mib:,.0f} MiB over the steps after it (growth "
        f"{(figures['most'] - compiled['VmRSS']) / mib:,.0f} MiB); process peak "
        f"{after['VmHWM'] / mib:,.0f} MiB; at the end anonymous {after['RssAnon'] / mib:,.0f}"
        f" MiB, file-backed {after['RssFile'] / mib:,.0f} MiB; input waiting "
        f"{figures['input_wait']:.1%}; {figures['tokens_per_sec']:,.0f} tokens/s"
    )
