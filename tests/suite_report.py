"""``python -m pytest --suite-report FILE``: where the suite's time goes, as markdown.

Per test file and per test: the wall time of its setup, call and teardown, and the
fresh processes it started (each ``subprocess.Popen``: a ``python -m jdp.*`` run, a
launcher, a server), each paying Python's, JAX's and the imports' start. With test
workers, each test's figures travel to the main process on its reports.
"""

from __future__ import annotations

import collections
import pathlib
import subprocess

import pytest

SLOWEST = 40  # tests listed one by one

_started = [0]  # processes this worker has started
_before: dict[str, int] = {}


def pytest_addoption(parser):
    parser.addoption(
        "--suite-report",
        metavar="FILE",
        default=None,
        help="write each file's and the slowest tests' time and fresh processes",
    )


def pytest_configure(config):
    if config.getoption("suite_report") is None:
        return
    config.pluginmanager.register(_Report(config.getoption("suite_report")), "suite-report")
    start = subprocess.Popen.__init__

    def counted(self, *args, **kwargs):
        _started[0] += 1
        start(self, *args, **kwargs)

    subprocess.Popen.__init__ = counted


class _Report:
    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.wall = collections.Counter()
        self.processes = collections.Counter()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        _before[item.nodeid] = _started[0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown":
            started = _started[0] - _before.pop(item.nodeid, _started[0])
            outcome.get_result().user_properties.append(("processes", started))

    def pytest_runtest_logreport(self, report):
        self.wall[report.nodeid] += report.duration
        for name, value in report.user_properties:
            if name == "processes" and report.when == "teardown":
                self.processes[report.nodeid] = value

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput") or not self.wall:
            return  # a worker: its reports went to the main process
        self.path.write_text(table(self.wall, self.processes))


def table(wall: dict[str, float], processes: dict[str, int]) -> str:
    """The report: each file's tests, wall and processes, slowest first; then the
    `SLOWEST` slowest tests."""
    files = collections.defaultdict(lambda: [0, 0.0, 0])
    for test, seconds in wall.items():
        row = files[test.split("::")[0]]
        row[0] += 1
        row[1] += seconds
        row[2] += processes.get(test, 0)
    total = [sum(row[i] for row in files.values()) for i in range(3)]
    lines = ["| file | tests | wall (s) | fresh processes |", "| --- | ---: | ---: | ---: |"]
    for name, (count, seconds, started) in sorted(files.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {count} | {seconds:.0f} | {started} |")
    lines.append(f"| all | {total[0]} | {total[1]:.0f} | {total[2]} |")
    lines += ["", "| test | wall (s) | fresh processes |", "| --- | ---: | ---: |"]
    for test, seconds in sorted(wall.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        lines.append(f"| `{test}` | {seconds:.1f} | {processes.get(test, 0)} |")
    return "\n".join(lines) + "\n"
