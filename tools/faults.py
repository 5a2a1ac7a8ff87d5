"""``python -m tools.faults``: random kill -9 trials and random bit flips in checkpoints,
and the classes of `tools.fault_trials` (bad data, a stolen lock, a killed launcher,
a checkpoint directory failing mid-run).

Kills: a run is killed with SIGKILL at a random moment (any step, during a save
or between saves), resumed with the same command, and its final checkpoint
compared bitwise with an uninterrupted run's. Flips: one random bit of the
latest checkpoint (every byte of its files as likely; or of its array data
files alone) is flipped, the directory restored, and the outcome sorted: the
damage detected (the checkpoint set aside and the one before it restored),
unaffected (the bit was in bytes nothing reads, and the
restored state equals the saved one bit for bit), or restored silently with
other values. The last count is the one that must be 0.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from jdp.bench.common import report_lines
from jdp.mesh_spec import child_environment
from jdp.tool import command
from jdp.training.run import setup_devices
from tools import command_line, fault_trials, tool_faults

# A run long enough for kills to land anywhere in it, short enough for many trials.
KILL_RUN = "--mesh data=2 --steps 60 --warmup-steps 5 --batch-size 64 --ckpt-every 5"


def _tree_bytes(tree) -> dict[str, np.ndarray]:
    from jdp.checkpoint.digest import leaf_name

    return {
        leaf_name(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]) for name in a
    )


def _flip_state():
    """The state the flip trials save: an MLP's worth of parameters under Adam, on 8 devices."""
    from jdp.mesh import make_mesh
    from jdp.state import create_train_state

    mesh = make_mesh(f"data={jax.device_count()}")
    keys = jax.random.split(jax.random.key(0), 3)
    params = {
        "dense_0": {"kernel": jax.random.normal(keys[0], (64, 256)), "bias": np.zeros(256)},
        "dense_1": {"kernel": jax.random.normal(keys[1], (256, 10)), "bias": np.zeros(10)},
    }
    return create_train_state(params, optax.adam(1e-3), mesh, rng=keys[2])


def bit_flips(trials: int, seed: int, *, data_only: bool = False) -> Counter:
    """Flips one random bit per trial in the latest of two checkpoints; counts the outcomes.

    ``data_only``: only in the array data files (OCDBT's ``d/`` files), not the
    metadata and record beside them.
    """
    from jdp.checkpoint import Checkpointer

    first = _flip_state()
    second = first.replace(
        step=first.step + 1, params=jax.tree.map(lambda x: x * 1.5 + 1, first.params)
    )
    expected = _tree_bytes(second)
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-flips-") as root:
        base = os.path.join(root, "base")
        with Checkpointer(base) as checkpoints:
            checkpoints.save(first, loader_step=1)
            checkpoints.save(second, loader_step=2)
        latest = os.path.join(base, str(int(second.step)))
        files = sorted(  # by size: the random names of OCDBT's files change between runs
            (
                os.path.getsize(os.path.join(where, name)),
                os.path.relpath(os.path.join(where, name), base),
            )
            for where, _, names in os.walk(latest)
            for name in names
            if not data_only or os.path.basename(where) == "d"
        )
        total = sum(size for size, _ in files)
        for trial in range(trials):
            directory = os.path.join(root, f"trial-{trial}")  # a new path: no cached reads
            shutil.copytree(base, directory)
            offset = rng.randrange(total)  # a byte of the checkpoint, each as likely
            index = 0
            while offset >= files[index][0]:
                offset -= files[index][0]
                index += 1
            with open(os.path.join(directory, files[index][1]), "r+b") as handle:
                handle.seek(offset)
                byte = handle.read(1)[0] ^ (1 << rng.randrange(8))
                handle.seek(offset)
                handle.write(bytes([byte]))
            with Checkpointer(directory) as checkpoints:
                restored = checkpoints.restore(first)
            if restored is None or int(restored[1]["step"]) != int(second.step):
                outcomes["detected"] += 1
            elif _bitwise_equal(_tree_bytes(restored[0]), expected):
                outcomes["unaffected"] += 1
            else:
                outcomes["silent"] += 1
            shutil.rmtree(directory)
    return outcomes


def _final_arrays(directory: str, steps: int) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    path = os.path.join(directory, str(steps), "state")
    return _tree_bytes(ocp.StandardCheckpointer().restore(path))


def _train(directory: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "jdp.train", *shlex.split(KILL_RUN), "--ckpt-dir", directory]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def kills(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """Kills a run at a random moment, resumes it; counts bitwise-equal final checkpoints."""
    env = child_environment()
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    steps = int(shlex.split(KILL_RUN)[shlex.split(KILL_RUN).index("--steps") + 1])
    with tempfile.TemporaryDirectory(prefix="jdp-kills-") as root:
        reference_dir = os.path.join(root, "reference")
        started = time.perf_counter()
        reference = _train(reference_dir, env)
        if reference.returncode != 0:
            raise RuntimeError(f"the reference run failed: {reference.stderr[-2000:]}")
        duration = time.perf_counter() - started
        expected = _final_arrays(reference_dir, steps)
        for trial in range(trials):
            directory = os.path.join(root, f"trial-{trial}")
            command = [sys.executable, "-m", "jdp.train", *shlex.split(KILL_RUN)]
            process = subprocess.Popen(
                [*command, "--ckpt-dir", directory],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            time.sleep(rng.uniform(0.1, duration))
            process.send_signal(signal.SIGKILL)
            process.wait()
            resumed = _train(directory, env)
            equal = resumed.returncode == 0 and _bitwise_equal(
                _final_arrays(directory, steps), expected
            )
            outcomes["bitwise-equal" if equal else "different"] += 1
            emit(f"  kill {trial + 1}: {'bitwise-equal' if equal else 'DIFFERENT'}")
            shutil.rmtree(directory, ignore_errors=True)
    return outcomes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=20, help="kill -9 trials (0: none)")
    parser.add_argument("--flips", type=int, default=20, help="bit-flip trials (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices")
    for flag, count, what in NEW_CLASSES:
        parser.add_argument(flag, type=int, default=count, help=f"{what} trials (0: none)")


# The classes of fault_trials: flag, default trials, what a trial does, its function,
# and the verdicts it counts (the last ones must stay 0).
NEW_CLASSES = (
    ("--data-faults", 8, "bad-data"),
    ("--lock-thefts", 3, "lock-theft"),
    ("--directory-failures", 6, "unwritable or removed checkpoint directory"),
    ("--launcher-kills", 3, "launcher kill -9"),
    ("--wrapped-stops", 2, "SIGTERM to jdp.launch of a wrapper script"),
    ("--tool-faults", 12, "bad path given to a tool"),
)
_REPORTS = {
    "data_faults": ("bad data trained on", fault_trials.data_faults,
                    ("named", "silent", "hang", "other")),
    "lock_thefts": ("lock file deleted under a live run, the command run again",
                    fault_trials.lock_thefts, ("kept", "two writers", "lost", "hang")),
    "directory_failures": ("checkpoint directory made immutable or removed mid-run",
                           fault_trials.directory_failures, ("stopped", "hang", "other")),
    "launcher_kills": ("jdp.launch of 2 processes killed with SIGKILL",
                       fault_trials.launcher_kills, ("ended", "late", "orphaned", "lost")),
    "wrapped_stops": ("jdp.launch of 2 wrapper scripts (a shell running the trainer) sent "
                      "SIGTERM", fault_trials.wrapped_stops,
                      ("saved", "orphaned", "lost", "hang")),
    "tool_faults": ("a python -m jdp.* tool's path argument given a bad path (missing, a "
                    "loop of links, the wrong kind, empty, cut short, unwritable, not "
                    "UTF-8)", tool_faults.tool_faults, ("one line", "traceback", "other")),
}  # fmt: skip


def bench_faults(
    *,
    kill_trials: int,
    flip_trials: int,
    seed: int,
    on_line: Callable[[str], None] = print,
    **classes: int,
) -> list[str]:
    """Every kind of trial (``classes``: trials of `fault_trials`' by name, e.g.
    ``data_faults=8``); the report's lines, each passed to ``on_line`` as it comes."""
    lines, emit = report_lines(on_line)
    for name, trials in classes.items():
        if trials:
            what, trial, verdicts = _REPORTS[name]
            emit(f"{what}:")
            counts = trial(trials, seed, emit)
            shown = " ".join(
                f"{verdict.replace(' ', '-')}={counts[verdict]}" for verdict in verdicts
            )
            emit(f"{name.replace('_', ' ')}: trials={trials} {shown}")
    for data_only, where in ((False, "anywhere in a checkpoint"), (True, "in its array data")):
        if flip_trials:
            flips = bit_flips(flip_trials, seed, data_only=data_only)
            emit(
                f"bit flips {where}: trials={flip_trials} detected={flips['detected']} "
                f"unaffected={flips['unaffected']} silent={flips['silent']}"
            )
    if kill_trials:
        emit(f"kill -9 trials ({KILL_RUN}):")
        result = kills(kill_trials, seed, emit)
        emit(
            f"kills: trials={kill_trials} bitwise-equal resumes={result['bitwise-equal']} "
            f"different={result['different']}"
        )
    return lines


def run(args: argparse.Namespace) -> None:
    # The flips save on 8 devices, and the kill trials' checkpoints (2 devices) are
    # read back here: on a CPU, simulated before JAX starts.
    setup_devices("data=8")
    on_line = lambda line: print(line, flush=True)  # noqa: E731
    classes = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
        for flag, _, _ in NEW_CLASSES
    }
    bench_faults(
        kill_trials=args.kills, flip_trials=args.flips, seed=args.seed, on_line=on_line, **classes
    )


@command("tools.faults")
def main(argv: Sequence[str] | None = None) -> int:
    return command_line("tools.faults", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
