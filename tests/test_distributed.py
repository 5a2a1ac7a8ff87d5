"""Multi-process runs: start-up, the launcher, failures, replica checks, checkpoints across counts.

The runs are real: several processes on loopback, joined by JAX's distributed
runtime, all-reducing with gloo.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from closeness import assert_drift_within, assert_sequences_close
from helpers import assert_trees_close, launched_pids, run_cli, subprocess_env

from jdp import distributed
from jdp.checkpoint import load_params
from jdp.distributed import Cluster, ReplicaMismatchError, check_replicas, ports
from jdp.distributed.handshake import handshake
from jdp.distributed.ports import free_port
from jdp.distributed.process_groups import in_groups
from jdp.errors import UsageError
from jdp.mesh import replicated

# One run, computed in 1 process or in 2; only topology flags are added to it.
_RUN = ["--mesh", "data=8", "--steps", "120", "--warmup-steps", "10", "--eval-every", "20"]
SUMMARY = re.compile(r"^(\[\d\] )?jdp\.train: steps=\d+ .*wall=[\d.]+s$", re.M)


def _env():
    return subprocess_env()  # the commands set up their devices


def _train(*flags, nproc=None, grace=10, timeout=240, wrapper=(), **popen):
    command = [sys.executable, "-m", "jdp.train", *_RUN, *flags]
    if nproc:
        command = [
            sys.executable,
            *"-m jdp.launch --nproc".split(),
            str(nproc),
            "--devices-per-process",
            str(8 // nproc),
            "--grace",
            str(grace),
            "--",
            *wrapper,
            *command,
        ]
    if popen:
        return subprocess.Popen(command, text=True, env=_env(), **popen)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env())


# Steps over which losses are compared tightly: the warmup's.
_EARLY = 10


def _assert_same_params(a_dir, b_dir):
    """Gloo's and XLA's all-reduces sum in other orders: equal to rounding (closeness.py)."""
    assert_drift_within(load_params(str(a_dir)), load_params(str(b_dir)))


def _logged(log_dir, key):
    with open(log_dir / "metrics.jsonl") as records:
        values = [json.loads(line).get(key) for line in records]
    return [value for value in values if value is not None]


def _assert_same_early_steps(a_log, b_log):
    assert_sequences_close(_logged(a_log, "loss")[:_EARLY], _logged(b_log, "loss")[:_EARLY])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The run in one process with 8 devices, checkpointed every 60 steps, logged every step."""
    directory = tmp_path_factory.mktemp("single")
    result = _train(
        "--ckpt-dir",
        str(directory / "ckpt"),
        *"--ckpt-every 60 --log-dir".split(),
        str(directory / "log"),
        "--log-every",
        "1",
    )
    assert result.returncode == 0, result.stderr
    return directory


@pytest.mark.parametrize("backend", ["jit", "pmap"])
@pytest.mark.slow
def test_two_processes_match_one(single, tmp_path, backend):
    result = _train(
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--log-dir",
        str(tmp_path / "log"),
        *"--log-every 1 --backend".split(),
        backend,
        "--check-replicas-every",
        "40",
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = SUMMARY.findall(result.stdout)
    assert len(summaries) == 1 and summaries[0] == "[0] ", result.stdout
    assert "jdp: 2 processes" in result.stdout
    assert "jdp: data on each device: train" in result.stdout  # each process's own devices
    assert not re.search(r"^\[1\] jdp", result.stdout, re.M), "process 1 printed"
    assert "[Gloo]" not in result.stdout + result.stderr  # the peers' connection lines
    _assert_same_early_steps(tmp_path / "log", single / "log")
    _assert_same_params(tmp_path / "ckpt", single / "ckpt")


def _read_lines(stream, into):
    for line in iter(stream.readline, ""):
        into.append(line)


def _interrupt_mid_run(launcher, interrupt, timeout=120):
    """Waits for process 0's eval at step 20, calls ``interrupt(stderr_lines)``, waits.

    Returns the launcher's exit code, its stdout and stderr, and the seconds it
    took to exit after ``interrupt``.
    """
    out, err = [], []
    readers = [
        threading.Thread(target=_read_lines, args=(launcher.stdout, out), daemon=True),
        threading.Thread(target=_read_lines, args=(launcher.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    with launcher:  # closes the pipes
        try:
            deadline = time.monotonic() + 120
            while not any("step 20: test_loss" in line for line in out):
                assert launcher.poll() is None and time.monotonic() < deadline, "".join(out + err)
                time.sleep(0.05)
            interrupt(err)
            interrupted = time.monotonic()
            code = launcher.wait(timeout=timeout)
            took = time.monotonic() - interrupted
        finally:
            if launcher.poll() is None:
                launcher.kill()
        for reader in readers:
            reader.join(timeout=10)
    return code, "".join(out), "".join(err), took


@pytest.mark.slow
def test_a_lost_process_stops_the_others_within_the_heartbeat_timeout():
    launcher = _train(
        "--steps",
        "100000",
        "--heartbeat-timeout",
        "5",
        nproc=2,
        grace=120,  # long: process 0 must be stopped by the runtime, not by the launcher
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    code, _, text, stopped_after = _interrupt_mid_run(
        launcher, lambda err: os.kill(launched_pids(err)[1], signal.SIGKILL), timeout=90
    )
    assert code != 0
    assert "jdp.launch: process 1 killed by SIGKILL" in text
    assert "process 1 of 2 failed first" in text
    assert "killing process 0" not in text, text[-3000:]  # it stopped on its own
    assert re.search(r"\[0\] .*unhealthy \(stopped sending heartbeats\)", text), text[-3000:]
    assert stopped_after < 60, stopped_after


@pytest.mark.slow
def test_process_0_stopped_is_named_by_another_in_one_line_never_an_abort():
    """Process 0 holds the run's store: stopped (SIGSTOP), process 1's watchdog cannot
    reach it, and JAX's heartbeats would abort process 1 with a C++ stack (exit 134)."""
    launcher = _train(
        "--steps",
        "100000",
        "--stall-timeout",
        "3",
        "--heartbeat-timeout",
        "30",
        nproc=2,
        grace=2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    code, _, text, _ = _interrupt_mid_run(
        launcher, lambda err: os.kill(launched_pids(err)[0], signal.SIGSTOP), timeout=90
    )
    assert code == 75, text[-3000:]
    assert re.search(
        r"^\[1\] jdp: process 0 of 2 does not answer: the store it holds for the run has been "
        r"silent for \d+ s \(it is stopped, or its process is stuck\);",
        text,
        re.M,
    ), text[-3000:]
    assert "SIGABRT" not in text and "Check failure" not in text


@pytest.mark.slow
def test_a_whole_group_stopped_and_continued_is_not_a_stall():
    """Every process stopped for 4 x --stall-timeout (a scheduler suspending the job), then
    continued: each excuses its own stop and waits for the others' marks to move."""
    launcher = _train(
        "--steps",
        "100000",
        "--stall-timeout",
        "2",
        nproc=2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def suspend_then_stop(err):
        pids = list(launched_pids(err).values())
        for number in (signal.SIGSTOP, signal.SIGCONT):
            for pid in pids:
                os.kill(pid, number)
            time.sleep(8 if number == signal.SIGSTOP else 4)  # then 2 x the timeout running
        assert launcher.poll() is None, "".join(err)[-3000:]
        launcher.send_signal(signal.SIGTERM)

    code, text, errors, _ = _interrupt_mid_run(launcher, suspend_then_stop)
    assert code == 143, errors[-3000:]
    assert "stalled" not in errors and "does not answer" not in errors, errors[-3000:]
    assert re.search(r"^\[0\] jdp\.train: preemption notice \(SIGTERM\) at step", text, re.M)


def test_launcher_grace_kills_what_does_not_stop(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['JDP_PROCESS_ID'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            *"-m jdp.launch --nproc 2 --grace 1 --".split(),
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    assert "killing process 0" in result.stderr
    assert "process 1 of 2 failed first (exit code 3)" in result.stderr
    assert time.monotonic() - started < 30


# Scheduled: per change the launcher's SIGTERM saves on two processes
# (test_sigterm_stops_two_processes_at_20_steps_a_call, the group stop's test) and one
# process resumes two's checkpoint (test_checkpoints_move_between_one_and_two_processes).
@pytest.mark.slow
@pytest.mark.scheduled
def test_sigterm_to_the_launcher_saves_and_one_process_resumes(tmp_path):
    # Long enough that the signal lands mid-run.
    steps = ["--steps", "400"]
    stopped_dir = tmp_path / "stopped"
    launcher = _train(
        "--ckpt-dir",
        str(stopped_dir),
        *steps,
        nproc=2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    code, text, errors, _ = _interrupt_mid_run(
        launcher, lambda err: launcher.send_signal(signal.SIGTERM)
    )
    assert code == 143, text[-2000:] + errors[-2000:]  # stopped as asked, saved
    stopped = re.search(r"^\[0\] jdp\.train: .* at step (\d+); checkpoint saved", text, re.M)
    assert stopped, text[-2000:]
    assert int(stopped.group(1)) < 400

    result = _train("--ckpt-dir", str(stopped_dir), *steps)
    assert result.returncode == 0, result.stderr
    assert f"jdp: resuming from step {stopped.group(1)}" in result.stdout
    # The same run without the stop, in one process: the two differ only by the
    # 2-process part's summation order (a resume at the wrong step or batch would
    # move the parameters by orders of magnitude more).
    whole_dir = tmp_path / "whole"
    whole = _train("--ckpt-dir", str(whole_dir), *steps)
    assert whole.returncode == 0, whole.stderr
    assert_drift_within(load_params(str(stopped_dir)), load_params(str(whole_dir)))


@pytest.mark.slow
def test_sigterm_stops_two_processes_at_20_steps_a_call(tmp_path):
    """JAX's sync point counts steps, not calls: a count of calls, which the processes
    passed by while they agreed on one, let 3 runs in 4 train on to the end."""
    launcher = _train(
        *"--steps 400 --steps-per-call 20 --ckpt-dir".split(),
        str(tmp_path),
        nproc=2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    code, text, errors, _ = _interrupt_mid_run(
        launcher, lambda err: launcher.send_signal(signal.SIGTERM)
    )
    assert code == 143, text[-2000:] + errors[-2000:]
    stopped = re.search(r"^\[0\] jdp\.train: .* at step (\d+); checkpoint saved", text, re.M)
    assert stopped and int(stopped.group(1)) % 20 == 0 and int(stopped.group(1)) < 400, text


@pytest.mark.slow
def test_checkpoints_move_between_one_and_two_processes(single, tmp_path):
    # Two processes continue a one-process run from step 60 ...
    two = tmp_path / "two"
    shutil.copytree(single / "ckpt", two)
    _remove_after(two, 60)
    result = _train("--ckpt-dir", str(two), nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[0] jdp: resuming from step 60" in result.stdout
    _assert_same_params(two, single / "ckpt")
    # ... and one process continues a two-process run from step 60.
    one = tmp_path / "one"
    result = _train("--ckpt-dir", str(one), "--ckpt-every", "60", nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _remove_after(one, 60)
    result = _train("--ckpt-dir", str(one))
    assert result.returncode == 0, result.stderr
    assert "jdp: resuming from step 60" in result.stdout
    _assert_same_params(one, single / "ckpt")


def _remove_after(directory, step: int) -> None:
    """Removes the checkpoints after ``step``: the scheduled ones, and those an improving
    evaluation saved (every 20 steps here)."""
    for name in os.listdir(directory):
        if name.isdigit() and int(name) > step:
            shutil.rmtree(directory / name)


_DIVERGED = textwrap.dedent(
    """
    import jax, numpy as np
    from jdp import distributed
    distributed.initialize()
    from jdp.mesh import make_mesh, replicated
    mesh = make_mesh("data=-1")
    sharding = replicated(mesh)
    value = np.full((3,), float(jax.process_index() == 1), np.float32)
    params = jax.make_array_from_single_device_arrays(
        (3,), sharding, [jax.device_put(value, d) for d in sharding.addressable_devices]
    )
    distributed.check_replicas({"w": params}, step=7)
    """
)


@pytest.mark.slow
def test_replica_check_across_processes_names_the_odd_one(tmp_path):
    script = tmp_path / "diverged.py"
    script.write_text(_DIVERGED)
    result = subprocess.run(
        [
            sys.executable,
            *"-m jdp.launch --nproc 2 --devices-per-process 2 --".split(),
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 1
    assert (
        "replicas differ at step 7: parameters on process 1 device 2048, process 1 device 2049"
        in result.stderr
    ), result.stderr[-3000:]


def test_replica_check_in_one_process(mesh8):
    sharding = replicated(mesh8)
    same = jax.device_put(np.arange(6.0, dtype=np.float32), sharding)
    check_replicas({"w": same})
    copies = [
        jax.device_put(np.arange(6.0, dtype=np.float32) + (device.id == 5), device)
        for device in sharding.addressable_devices
    ]
    diverged = jax.make_array_from_single_device_arrays((6,), sharding, copies)
    with pytest.raises(ReplicaMismatchError, match=r"at step 3: parameters on process 0 device 5 "):
        check_replicas({"w": same, "v": diverged}, step=3)


@pytest.mark.slow
def test_startup_names_the_missing_process():
    result = subprocess.run(
        [
            sys.executable,
            *"-m jdp.train --coordinator".split(),
            f"127.0.0.1:{free_port()}",
            *"--num-processes 3 --process-id 0 --startup-timeout 2".split(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line, no traceback
    assert "processes 1, 2 of 3 did not reach the coordinator" in result.stderr
    assert "--startup-timeout" in result.stderr


def _handshake_all(clusters, timeout):
    errors = {}

    def run(cluster):
        try:
            handshake(cluster, timeout)
        except UsageError as error:
            errors[cluster.process_id] = str(error)

    threads = [threading.Thread(target=run, args=(c,)) for c in clusters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout + 30)
    return errors


def _clusters(count, ids, port):
    address = f"127.0.0.1:{port}"
    return [Cluster(count, i, address, bind=address) for i in ids]


def test_handshake_meets_and_names_what_is_wrong():
    assert _handshake_all(_clusters(3, [0, 1, 2], free_port()), timeout=20) == {}

    errors = _handshake_all(_clusters(3, [0, 2], free_port()), timeout=2)
    assert set(errors) == {0, 2}
    assert all("process 1 of 3 did not reach" in text for text in errors.values())

    errors = _handshake_all(_clusters(3, [0, 1, 1], free_port()), timeout=5)
    assert "two processes were started with --process-id 1" in errors[0]

    port = free_port()
    wrong = [*_clusters(2, [0], port), *_clusters(3, [1], port)]
    errors = _handshake_all(wrong, timeout=5)
    assert "process 1 was started with --num-processes 3, process 0 with 2" in errors[1]


@pytest.mark.slow
def test_a_process_that_left_the_handshake_is_missing_not_counted():
    port = free_port()
    (cluster,) = _clusters(3, [0], port)
    errors = {}

    def gather():
        try:
            handshake(cluster, 3)
        except UsageError as error:
            errors[0] = str(error)

    thread = threading.Thread(target=gather)
    thread.start()
    deadline = time.monotonic() + 10
    while True:  # process 1 says hello, then gives up before the verdict
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as gone:
                gone.sendall(b"jdp-hello/2 1 3 {}\n")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    thread.join(timeout=30)
    assert "processes 1, 2 of 3 did not reach" in errors[0]


@pytest.mark.slow
def test_sigint_to_the_launcher_stops_a_run_without_checkpoints(tmp_path):
    """Through a wrapper script that runs the trainer as its child without ``exec``, by a
    name the launcher does not know: the signal ends the wrapper, and what it left
    running (the trainer) is signalled in turn and stops as asked."""
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text('#!/bin/sh\n"$@"\n')
    wrapper.chmod(0o755)
    launcher = _train(
        "--steps",
        "100000",
        nproc=2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        wrapper=[str(wrapper)],
    )
    pids = []

    def interrupt(err):
        pids.extend(launched_pids(err).values())  # the shells'
        launcher.send_signal(signal.SIGINT)

    code, text, errors, _ = _interrupt_mid_run(launcher, interrupt)
    assert code == 130, text[-2000:] + errors[-2000:]  # as a shell says a Ctrl-C
    assert len(pids) == 2 and not in_groups(pids)  # nothing of the shells' groups runs
    assert re.search(
        r"^\[0\] jdp\.train: preemption notice \(SIGTERM\) at step \d+; stopped without "
        r"saving \(no --ckpt-dir\)$",
        text,
        re.M,
    ), text[-2000:]
    assert "KeyboardInterrupt" not in errors


def test_process_0_not_answering_is_named():
    started = time.monotonic()
    errors = _handshake_all(_clusters(2, [1], free_port()), timeout=1)
    assert "process 0 did not answer at 127.0.0.1:" in errors[1]
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("kwargs", "env", "needle"),
    [
        ({"num_processes": 2}, {}, "needs --coordinator (or JDP_COORDINATOR) and --process-id"),
        ({"process_id": 1, "coordinator": "h:1"}, {}, "but not --num-processes"),
        ({"num_processes": 0}, {}, "--num-processes must be at least 1"),
        ({"num_processes": 2, "process_id": 2, "coordinator": "h:1"}, {}, "not in 0..1"),
        ({"num_processes": 2, "process_id": 0, "coordinator": "nohost"}, {}, "is not HOST:PORT"),
        ({}, {"JDP_NUM_PROCESSES": "two"}, "JDP_NUM_PROCESSES='two' is not an integer"),
    ],
)
def test_incomplete_settings_are_named(monkeypatch, kwargs, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=re.escape(needle)):
        distributed.resolve(**kwargs)


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("JDP_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("JDP_NUM_PROCESSES", "4")
    monkeypatch.setenv("JDP_PROCESS_ID", "3")
    cluster = distributed.resolve()
    assert (cluster.coordinator, cluster.num_processes, cluster.process_id) == (
        "10.0.0.1:1234",
        4,
        3,
    )
    assert distributed.resolve(process_id=1).process_id == 1  # a flag wins
    assert distributed.resolve(num_processes=1, process_id=0).num_processes == 1


def test_a_picked_port_is_free_and_outside_the_outgoing_connections_range():
    """The launcher's coordinator port is one no outgoing connection can take between the
    pick and the bind (a port from a bind to 0 could be: a CI run lost one that way)."""
    picked = {free_port() for _ in range(20)}
    outgoing = set(ports.outgoing_ports())
    if set(ports.LISTEN_PORTS) - outgoing:  # a machine whose range covers them all has none
        assert not picked & outgoing and picked <= set(ports.LISTEN_PORTS)
    with socket.create_server(("127.0.0.1", free_port())):  # it can be listened on
        pass


@pytest.mark.parametrize("says", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_port_another_program_holds_stops_a_process_at_once(says, monkeypatch):
    # A silent program is found out when the greeting's wait ends: 15 s in a run, 1 s here
    # (what is checked is that it is that wait, not the start-up timeout's 300 s).
    monkeypatch.setattr(sys.modules[handshake.__module__], "_GREETING_SECONDS", 1.0)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    connections = []

    def serve():  # a program that listens on the port: silent, or answering its own way
        with contextlib.suppress(OSError):
            connection, _ = server.accept()
            connections.append(connection)
            connection.sendall(says)

    threading.Thread(target=serve, daemon=True).start()
    (cluster,) = _clusters(2, [1], port)
    started = time.monotonic()
    try:
        with pytest.raises(
            UsageError,
            match=rf"another program holds the coordinator's port "
            rf"127.0.0.1:{port} \(it said ",
        ):
            handshake(cluster, 300)
    finally:
        for connection in connections:
            connection.close()
        server.close()
    # Not the start-up timeout's 300 s: about the greeting's wait.
    assert time.monotonic() - started < 60
    # Process 0 on that port says so as it did.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        (zero,) = _clusters(2, [0], taken.getsockname()[1])
        with pytest.raises(UsageError, match=r"process 0 cannot listen on port \d+"):
            handshake(zero, 5)


@pytest.mark.slow
def test_two_processes_draw_one_processs_dropout(tmp_path):
    """A gpt with dropout on 2 processes x 4 devices trains as on 1 device: each example's
    mask comes from the step's key and its place in the global batch (with a key per
    replica, as before, the two drew other masks)."""
    flags = [
        *"--model gpt --dataset numbers2words --layers 1 --width 32".split(),
        *"--heads 2 --dropout 0.3 --steps 6 --warmup-steps 1 --batch-size 32".split(),
        *"--eval-every 0 --optimizer momentum --lr 0.1 --log-every 1".split(),
    ]
    one = run_cli(
        *flags,
        *"--mesh data=1 --ckpt-dir".split(),
        tmp_path / "one",
        "--log-dir",
        tmp_path / "one-log",
    )
    assert one.returncode == 0, one.stderr[-3000:]
    command = [
        sys.executable,
        *"-m jdp.launch --nproc 2 --devices-per-process 4 --".split(),
        sys.executable,
        "-m",
        "jdp.train",
        *flags,
        *"--mesh data=8 --ckpt-dir".split(),
        str(tmp_path / "two"),
        "--log-dir",
        str(tmp_path / "two-log"),
    ]
    two = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env())
    assert two.returncode == 0, two.stderr[-3000:]
    # Momentum is linear in the gradient: rounding stays rounding (closeness.py).
    assert_sequences_close(
        _logged(tmp_path / "two-log", "loss"), _logged(tmp_path / "one-log", "loss")
    )
    assert_trees_close(
        load_params(str(tmp_path / "two")), load_params(str(tmp_path / "one")), rtol=1e-5, atol=1e-6
    )


def test_the_launcher_drops_the_collectives_connection_lines_even_interleaved():
    from jdp.distributed.output import ConnectionLines

    dropped = [
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
        "is : 1",
        # two threads of one process writing at once, as CI runs printed them
        "[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected "
        "peer ranks is : 1",
        "0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
        "[Gloo] Rank 2 is connected to 7 peer ranks. Expected number of connected peer ranks "
        "is : 7[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer "
        "ranks is : ",
        "7",  # the count cut from the line before
        # pieces of two messages interleaved inside the line (a CI run's process 1), then
        # the rest of the second
        "[Gloo] Rank 4 is connected to 7 peer ranks. [Gloo] Rank 7Expected number of "
        "connected peer ranks is :  is connected to 77",
        " peer ranks. Expected number of connected peer ranks is : 7",
        # both counts, then both line ends
        "[Gloo] Rank 5 is connected to 7 peer ranks. [Gloo] Rank 6 is connected to 7 peer "
        "ranks. Expected number of connected peer ranks is : Expected number of connected "
        "peer ranks is : 77",
        "",
    ]
    kept = [
        "[Gloo] Rank 0 failed to connect to 127.0.0.1:1234",
        "7",
        "",
        "[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks "
        "is : 1",  # a peer missing
        "",
        "42",
        "step 20: loss=0.1",
    ]
    connection = ConnectionLines()
    drops = [connection.drops(line + "\n") for line in dropped + kept]
    assert drops == [True] * len(dropped) + [False] * len(kept)
    # a whole message owes nothing: the empty line and the number after it are the run's
    whole = dropped[0]
    assert [connection.drops(line + "\n") for line in (whole, "", "42")] == [True, False, False]


# jdp.train where the longest call the periods allow always pays back its compile, as in a
# long run (a loaded machine's timings may ask for one step a call: 2% of a call, once).
_PAYING = (
    "import sys\n"
    "from jdp.training import calls\n"
    "calls.saving = lambda host_us, steps, remaining: float('inf')\n"
    "calls.steps_for_share = lambda host_us, call_us, longest: longest\n"
    "from jdp.train import main\n"
    "sys.exit(main(sys.argv[sys.argv.index('jdp.train') + 1 :]))\n"
)


@pytest.mark.slow
def test_auto_steps_per_call_on_two_processes_is_their_run_at_one(tmp_path):
    """Process 0's timings choose for both (each process checks the call, all agreeing);
    the two processes' run is bitwise their run at one step a call, as is their run at a
    forced 8 steps a call, whose calls a shorter one closes up to every 20th step."""
    runs, said = {}, {}
    for calls in ("auto", "1", "8"):
        log = tmp_path / calls
        flags = ["--steps-per-call", calls, "--log-dir", str(log), "--log-every", "20"]
        result = _train(*flags, nproc=2, wrapper=[sys.executable, "-c", _PAYING])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        figures = re.search(r"train_loss=\S+ test_loss=\S+ test_accuracy=\S+", result.stdout)
        runs[calls], said[calls] = (_logged(log, "loss"), figures.group(0)), result.stdout
    chosen = r"^\[0\] jdp: --steps-per-call auto: (\d+) steps a call .*bitwise"
    assert re.search(chosen, said["auto"], re.M), said["auto"]
    assert "--steps-per-call auto" not in said["1"]
    assert runs["auto"] == runs["1"] == runs["8"]
