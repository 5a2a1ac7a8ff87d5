"""The suite's own report (``--suite-report``): what it sums, and in which order."""

from suite_report import table


def test_files_and_tests_come_costliest_cpu_first_with_their_sums():
    wall = {"tests/a.py::one": 30.0, "tests/a.py::two": 1.0, "tests/b.py::three": 5.0}
    cpu = {"tests/a.py::one": 2.0, "tests/a.py::two": 1.0, "tests/b.py::three": 9.0}
    report = table(wall, cpu, {"tests/a.py::one": 1}).splitlines()
    assert report[2:5] == [
        "| `tests/b.py` | 1 | 5 | 9 | 0 |",  # the most CPU, if not the longest wall: first
        "| `tests/a.py` | 2 | 31 | 3 | 1 |",
        "| all | 3 | 36 | 12 | 1 |",
    ]
    assert [line.split("`")[1] for line in report[8:]] == [
        "tests/b.py::three",
        "tests/a.py::one",
        "tests/a.py::two",
    ]
