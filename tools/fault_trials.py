"""The new classes of ``python -m tools.faults``: bad data, a stolen lock, a launcher
killed, a checkpoint directory that fails mid-run. Each trial draws its fault at
random (seeded) and sorts the outcome; the counts that must be 0 are the silent
results, the lost runs and the hangs.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from jdp.distributed.process_groups import alive, in_groups
from jdp.mesh_spec import child_environment

# What a trial waits for a process that should end before it calls it hung: a run that
# stops on a fault takes seconds; one left waiting on a failed save, 300.
HANG_SECONDS = 90
# A launcher kill's run: killed within 1.5 s of its first save (step 50; the default
# MLP runs about 100 steps a second on the 2-core machine), then finished by the same
# command.
LAUNCHER_STEPS = 600
# Its processes get SIGTERM from the kernel, save at one step and end: about 2 s here,
# 30 s on a loaded machine (61 s when process 0 died unsaved at a line to the dead
# launcher, and process 1 waited for it until the stall watchdog).
LAUNCHER_GONE_SECONDS = 30
_RUN = ["--mesh", "data=2", "--batch-size", "16", "--warmup-steps", "2"]


def _env() -> dict[str, str]:
    return child_environment()


def _train(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess | None:
    """``python -m jdp.train FLAGS``; None when it did not end within ``timeout``."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "jdp.train", *flags],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None


def _one_error_line(result: subprocess.CompletedProcess) -> bool:
    lines = result.stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("jdp.train: error: ")


# Each bad input: what it does to a good npz's arrays (x_train, y_train, x_test, y_test).
DATA_FAULTS: dict[str, Callable[[dict, random.Random], None]] = {
    "negative train label": lambda a, r: a["y_train"].__setitem__(r.randrange(64), -1),
    "test label outside the classes": lambda a, r: a["y_test"].__setitem__(r.randrange(16), 7),
    "NaN in train inputs": lambda a, r: a["x_train"].__setitem__((r.randrange(64), 0), np.nan),
    "inf in test inputs": lambda a, r: a["x_test"].__setitem__((r.randrange(16), 1), np.inf),
    "empty test split": lambda a, r: a.update(x_test=a["x_test"][:0], y_test=a["y_test"][:0]),
    "test inputs of another shape": lambda a, r: a.update(x_test=np.zeros((16, 5), np.float32)),
    "labels that are ids": lambda a, r: a["y_train"].__setitem__(0, 10**8),
    "inputs without labels": lambda a, r: a.pop("y_test"),
}


def data_faults(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """A good npz spoilt by one random bad input, trained on: "named" (one line, exit 2),
    "silent" (trained on it), "hang" or "other"."""
    rng, outcomes = random.Random(seed), Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-data-faults-") as root:
        for trial in range(trials):
            fault = rng.choice(sorted(DATA_FAULTS))
            arrays = {
                "x_train": np.random.default_rng(trial).normal(size=(64, 4)),
                "y_train": np.arange(64) % 3,
                "x_test": np.ones((16, 4)),
                "y_test": np.arange(16) % 3,
            }
            arrays["x_train"] = arrays["x_train"].astype(np.float32)
            arrays["x_test"] = arrays["x_test"].astype(np.float32)
            DATA_FAULTS[fault](arrays, rng)
            file = os.path.join(root, f"trial-{trial}.npz")
            np.savez(file, **arrays)
            result = _train(
                "--dataset", f"npz:{file}", *_RUN, "--steps", "20", timeout=HANG_SECONDS
            )
            if result is None:
                verdict = "hang"
            elif result.returncode == 2 and _one_error_line(result):
                verdict = "named"
            else:
                verdict = "silent" if result.returncode == 0 else "other"
            outcomes[verdict] += 1
            emit(f"  data fault {trial + 1} ({fault}): {verdict}")
    return outcomes


def _checkpoints(directory: str) -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir(directory) if name.isdigit())
    except OSError:
        return []


def _start_until_saved(flags: list[str], directory: str, rng: random.Random) -> subprocess.Popen:
    """A run started, once it has saved a checkpoint and then run a random while longer."""
    process = subprocess.Popen(
        [sys.executable, "-m", "jdp.train", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    _until_saved(process, directory, rng)
    return process


def _until_saved(process: subprocess.Popen, directory: str, rng: random.Random) -> None:
    """Returns once ``directory`` holds a checkpoint (or the process ended, or 240 s
    passed), and a random while more: the fault's moment."""
    deadline = time.monotonic() + 240
    while not _checkpoints(directory) and process.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))


def _ended(process: subprocess.Popen, timeout: float) -> tuple[str, str] | None:
    """``(stdout, stderr)`` once it ends; None (killed) when it did not within ``timeout``."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return None


def lock_thefts(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """A live run's lock file deleted, the command run again (or with another --lr):
    "kept" (the second refused, the first finished whole), "two writers", "lost" (the
    first did not finish) or "hang"."""
    rng, outcomes = random.Random(seed), Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-lock-thefts-") as root:
        for trial in range(trials):
            directory = os.path.join(root, f"trial-{trial}")
            flags = [*_RUN, "--steps", "1500", "--ckpt-every", "50", "--ckpt-dir", directory]
            first = _start_until_saved(flags, directory, rng)
            with contextlib.suppress(FileNotFoundError):  # the run may have ended
                os.remove(os.path.join(directory, "jdp.lock"))
            second = _train(*flags, *rng.choice([[], ["--lr", "1e-2"]]), timeout=HANG_SECONDS)
            ended = _ended(first, 600)
            if second is None or ended is None:
                verdict = "hang"
            elif second.returncode == 0:
                verdict = "two writers"
            elif first.returncode != 0 or _checkpoints(directory)[-1:] != [1500]:
                verdict = "lost"
            else:
                verdict = "kept"
            outcomes[verdict] += 1
            emit(f"  lock theft {trial + 1}: {verdict}")
    return outcomes


def directory_failures(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """A live run's checkpoint directory made immutable (``chattr +i``: EPERM, as a
    read-only mount) or removed: "stopped" (exit 2, one line), "hang" or "other"."""
    rng, outcomes = random.Random(seed), Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-unwritable-") as root:
        for trial in range(trials):
            directory = os.path.join(root, f"trial-{trial}")
            flags = [*_RUN, "--steps", "1000000", "--ckpt-every", "100", "--ckpt-dir", directory]
            fault = rng.choice(["immutable", "removed"])
            process = _start_until_saved(flags, directory, rng)
            if fault == "immutable" and not _chattr(directory, "+i"):
                fault = "removed"  # this filesystem or user cannot
            if fault == "removed":  # at once: rm -r races the run's writes, and may leave it
                os.rename(directory, f"{directory}.gone")
                shutil.rmtree(f"{directory}.gone", ignore_errors=True)
            ended = _ended(process, HANG_SECONDS)
            if fault == "immutable":
                _chattr(directory, "-i")
            if ended is None:
                verdict = "hang"
            else:
                lines = ended[1].strip().splitlines()
                stopped = process.returncode == 2 and lines and "jdp.train: error: " in lines[-1]
                verdict = "stopped" if stopped else "other"
            outcomes[verdict] += 1
            emit(f"  directory {fault} {trial + 1}: {verdict}")
    return outcomes


def _chattr(path: str, flag: str) -> bool:
    try:
        return subprocess.run(["chattr", flag, path], capture_output=True).returncode == 0
    except OSError:
        return False


def launcher_kills(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """``jdp.launch`` of 2 processes killed with SIGKILL at a random moment: "ended" (its
    processes gone within `LAUNCHER_GONE_SECONDS` and the same command then
    finishes the run), "late" (gone only within the hang limit: one process died unsaved
    and another waited for it in a collective until the stall watchdog), "orphaned" (a
    process left running) or "lost" (the run could not finish)."""
    rng, outcomes = random.Random(seed), Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-launcher-kills-") as root:
        for trial in range(trials):
            directory = os.path.join(root, f"trial-{trial}")
            command = [
                sys.executable,
                *"-m jdp.launch --nproc 2 --devices-per-process 1 --".split(),
                sys.executable,
                "-m",
                "jdp.train",
                *_RUN,
                "--steps",
                str(LAUNCHER_STEPS),
                *"--ckpt-every 50 --ckpt-dir".split(),
                directory,
            ]
            launcher, pids = _launch(command)
            _until_saved(launcher, directory, rng)
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
            killed = time.monotonic()
            alive = _wait_gone(pids, HANG_SECONDS)
            seconds = time.monotonic() - killed
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            finished = subprocess.run(
                command, capture_output=True, text=True, env=_env(), timeout=600
            )
            if alive:
                verdict = "orphaned"
            elif finished.returncode != 0 or _checkpoints(directory)[-1:] != [LAUNCHER_STEPS]:
                verdict = "lost"
            else:
                verdict = "ended" if seconds <= LAUNCHER_GONE_SECONDS else "late"
            outcomes[verdict] += 1
            emit(
                f"  launcher kill {trial + 1}: {verdict} (its processes gone {seconds:.1f} s "
                "after it)"
            )
    return outcomes


def _launch(command: list[str]) -> tuple[subprocess.Popen, list[int]]:
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    pids: list[int] = []

    def read() -> None:
        for line in launcher.stdout:
            if found := re.search(r"started process \d+ of \d+ \(pid (\d+)\)", line):
                pids.append(int(found.group(1)))
        launcher.stdout.close()

    threading.Thread(target=read, daemon=True).start()
    return launcher, pids


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The processes of ``pids`` still alive after ``timeout`` seconds (zombies are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def wrapped_stops(trials: int, seed: int, emit: Callable[[str], None]) -> Counter:
    """``jdp.launch`` of 2 processes whose command is a wrapper script (a shell that runs
    the trainer as its child), sent SIGTERM at a random moment: "saved" (the launcher
    ended with 143, as a stop a signal asked, and the trainers saved a checkpoint after
    the signal), "orphaned" (a
    trainer still running once the launcher ended), "lost" (no save) or "hang"."""
    rng, outcomes = random.Random(seed), Counter()
    with tempfile.TemporaryDirectory(prefix="jdp-wrapped-stops-") as root:
        for trial in range(trials):
            directory = os.path.join(root, f"trial-{trial}")
            command = [
                sys.executable,
                *"-m jdp.launch --nproc 2 --devices-per-process 1 -- sh -c".split(),
                '"$@"; exit $?',
                "wrapper",
                sys.executable,
                "-m",
                "jdp.train",
                *_RUN,
                *"--steps 100000 --ckpt-every 50 --ckpt-dir".split(),
                directory,
            ]
            launcher, shells = _launch(command)
            _until_saved(launcher, directory, rng)
            before = _checkpoints(directory)
            launcher.send_signal(signal.SIGTERM)
            try:
                code = launcher.wait(timeout=HANG_SECONDS)
            except subprocess.TimeoutExpired:
                launcher.kill()
                code = None
            left = in_groups(shells)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            verdict = (
                "hang"
                if code is None
                else "orphaned"
                if left
                else "saved"
                if code == 143 and _checkpoints(directory)[-1:] > before[-1:]
                else "lost"
            )
            outcomes[verdict] += 1
            emit(f"  wrapped stop {trial + 1}: {verdict}")
    return outcomes
