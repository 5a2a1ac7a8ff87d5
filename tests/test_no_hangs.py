"""No fault leaves a process behind or asleep: a checkpoint directory that turns
unwritable or vanishes mid-run ends the run with exit 2 in seconds."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import subprocess_env

# A run that stops when a save fails takes under 5 s here; Orbax's threads, when
# waited for, held the process for their 300 s timeout. 60 s tells the two apart on
# a loaded machine.
EXIT_SECONDS = 60


def _train_until_checkpoints(directory, count=2):
    """A long ``jdp.train`` run saving every 200 steps, once ``count`` checkpoints exist."""
    process = subprocess.Popen(
        [
            sys.executable,
            *"-m jdp.train --mesh data=2 --steps 1000000 --ckpt-every 200".split(),
            "--ckpt-dir",
            str(directory),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        steps = [name for name in os.listdir(directory) if name.isdigit()]
        if len(steps) >= count:
            return process
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"no {count} checkpoints in 180 s: {process.communicate()}")


def _immutable(path, on: bool) -> bool:
    flag = "+i" if on else "-i"
    result = subprocess.run(["chattr", flag, str(path)], capture_output=True)
    return result.returncode == 0


FAULTS = {
    # EPERM for any write, root's included (what a read-only mount does too).
    "made immutable": lambda path: _immutable(path, True),
    "removed": lambda path: _remove(path),
}


def _remove(path) -> bool:
    """Gone at once: ``rm -r`` races the run's writes, and may leave the directory there."""
    gone = path.rename(f"{path}.gone")
    shutil.rmtree(gone)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_checkpoint_directory_that_fails_mid_run_ends_it_in_seconds(tmp_path, fault):
    directory = tmp_path / "run"
    directory.mkdir()
    process = _train_until_checkpoints(directory)
    try:
        if not FAULTS[fault](directory):
            process.kill()
            pytest.skip("chattr +i does not work on this filesystem or as this user")
        faulted = time.monotonic()
        try:
            _, err = process.communicate(timeout=EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"still running {EXIT_SECONDS} s after the directory was {fault}")
        took = time.monotonic() - faulted
    finally:
        if directory.exists():
            _immutable(directory, False)
    assert process.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(EXPECTED[fault].format(directory=re.escape(str(directory))), last), last
    assert took < EXIT_SECONDS


EXPECTED = {
    "made immutable": r"jdp.train: error: could not write a checkpoint in {directory} \(.*"
    r"Operation not permitted.*\); the last complete checkpoint is step \d+; make it "
    r"writable again \(mount, permissions, chattr -i\), or choose another --ckpt-dir",
    "removed": r"jdp.train: error: {directory} was removed or replaced while this run wrote "
    r"to it; nothing more is saved there: restore it, or resume from another --ckpt-dir",
}


# The workers of a killed launcher save and end in about 2 s here; 30 s on a loaded
# machine. Before, process 0 died at its next progress line (a broken pipe to the dead
# launcher's relay), unsaved, and process 1 waited in a collective until the stall
# watchdog ended it, 61 s on.
LAUNCHER_GONE_SECONDS = 30


@pytest.mark.slow
def test_workers_die_with_a_launcher_killed_with_sigkill(tmp_path):
    import signal
    import threading

    directory = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable,
            *"-m jdp.launch --nproc 2 --devices-per-process 1 --".split(),
            sys.executable,
            *"-m jdp.train --mesh data=2 --batch-size 16 --steps 600".split(),
            *"--ckpt-every 50 --ckpt-dir".split(),
            str(directory),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    pids, lines = [], []

    def read():
        for line in launcher.stdout:
            lines.append(line)
            if found := re.search(r"started process \d of 2 \(pid (\d+)\)", line):
                pids.append(int(found.group(1)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not (directory.exists() and [n for n in os.listdir(directory) if n.isdigit()]):
        assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    assert len(pids) == 2, lines
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    reader.join(timeout=10)
    launcher.stdout.close()
    # The workers get SIGTERM from the kernel: they save at one step and end.
    deadline = time.monotonic() + LAUNCHER_GONE_SECONDS
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their launcher by {LAUNCHER_GONE_SECONDS} s"
    # The directory's lock went with them: a new run may take it.
    from jdp.distributed.lock import DirectoryLock

    lock = DirectoryLock(str(directory))
    lock.acquire()
    lock.release()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
