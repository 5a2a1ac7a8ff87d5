"""``python -m jdp.bench resume``: how long a resumed run takes to its first step, reading
its compiled programs from the compilation cache against compiling them again.

For each model a run of 4 steps saves at steps 2 and 4 into a checkpoint
directory with its compilation cache (``--compile-cache auto``); step 4 is then
removed, so the directory is a run stopped at step 2. Each round copies it afresh
to the path it was written at (JAX keys the programs by the cache's path too) and
resumes it with the same command twice, once as it is and once with
``--compile-cache off`` (the order alternating), each a process of its own on one
CPU device; a resume's time is from starting the process to its line "compiled and
ran the first call", which comes once the first step after the resume is done. The
process is then stopped: its evaluation and save are not what this measures.
Each arm's figure is its median over the rounds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from jdp.bench.common import names, report_lines
from jdp.errors import UsageError
from jdp.mesh_spec import child_environment
from jdp.training.compile_cache import DIRNAME

# Seconds one run may take to its first step: gpt's compilation takes about 15 s on the
# 2-core development machine.
RUN_TIMEOUT = 300
FIRST_CALL = "jdp: compiled and ran the first call"
DATASETS = {"gpt": "python_stdlib"}  # models that read text; the others digits' images


def add_arguments(parser) -> None:
    parser.add_argument("--models", default="gpt,resnet20", help="comma-separated models")
    parser.add_argument("--rounds", type=int, default=3, help="resumes of each kind per model")


def run(args) -> int | None:
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds}")
    bench_resume(names(args.models), args.rounds, on_line=lambda line: print(line, flush=True))
    return 0


def bench_resume(
    models: list[str], rounds: int, *, on_line: Callable[[str], None] = print
) -> list[str]:
    """The table, a row per model: seconds to the first step of a resume, cached and not."""
    lines, emit = report_lines(on_line)
    emit(
        f"jdp.bench resume: seconds from a resumed run's start to its first step, its "
        f"programs read from CKPT_DIR/{DIRNAME} or compiled (--compile-cache off); "
        f"median of {rounds} rounds, each run a process on one CPU device"
    )
    emit(f"  {'model':<12}{'cached s':>10}{'compiling s':>13}{'ratio':>8}  read")
    with tempfile.TemporaryDirectory(prefix="jdp-bench-resume-") as scratch:
        for model in models:
            # JAX keys the programs by the cache's path too (it hands XLA the directory for
            # GPU autotuning): each resume runs in the directory the first run used.
            where, stopped = os.path.join(scratch, model), os.path.join(scratch, f"{model}-2")
            _setup(model, where)
            os.rename(where, stopped)
            seconds: dict[str, list[float]] = {"cached": [], "compiling": []}
            said = ""
            for round_ in range(rounds):
                arms = ["cached", "compiling"] if round_ % 2 == 0 else ["compiling", "cached"]
                for arm in arms:
                    shutil.rmtree(where, ignore_errors=True)
                    shutil.copytree(stopped, where)
                    off = ["--compile-cache", "off"] if arm == "compiling" else []
                    took, line = _first_step(_command(model, where) + off)
                    seconds[arm].append(took)
                    if arm == "cached":
                        said = line.partition("(")[2].partition(" read")[0] or "nothing"
            cached, compiling = (statistics.median(seconds[arm]) for arm in seconds)
            emit(
                f"  {model:<12}{cached:>10.1f}{compiling:>13.1f}{compiling / cached:>7.2f}x  {said}"
            )
    return lines


def _command(model: str, ckpt_dir: str) -> list[str]:
    return [
        sys.executable,
        *"-m jdp.train --model".split(),
        model,
        "--dataset",
        DATASETS.get(model, "digits"),
        *"--mesh data=1 --steps 4 --ckpt-every 2 --warmup-steps 1".split(),
        "--ckpt-dir",
        ckpt_dir,
    ]


def _environment() -> dict[str, str]:
    # No cache of yours (it would take the place of CKPT_DIR/compile_cache), no device count.
    env = child_environment()
    for cache in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(cache, None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _setup(model: str, ckpt_dir: str) -> None:
    """A run of ``model`` stopped at step 2: its checkpoint and its compilation cache."""
    try:
        result = subprocess.run(
            _command(model, ckpt_dir),
            capture_output=True,
            text=True,
            timeout=4 * RUN_TIMEOUT,
            env=_environment(),
        )
    except subprocess.TimeoutExpired:
        raise UsageError(f"the first run of {model} took over {4 * RUN_TIMEOUT} s") from None
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if line.strip()]
        raise UsageError(f"the first run of {model} failed: {said[-1] if said else '?'}")
    shutil.rmtree(os.path.join(ckpt_dir, "4"))


def _first_step(command: list[str]) -> tuple[float, str]:
    """Seconds from starting ``command`` to its first-call line, and the line."""
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_environment()
    )
    try:
        for line in process.stdout:
            if line.startswith(FIRST_CALL):
                return time.perf_counter() - started, line.strip()
            if time.perf_counter() - started > RUN_TIMEOUT:
                break
    finally:
        process.kill()
        process.wait()
    raise UsageError(f"{' '.join(command[1:4])} printed no first-call line")
