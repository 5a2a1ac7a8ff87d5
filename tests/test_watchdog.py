"""The stall watchdog (`jdp.distributed.watchdog`): which process it names, what it writes,
and no alarm for what is slow but moving. The runs that end stalled, with real processes,
are in test_elastic.py (several processes, a launcher's restart) and test_faults.py."""

import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time

import flax.linen as nn
import pytest
from helpers import subprocess_env

import jdp
from jdp.checkpoint import Checkpointer
from jdp.distributed import watchdog
from jdp.distributed.marks import (
    ACTIONS,
    CALLBACK,
    COMPILE_EVENT,
    COMPILING,
    EVALUATING,
    FINISHED,
    READING,
    SAVING,
    STEPPING,
    Mark,
    Watch,
    stalled,
)
from jdp.distributed.ports import free_port
from jdp.distributed.watchdog import Watchdog
from jdp.errors import LoaderError
from jdp.report.goodput import Clock, Goodput
from jdp.training import finite

S = 10.0


def test_the_process_named_is_the_one_the_others_wait_for():
    # Process 1 never started step 41: it is reading data while 0 waits in the step.
    marks = [Mark(0, 41, STEPPING, 30.0), Mark(1, 40, READING, 29.0)]
    assert stalled(marks, S).process == 1
    # At one step, the one outside the step: a callback, not the all-reduce's waiter.
    marks = [Mark(0, 40, ACTIONS, 31.0), Mark(1, 40, CALLBACK, 12.0, "hang")]
    assert stalled(marks, S) == marks[1]
    # Everyone waiting in the step (a collective one process never reaches inside it):
    # the one idle longest.
    marks = [Mark(0, 40, STEPPING, 11.0), Mark(1, 40, STEPPING, 12.0)]
    assert stalled(marks, S).process == 1
    # Not yet: the one behind is still within its time.
    assert stalled([Mark(0, 41, STEPPING, 30.0), Mark(1, 40, READING, 9.0)], S) is None
    # A process whose loop ended moves no more: the run is ending, not stalled.
    assert stalled([Mark(0, 90, FINISHED, 1e6), Mark(1, 90, SAVING, 1e6)], S) is None


def test_compiling_is_never_a_stall_and_saving_or_evaluating_has_four_times_longer():
    assert stalled([Mark(0, 1, COMPILING, 1e6)], S) is None
    # The others wait for a process still compiling: not a stall, however long.
    assert stalled([Mark(0, 1, ACTIONS, 1e6), Mark(1, 1, COMPILING, 1e6)], S) is None
    for phase in (SAVING, EVALUATING):
        assert stalled([Mark(0, 40, phase, 39.0)], S) is None
        assert stalled([Mark(0, 40, phase, 41.0)], S).phase == phase
    assert stalled([Mark(0, 40, READING, 10.5)], S).phase == READING


def test_the_process_named_is_the_one_whose_mark_stopped_moving():
    # Trainer 1 stopped (SIGSTOP) during a save: both marks say saving, and 0 entered it
    # first; 1's mark no longer moves, so 1 is the one holding the others up.
    marks = [Mark(0, 40, SAVING, 50.0), Mark(1, 40, SAVING, 45.0, silent=True)]
    assert stalled(marks, S).process == 1
    # Stopped while compiling: its compile would have let its watchdog run.
    assert stalled([Mark(0, 40, STEPPING, 50.0), Mark(1, 40, STEPPING, 45.0, "", True, True)], S)


def test_an_xla_compile_in_progress_is_compiling_in_any_phase(tmp_path):
    from jax import monitoring

    watch, ended = Watch(3), []
    watch.at(EVALUATING)
    with Watchdog(watch, 0.2, str(tmp_path), say=lambda line: None, end=ended.append):
        # JAX's event as an evaluation's compile begins (as `jax.jit` sends it).
        monitoring.record_scalar(COMPILE_EVENT, time.time())
        assert watch.mark(0).compiling
        time.sleep(1.5)  # far past 4 x 0.2 s: not a stall while the compile runs
        assert ended == []
        monitoring.record_event_duration_secs(COMPILE_EVENT, 1.5)
        assert not watch.mark(0).compiling and watch.mark(0).idle < 1.0  # its end is progress
        deadline = time.monotonic() + 30
        while not ended:  # and then evaluating without progress is
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert ended == [watchdog.EXIT_STALLED]


def test_time_a_process_was_stopped_is_excused():
    watch = Watch(0)
    now = time.monotonic()
    watch.since = now - 10  # progress 10 s ago; stopped from 8 s ago until now
    watch.excuse(now - 8, now)
    assert 1.9 < watch.mark(0).idle < 2.5
    watch.since = now - 1  # progress after the stop began (only the rest is excused)
    watch.excuse(now - 8, now)
    assert watch.mark(0).idle < 0.5


def test_the_others_marks_read_before_the_watchdog_sees_its_own_stop_are_not_judged(tmp_path):
    """After a stop of the whole group, the thread that reads the others' marks from the
    store may run before the loop that notices the stop: marks from before the stop look
    idle for as long as the stop lasted, and are not judged then."""
    from jax._src.lib import _jax

    address = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(address, 1)
    client = _jax.get_distributed_runtime_client(address, 0)
    client.connect()
    try:
        watch, stop = Watch(), 4 * STOPPED_TIMEOUT
        watch.started(40, STEPPING)
        dog = Watchdog(watch, STOPPED_TIMEOUT, str(tmp_path), processes=2, client=client)
        other = {**dataclasses.asdict(Mark(1, 40, STEPPING, 0.0)), "at": time.time() - stop}
        client.key_value_set("jdp/watchdog/mark/1", json.dumps(other))
        dog._turned -= stop  # its loop last turned before the stop
        assert dog._shared(watch.mark(0)) is None
        # Its loop turned without a stop in between: process 1's mark is 8 s old, stalled
        # (give or take the milliseconds between the write and the read; 1 s on a loaded CPU).
        dog._turned = time.monotonic()
        assert dog._shared(watch.mark(0)) == Mark(
            1, 40, STEPPING, pytest.approx(stop, abs=1.0), silent=True
        )
    finally:
        client.shutdown()
        service.shutdown()


@pytest.mark.slow
def test_a_stopped_run_is_not_stalled_and_a_sigterm_sent_while_stopped_saves(tmp_path):
    logs = tmp_path / "logs"
    flags = [
        "--mesh",
        "data=1",
        "--steps",
        "1000000",
        "--warmup-steps",
        "1",
        "--ckpt-dir",
        tmp_path / "ckpt",
        "--log-dir",
        logs,
        "--log-every",
        "20",
        "--eval-every",
        "0",
        "--stall-timeout",
        STOPPED_TIMEOUT,
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "jdp.train", *map(str, flags)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 120
    while not (logs / "metrics.jsonl").exists() or not (logs / "metrics.jsonl").read_text():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGSTOP)  # Ctrl-Z, a scheduler's suspend
    time.sleep(3 * STOPPED_TIMEOUT)
    process.send_signal(signal.SIGCONT)
    time.sleep(STOPPED_TIMEOUT)  # the watchdog, polling every 0.2 s, had a second to fire
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGSTOP)
    time.sleep(3 * STOPPED_TIMEOUT)
    process.send_signal(signal.SIGTERM)  # a preemption notice while stopped
    process.send_signal(signal.SIGCONT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    assert "stalled" not in stderr, stderr
    assert re.search(r"^jdp\.train: SIGTERM at step \d+; checkpoint saved in ", stdout, re.M)


# Longer than any pause of a small MLP's steady loop on a loaded 2-core machine (a step
# takes milliseconds), and short enough that a stop three times as long is a few seconds.
STOPPED_TIMEOUT = 2.0


def test_one_process_stalled_writes_its_stacks_says_one_line_and_ends(tmp_path):
    watch, ended, lines = Watch(7), [], []
    clock = Clock()
    goodput = Goodput(clock, str(tmp_path))
    goodput.start(0)
    clock.switch("input")
    watch.at(READING)
    watch.since -= 0.5  # half a second without progress, against a limit of 0.2
    with Watchdog(
        watch, 0.2, str(tmp_path), on_stall=goodput.stalled, say=lines.append, end=ended.append
    ):
        deadline = time.monotonic() + 30
        while not ended:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert ended == [watchdog.EXIT_STALLED]
    stacks = tmp_path / "stalls" / "process-0.txt"
    assert len(lines) == 2 and re.fullmatch(
        r"jdp: the run stalled reading data after step 7: no progress for \d+ s "
        rf"\(--stall-timeout 0.2\); Python stacks go to {re.escape(str(stacks.parent))}; "
        r"ending the run with exit code 75, nothing saved now \(without --ckpt-dir a restart "
        r"begins at step 0\)",
        lines[0],
    ), lines
    assert lines[1] == f"jdp: Python stacks written: {stacks}"  # only files that exist
    text = stacks.read_text()
    assert text.startswith("process 0: reading data, step 7, no progress for")
    assert "in test_one_process_stalled_writes_its_stacks_says_one_line_and_ends" in text
    # The goodput ledger: the time without progress is the attempt's stalled part.
    attempt = json.loads((tmp_path / "goodput.json").read_text())["attempts"][-1]
    # (all this attempt's reading time: the watch was set back, not the clock)
    assert attempt["ended"] == "stalled" and attempt["parts"]["stalled"] > 0
    assert attempt["parts"]["input"] == 0


def test_the_stall_line_says_where_a_restart_begins(tmp_path):
    """Not "resumes from the last complete checkpoint" where none was written."""
    assert watchdog.resume_point(None) == "without --ckpt-dir a restart begins at step 0"
    assert watchdog.resume_point(str(tmp_path)) == (
        f"no checkpoint in {tmp_path} yet: a restart begins at step 0"
    )
    for name in ("20", "40", "damaged-60-123", "80.orbax-checkpoint-tmp-1"):
        (tmp_path / name).mkdir()
    assert watchdog.resume_point(str(tmp_path)) == (
        "a restart resumes from step 40, the last complete checkpoint"
    )
    assert watchdog.stacks_written(str(tmp_path), 2) == (
        "jdp: Python stacks written: none; process 0, 1 wrote none (stopped or killed)"
    )


class _SlowToTrace(nn.Module):
    """A model whose tracing sleeps (its first compile, and its evaluation's, take longer
    than the stall timeout), but not its initialisation."""

    seconds: float

    @nn.compact
    def __call__(self, x, *, train=False):
        if not self.is_initializing():
            time.sleep(self.seconds)
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


# A stall timeout shorter than the slow parts below, longer than a step of this small
# model or a batch's read on a loaded 2-core machine (milliseconds) by 100x.
SHORT = 1.0
SLOW = 1.5  # > SHORT, and with the evaluation's compile under the 4 x SHORT it may take


@pytest.mark.slow
def test_a_slow_compile_evaluation_and_save_are_not_stalls(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(watchdog, "_end_process", fired.append)
    save = Checkpointer.save

    def slow_save(self, *args, **kwargs):
        time.sleep(SLOW)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", slow_save)
    read, reads = finite.state_finite, []

    def slow_first_read(state):  # the guard's first read of the state compiles it
        reads.append(state)
        if len(reads) == 1:
            time.sleep(SLOW)
        return read(state)

    monkeypatch.setattr(finite, "state_finite", slow_first_read)
    model = jdp.models.from_linen(_SlowToTrace(SLOW), jdp.models.classification())
    config = jdp.TrainConfig(
        mesh="data=8",
        steps=12,
        warmup_steps=2,
        batch_size=64,
        ckpt_dir=str(tmp_path),
        stall_timeout=SHORT,
    )
    watching = []  # the watchdog's thread, seen from inside the run

    def look(progress):
        watching.append(any(t.name == "jdp-watchdog" for t in threading.enumerate()))

    result = jdp.fit(config, model=model, console=jdp.Console(enabled=False), callbacks=[look])
    assert fired == [] and result.steps == 12 and all(watching) and watching
    assert reads  # the guard read the state (before the first call, first, slowly)
    assert not (tmp_path / "stalls").exists()


@pytest.mark.slow
def test_a_killed_loader_worker_is_one_line_after_saving_the_last_step(tmp_path):
    def kill_a_worker(progress):
        if progress.step == 6:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)

    config = jdp.TrainConfig(
        mesh="data=8",
        steps=400,
        warmup_steps=2,
        batch_size=64,
        loader_workers=1,
        ckpt_dir=str(tmp_path),
    )
    with pytest.raises(LoaderError) as raised:
        jdp.fit(config, console=jdp.Console(enabled=False), callbacks=[kill_a_worker])
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith("a loader worker process died (killed by SIGKILL;"), line
    step = int(line.split(" after step ")[1].split(";")[0])
    assert step >= 6 and f"that step's state is saved in {tmp_path}" in line
    with Checkpointer(str(tmp_path)) as checkpoints:
        assert checkpoints.steps()[-1] == step


@pytest.mark.slow
def test_one_process_stalled_between_steps_saves_the_last_step_first(tmp_path):
    """A loader worker stopped (alive, answering nothing): the loop waits for data between
    steps, so the stall saves the last step's state as a signal would, and ends stalled."""

    def stop_the_worker(progress):
        if progress.step == 6:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGSTOP)

    config = jdp.TrainConfig(
        mesh="data=8",
        steps=100000,
        warmup_steps=2,
        batch_size=64,
        loader_workers=1,
        ckpt_dir=str(tmp_path),
        stall_timeout=STOPPED_TIMEOUT,
    )
    try:
        result = jdp.fit(config, console=jdp.Console(enabled=False), callbacks=[stop_the_worker])
    finally:
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
    assert result.stalled and result.signal is None
    match = re.fullmatch(
        r"jdp\.train: stalled reading data \(no progress for \d+ s, --stall-timeout "
        rf"{STOPPED_TIMEOUT:g}\) at step (\d+); checkpoint saved in {re.escape(str(tmp_path))}; "
        r"run the same command to resume",
        result.stopped,
    )
    assert match, result.stopped
    step = int(match.group(1))
    assert step >= 6 and step == result.steps
    with Checkpointer(str(tmp_path)) as checkpoints:
        assert checkpoints.steps()[-1] == step
    assert (tmp_path / "stalls" / "process-0.txt").exists()
