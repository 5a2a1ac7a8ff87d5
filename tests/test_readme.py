"""README.md's figures table holds what its commands print."""

import os
import pathlib
import platform

import pytest
from helpers import run_python

from tools import numerics, readme

ROOT = pathlib.Path(__file__).parent.parent
HERE = "0123456789ab"  # a fingerprint standing for this machine's
ELSEWHERE = "ba9876543210"  # one recorded on a machine whose numerics differ

TABLE = """Recorded with: {settings}.

| command | test accuracy | on another CPU | wall | examples/s |
| --- | --- | --- | --- | --- |
| `python -m jdp.train --mesh data=8` | 0.9666 | ±0.0084 | 5.2 s | 53,811 |
| `python -m jdp.train --model gpt` | 1.0000 (exact match) | ±0.0005 | 45.4 s | 961 |

After the table.
"""


def _now(rows, first, second="1.0000"):
    return [
        readme.Row(rows[0].command, first, "", "0.0084", "4.0", "60,000"),
        readme.Row(rows[1].command, second, " (exact match)", "0.0005", "40.1", "1,600"),
    ]


def test_the_table_is_read_rewritten_and_checked_exactly_on_its_numerics():
    text = TABLE.format(settings=readme.settings(HERE))
    rows = readme.table(text)
    assert [row.command for row in rows] == [
        "python -m jdp.train --mesh data=8",
        "python -m jdp.train --model gpt",
    ]
    assert (rows[1].note, rows[0].tolerance) == (" (exact match)", "0.0084")
    assert readme.recorded_numerics(text) == HERE
    now = _now(rows, "0.9694")
    # Same fingerprint: the runs are bit-identical, so one example is a stale figure.
    assert readme.check(text, now, HERE) == [
        "python -m jdp.train --mesh data=8: README 0.9666, printed 0.9694"
    ]
    # Rewriting sets every row and records this machine's settings and fingerprint.
    elsewhere = TABLE.format(settings="JAX 0.0.1, 1 x another CPU, numerics " + ELSEWHERE)
    rewritten = readme.rewrite(elsewhere, rows, now, HERE)
    expected = text.replace(
        "| 0.9666 | ±0.0084 | 5.2 s | 53,811 |", "| 0.9694 | ±0.0084 | 4.0 s | 60,000 |"
    )
    expected = expected.replace("| 45.4 s | 961 |", "| 40.1 s | 1,600 |")
    assert rewritten == expected
    assert readme.check(rewritten, now, HERE) == []


def test_another_machines_table_is_checked_within_each_rows_tolerance():
    text = TABLE.format(settings="JAX 0.10.2, 2 x AMD EPYC, numerics " + ELSEWHERE)
    rows = readme.table(text)
    # 0.9721 is 0.0055 away: within ±0.0084, as another CPU's trajectory may land.
    assert readme.check(text, _now(rows, "0.9721"), HERE) == []
    assert readme.check(text, _now(rows, "0.9582"), HERE) == []  # 0.0084 away: the limit
    # A planted wrong figure beyond the tolerance still fails, on either row.
    assert readme.check(text, _now(rows, "0.9555"), HERE) == [
        "python -m jdp.train --mesh data=8: README 0.9666 ±0.0084 on another CPU, printed 0.9555"
    ]
    assert readme.check(text, _now(rows, "0.9666", "0.9985"), HERE) == [
        "python -m jdp.train --model gpt: README 1.0000 ±0.0005 on another CPU, printed 0.9985"
    ]
    # A table recorded before fingerprints existed is never compared exactly.
    old = TABLE.format(settings="JAX 0.10.2, 2 x AMD EPYC")
    assert readme.recorded_numerics(old) is None
    assert readme.check(old, _now(rows, "0.9721"), HERE) == []


def test_a_tolerance_is_the_spread_of_the_reruns_and_at_least_one_example():
    # Four reruns of a row on 359 test images: 0.9666 to 0.9749 is 3 examples (0.00836).
    assert readme.tolerance(["0.9666", "0.9749", "0.9694", "0.9694", "0.9666"], 359) == "0.0084"
    # Runs that all agree still allow one borderline example to flip (1/359 = 0.00279).
    assert readme.tolerance(["0.9666"] * 5, 359) == "0.0028"
    assert readme.tolerance(["1.0000"] * 5, 2000) == "0.0005"


def test_the_rows_run_as_typed_not_as_the_suite_compiles(monkeypatch):
    """The suite's device count and compiler effort (conftest.py) are not the rows':
    figures recorded at XLA's defaults are compared with runs at its defaults."""
    suite = os.environ["XLA_FLAGS"]  # as conftest.py set it for this session
    assert "--xla_backend_optimization_level" in suite
    monkeypatch.setenv("XLA_FLAGS", suite + " --xla_cpu_max_isa=AVX2")
    assert readme.row_env()["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
    assert readme.row_env("--xla_cpu_max_isa=AVX")["XLA_FLAGS"].endswith(
        "=AVX2 --xla_cpu_max_isa=AVX"
    )
    monkeypatch.setenv("XLA_FLAGS", suite)
    assert "XLA_FLAGS" not in readme.row_env()


@pytest.mark.slow
def test_the_fingerprint_changes_with_the_vector_code_xla_emits():
    """Another CPU, simulated: the same machine told to compile for AVX only gives
    other float32 bits, so a table recorded there is not compared exactly here."""
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in numerics.cpu_identity():
        pytest.skip("needs an x86 CPU with AVX2, whose vector code AVX-only code differs from")
    native = readme.machine_numerics(readme.row_env())
    avx = readme.machine_numerics(readme.row_env("--xla_cpu_max_isa=AVX"))
    assert len(native) == len(avx) == 12 and native != avx
    assert native == readme.machine_numerics(readme.row_env())  # and it is deterministic


# The scheduled lane: 21 full training runs, a quarter of the whole suite's CPU. Per change,
# tests/test_cli.py runs the first command as typed, and the in-process equivalence tests
# (tests/test_layout.py, test_step.py, test_distributed.py, test_models.py, test_optim.py)
# each row's path; the checker itself is the tests above.
# Two halves of about equal cost, one a worker: the language model's 200 steps with the
# small MLP rows, the CNNs, ResNet-20 and sequence models with the rest.
HALVES = {"lm-and-mlps": [13, *range(8)], "convnets-and-seq": [*range(8, 13), *range(14, 21)]}


def test_the_halves_hold_every_row_once():
    rows = readme.table((ROOT / "README.md").read_text())
    assert sorted(row for half in HALVES.values() for row in half) == list(range(len(rows)))


@pytest.mark.timeout(1500)
@pytest.mark.slow
@pytest.mark.scheduled
@pytest.mark.parametrize("half", HALVES)
def test_the_readme_figures_are_what_their_commands_print(half):
    rows = ",".join(map(str, HALVES[half]))
    result = run_python(
        "-m", "tools.readme", "--check", "--rows", rows, timeout=1500, cwd=ROOT
    )  # the project's tools run from a checkout's root
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    count = len(HALVES[half])
    assert f"{count} of {count} rows hold" in result.stdout, result.stdout
