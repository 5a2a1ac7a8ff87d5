"""README.md's figures table holds what its commands print."""

import pytest
from helpers import run_python

from jdp.bench import readme

TABLE = """Recorded with: {settings}.

| command | test accuracy | wall | examples/s |
| --- | --- | --- | --- |
| `python -m jdp.train --mesh data=8` | 0.9666 | 5.2 s | 53,811 |
| `python -m jdp.train --model gpt --dataset numbers2words` | 1.0000 (exact match) | 45.4 s | 961 |

After the table.
"""


def test_the_table_is_read_rewritten_and_checked():
    text = TABLE.format(settings=readme.settings())
    rows = readme.table(text)
    assert [row.command for row in rows] == [
        "python -m jdp.train --mesh data=8",
        "python -m jdp.train --model gpt --dataset numbers2words",
    ]
    assert rows[1].note == " (exact match)"
    now = [
        readme.Row(rows[0].command, "0.9694", "", "4.0", "60,000"),
        readme.Row(rows[1].command, "1.0000", " (exact match)", "40.1", "1,600"),
    ]
    assert readme.check(text, now) == [
        "python -m jdp.train --mesh data=8: README 0.9666, printed 0.9694"
    ]
    # Rewriting sets every row and records this machine's settings.
    rewritten = readme.rewrite(TABLE.format(settings="JAX 0.0.1, 1 x another CPU"), rows, now)
    expected = text.replace("| 0.9666 | 5.2 s | 53,811 |", "| 0.9694 | 4.0 s | 60,000 |")
    expected = expected.replace("| 45.4 s | 961 |", "| 40.1 s | 1,600 |")
    assert rewritten == expected
    assert readme.check(rewritten, now) == []
    # Figures recorded elsewhere are not compared exactly here: only read.
    assert readme.check(TABLE.format(settings="JAX 0.0.1, 1 x another CPU"), now) == []


@pytest.mark.timeout(1500)
def test_the_readme_figures_are_what_their_commands_print():
    result = run_python("-m", "jdp.bench", "readme", "--check", timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "20 of 20 rows hold" in result.stdout, result.stdout
