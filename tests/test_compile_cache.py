"""The compilation cache: a resumed run reads its compiled train step back from
``CKPT_DIR/compile_cache`` and computes what a run that compiles it computes; an entry
that cannot be read is compiled again; a bad ``--compile-cache`` is one line."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import subprocess_env

import jdp
from jdp.checkpoint import read_params
from jdp.training.compile_cache import DIRNAME, cache_dir, compile_cache

# Six steps, saved at 3 and 6; removing step 6 and running the same command again
# resumes from step 3 with the very program the first run compiled.
FLAGS = ["--mesh", "data=1", "--steps", "6", "--ckpt-every", "3", "--warmup-steps", "2"]
READ = "read from the compilation cache"


def run_cli(*flags, timeout):
    """``python -m jdp.train`` in a fresh process without the tests' session cache (a JAX
    cache of yours takes the place of ``auto``'s)."""
    env = subprocess_env()
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "jdp.train", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _resume(ckpt, *flags):
    shutil.rmtree(ckpt / "6")
    result = run_cli(*FLAGS, "--ckpt-dir", str(ckpt), *flags, timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"jdp: resuming from step 3 in {ckpt}" in result.stdout
    return result.stdout, jax.tree.leaves(read_params(ckpt, step=6))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_a_resume_reads_its_compiled_step_back_and_computes_the_same(tmp_path):
    ckpt = tmp_path / "run"
    first = run_cli(*FLAGS, "--ckpt-dir", str(ckpt), timeout=180)
    assert first.returncode == 0, first.stderr
    assert READ not in first.stdout  # nothing to read yet: it compiled, and wrote
    assert os.listdir(ckpt / DIRNAME)
    straight = jax.tree.leaves(read_params(ckpt, step=6))

    cached, cached_params = _resume(ckpt)
    compiled, compiled_params = _resume(ckpt, "--compile-cache", "off")
    assert READ in cached, cached
    assert READ not in compiled, compiled
    # The same program, read back or compiled again: bitwise the run that did not stop.
    assert _same(cached_params, straight) and _same(compiled_params, straight)

    # Entries cut short (a process killed while writing one) are compiled again.
    for entry in (ckpt / DIRNAME).iterdir():
        entry.write_bytes(entry.read_bytes()[:100])
    damaged, damaged_params = _resume(ckpt)
    assert READ not in damaged
    assert _same(damaged_params, straight)

    # Two entries' files swapped: JAX would run the other program under each name.
    a, b = sorted((ckpt / DIRNAME).glob("*-cache"), key=lambda entry: entry.stat().st_size)[-2:]
    a.rename(a.with_name("swap"))
    b.rename(a)
    a.with_name("swap").rename(b)
    shutil.rmtree(ckpt / "6")
    swapped = run_cli(*FLAGS, "--ckpt-dir", str(ckpt), timeout=180)
    assert swapped.returncode == 0, swapped.stderr
    assert (
        f"compiled program(s) in {ckpt / DIRNAME} changed since a run wrote them" in swapped.stderr
    )
    assert _same(jax.tree.leaves(read_params(ckpt, step=6)), straight)


@pytest.mark.slow
def test_a_shared_cache_directory_serves_another_run(tmp_path):
    shared = tmp_path / "shared"
    for run in ("a", "b"):
        result = run_cli(
            *FLAGS, "--ckpt-dir", str(tmp_path / run), "--compile-cache", str(shared), timeout=180
        )
        assert result.returncode == 0, result.stderr
        assert (READ in result.stdout) == (run == "b"), result.stdout
        assert not (tmp_path / run / DIRNAME).exists()


@pytest.mark.slow
def test_fit_leaves_jax_cache_setting_as_it_was(tmp_path):
    before = jax.config.jax_compilation_cache_dir  # the tests' session cache
    assert before
    mine = tmp_path / "mine"
    config = jdp.TrainConfig(mesh="data=1", steps=2, warmup_steps=1, compile_cache=str(mine))
    jdp.fit(config, console=jdp.Console(enabled=False))
    assert os.listdir(mine)  # written during the run
    assert jax.config.jax_compilation_cache_dir == before
    with compile_cache("off", None):  # a cache of yours is off too
        assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_compilation_cache_dir == before


def test_where_the_cache_goes(tmp_path):
    assert cache_dir("auto", "/runs/a") is None  # JAX has a cache of yours: it stays
    with compile_cache("off", None):  # as without one
        assert cache_dir("auto", "/runs/a") == f"/runs/a/{DIRNAME}"
        assert cache_dir("auto", None) is None  # no checkpoint directory: no cache
    assert cache_dir("off", "/runs/a") is None
    assert cache_dir("/cache", None) == "/cache"
    refused = pytest.raises(jdp.UsageError, match=r"cannot write in --ckpt-dir /proc/jdp \(")
    with compile_cache("off", None), refused, compile_cache("auto", "/proc/jdp"):
        pass  # --ckpt-dir's own line comes first


def test_a_bad_compile_cache_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(jdp.UsageError, match="is a file, not a directory"):
        cache_dir(str(afile), None)
    with pytest.raises(jdp.UsageError, match="give a directory, auto"):
        jdp.fit(jdp.TrainConfig(compile_cache=" "), console=jdp.Console(enabled=False))
    blocked = afile / "cache"  # under a file: cannot be made
    config = jdp.TrainConfig(mesh="data=1", steps=2, compile_cache=str(blocked))
    with pytest.raises(jdp.UsageError, match=r"cannot make .*; name a directory you can write"):
        jdp.fit(config, console=jdp.Console(enabled=False))
