"""Elastic restarts (``jdp.launch --max-restarts K --min-nproc M``): a process killed with
SIGKILL mid-run, or while a checkpoint is being written, and the launcher starts the
group again from the last complete checkpoint; the run finishes with the parameters
of one that never failed (bitwise on the same processes; to float32 rounding when it
goes on with fewer). Real runs: processes on loopback, JAX's distributed runtime."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from closeness import assert_drift_within
from helpers import alive, assert_bitwise_equal, launched_pids, loader_workers, subprocess_env

from jdp.checkpoint import load_params
from jdp.launch import launch

STEPS = 300
TRAIN = [
    sys.executable,
    *"-m jdp.train --mesh data=-1 --steps".split(),
    str(STEPS),
    *"--ckpt-every 50 --eval-every 0 --log-every 20".split(),
]
# Seconds a run's processes may take to exit after its summary line (Orbax's and the
# distributed runtime's threads), and the launcher to start (its imports: JAX, Orbax,
# Grain), on a loaded 2-core machine: outside the ledger's wall.
EXIT_SECONDS = 10.0
# Process 1 exits at once once this file exists: a process that cannot come back.
FAILS_AGAIN = (
    "import os, sys\n"
    "if os.environ['JDP_PROCESS_ID'] == '1' and os.path.exists(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
# Process 1 sleeps inside a callback of its own at step 130, on the run's first start only
# (sys.argv[1] is made then): the others go on into step 251's all-reduce and wait there.
STALLS_IN_A_CALLBACK = (
    "import os, sys, time\n"
    "from jdp.training.flags import parse_flags\n"
    "from jdp.training.loop import fit\n"
    "def hang_once(progress):\n"
    "    if (progress.step == 130 and os.environ['JDP_PROCESS_ID'] == '1'\n"
    "            and not os.path.exists(sys.argv[1])):\n"
    "        open(sys.argv[1], 'w').close()\n"
    "        time.sleep(3600)\n"
    "flags = sys.argv[sys.argv.index('jdp.train') + 1:]\n"
    "fit(parse_flags([*flags, '--stall-timeout', sys.argv[2]]), callbacks=[hang_once])\n"
)
# A stall timeout far above this small model's steps and batch reads (milliseconds) on a
# loaded 2-core machine, and short enough to keep the tests quick.
STALL = 10


def _launcher(ckpt_dir, *launch_flags, wrapper=()):
    command = [
        sys.executable,
        *"-m jdp.launch --nproc 2 --devices-per-process 4 --grace 3".split(),
        *launch_flags,
        "--",
        *wrapper,
        *TRAIN,
        "--ckpt-dir",
        str(ckpt_dir),
        "--log-dir",
        _log_dir(ckpt_dir),
    ]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )


def _kill_when(launcher, ready, then=lambda: None, timeout=240, act=None):
    """Kills process 1 with SIGKILL once ``ready()`` (or calls ``act(stderr_lines)``);
    returns the exit code and output."""
    out, err = [], []
    readers = [
        threading.Thread(
            target=lambda s=s, into=into: into.extend(iter(s.readline, "")), daemon=True
        )
        for s, into in ((launcher.stdout, out), (launcher.stderr, err))
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    with launcher:
        try:
            while not ready():
                assert launcher.poll() is None, "".join(out + err)[-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.002)
            if act is None:
                os.kill(launched_pids(err)[1], signal.SIGKILL)
            else:
                act(err)
            then()
            code = launcher.wait(timeout=timeout)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        for reader in readers:
            reader.join(timeout=10)
    return code, "".join(out), "".join(err)


def _params(ckpt_dir) -> dict:
    """The final checkpoint's parameters by leaf path (restored here, on one device)."""
    params = load_params(str(ckpt_dir / str(STEPS)))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def _log_dir(ckpt_dir) -> str:
    return f"{ckpt_dir}-log"


def _ledger(ckpt_dir) -> dict:
    """Each logged step's data ledger digests (`jdp.data.splits.ledger`), every attempt's
    records of a step agreeing (a restart logs again the steps a kill lost)."""
    ledger = {}
    with open(os.path.join(_log_dir(ckpt_dir), "metrics.jsonl")) as file:
        for record in map(json.loads, file):
            if record["kind"] == "train":
                digests = (record["batch_digest"], record["data_ledger"])
                assert ledger.setdefault(record["step"], digests) == digests, record["step"]
    return ledger


def _goodput(ckpt_dir) -> tuple[dict, list[dict]]:
    """The run's goodput accounting (run.json) and its starts (goodput.json)."""
    with open(os.path.join(_log_dir(ckpt_dir), "run.json")) as file:
        accounting = json.load(file)["goodput"]
    with open(os.path.join(_log_dir(ckpt_dir), "goodput.json")) as file:
        return accounting, json.load(file)["attempts"]


def _logged(ckpt_dir, step):
    """True once the run's metrics hold a train record of ``step`` or later."""

    def logged():
        try:
            with open(os.path.join(_log_dir(ckpt_dir), "metrics.jsonl")) as file:
                lines = file.read().splitlines()
        except OSError:
            return False
        return any(
            f'"kind": "train", "step": {logged},' in line
            for line in lines
            for logged in range(step, STEPS + 1, 20)
        )

    return logged


def _saved(ckpt_dir, step):
    return lambda: (ckpt_dir / str(step)).is_dir()


def _saving_after(ckpt_dir, step):
    """True while a checkpoint after ``step``'s is being written (Orbax's temporary
    directory is there): the restart then resumes from ``step``'s."""

    def saving():
        if not (ckpt_dir / str(step)).is_dir():
            return False
        with os.scandir(ckpt_dir) as entries:
            return any("tmp" in entry.name for entry in entries)

    return saving


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run on 2 processes of 4 devices that nothing interrupts."""
    directory = tmp_path_factory.mktemp("whole")
    launcher = _launcher(directory)
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err[-3000:]
    return directory


@pytest.mark.slow
@pytest.mark.timeout(600)
# Killed mid-run is in the scheduled lane: the kill during a save takes the same restart per
# change, and restores the same ledger and goodput's parts.
@pytest.mark.parametrize(
    "when", [pytest.param("mid-run", marks=pytest.mark.scheduled), "during a save"]
)
def test_a_killed_process_is_restarted_and_the_run_ends_bitwise(whole, tmp_path, when):
    ready = _logged(tmp_path, 80) if when == "mid-run" else _saving_after(tmp_path, 50)
    began = time.monotonic()
    code, out, err = _kill_when(_launcher(tmp_path, "--max-restarts", "2"), ready)
    stopwatch = time.monotonic() - began
    assert code == 0, err[-3000:]
    assert "jdp.launch: process 1 of 2 failed first (killed by SIGKILL)" in err
    assert "jdp.launch: restart 1 of 2: 2 processes, resuming from the last complete" in err
    resumed = re.search(r"\[0\] jdp: resuming from step (\d+)", out)
    assert resumed, out[-3000:]
    assert_bitwise_equal(_params(tmp_path), _params(whole))
    # The restart trained on the uninterrupted run's batches, step for step.
    assert _ledger(tmp_path) == _ledger(whole)
    # The goodput ledger: the killed attempt's steps after the checkpoint were computed
    # again and are counted; the parts add up to the wall time, which the test's own
    # stopwatch bounds (less the launcher's start and the last process's exit).
    goodput, (killed, _) = _goodput(tmp_path)
    assert goodput["restarts"] == 1 and goodput["parts"]["restart"] > 0
    lost = killed["last_step"] - int(resumed[1])  # as far as the killed start wrote
    assert goodput["recomputed_steps"] == lost >= 0
    assert (goodput["parts"]["recomputed"] > 0) == (lost > 0)
    if when == "mid-run":  # killed once step 80 was logged, which it writes first
        assert killed["last_step"] >= 80
    assert abs(sum(goodput["parts"].values()) - goodput["wall"]) <= 0.02 * goodput["wall"]
    assert stopwatch - EXIT_SECONDS <= goodput["wall"] <= stopwatch


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_process_that_cannot_come_back_is_left_out(whole, tmp_path):
    """--min-nproc 1: process 1 is killed, then fails at once; process 0 finishes alone
    on its 4 devices, the same global batches in the same order."""
    mark = tmp_path / "fails-again"
    wrapper = [sys.executable, "-c", FAILS_AGAIN, str(mark)]
    launcher = _launcher(
        tmp_path / "ckpt", "--max-restarts", "3", "--min-nproc", "1", wrapper=wrapper
    )
    code, _, err = _kill_when(launcher, _saved(tmp_path / "ckpt", 50), then=mark.touch)
    assert code == 0, err[-3000:]
    assert "process 1 failed twice in a row; going on with 1 processes (--min-nproc 1)" in err
    assert "restart 2 of 3: 1 processes" in err
    # 4 devices instead of 8 sum the gradients in another order: equal to rounding.
    assert_drift_within(load_params(str(tmp_path / "ckpt")), load_params(str(whole)))
    assert _ledger(tmp_path / "ckpt") == _ledger(whole)  # the same batches on 1 process


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spent_restarts_end_in_one_line_with_the_last_checkpoint_intact(tmp_path):
    mark = tmp_path / "fails-again"
    wrapper = [sys.executable, "-c", FAILS_AGAIN, str(mark)]
    launcher = _launcher(tmp_path / "ckpt", "--max-restarts", "1", wrapper=wrapper)
    code, _, err = _kill_when(launcher, _saved(tmp_path / "ckpt", 50), then=mark.touch)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "jdp.launch: --max-restarts 1 spent; the last complete checkpoint is where a rerun resumes"
    )
    load_params(str(tmp_path / "ckpt"))  # the latest complete checkpoint, digests checked


# Process 0 ends first, as the processes told of a stop do; process 1, the one signalled,
# after it (`jdp.distributed.leaving`). Both exit 130, as a jdp run stopped by SIGINT does.
ENDS_ON_A_STOP = (
    "import os, sys, time\n"
    "if os.environ['JDP_PROCESS_ID'] == '0':\n"
    "    open(sys.argv[1], 'w').close()\n"
    "else:\n"
    "    while not os.path.exists(sys.argv[1]):\n"
    "        time.sleep(0.05)\n"
    "    os.remove(sys.argv[1])\n"
    "    time.sleep(0.5)\n"
    "sys.exit(130)\n"
)


def test_a_stop_signalled_to_one_process_is_said_as_one_and_leaves_no_process_out(tmp_path, capfd):
    """A signal to one of the processes, not to the launcher: the first to end is said to
    have ended on it, not failed, and ending first twice does not leave it out."""
    command = [sys.executable, "-c", ENDS_ON_A_STOP, str(tmp_path / "ended")]
    assert launch(command, 2, max_restarts=2, min_nproc=1) == 130
    err = capfd.readouterr().err
    assert err.count("jdp.launch: started process 1 of 2") == 3, err  # restarted, on two
    assert "failed" not in err and "going on with" not in err, err
    assert err.strip().splitlines()[-2:] == [
        "jdp.launch: process 0 of 2 ended first (exit code 130: stopped on SIGINT); exit code 130",
        "jdp.launch: --max-restarts 2 spent; the last complete checkpoint is where a rerun resumes",
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stalled_process_ends_the_group_and_the_restart_ends_bitwise(whole, tmp_path):
    """Process 1 hangs in a callback (alive: its heartbeats go on) while process 0 waits in
    the next step's all-reduce; without the watchdog the run never ends."""
    wrapper = [sys.executable, "-c", STALLS_IN_A_CALLBACK, str(tmp_path / "hung"), str(STALL)]
    launcher = _launcher(tmp_path / "ckpt", "--max-restarts", "1", wrapper=wrapper)
    _, err = launcher.communicate(timeout=500)
    assert launcher.returncode == 0, err[-3000:]
    stacks = f"{_log_dir(tmp_path / 'ckpt')}/stalls/process-1.txt"
    line = re.search(
        r"\[0\] jdp: process 1 of 2 stalled in a callback \(hang_once\) after "
        rf"step 130: no progress for (\d+) s \(--stall-timeout {STALL}\); "
        rf"Python stacks go to {re.escape(os.path.dirname(stacks))}; ending the run "
        r"with exit code 75, nothing saved now \(a restart resumes from step (\d+), "
        r"the last complete checkpoint\)",
        err,
    )
    assert line and STALL <= int(line[1]) <= STALL + 10, err[-3000:]
    both = f"{stacks.replace('process-1', 'process-0')}, {stacks}"
    assert f"[0] jdp: Python stacks written: {both}\n" in err, err[-3000:]
    assert "jdp.launch: process 1 of 2 failed first (exit code 75: the run stalled)" in err
    assert "jdp.launch: restart 1 of 1" in err
    with open(stacks) as file:
        text = file.read()
    assert text.startswith("process 1: in a callback (hang_once), step 130"), text[:300]
    assert "line 8 in hang_once" in text  # the sleep
    assert_bitwise_equal(_params(tmp_path / "ckpt"), _params(whole))
    goodput, attempts = _goodput(tmp_path / "ckpt")
    assert [attempt["ended"] for attempt in attempts] == ["stalled", "finished"]
    assert goodput["restarts"] == 1 and goodput["parts"]["stalled"] >= STALL * 0.5
    assert abs(sum(goodput["parts"].values()) - goodput["wall"]) <= 0.02 * goodput["wall"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_loader_worker_ends_every_process_naming_the_read(tmp_path):
    """One process's loader worker stopped (SIGSTOP): that process waits for data forever
    while the other waits in the all-reduce; both end within the stall timeout and 10 s."""
    command = [
        sys.executable,
        *"-m jdp.launch --nproc 2 --devices-per-process 2 --grace 3".split(),
        "--",
        *TRAIN,
        *"--loader-workers 1 --stall-timeout".split(),
        str(STALL),
        "--ckpt-dir",
        str(tmp_path),
        "--log-dir",
        _log_dir(tmp_path),
    ]
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )
    stopped = []

    def stop_a_worker(err_lines):
        stopped.extend(loader_workers(launched_pids(err_lines)[1])[:1])
        assert stopped, "process 1 has no loader worker"
        os.kill(stopped[0], signal.SIGSTOP)

    code, _, err = _kill_when(launcher, _logged(tmp_path, 100), act=stop_a_worker)
    assert code == 75, err[-3000:]
    line = re.search(
        r"\[0\] jdp: process 1 of 2 stalled reading data after step \d+: no "
        r"progress for (\d+) s",
        err,
    )
    assert line and STALL <= int(line[1]) <= STALL + 10, err[-3000:]
    with open(f"{_log_dir(tmp_path)}/stalls/process-1.txt") as file:
        text = file.read()
    assert text.startswith("process 1: reading data"), text[:300]
    assert "in _wait" in text and "in __next__" in text  # the loop's wait for a batch
    with open(f"{_log_dir(tmp_path)}/stalls/process-0.txt") as file:
        assert file.read().startswith("process 0: ")  # every process writes its stacks
    assert not alive(stopped[0])  # the stopped worker does not outlive its trainer
