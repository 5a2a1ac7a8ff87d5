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
        [sys.executable, "-m", "jdp.train", "--mesh", "data=2", "--steps", "1000000",
         "--ckpt-every", "200", "--ckpt-dir", str(directory)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )  # fmt: skip
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
    "removed": lambda path: shutil.rmtree(path) or True,
}


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
