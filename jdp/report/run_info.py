"""``config.json`` and ``run.json``: what a run directory needs to rerun and compare it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

import jax

from jdp.report.bookkeeping import mapping_of, read_or_set_aside
from jdp.version import __version__


def write_run_info(log_dir: str, config: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
    """Writes ``config.json`` and ``run.json`` (versions, mesh, devices): enough to rerun it.

    A run resumed into the same directory keeps the first start's files and adds
    its own facts to ``run.json``'s ``resumed`` list.
    """
    import flax
    import optax

    os.makedirs(log_dir, exist_ok=True)
    devices = jax.devices()
    run = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": _command_line(),
        "versions": {
            "jdp": __version__,
            "jax": jax.__version__,
            "jaxlib": jax.lib.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "python": platform.python_version(),
        },
        "platform": devices[0].platform,
        "device_kinds": sorted({device.device_kind for device in devices}),
        "devices": len(devices),
        "processes": jax.process_count(),
        **facts,
    }
    run_path = os.path.join(log_dir, "run.json")
    first = read_or_set_aside(run_path, mapping_of(object))
    if first is not None:
        first.setdefault("resumed", []).append(run)
        run = first
    if not os.path.exists(os.path.join(log_dir, "config.json")):
        write_json(os.path.join(log_dir, "config.json"), dict(config))
    write_json(run_path, run)


def record_goodput(log_dir: str, accounting: Mapping[str, Any]) -> None:
    """Puts the run's goodput accounting (`jdp.report.goodput.summarize`) in ``run.json``."""
    path = os.path.join(log_dir, "run.json")
    run = read_or_set_aside(path, mapping_of(object)) or {}
    run["goodput"] = dict(accounting)
    write_json(path, run)


def write_json(path: str, value: Any) -> None:
    """Writes ``path`` whole or not at all: into a temporary file, then renamed over it."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as file:
        json.dump(value, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _command_line() -> list[str]:
    """This process's command as typed: ``python -m jdp.train ...`` rather than a file path."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return ["python", *sys.argv]
