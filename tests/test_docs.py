"""Every shell command in the docs that can run here runs, as the docs give it.

A bash block runs whole, in a copy of the repository, after CI's own install
(so a leading ``pip install ... &&`` is done already). A block may declare a
smoke form in the line before it, ``<!-- smoke: FLAGS -->``: FLAGS are added to
each ``python -m jdp...`` command in it, so benchmarks run in seconds. Blocks
for a cluster (Slurm, Kubernetes, Cloud TPU tools) are recipes for there, and
TensorBoard is a server that runs until stopped: those lines are the only ones
left out, each for that reason. A block whose every command is a row of the
README's figures table is not run twice: the table's check runs it whole in the
scheduled lane (tests/test_readme.py), and a per-change test runs its path at a
smaller size; nor is a benchmark's smoke run that tests/test_bench.py makes with the
same flags (`helpers.BENCH_RUNS`). Blocks whose code path another test runs are in
the scheduled lane (`SCHEDULED`).
"""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from helpers import BENCH_RUNS, interop, subprocess_env

from tools import readme

ROOT = pathlib.Path(__file__).parent.parent
DOCS = [
    "README.md",
    "docs/library.md",
    "docs/cli.md",
    "docs/data.md",
    "docs/models.md",
    "docs/sharding.md",
    "docs/diloco.md",
    "docs/multihost.md",
    "docs/checkpoints.md",
    "docs/observability.md",
    "docs/performance.md",
    "docs/examples.md",
    "docs/layout.md",
    "docs/figures.md",
    "docs/testing.md",
    "docs/adopt.md",
    "colab/README.md",
]
CLUSTER_TOOLS = ("srun", "sbatch", "gcloud", "kubectl")
BLOCK = re.compile(r"(?:<!-- smoke: (?P<smoke>[^>]*?) -->\n)?```bash\n(?P<body>.*?)```", re.S)


# The README's figures rows: tests/test_readme.py runs each whole, in a fresh process.
ROW = "a README figures row, run whole in the scheduled lane"
FIGURES = {row.command for row in readme.table((ROOT / "README.md").read_text())}
# A benchmark's smoke run that tests/test_bench.py makes, in the same environment.
BENCH_TESTS = {f"python -m jdp.bench {name} {flags}" for name, flags in BENCH_RUNS.items()}


def _blocks():
    """(doc, index, script or None, why left out) for every bash block of the docs."""
    for doc in DOCS:
        for index, match in enumerate(BLOCK.finditer((ROOT / doc).read_text())):
            body, smoke = match.group("body"), match.group("smoke")
            words = set(re.findall(r"[\w.-]+", body))
            if words & set(CLUSTER_TOOLS):
                yield doc, index, None, "a recipe for a cluster"
                continue
            commands = re.sub(r"^pip install \S+ && ", "", body.replace("\\\n", " "), flags=re.M)
            commands = [" ".join(line.split()) for line in commands.strip().splitlines()]
            if commands and all(command in FIGURES for command in commands):
                yield doc, index, None, ROW
                continue
            lines, in_jdp = [], False
            for line in body.splitlines():
                line = re.sub(r"^pip install \S+ && ", "", line)  # CI installed jdp
                if line.startswith(("tensorboard ", "python -m pytest")):
                    continue  # a server; the suite this test belongs to
                # The smoke flags are the run's (train, bench, a launched train), not a tool's
                # that prepares its data (jdp.data).
                runs = line.startswith(
                    ("python -m jdp.train", "python -m jdp.bench", "python -m jdp.launch")
                )
                in_jdp = runs or (in_jdp and lines[-1].endswith("\\"))
                if smoke and in_jdp and not line.endswith("\\"):  # a command's last line
                    line += f" {smoke}"  # after the command's own flags, so the smoke's win
                lines.append(line)
            script = "\n".join(lines).strip()
            if script in BENCH_TESTS:
                yield doc, index, None, "tests/test_bench.py runs it so"
                continue
            yield doc, index, script or None, "nothing runnable here" if not script else ""


BLOCKS = list(_blocks())


def test_every_block_runs_or_says_why_not():
    runnable = {(doc, index) for doc, index, script, _ in BLOCKS if script}
    assert set(SCHEDULED) <= runnable, sorted(set(SCHEDULED) - runnable)
    left_out = {(doc, index): why for doc, index, script, why in BLOCKS if script is None}
    assert left_out == {
        ("README.md", 0): ROW,  # per change: tests/test_cli.py
        ("README.md", 1): "nothing runnable here",  # pip install '.[test]' && python -m pytest
        ("README.md", 3): ROW,  # per change: tests/test_tokens.py
        ("docs/multihost.md", 0): ROW,  # per change: tests/test_distributed.py
        ("docs/performance.md", 2): "tests/test_bench.py runs it so",  # dispatch
        ("docs/performance.md", 5): "tests/test_bench.py runs it so",  # lm
        ("docs/performance.md", 6): "tests/test_bench.py runs it so",  # keras
        ("docs/performance.md", 7): "tests/test_bench.py runs it so",  # diloco
        ("docs/multihost.md", 2): "a recipe for a cluster",  # Slurm
        ("docs/multihost.md", 3): "a recipe for a cluster",  # Cloud TPU
    }


# Blocks in the scheduled lane (tests/conftest.py), each with the per-change test that runs
# its code path: a benchmark's docs form whose benchmark tests/test_bench.py runs, or a
# block another block runs whole.
SCHEDULED = {
    ("docs/data.md", 0): (
        "tests/test_images.py's pack, packed form and --loader-workers 1 on images; "
        "tests/test_recipes.py's ResNet-50 on image files"
    ),
    ("docs/data.md", 1): "tests/test_tokenize.py, tests/test_tokens.py's stdlib run",
    ("docs/data.md", 2): "tests/test_tokenize.py, tests/test_tokens.py, tests/test_generate.py",
    ("docs/performance.md", 0): "tests/test_bench.py's step sweep",
    ("docs/performance.md", 1): "tests/test_bench.py's step sweep",
    ("docs/performance.md", 3): "tests/test_bench.py's step sweep",
    ("docs/performance.md", 4): "tests/test_bench.py's dispatch run",
    ("docs/performance.md", 8): "tests/test_bench.py's diloco run",
    ("docs/performance.md", 9): "tests/test_bench.py's input run and loader window",
}


def _marks(doc, index, script):
    marks = [pytest.mark.interop] if _needs(script) else []
    return marks + ([pytest.mark.scheduled] if (doc, index) in SCHEDULED else [])


# What a block runs that only the interop extra installs, by a word it holds.
INTEROP_WORDS = {"transformers": "transformers", "jdp.bench keras": "keras"}


def _needs(script: str) -> list[str]:
    return [module for word, module in INTEROP_WORDS.items() if word in script]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "script",
    [
        pytest.param(script, marks=_marks(doc, index, script))
        for doc, index, script, _ in BLOCKS
        if script
    ],
    ids=[f"{doc}#{index}" for doc, index, script, _ in BLOCKS if script],
)
@pytest.mark.slow
def test_a_documented_block_runs(script, tmp_path):
    interop(*_needs(script), load=False)
    repository = tmp_path / "repository"
    shutil.copytree(
        ROOT,
        repository,
        ignore=shutil.ignore_patterns(".git", ".whl", "*.egg-info", "__pycache__", "runs"),
    )
    env = subprocess_env()
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"  # `python` is this one
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=repository,
        env=env,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_the_readmes_library_example_runs_as_pasted(tmp_path):
    """Pasted into a script on a laptop (one CPU device), it runs."""
    (example,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "1.0"], result.stdout


# Pages whose Python blocks are each a complete program, run as written: what each prints
# last, a float to the digits a float32 result shows (8 EPS32 relative: a few rounded steps).
PYTHON_PAGES = {
    "docs/library.md": [[1, 1.0], ["None"]],
    "docs/adopt.md": [[1, 1.0], [1, 2, 0.04]],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("doc", "index"), [(doc, i) for doc, lasts in PYTHON_PAGES.items() for i in range(len(lasts))]
)
def test_a_python_block_runs_as_written(doc, index, tmp_path):
    """Pasted into a script on a laptop (one CPU device: each simulates its own), it runs
    and prints what the page says."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
    assert len(blocks) == len(PYTHON_PAGES[doc]), f"{doc}: a block without its check here"
    script = tmp_path / "block.py"
    script.write_text(blocks[index])
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.strip().splitlines()[-1].split()
    expected = PYTHON_PAGES[doc][index]
    assert len(printed) == len(expected), printed
    for word, want in zip(printed, expected, strict=True):
        if isinstance(want, float):
            assert float(word) == pytest.approx(want, rel=8 * 1.2e-7), printed
        else:
            assert word == str(want), printed


# A newcomer reads the README in five minutes; everything else is a docs page it links.
README_LIMIT = 12_000
LINK = re.compile(r"\]\((?P<target>[^)\s#]+\.md)(?:#(?P<anchor>[^)\s]+))?\)")


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_readme_is_short_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text) < README_LIMIT, f"README.md is {len(text):,} characters; move text to docs/"
    linked = {match.group("target") for match in LINK.finditer(text)}
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    page = ROOT / doc
    for match in LINK.finditer(page.read_text()):
        target = (page.parent / match.group("target")).resolve()
        assert target.exists(), f"{doc} links to {match.group('target')}, which does not exist"
        anchor = match.group("anchor")
        assert anchor is None or anchor in _anchors(target), f"{doc}: no #{anchor} in {target}"


def test_the_layout_names_every_module():
    """docs/layout.md names each module of the package and of the tools beside it: by its
    path, its file name in its folder's row, or its name in the layers' table."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    missing = []
    for path in sorted([*(ROOT / "jdp").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":  # the folder's face: the folder's row, or its layer's
            folder = path.parent.relative_to(ROOT).as_posix()
            faces = (f"`{folder}/`", f"`{folder.removeprefix('jdp/')}/`", relative)
            named = any(face in layout for face in faces)
        else:
            named = relative in layout or f"`{path.name}`" in layout or f"`{path.stem}`" in layout
        missing += [] if named else [relative]
    assert missing == []
