"""``python -m jdp.on_ray``: a run's processes as Ray actors, on a Ray cluster of a head
and a worker node started here (Ray's own ``cluster_utils``; Ray gives a node on this
machine its own address, not 127.0.0.1, and nothing leaves the machine)."""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import interop, subprocess_env

pytestmark = pytest.mark.interop
interop("ray")

TRAIN = ["python", "-m", "jdp.train", "--mesh", "data=8", "--steps", "40"]


# The cluster lives in a process of its own: Ray forks, and this test process may hold
# JAX's threads (JAX warns of a fork there; a deadlock is possible).
CLUSTER = """
import sys
from ray.cluster_utils import Cluster
nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
try:
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    print(nodes.address, flush=True)
    sys.stdin.read()  # until the test closes it
finally:
    nodes.shutdown()
"""


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of a head and a worker node, as ``ray start`` makes them."""
    process = subprocess.Popen(
        [sys.executable, "-c", CLUSTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        start_new_session=True,
    )
    try:
        address = process.stdout.readline().strip()
        assert address, "the Ray cluster did not start"
        yield address
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()


def _run(*command, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
    )


def _final(log_dir):
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] == 40]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_on_ray_end_where_jdp_launch_does(cluster, tmp_path):
    on_ray = _run(
        "jdp.on_ray",
        "--address",
        cluster,
        *"--nproc 2 --devices-per-process 4 --".split(),
        *TRAIN,
        "--log-dir",
        str(tmp_path / "ray"),
    )
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert "2 processes on 2 Ray nodes" in on_ray.stderr
    assert "[Gloo]" not in on_ray.stdout + on_ray.stderr  # the peers' connection lines
    launched = _run(
        *"jdp.launch --nproc 2 --devices-per-process 4 --".split(),
        *TRAIN,
        "--log-dir",
        str(tmp_path / "launch"),
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    ray_final, launch_final = _final(tmp_path / "ray"), _final(tmp_path / "launch")
    # The same 2 x 4 devices, the same program and batches: the same bits.
    for got, expected in zip(ray_final, launch_final, strict=True):
        assert (got["kind"], got["loss"], got["accuracy"]) == (
            expected["kind"],
            expected["loss"],
            expected["accuracy"],
        )


@pytest.mark.slow
def test_a_failing_process_ends_the_run_with_its_exit_code(cluster):
    script = "import os, sys, time\nsys.exit(3) if os.environ['JDP_PROCESS_ID'] == '1' else "
    script += "time.sleep(300)"  # process 0 waits for a collective that never comes
    result = _run(
        "jdp.on_ray",
        "--address",
        cluster,
        *"--nproc 2 --grace 2 -- python -c".split(),
        script,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert "process 1 of 2 failed first (exit code 3)" in result.stderr
