"""The lock holds for the whole run: a deleted lock file never lets a second run in, nor
lets it clean up the owner's save in flight; a lock another process made stops the owner."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import optax
import pytest
from helpers import run_cli, subprocess_env

import jdp
from jdp.checkpoint import Checkpointer
from jdp.distributed import lock
from jdp.distributed.lock import LOCK_NAME, DirectoryLock


@pytest.mark.slow
def test_a_deleted_lock_file_lets_no_second_run_in(tmp_path):
    flags = ["--mesh", "data=1", "--steps", "6000", "--ckpt-every", "100", "--ckpt-dir", tmp_path]
    first = subprocess.Popen(
        [sys.executable, "-m", "jdp.train", *map(str, flags)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while not [name for name in os.listdir(tmp_path) if name.isdigit()]:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run saved nothing"
            time.sleep(0.05)
        (tmp_path / LOCK_NAME).unlink()
        # The same command again, and one with another --lr: both refused, before either
        # cleans anything up in the directory (a save in flight included).
        for more in ([], ["--lr", "1e-2"]):
            second = run_cli(*flags, *more, timeout=120)
            assert second.returncode == 2, second.stderr
            assert "is in use by another run" in second.stderr.strip().splitlines()[-1]
        # The first run goes on holding the directory: its save on SIGTERM writes the lock
        # file again (as any save after the deletion does) and lands.
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.communicate()
    assert first.returncode == 143, err
    assert f"jdp: {tmp_path / LOCK_NAME} was deleted under this run; written again" in err
    stopped = int(re.search(r"^jdp\.train: SIGTERM at step (\d+); checkpoint saved", out, re.M)[1])
    with Checkpointer(tmp_path) as checkpoints:
        assert checkpoints.steps()[-1] == stopped


def test_where_directories_cannot_be_locked_a_lock_taken_by_another_stops_the_owner(
    tmp_path, monkeypatch, mesh8
):
    monkeypatch.setattr(lock, "_lock_folder", lambda directory: None)  # some network filesystems
    owner = Checkpointer(tmp_path)
    try:
        (tmp_path / LOCK_NAME).unlink()
        intruder = DirectoryLock(str(tmp_path))
        intruder.acquire()  # the lock file alone protected the directory, and it was gone
        with pytest.raises(
            jdp.UsageError,
            match=r"another run took .* \(pid \d+ on .*\) while this "
            r"one held it \(its lock file was deleted\); this run stops without",
        ):
            owner.save(
                jdp.create_train_state({"w": jnp.ones((2,))}, optax.sgd(0.1), mesh8), loader_step=0
            )
        intruder.release()
    finally:
        owner.close()


def test_a_lock_file_that_is_a_directory_is_named(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(jdp.UsageError, match=rf"{LOCK_NAME} is a directory, where jdp keeps the "):
        DirectoryLock(str(tmp_path)).acquire()


def test_a_removed_directory_stops_the_owner_before_it_writes(tmp_path):
    held = DirectoryLock(str(tmp_path / "run"))
    held.acquire()
    (tmp_path / "run" / LOCK_NAME).unlink()
    held.check()  # a deleted lock file is written again
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    (tmp_path / "run" / LOCK_NAME).unlink()
    (tmp_path / "run").rmdir()
    (tmp_path / "run").mkdir()  # another directory where it was
    with pytest.raises(jdp.UsageError, match=r"run was removed or replaced while this run wrote"):
        held.check()
    held.release()


# Another run, as far as a lock can tell: a process that holds DIR's lock until killed.
_HOLD = """import sys, time
from jdp.distributed.lock import DirectoryLock
held = DirectoryLock(sys.argv[1])
held.acquire()
print("held", flush=True)
time.sleep(300)
"""


def test_no_directory_of_a_run_lies_inside_a_live_runs(tmp_path):
    """A second run's --ckpt-dir inside a live run's, or its --log-dir equal to or inside
    it, would interleave files with that run's: each is one line, exit 2."""
    live = tmp_path / "live"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(live)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        inside = f"is inside {live}, which is in use by another run (pid {holder.pid} on "
        for flags, said in (
            (["--ckpt-dir", live / "sub"], f"--ckpt-dir {live / 'sub'} {inside}"),
            (["--log-dir", live / "logs"], f"--log-dir {live / 'logs'} {inside}"),
            (["--log-dir", live], f"{live} is in use by another run (pid {holder.pid} on "),
        ):
            result = run_cli("--mesh", "data=1", "--steps", "2", *flags)
            assert result.returncode == 2, result.stderr
            (line,) = result.stderr.strip().splitlines()
            assert said in line, line
        assert not (live / "sub").exists() and not (live / "logs").exists()
        with pytest.raises(jdp.UsageError, match="which is in use by another run"):
            DirectoryLock(str(live / "deeper" / "still")).acquire()  # the library's too
    finally:
        holder.kill()
        holder.communicate()
    lock.refuse_a_live_runs(str(live / "sub"), "--ckpt-dir")  # the run gone: nothing refused


@pytest.mark.slow
def test_two_runs_never_share_a_log_dir(tmp_path):
    """A live run holds its --log-dir (without a --ckpt-dir too): a second run given it is
    one line, exit 2, and the first one's metrics are its own."""
    logs = tmp_path / "logs"
    first = subprocess.Popen(
        [sys.executable, *"-m jdp.train --mesh data=1 --steps 100000 --log-dir".split(), str(logs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while not (logs / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = run_cli("--mesh", "data=1", "--steps", "2", "--log-dir", logs)
        assert second.returncode == 2, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert f"{logs} is in use by another run (pid {first.pid} on " in line, line
        assert line.endswith("wait for it to end, or choose another --log-dir"), line
    finally:
        first.kill()
        first.communicate()
