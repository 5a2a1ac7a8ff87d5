"""``python -m pytest --suite-report FILE``: where the suite's time goes, as markdown.

Per test file and per test: the wall time of its setup, call and teardown, the CPU
time they took, and the fresh processes it started (each ``subprocess.Popen``: a
``python -m jdp.*`` run, a launcher, a server), each paying Python's, JAX's and the
imports' start. With test workers, each test's figures travel to the main process on
its reports.

The CPU time is the budget on a machine whose cores are all busy: a test's wall there
is stretched by whatever runs beside it, its CPU much less so (two tests, alone and then
beside two busy loops on the 2-core machine: wall 25.5 and 19.9 s to 45.0 and 33.5 s,
CPU 25.2 and 22.1 s to 28.3 and 23.2 s). It is the worker process's own (every thread
of it) and that of the fresh processes it waited for, user and system, from the test's
setup to its teardown: a thread an earlier test left running counts here, and a child
reaped later (a killed loader worker) counts where it is reaped.
"""

from __future__ import annotations

import collections
import pathlib
import resource
import subprocess
import time

import pytest

SLOWEST = 40  # tests listed one by one

_started = [0]  # processes this worker has started
_lane = [0.0, 0.0, 0.0]  # when this run started; its workers' CPU seconds; the machine's pace
_before: dict[str, tuple[int, float]] = {}


def _cpu() -> float:
    """This process's CPU seconds and its waited-for children's, user and system."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def pytest_addoption(parser):
    parser.addoption(
        "--suite-report",
        metavar="FILE",
        default=None,
        help="write each file's and the slowest tests' time and fresh processes",
    )


def machine_pace(rounds: int = 3) -> float:
    """The CPU seconds of a fixed loop of Python arithmetic, the fastest of ``rounds``: the
    machine's single-core pace that day. The same code's lane took 35:14 on one day and
    15:47 on another on machines of the same name (docs/testing.md): a lane's time is read
    beside the pace it ran at."""
    fastest = float("inf")
    for _ in range(rounds):
        start, total = time.process_time(), 0
        for i in range(2_000_000):
            total += i * i % 7
        fastest = min(fastest, time.process_time() - start)
    return fastest


def pytest_configure(config):
    controller = not hasattr(config, "workerinput")
    _lane[:] = [time.monotonic(), 0.0, machine_pace() if controller else 0.0]
    if config.getoption("suite_report") is None:
        return
    config.pluginmanager.register(_Report(config.getoption("suite_report")), "suite-report")
    start = subprocess.Popen.__init__

    def counted(self, *args, **kwargs):
        _started[0] += 1
        start(self, *args, **kwargs)

    subprocess.Popen.__init__ = counted


def pytest_sessionfinish(session):
    """A worker's CPU, every thread and the fresh processes it waited for, to the main
    process (xdist carries ``workeroutput`` there)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["cpu"] = _cpu()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _lane[1] += getattr(node, "workeroutput", {}).get("cpu", 0.0)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """Every run ends with its wall and CPU time: the budget, in the run's own log."""
    if hasattr(config, "workerinput"):
        return
    wall = time.monotonic() - _lane[0]
    if _lane[1]:  # the workers' CPU, and this process's own (it collects, it reports)
        own = resource.getrusage(resource.RUSAGE_SELF)
        cpu = _lane[1] + own.ru_utime + own.ru_stime
    else:
        cpu = _cpu()
    terminalreporter.write_line(
        f"suite: {wall:.0f} s of wall, {cpu:.0f} s of CPU (user + system: the test "
        f"processes and the fresh processes they started), markers {config.option.markexpr!r}; "
        f"the machine's pace {_lane[2]:.3f} s (`machine_pace`)"
    )


class _Report:
    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.wall = collections.Counter()
        self.processes = collections.Counter()
        self.cpu = collections.Counter()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        _before[item.nodeid] = (_started[0], _cpu())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown":
            started, cpu = _before.pop(item.nodeid, (_started[0], _cpu()))
            properties = outcome.get_result().user_properties
            properties += [("processes", _started[0] - started), ("cpu", _cpu() - cpu)]

    def pytest_runtest_logreport(self, report):
        self.wall[report.nodeid] += report.duration
        for name, value in report.user_properties:
            if report.when == "teardown" and name in ("processes", "cpu"):
                getattr(self, name)[report.nodeid] = value

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput") or not self.wall:
            return  # a worker: its reports went to the main process
        self.path.write_text(table(self.wall, self.cpu, self.processes))


def table(wall: dict[str, float], cpu: dict[str, float], processes: dict[str, int]) -> str:
    """The report: each file's tests, wall, CPU and processes, costliest CPU first; then
    the `SLOWEST` costliest tests."""
    files = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for test, seconds in wall.items():
        row = files[test.split("::")[0]]
        row[0] += 1
        row[1] += seconds
        row[2] += cpu.get(test, 0.0)
        row[3] += processes.get(test, 0)
    total = [sum(row[i] for row in files.values()) for i in range(4)]
    lines = [
        "| file | tests | wall (s) | CPU (s) | fresh processes |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, (count, seconds, used, started) in sorted(files.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"| `{name}` | {count} | {seconds:.0f} | {used:.0f} | {started} |")
    lines.append(f"| all | {total[0]} | {total[1]:.0f} | {total[2]:.0f} | {total[3]} |")
    lines += ["", "| test | wall (s) | CPU (s) | fresh processes |", "| --- | ---: | ---: | ---: |"]
    for test in sorted(wall, key=lambda test: -cpu.get(test, 0.0))[:SLOWEST]:
        lines.append(
            f"| `{test}` | {wall[test]:.1f} | {cpu.get(test, 0.0):.1f} | {processes.get(test, 0)} |"
        )
    return "\n".join(lines) + "\n"
