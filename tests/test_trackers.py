"""Experiment trackers: an MLflow tracking server started here on 127.0.0.1 (and a local
store) gets what metrics.jsonl gets, read back with MLflow's own client; a resume logs on
in the same MLflow run; the server killed mid-run is one warning and the run finishes.
Weights & Biases in offline mode writes the same, read back with W&B's own reader
(``wandb leet inspect --json``)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import interop, subprocess_env

import jdp
from jdp.distributed.ports import free_port
from jdp.report import trackers
from jdp.report.trackers import Guarded, check_trackers

# MLflow's client on a local store warns of its own dependencies' deprecations (SQLAlchemy's).
pytestmark = [pytest.mark.interop, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

FLAGS = "--mesh data=1 --warmup-steps 4 --log-every 10 --tracker tensorboard,mlflow".split()
SERVER_START = 120  # seconds: MLflow's server took 16 s to answer on the busy 2-core machine


@pytest.fixture
def server(tmp_path):
    """``(uri, stop)``: an MLflow tracking server on 127.0.0.1, as a user starts one."""
    interop("mlflow", load=False)
    port = free_port()
    command = [
        sys.executable,
        *"-m mlflow server --host 127.0.0.1 --port".split(),
        str(port),
        *"--workers 1 --backend-store-uri".split(),
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--default-artifact-root",
        str(tmp_path / "artifacts"),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=subprocess_env(),
    )

    def stop():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the server and its workers
            process.wait()

    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START
    while not _answers(port):
        assert process.poll() is None and time.monotonic() < deadline, "no MLflow server"
        time.sleep(0.5)
    yield uri, stop
    stop()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _run(uri, log_dir, *flags, **popen):
    env = subprocess_env() | {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "tests"}
    command = [sys.executable, "-m", "jdp.train", *FLAGS, "--log-dir", str(log_dir), *flags]
    if popen:
        return subprocess.Popen(command, env=env, text=True, **popen)
    return subprocess.run(command, env=env, text=True, capture_output=True, timeout=240)


def _records(log_dir):
    with open(log_dir / "metrics.jsonl") as file:
        return [json.loads(line) for line in file]


def _check_same_as_jsonl(client, run_id, log_dir):
    """Every curve of every record of metrics.jsonl is in the MLflow run, value for value."""
    from jdp.report.writers import curves

    expected: dict[str, dict[int, float]] = {}
    for record in _records(log_dir):
        for name, value in curves(record).items():
            expected.setdefault(name, {})[record["step"]] = value
    assert {"train/loss", "train/lr", "eval/loss", "eval/accuracy"} <= set(expected)
    for name, by_step in expected.items():
        logged = {metric.step: metric.value for metric in client.get_metric_history(run_id, name)}
        assert logged == by_step, name  # floats through JSON and MLflow's doubles: exact


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_mlflow_server_gets_the_runs_metrics_params_and_checkpoint(server, tmp_path):
    (mlflow,) = interop("mlflow")  # here, not at import: the fast lane needs none
    uri, _ = server
    log_dir, ckpt = tmp_path / "log", tmp_path / "ckpt"
    first = _run(uri, log_dir, "--steps", "40", "--ckpt-dir", str(ckpt))
    assert first.returncode == 0, first.stderr
    client = mlflow.MlflowClient(tracking_uri=uri)
    run_id = json.loads((log_dir / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "log"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["lr"] == "0.003" and run.data.params["mesh"] == "{'data': 1}"
    assert run.data.tags["jdp.checkpoint"] == str(ckpt / "40")
    _check_same_as_jsonl(client, run_id, log_dir)

    resumed = _run(uri, log_dir, "--steps", "60", "--ckpt-dir", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr
    run = client.get_run(run_id)  # the same run, logged on
    assert run.data.tags["jdp.resumed"] == "true" and run.info.status == "FINISHED"
    assert run.data.tags["jdp.checkpoint"] == str(ckpt / "60")
    assert max(m.step for m in client.get_metric_history(run_id, "train/loss")) == 60
    _check_same_as_jsonl(client, run_id, log_dir)


@pytest.mark.slow
def test_a_local_mlflow_store_gets_the_same(tmp_path):
    (mlflow,) = interop("mlflow")  # here, not at import: the fast lane needs none
    uri = f"sqlite:///{tmp_path / 'local.db'}"
    result = _run(uri, tmp_path / "log", "--steps", "20")
    assert result.returncode == 0, result.stderr
    run_id = json.loads((tmp_path / "log" / "trackers.json").read_text())["mlflow"]
    _check_same_as_jsonl(mlflow.MlflowClient(tracking_uri=uri), run_id, tmp_path / "log")


@pytest.mark.slow
def test_a_kept_mlflow_run_the_server_lacks_is_named_and_a_new_one_logged(
    tmp_path, monkeypatch, capsys
):
    """trackers.json naming a run of another server (or one deleted): one warning naming
    the file, then a new run kept there; not the tracker dropped on every resume."""
    interop("mlflow", load=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'local.db'}")
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": "0123456789abcdef"}))
    tracker = trackers.MlflowTracker(str(tmp_path))
    tracker.close()
    warning = capsys.readouterr().err.strip().splitlines()[-1]
    assert warning.startswith(
        f"jdp: warning: the MLflow run 0123456789abcdef that "
        f"{tmp_path / 'trackers.json'} names is not on this tracking server"
    )
    assert warning.endswith("; logging to a new run") and not tracker.resumed
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == tracker.run_id
    assert trackers.MlflowTracker(str(tmp_path)).resumed  # the new one resumes from now on


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_server_killed_mid_run_is_one_warning_and_the_run_finishes(server, tmp_path):
    (mlflow,) = interop("mlflow")  # here, not at import: the fast lane needs none
    uri, stop = server
    log_dir = tmp_path / "log"
    # Long enough to go on after the server is gone: on the 2-core machine its first
    # metrics reached the server 35 s after the start (most of it the run's start), and
    # the steps left ran 26 s after the kill (30,000 steps took 113 s).
    process = _run(
        uri,
        log_dir,
        *"--steps 8000 --log-every 5".split(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    client = mlflow.MlflowClient(tracking_uri=uri)
    deadline = time.monotonic() + 180
    while True:  # until the run's first metrics reach the server
        assert process.poll() is None and time.monotonic() < deadline
        ids = log_dir / "trackers.json"
        if ids.exists() and client.get_metric_history(
            json.loads(ids.read_text())["mlflow"], "train/loss"
        ):
            break
        time.sleep(0.2)
    stop()
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    warnings = [line for line in stderr.splitlines() if "tracker failed" in line]
    assert len(warnings) == 1, stderr
    assert warnings[0].startswith("jdp: warning: the mlflow tracker failed (")
    assert warnings[0].endswith("training goes on without it")
    assert _records(log_dir)[-1]["step"] == 8000 or _records(log_dir)[-2]["step"] == 8000


@pytest.mark.slow
def test_no_server_at_the_start_is_one_warning_and_the_run_trains(tmp_path):
    interop("mlflow", load=False)  # the run is a fresh process
    result = _run(f"http://127.0.0.1:{free_port()}", tmp_path / "log", "--steps", "20")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "tracker failed" in line]
    assert len(warnings) == 1 and warnings[0].startswith("jdp: warning: the mlflow tracker")
    assert _records(tmp_path / "log")[-1]["step"] == 20  # metrics.jsonl is whole


def test_a_failing_tracker_warns_once_and_is_dropped(capsys):
    class Failing:
        calls = 0

        def write(self, record):
            self.calls += 1
            raise ConnectionError("the server is gone\nand more")

    failing = Failing()
    guarded = Guarded("mlflow", failing)
    guarded.write({})
    guarded.write({})
    assert failing.calls == 1
    assert capsys.readouterr().err == (
        "jdp: warning: the mlflow tracker failed (ConnectionError: the server is gone); "
        "training goes on without it\n"
    )
    guarded.flush()  # dropped: nothing more is asked of it
    assert failing.calls == 1


def test_bad_tracker_settings_are_one_line(monkeypatch):
    with pytest.raises(jdp.UsageError, match=r"choose from tensorboard, mlflow, wandb"):
        check_trackers("tensorboard,comet", "log")
    with pytest.raises(jdp.UsageError, match="add --log-dir DIR"):
        jdp.fit(jdp.TrainConfig(tracker="mlflow"), console=jdp.Console(enabled=False))
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(jdp.UsageError, match=r"needs mlflow: pip install 'jdp\[mlflow\]'"):
        check_trackers("mlflow", "log")
    check_trackers("none", None)  # metrics.jsonl alone


def _wandb_records(run_dir) -> list[dict]:
    """The records of a W&B offline run, as W&B's own reader prints them."""
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    result = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _wandb_run(log_dir, *flags):
    env = subprocess_env() | {"WANDB_MODE": "offline", "WANDB_PROJECT": "tests"}
    command = [
        sys.executable,
        "-m",
        "jdp.train",
        *FLAGS[:-1],
        "wandb",
        "--log-dir",
        str(log_dir),
        *flags,
    ]
    return subprocess.run(command, env=env, text=True, capture_output=True, timeout=240)


def _check_wandb_history(records, log_dir, steps):
    """W&B's history rows (a step's records merged into one row) hold every curve of
    metrics.jsonl's records at ``steps``, value for value."""
    from jdp.report.writers import curves

    expected: dict[int, dict[str, float]] = {}
    for record in _records(log_dir):
        if record["step"] in steps:
            expected.setdefault(record["step"], {}).update(curves(record))
    rows = {
        r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"
    }
    assert set(rows) == set(expected)
    for step, values in expected.items():
        logged = {name: value for name, value in rows[step].items() if not name.startswith("_")}
        assert logged == values, step  # JSON's doubles both ways: exact


@pytest.mark.slow
def test_wandb_offline_gets_the_runs_metrics_config_and_checkpoint(tmp_path):
    interop("wandb")
    log_dir, ckpt = tmp_path / "log", tmp_path / "ckpt"
    first = _wandb_run(log_dir, "--steps", "40", "--ckpt-dir", str(ckpt))
    assert first.returncode == 0 and "warning" not in first.stderr, first.stderr
    (run_dir,) = (log_dir / "wandb").glob("offline-run-*")
    records = _wandb_records(run_dir)
    (run,) = (r["run"] for r in records if r["type"] == "run")
    run_id = json.loads((log_dir / "trackers.json").read_text())["wandb"]
    assert run["run_id"] == run_id and run["project"] == "tests" and run["display_name"] == "log"
    config = {}
    for record in records:
        if record["type"] == "config":
            config.update(record["config"]["update"])
    assert config["lr"] == 0.003 and config["mesh"] == {"data": 1}
    summary = {}
    for record in records:
        if record["type"] == "summary":
            summary.update(record["summary"]["update"])
    assert summary["jdp.checkpoint"] == str(ckpt / "40")
    _check_wandb_history(records, log_dir, steps=range(41))

    resumed = _wandb_run(log_dir, "--steps", "60", "--ckpt-dir", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr
    later = [d for d in (log_dir / "wandb").glob("offline-run-*") if d != run_dir]
    (again,) = later  # the same run id, logged on from step 41 (wandb sync joins them)
    records = _wandb_records(again)
    assert next(r["run"] for r in records if r["type"] == "run")["run_id"] == run_id
    _check_wandb_history(records, log_dir, steps=range(41, 61))


@pytest.mark.slow
def test_wandb_online_without_a_key_is_one_warning_never_a_prompt(tmp_path):
    interop("wandb")
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("WANDB_")}
    command = [
        sys.executable,
        "-m",
        "jdp.train",
        *FLAGS[:-1],
        "wandb",
        "--log-dir",
        str(tmp_path / "log"),
        "--steps",
        "20",
    ]
    result = subprocess.run(
        command,
        env=env | {"HOME": str(tmp_path)},
        text=True,
        capture_output=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "jdp: warning: the wandb tracker failed (RuntimeError: no W&B API key: "
        "run wandb login, or set WANDB_MODE=offline); training goes on without "
        "it"
    ]
