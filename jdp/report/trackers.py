"""Experiment trackers behind the writer interface: ``--tracker tensorboard,mlflow,wandb``.

Every tracker gets what ``metrics.jsonl`` gets, under the names TensorBoard shows
(``train/loss``, ``test/accuracy``, ``perf/examples_per_sec``); a tracker with
``describe`` also gets the run's config and facts once (``run.json``'s), and with
``tag`` the final checkpoint's path. Only process 0 logs (`MetricLogger`). A
tracker that fails (its server gone) is one warning, and the run goes on without it.

MLflow (``pip install 'jdp[mlflow]'``) logs to ``MLFLOW_TRACKING_URI`` (MLflow's
default otherwise), in the experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``jdp``),
a run named after ``--log-dir``; the run's id is kept in ``LOG_DIR/trackers.json``,
so a resumed run logs on in the same MLflow run.

Weights & Biases (``pip install 'jdp[wandb]'``) logs to the project ``WANDB_PROJECT``
(default ``jdp``), a run named after ``--log-dir`` whose files W&B keeps in
``LOG_DIR/wandb``; ``WANDB_MODE=offline`` writes there only (``wandb sync`` uploads
it later). Its id is kept in ``trackers.json`` too: a resume logs on in the same run.
Without a key (``wandb login``) an online run is one warning, never a prompt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from jdp.errors import UsageError
from jdp.report.bookkeeping import mapping_of, read_or_set_aside
from jdp.report.writers import JsonlWriter, TensorBoardWriter, Writer, curves

TRACKERS = {"tensorboard": None, "mlflow": "mlflow", "wandb": "wandb"}  # name -> its module
_IDS = "trackers.json"  # in the run directory: each tracker's run, for a resume
# Seconds an MLflow request may take, and its retries, unless you set MLflow's own
# variables: a tracking server that went away costs the writer thread seconds, not
# MLflow's default of minutes of retries.
_MLFLOW_TIMEOUT, _MLFLOW_RETRIES = "10", "1"
_PARAMS_PER_CALL = 100  # MLflow takes at most this many parameters a request


def tracker_names(setting: str) -> list[str]:
    """``--tracker``'s names (``none``: only ``metrics.jsonl``)."""
    names = [name.strip() for name in setting.split(",") if name.strip()]
    return [] if names == ["none"] else names


def check_trackers(setting: str, log_dir: str | None) -> None:
    """UsageError (one line) for an unknown tracker, a missing package or no ``--log-dir``."""
    names = tracker_names(setting)
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or (not names and setting.strip() != "none"):
        raise UsageError(
            f"--tracker {setting!r}: choose from {', '.join(TRACKERS)} (comma-separated), or none"
        )
    trackers = [name for name in names if TRACKERS[name]]
    if trackers and not log_dir:
        raise UsageError(
            f"--tracker {','.join(trackers)} logs a run directory's metrics: add --log-dir DIR"
        )
    for name in trackers:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise UsageError(f"--tracker {name} needs {name}: pip install 'jdp[{name}]'")


_STEPS = ("write", "flush", "close", "describe", "tag")  # what the metric logger asks


class Guarded:
    """A tracker whose failure is one warning: the run goes on, the tracker is dropped."""

    def __init__(self, name: str, tracker):
        self.name, self.tracker = name, tracker

    def __getattr__(self, method: str):
        if self.tracker is None:  # dropped: what a writer is asked does nothing
            if method in _STEPS:
                return lambda *args, **kwargs: None
            raise AttributeError(method)
        call = getattr(self.tracker, method)  # AttributeError: the tracker has no such step

        def guarded(*args, **kwargs):
            if self.tracker is None:
                return None
            try:
                return call(*args, **kwargs)
            except Exception as error:  # any failure of a third party's client
                self.tracker = None
                _warn(self.name, error)
            return None

        return guarded


def _warn(name: str, error: Exception) -> None:
    text = str(error).strip().splitlines()
    said = text[0][:200] if text else "no message"
    print(
        f"jdp: warning: the {name} tracker failed ({type(error).__name__}: {said}); "
        "training goes on without it",
        file=sys.stderr,
        flush=True,
    )


def open_writers(log_dir: str, trackers: Sequence[str] = ("tensorboard",)) -> list[Writer]:
    """A run directory's ``metrics.jsonl``, and the trackers named."""
    os.makedirs(log_dir, exist_ok=True)
    writers: list[Writer] = [JsonlWriter(os.path.join(log_dir, "metrics.jsonl"))]
    if "tensorboard" in trackers:
        writers.append(TensorBoardWriter(log_dir))
    for name, tracker in (("mlflow", MlflowTracker), ("wandb", WandbTracker)):
        if name in trackers:
            try:  # a server that is not there at the start is a warning too
                writers.append(Guarded(name, tracker(log_dir)))
            except Exception as error:  # any failure of a third party's client
                _warn(name, error)
    return writers


def _run_ids(log_dir: str) -> dict[str, str]:
    return read_or_set_aside(os.path.join(log_dir, _IDS), mapping_of(str)) or {}


def _keep_run_id(log_dir: str, tracker: str, run_id: str) -> None:
    ids = _run_ids(log_dir) | {tracker: run_id}
    with open(os.path.join(log_dir, _IDS), "w") as file:
        json.dump(ids, file, indent=2)


class MlflowTracker:
    """One MLflow run per run directory, through MLflow's client (no global run)."""

    def __init__(self, log_dir: str):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", _MLFLOW_TIMEOUT)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", _MLFLOW_RETRIES)
        from mlflow import MlflowClient

        self.client, self.log_dir = MlflowClient(), log_dir
        self.run_id = _run_ids(log_dir).get("mlflow")
        self.resumed = self.run_id is not None
        if self.resumed:
            from mlflow.exceptions import MlflowException

            try:
                self.client.update_run(self.run_id, status="RUNNING")
            except MlflowException as error:  # not on this server: another URI, or deleted
                if error.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                    raise  # the server failing: the tracker's one warning (`Guarded`)
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                print(
                    f"jdp: warning: the MLflow run {self.run_id} that "
                    f"{os.path.join(log_dir, _IDS)} names is not on this tracking server "
                    f"({reason}); logging to a new run",
                    file=sys.stderr,
                    flush=True,
                )
                self.run_id, self.resumed = None, False
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "jdp")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(name)
            )
            run_name = os.path.basename(os.path.abspath(log_dir))
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            _keep_run_id(log_dir, "mlflow", self.run_id)

    def describe(self, config: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
        from mlflow.entities import Param, RunTag

        if self.resumed:  # its parameters are logged; MLflow refuses another value for one
            self.client.log_batch(self.run_id, tags=[RunTag("jdp.resumed", "true")])
            return
        params = [Param(key, str(value)[:6000]) for key, value in {**config, **facts}.items()]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + _PARAMS_PER_CALL])

    def write(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(record["time"] * 1000)
        metrics = [
            Metric(key, float(value), stamp, record["step"])
            for key, value in curves(record).items()
            if value is not None and not isinstance(value, str)
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def tag(self, name: str, value: str) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(name, value)])

    def flush(self) -> None:
        pass  # each write is a request of its own

    def close(self) -> None:
        self.client.set_terminated(self.run_id, end_time=int(time.time() * 1000))


class WandbTracker:
    """One W&B run per run directory (``wandb.init`` with the kept id, ``resume="allow"``)."""

    def __init__(self, log_dir: str):
        import wandb

        offline = os.environ.get("WANDB_MODE", "") in ("offline", "disabled", "dryrun")
        if not offline and not wandb.login(prompt=False):
            raise RuntimeError("no W&B API key: run wandb login, or set WANDB_MODE=offline")
        self.run_id = _run_ids(log_dir).get("wandb")
        self.resumed = self.run_id is not None
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex[:12]  # letters and digits, as W&B ids are
            _keep_run_id(log_dir, "wandb", self.run_id)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "jdp"),
            name=os.path.basename(os.path.abspath(log_dir)),
            id=self.run_id,
            resume="allow",
            dir=log_dir,
            settings=wandb.Settings(console="off", silent=True),
        )

    def describe(self, config: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
        if self.resumed:
            self.run.summary["jdp.resumed"] = True
        self.run.config.update({**config, **facts}, allow_val_change=True)

    def write(self, record: Mapping[str, Any]) -> None:
        values = {
            key: float(value)
            for key, value in curves(record).items()
            if value is not None and not isinstance(value, str)
        }
        self.run.log(values, step=record["step"])

    def tag(self, name: str, value: str) -> None:
        self.run.summary[name] = value

    def flush(self) -> None:
        pass  # W&B's own process writes and uploads

    def close(self) -> None:
        self.run.finish()
