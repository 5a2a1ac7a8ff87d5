"""``python -m jdp.bench gpu``: its smoke run (every part at toy sizes on the CPU, the JSON,
the table), the offline bundle's dependency list against a fake ``pip list``, and the
docs' generator, so that the command cannot rot between the runs on an accelerator."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.bench import arms, common, gpu_host, gpu_table
from jdp.bench.gpu import PARTS
from jdp.bench.gpu_models import GPT2_CELLS
from jdp.bench.levers import LEVERS
from tests.helpers import run_tool
from tools import bundle, gpu_docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_RUNS = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs" / "gpu").glob("*.json"))


def bench(*flags):
    return run_tool("jdp.bench.__main__", "gpu", *flags)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    result = bench("--smoke", "--gpt2-profile", "--levers", "all", "--out", out)
    return result, json.loads(out.read_text()), out


@pytest.mark.slow  # a benchmark's smoke run: every part compiled, about a minute
def test_smoke_runs_every_part_and_lands_each_in_the_json(smoke):
    result, data, _ = smoke
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert list(data["parts"]) == list(PARTS)
    for part, landed in data["parts"].items():
        assert "error" not in landed, (part, landed["error"])
    gpt = data["parts"]["gpt2"]["cells"][0]
    assert gpt["check"]["agree"] and gpt["check"]["same_params"], gpt["check"]
    # The smoke cell turns every compiler setting the GPU cells turn one at a time.
    assert gpt["cell"]["xla"] == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert gpt["cell"]["optimization"] == "O1"
    assert gpt["cell"]["loss_chunks"] == 8  # and jdp's arm takes its loss in chunks
    assert gpt["cell"]["fp8"] and gpt["plan"]["fp8"]  # and both arms' products in FP8
    # --gpt2-profile traced both arms (a CPU's trace names no kernels, and says so).
    assert {arm: traced["steps"] for arm, traced in gpt["kernels"].items()} == {
        "hand-written": 6,
        "jdp": 6,
    }
    assert "    kernels: none in the trace (a CPU's XLA names none" in result.stdout
    # What the planner predicted for the cell, compiled in a CPU process of its own: the
    # cell's parameters and optimizer state exactly, and bytes beyond them.
    plan = gpt["plan"]
    assert plan["parameters"] == gpt["params"], plan
    assert plan["need"] > plan["params"] + plan["optimizer"] > 0, plan
    assert "    plan: needs " in result.stdout
    assert not jax.config.read("jax_disable_most_optimizations")  # the smoke's, restored
    assert jax.config.jax_optimization_level == "UNKNOWN"
    loader = data["parts"]["loader"]  # timed once each worker has started
    assert (loader["warm_batches"], loader["timed_batches"]) == common.worker_window(
        loader["workers"], 2
    ), loader
    overhead = data["parts"]["sweep"]["cases"][0]["overhead"]  # host time a call, by arm
    assert list(overhead) == ["hand-written", "hand-written, jdp's scalars", "jdp"], overhead
    assert all(arm["dispatch_us"] > 0 for arm in overhead.values()), overhead
    # --levers all: each lever raced as an arm of jdp's step, its source beside it.
    parts = {"sweep": data["parts"]["sweep"]["cases"][0], "resnet50": data["parts"]["resnet50"]}
    for part, landed in parts.items():
        raced = {arm for arm in landed["rates"] if arm.startswith("jdp, ")}
        assert {f"jdp, {lever.name}" for lever in LEVERS[part]} <= raced, (part, raced)
        assert set(landed["levers"]) == {lever.name for lever in LEVERS[part]}
    assert "    levers: command buffers of any size " in result.stdout
    correctness = data["parts"]["correctness"]
    assert correctness["within"], correctness
    machine = data["parts"]["machine"]  # and where it ran, whatever --parts asks
    assert data["where"] == {"kind": machine["kind"], "versions": machine["versions"]}
    # The tolerance is derived from a run nudged by a rounding, which must differ.
    assert correctness["cpu_nudged"] != correctness["cpu"], correctness
    table = result.stdout.split("--- jdp.bench gpu,", 1)[1]
    for said in (
        "bf16 256-cube product",
        "GPT-2 small, T = 32",
        "ResNet-50 toy",
        "JPEG loader",
        "sweep mlp-38k",
        "with jdp's scalars) vs",
        "correctness: 4 steps",
        "scheduler=true JAX_OPTIMIZATION_LEVEL=O1",
    ):
        assert said in table, said
    assert "  lever no autotuning: jdp " in table and "  lever command buffers of any" in table


@pytest.mark.slow  # the smoke run's JSON
def test_the_docs_generator_writes_a_runs_figures_and_checks_them(smoke, tmp_path):
    _, data, out = smoke
    for name in (
        gpu_docs.DOC,
        gpu_docs.README,
        "jdp/recipes/gpt2-124m.toml",
        "jdp/recipes/imagenet-resnet50.toml",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert gpu_docs.main([str(out), "--root", str(tmp_path)]) == 0
    tokens = gpu_docs.gpt_numbers(data["parts"]["gpt2"]["cells"][0])["jdp"]
    doc = (tmp_path / gpu_docs.DOC).read_text()
    assert f"{tokens:>13,.0f}" in doc and "ResNet-50 toy" in doc
    assert f"{tokens:,.0f} tokens/s" in (tmp_path / gpu_docs.README).read_text()
    recipe = (tmp_path / "jdp/recipes/imagenet-resnet50.toml").read_text()
    assert f'throughput = "{data["parts"]["resnet50"]["jdp"]:,.0f} images/s' in recipe
    assert gpu_docs.main([str(out), "--root", str(tmp_path), "--check"]) == 0
    assert gpu_docs.main([*GPU_RUNS, "--root", str(tmp_path), "--check"]) == 1


def test_a_loaders_figure_timed_while_its_workers_started_says_so():
    """Runs before the loader's workers were timed once started keep their figure, named
    as what it was."""
    loader = {"jpegs": 256, "mean_kb": 72.4, "per_core": 372.1, "workers": 8, "with_workers": 436.7}
    (old,) = gpu_table._loader(loader)
    assert old.endswith(
        "437 with 8 workers (timed from the first batch, the other workers still starting)"
    )
    (new,) = gpu_table._loader(loader | {"warm_batches": 16, "timed_batches": 32})
    assert new.endswith("437 with 8 workers")


def test_the_sweeps_arm_with_jdps_scalars_that_fails_is_its_error_not_the_cases():
    failed = gpu_host.or_error(lambda steps: steps / 0, 1)
    assert failed == {"error": "ZeroDivisionError: division by zero"}
    arm = "hand-written, jdp's scalars"
    assert gpu_table._scalars({arm: failed}) == f" (with jdp's scalars: {failed['error']})"
    assert gpu_table._scalars({arm: {"kernels": 23, "dispatch_us": 71.9}}) == (
        " (72 with jdp's scalars)"
    )
    assert gpu_table._scalars({}) == ""  # a run from before the arm


def test_a_cells_xla_options_reach_its_programs_and_its_effort_level_is_undone(tmp_path):
    """`arms.with_options` compiles the program it wraps, on its first call, with XLA's
    options (a dump directory appears; a name XLA lacks is refused); the same function
    jitted without them compiles without them. `arms.optimization_level` is undone."""
    program, x = jax.jit(lambda x: jnp.sin(x) * 2), jnp.arange(4.0)
    dumped = tmp_path / "dump"
    wrapped = arms.with_options(program.lower, {"xla_dump_to": str(dumped)})
    assert not dumped.exists()
    assert np.array_equal(wrapped(x), program(x)) and any(dumped.iterdir())
    assert np.array_equal(wrapped(x + 1), program(x + 1))  # compiled once, called again
    with pytest.raises(Exception, match="xla_no_such_option"):
        arms.with_options(program.lower, {"xla_no_such_option": True})(x)
    before = jax.config.jax_optimization_level
    with arms.optimization_level("O1"):
        assert jax.config.jax_optimization_level == "O1"
    assert jax.config.jax_optimization_level == before


def test_the_docs_hold_the_committed_runs_figures():
    """The GPU section, the README's line and the recipes' throughput are the JSON's."""
    assert GPU_RUNS, "docs/gpu/ holds no jdp.bench gpu run"
    assert gpu_docs.main([*GPU_RUNS, "--check"]) == 0
    # The same files named by another path are the same figures: not stale.
    assert gpu_docs.main([*(str(ROOT / path) for path in GPU_RUNS), "--check"]) == 0


@pytest.mark.parametrize("text", ["[]", "null", '"a string"', '{"parts": 3}'])
def test_json_that_is_not_a_run_is_one_line(tmp_path, text):
    path = tmp_path / "run.json"
    path.write_text(text)
    result = run_tool("tools.gpu_docs", path, "--check")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"tools.gpu_docs: error: {path} is not a file jdp.bench")


def test_runs_are_merged_by_kind_of_device_the_newest_first(tmp_path):
    """An H100's rows never stand in an H200's table: each kind of device is merged
    apart; a run that skipped the machine part is of its ``where``'s kind, or of the
    kind of the run before (a run from before ``where`` was recorded)."""
    paths = []
    where = {"kind": "B", "versions": {"jax": "0.11"}}
    for index, (parts, extra) in enumerate(
        [
            ({"machine": {"kind": "A"}}, {}),
            ({"machine": {"kind": "B"}}, {}),
            ({"resnet50": {"jdp": 1.0}}, {}),
            ({"machine": {"kind": "A"}}, {}),
            ({"sweep": {"cases": []}}, {"where": where}),
            ({"machine": {"error": "failed"}}, {"where": where}),  # its where, not A's
        ]
    ):
        path = tmp_path / f"{index}.json"
        run = {"date": "d", "command": f"c{index}", "parts": parts, **extra}
        path.write_text(json.dumps(run))
        paths.append(str(path))
    groups = gpu_docs.by_device(paths)
    assert [[run["command"] for run in group["runs"]] for group in groups] == [
        ["c1", "c2", "c4", "c5"],
        ["c0", "c3"],
    ]
    assert groups[0]["parts"]["resnet50"]["run"]["kind"] == "B"
    assert groups[0]["parts"]["sweep"]["run"]["versions"] == {"jax": "0.11"}


def test_a_later_runs_cells_and_skips_merge_with_an_earlier_runs(tmp_path):
    """A cell one run skipped for its budget stays "not run" unless another measured it."""
    tuned, unrolled, xla, dots = (GPT2_CELLS[n] for n in (0, 3, 4, 5))
    paths = []
    for index, (cells, skipped) in enumerate([([tuned], [xla, dots]), ([xla], [unrolled])]):
        gpt = {"cells": [{"setting": cell} for cell in cells], "skipped_for_budget": skipped}
        path = tmp_path / f"{index}.json"
        path.write_text(json.dumps({"date": "d", "command": "c", "parts": {"gpt2": gpt}}))
        paths.append(str(path))
    merged = gpu_docs.merge(paths)["parts"]["gpt2"]
    assert [cell["setting"] for cell in merged["cells"]] == [tuned, xla]
    assert merged["skipped_for_budget"] == [dots, unrolled]


def test_the_peer_target_reads_the_cell_the_peers_ran_beside(tmp_path):
    """``--peers`` races one GPT-2 cell; the fastest cell may be another, without peers:
    the target and the README's line read the raced cell's ratio, and name its layers."""
    scanned, unrolled = (dict(GPT2_CELLS[0], unroll=flag) for flag in (False, True))
    peer = {"transformers": {"rate": 150.0, "jdp_over_peer": 1.25}}

    def cell(setting, rate, peers):
        rates = {"jdp": [rate], "hand-written": [rate]}
        return {"setting": setting, "rates": rates, "peak": None, "peers": peers}

    cells = [cell(scanned, 187.5, peer), cell(unrolled, 250.0, {})]
    parts = {"gpt2": {"cells": cells}, "resnet50": {"jdp": 10.0}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"date": "d", "command": "c", "parts": parts}))
    merged = gpu_docs.merge([str(path)])
    row = next(row for row in gpu_docs.targets(merged) if gpu_docs.TARGETS["gpt2_peer"][1] in row)
    assert "| 1.250x (transformers, beside jdp's scanned layers) | met |" in row, row
    line = gpu_docs.readme_line(merged)
    assert "at 250 tokens/s" in line and "1.250x the best PyTorch arm (transformers, 150;" in line


def test_the_bundle_carries_what_a_fake_pip_list_lacks(tmp_path):
    """The offline closure of jdp's dependencies, against a target that has all but two."""
    closure = bundle.local_closure(bundle.jdp_requirements(), "3.12")
    assert {"jax", "grain", "tensorflow-datasets", "simplejpeg"} <= set(closure)
    assert "fsspec" in closure  # behind an extra: orbax-checkpoint needs etils[epath]
    lacking = {"grain", "simplejpeg"}
    listed = ["Package    Version", "---------- -------"]
    listed += [f"{name} {version}" for name, version in closure.items() if name not in lacking]
    have = tmp_path / "pip-list.txt"
    have.write_text("\n".join(listed) + "\n")
    result = run_tool("tools.bundle", "--resolve-only", "--offline", "--have", have)
    assert result.returncode == 0, result.stderr
    carried = {line.strip().split("==")[0] for line in result.stdout.splitlines()[1:]}
    assert carried == lacking, result.stdout


def test_pip_freeze_and_pip_list_read_alike():
    freeze = "jax==0.11.2\nTorch==2.11.0+cu130\nmy_pkg @ file:///tmp/my_pkg\n"
    table = "Package Version\n------- -------\njax     0.11.2\ntorch   2.11.0+cu130\n"
    assert bundle.read_have(freeze) == {"jax": "0.11.2", "torch": "2.11.0+cu130", "my-pkg": ""}
    assert bundle.read_have(table) == {"jax": "0.11.2", "torch": "2.11.0+cu130"}
    assert bundle.read_have("Jax (0.11.2)\n") == {"jax": "0.11.2"}
    tags = bundle.platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_27_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux_2_29_x86_64" not in tags


GPU, BUNDLE = "jdp.bench gpu", "tools.bundle"


@pytest.mark.parametrize(
    "flags, said",
    [
        ((BUNDLE, "DIR"), "--have FREEZE"),
        ((BUNDLE, "--resolve-only", "--have", "/no/such/file"), "no such file"),
        ((GPU, "--parts", "gpt2,nope", "--smoke"), "unknown part 'nope'"),
        ((GPU, "--gpt2-cells", "4,10", "--smoke"), "'10' is not a cell number"),
        ((GPU, "--gpt2-cells", "4,4", "--smoke"), "'4' is not a cell number from 1 to 9 named"),
        ((GPU, "--gpt2-cells", ",", "--smoke"), "--gpt2-cells ',' names no cell"),
        ((GPU, "--parts", "", "--smoke"), "--parts '' names no part"),
        ((GPU, "--levers", "sweep,gpt2", "--smoke"), "--levers: unknown part 'gpt2'"),
        ((GPU, "--budget", "0", "--smoke"), "--budget 0.0: give more than 0"),
        ((GPU, "--budget", "-1", "--smoke"), "--budget -1.0: give more than 0"),
        (
            (
                BUNDLE,
                "--resolve-only",
                "--offline",
                "--have",
                "README.md",
                "--platform",
                "win_amd64",
            ),
            "cannot speak for --platform win_amd64",
        ),
        (
            (BUNDLE, "--resolve-only", "--offline", "--have", "README.md", "--python", "3.99"),
            "--python '3.99': give a Python jdp runs on",
        ),
        ((BUNDLE, "--resolve-only", "--have", "docs"), "--have docs is a directory"),
        pytest.param(
            (GPU,),
            "no accelerator here",
            marks=pytest.mark.skipif(
                jax.default_backend() != "cpu", reason="an accelerator is here: it would run"
            ),
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(flags, said):
    tool, *flags = flags
    result = bench(*flags) if tool == GPU else run_tool(tool, *flags)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], result.stderr


def test_the_peers_named_are_checked_and_those_left_out_say_why(tmp_path):
    """``--peers``: an unknown arm, or a nanoGPT folder without its model.py, is one line;
    ``auto`` races each arm this machine can run and says why it left out the others."""
    import importlib.util

    from jdp.bench import peers
    from jdp.errors import UsageError

    with pytest.raises(
        UsageError,
        match=r"^--peers: unknown arm 'jax'; choose from: "
        r"transformers, nanogpt, torchvision, torch eager, torch graphs, or "
        r"auto, or none$",
    ):
        peers.choose("jax", "")
    with pytest.raises(UsageError, match=r"no model.py there; give a checkout of karpathy/nanoGPT"):
        peers.choose("auto", str(tmp_path))
    assert peers.choose("none", "") == ([], {})
    racing, left_out = peers.choose("auto", "")
    for arm in peers.ALL:  # each left out for the first thing it lacks, or racing
        needs = [m for m in ("torch", peers.NEEDS.get(arm)) if m]
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if missing:
            assert left_out[arm] == f"needs {missing[0]}: pip install {missing[0]}"
        elif arm == "nanogpt":
            assert left_out[arm] == "needs a nanoGPT checkout: --nanogpt DIR"
        else:
            assert arm in racing
    result = bench("--smoke", "--parts", "machine", "--peers", "jax", "--out", tmp_path / "o")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jdp.bench: error: --peers: unknown arm 'jax'; choose from: transformers, nanogpt, "
        "torchvision, torch eager, torch graphs, or auto, or none"
    ]
