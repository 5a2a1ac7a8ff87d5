"""What several test modules share: fresh-process runs and a small regression problem."""

import contextlib
import io
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.mesh_spec import child_environment

INTEROP = "pip install '.[interop]'"

# Benchmark runs that tests/test_bench.py makes and that are also docs blocks with their
# smoke flags (``python -m jdp.bench NAME FLAGS``, in `subprocess_env`): tests/test_docs.py
# leaves those blocks out rather than run them twice.
BENCH_RUNS = {
    "dispatch": "--rounds 1 --round-seconds 0.05 --steps-per-call 1,4",
    "diloco": "--workloads mlp --steps 20 --sync-every 1,10",
    "lm": "--mesh data=2 --seq-len 32 --vocab-size 256 --rounds 2 --steps 2",
    "keras": "--steps 40 --rounds 2",
}


def interop(*modules: str, load: bool = True) -> list:
    """The heavy third-party stacks a round trip needs (the interop lane: PyTorch with
    transformers, Ray, MLflow's server, W&B, Keras, datasets), imported (unless not
    ``load``: a fresh process of the test's imports them), or the test skipped with one
    line naming the extra that installs them. At a module's top level too: the module is
    then skipped whole, never reported as a collection error."""
    import importlib.util

    for name in modules:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"needs {name}: {INTEROP}", allow_module_level=True)
    return [pytest.importorskip(name) for name in modules] if load else []


def subprocess_env(devices: int | None = None) -> dict[str, str]:
    """This environment for a fresh process, which sets up its own devices unless
    ``devices`` fixes the CPU device count (as hardware does): the suite's other XLA
    flags stay, as for the processes jdp starts. Its quick compiles (conftest.py) are
    what most fresh runs, a few steps each, spend their time on."""
    return child_environment(devices)


def run_python(*args, timeout=240, devices=None, **popen) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fresh process, output captured as text."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(devices),
        **popen,
    )


def run_cli(*flags, timeout=240, devices=None, fresh=False) -> subprocess.CompletedProcess:
    """``python -m jdp.train FLAGS``: what it prints and returns.

    In this process, on its 8 devices (`cli`), unless the test's point needs a fresh
    process (``fresh``: the devices a mesh sets up, a signal, an exit's threads) or fixes
    its device count (``devices``). A fresh process costs seconds of start (Python, JAX,
    the imports, the devices, the data) that a test of the tool's behaviour need not pay.
    """
    if fresh or devices:
        return run_python("-m", "jdp.train", *flags, timeout=timeout, devices=devices)
    return cli(*flags)


def run_main(main: Callable[[Sequence[str]], int], *flags) -> subprocess.CompletedProcess:
    """A ``python -m jdp.*`` tool's ``main(FLAGS)`` in this process, its output captured as
    text, for a test whose point is what the tool says and returns, not a fresh process:
    it saves the process's start (JAX, the devices, the imports: seconds each). Warnings
    are printed, as a fresh process prints them, not raised."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("default")
        try:
            code = main([str(flag) for flag in flags])
        except SystemExit as exit_:  # argparse: --help, a bad flag
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return subprocess.CompletedProcess(
        ["main", *map(str, flags)], code, out.getvalue(), err.getvalue()
    )


def cli(*flags) -> subprocess.CompletedProcess:
    """`run_cli` in this process, on its 8 devices (`run_main`)."""
    return run_tool("jdp.train", *flags)


def run_tool(module: str, *flags) -> subprocess.CompletedProcess:
    """``python -m MODULE FLAGS`` (a jdp tool) in this process (`run_main`)."""
    import importlib

    return run_main(importlib.import_module(module).main, *flags)


# A small regression problem whose exact answer plain JAX gives on one device.
BATCH = 64


def regression_data(seed=0, rows=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 3)) + 0.1 * rng.normal(size=(rows, 3))).astype(np.float32)
    return {"x": x, "y": y}


def init_params(seed=0):
    rng = np.random.default_rng(seed + 100)
    return {
        "w1": jnp.asarray(rng.normal(size=(6, 16)) * 0.5, jnp.float32),
        "b1": jnp.zeros((16,), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(16, 3)) * 0.5, jnp.float32),
    }


def regression_loss(params, batch, rng):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    """Element-wise: for a few steps of optimizers linear in the gradient (closeness.py)."""
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def saved_arrays(ckpt_dir, step) -> dict:
    """The arrays of one checkpoint, read back as numpy, by leaf path."""
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(os.path.join(ckpt_dir, str(step), "state"))
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
    }


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Two `saved_arrays` results hold the same leaves with the same bytes."""
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def saves_after(directory, broken, good, metrics) -> tuple[list[int], list[int], object]:
    """What `jdp.training.run_actions.Checkpoint` (no skipping) saves at step 2 in ``directory``:
    the steps on disk after it is given ``broken``, and after ``good`` in turn; the
    `jdp.actions.Progress` it was given, at ``good``."""
    from types import SimpleNamespace

    from jdp.actions import Progress
    from jdp.checkpoint import Checkpointer
    from jdp.training.run_actions import Checkpoint

    progress, saved = Progress(step=2, steps=2, state=broken), []
    with Checkpointer(str(directory)) as checkpointer:
        save = Checkpoint(
            checkpointer, SimpleNamespace(position=2), every=1, config={}, skipping=False
        )
        for state in (broken, good):
            progress.after_call(2, 1, state, metrics)
            save.run(progress)
            checkpointer.wait()
            saved.append(checkpointer.steps())
    return *saved, progress


def launched_pids(stderr_lines) -> dict[int, int]:
    """Each process's pid, by rank, from ``jdp.launch``'s lines (the latest start's)."""
    return {
        int(m.group(1)): int(m.group(2))
        for line in stderr_lines
        if (m := re.search(r"started process (\d+) of \d+ \(pid (\d+)\)", line))
    }


def children(pid) -> list[int]:
    """The pids of ``pid``'s child processes (Linux: read from ``/proc``)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:  # the parent pid
                found.append(int(name))
    return found


def cmdline(pid) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""


def alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def loader_workers(pid) -> list[int]:
    """The Grain worker processes of the trainer ``pid`` (multiprocessing's spawned children)."""
    return [child for child in children(pid) if alive(child) and b"spawn_main" in cmdline(child)]
