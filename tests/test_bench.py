"""``python -m jdp.bench``: each benchmark runs end to end and reports measured figures."""

import json
import re
import shlex
import subprocess
import sys

import pytest
from helpers import BENCH_RUNS, run_main, subprocess_env


def _bench(command, flags, timeout=240, env=None):
    return subprocess.run(
        [sys.executable, "-m", "jdp.bench", command, *shlex.split(flags)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _here(command, flags):
    """`_bench` in this process: what a benchmark says of bad flags needs no process."""
    from jdp.bench.__main__ import main

    return run_main(main, command, *shlex.split(flags))


@pytest.mark.slow
def test_memory_benchmark_reads_each_layouts_compiled_step():
    """``jdp.bench memory``: each layout's bytes from shapes and its compiled step's
    temporaries; fsdp=2 holds half the parameters (the LayerNorms' small leaves and the
    step count aside), and on data=2 the loss over 8 chunks of the logits needs fewer
    temporaries than the logits whole (4 rows a device x 64 tokens x 50,257 fp32 values,
    51 MB a copy). (On fsdp=2 it needs more: the gathered embedding's gradient is kept
    across the chunks; docs/models.md.)"""

    row = re.compile(r"^\| (data=2|fsdp=2) \| ([\d.,]+) \|.*?\| ([\d.,]+) \|[^|]*\|[^|]*\|$", re.M)

    def rows(flags):
        result = _here(
            "memory",
            f"--model-size small --seq-len 64 --meshes data=2,fsdp=2 {flags}",
        )
        assert result.returncode == 0, result.stderr
        found = row.findall(result.stdout)
        number = lambda text: float(text.replace(",", ""))  # noqa: E731
        return result.stdout, {mesh: (number(p), number(t)) for mesh, p, t in found}

    whole_text, whole = rows("")
    chunked_text, chunked = rows("--loss-chunks 8")
    assert "global batch 8 x 64 tokens" in whole_text and "loss in 8 chunks" in chunked_text
    assert set(whole) == set(chunked) == {"data=2", "fsdp=2"}, whole_text
    assert whole["fsdp=2"][0] == pytest.approx(whole["data=2"][0] / 2, rel=0.01)
    assert all(chunked[mesh][0] == whole[mesh][0] for mesh in whole)
    assert chunked["data=2"][1] < whole["data=2"][1], (chunked, whole)


@pytest.mark.slow
def test_input_benchmark_reports_loaders_step_and_waiting():
    result = _bench("input", "--mesh data=4 --workers 1 --batches 30 --step-repeats 10 --steps 30")
    assert result.returncode == 0, result.stderr
    rates = dict(re.findall(r"^  (.+?)\s{2,}([\d,]+)\s+[\d.]+x$", result.stdout, re.M))
    assert set(rates) == {
        "loader, no workers: host batches",
        "loader, 1 Grain workers: host batches",
        "loader, no workers, batches placed on the mesh",
        "loader, split on the devices, rows gathered there",
        "train step, same batch shape, no input",
    }, result.stdout
    assert all(int(rate.replace(",", "")) > 0 for rate in rates.values())
    waiting = re.search(
        r"training run, 30 steps: input waiting ([\d.]+)% of loop time", result.stdout
    )
    assert waiting and 0.0 <= float(waiting.group(1)) <= 100.0, result.stdout


def test_a_loader_with_workers_is_timed_once_each_has_started(monkeypatch):
    """Batch i comes from worker i % workers, which start one after another: the rate is
    timed after two batches of each (its start, what it buffered), over at least four."""
    from jdp.bench import common

    assert common.worker_window(0, 8) == (1, 8)  # no workers: only the first batch
    assert common.worker_window(8, 8) == (16, 32)
    assert common.worker_window(2, 30) == (4, 30)
    clock = [0.0]

    def stream(warm):  # 10 s for each batch of the start-up, then 1 s a batch
        for index in range(100):
            clock[0] += 10.0 if index < warm else 1.0
            yield index

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    warm, timed = common.worker_window(4, 8)
    assert common.batches_per_sec(stream(warm), timed, warm=warm) == 1.0
    # Timed from the first batch, the workers still starting slow it tenfold and more.
    assert common.batches_per_sec(stream(warm), timed) == timed / (7 * 10.0 + 9)


def test_bench_bad_input_is_one_line_and_exit_2():
    result = _here("input", "--dataset imagenet")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jdp.bench: error: unknown dataset 'imagenet'; choose one of: cifar10, digits, "
        "fashion_mnist, mnist, numbers2words, python_stdlib, or tfds:NAME (any TFDS dataset), "
        "folder:PATH or images:PATH (images in class folders), npz:FILE (arrays like x_train, "
        "y_train) "
        "or tokens:PATH (a token corpus)"
    ]


def test_corpus_benchmark_fails_where_a_run_failed():
    """A mesh's run that fails is its row's reason and the benchmark's exit code 1."""
    result = _here("corpus", "--gigabytes 0.0001 --steps 1 --meshes data=3")
    assert result.returncode == 1, result.stderr
    assert "mesh data=3: failed (exit 2): jdp.bench: error: global batch 16" in result.stdout


@pytest.mark.slow
def test_checkpoint_benchmark_reports_blocked_and_restore_times():
    result = _bench("checkpoint", "--mesh data=2 --size-mb 4 --repeats 1")
    assert result.returncode == 0, result.stderr
    assert re.search(r"synchronous save: loop blocked [\d.]+ s", result.stdout), result.stdout
    assert re.search(
        r"async save: +loop blocked [\d.]+ s \([\d.]+% of synchronous\)", result.stdout
    )
    assert re.search(r"restore \(latest, onto the mesh\): [\d.]+ s", result.stdout)


@pytest.mark.slow
def test_multihost_benchmark_compares_one_and_two_processes():
    result = _bench("multihost", "--cases mlp-38k --seconds 0.3")
    assert result.returncode == 0, result.stderr
    rows = re.findall(
        r"^  (\S+) +(\S+) +([\d,]+) +([\d,]+) +[\d.]+x +[\d.]+ +(\d+) +([\d.]+) +([\d.]+) +"
        r"([\d.]+)$",
        result.stdout,
        re.M,
    )
    assert len(rows) == 1, result.stdout
    name, params, one, two, ops, *reduce_ms = rows[0]
    assert (name, params) == ("mlp-38k", "38k"), result.stdout
    assert int(one.replace(",", "")) > 0 and int(two.replace(",", "")) > 0
    assert int(ops) >= 1 and all(float(ms) > 0 for ms in reduce_ms)


@pytest.mark.slow
def test_scaling_benchmark_writes_a_table_and_a_png(tmp_path):
    out = tmp_path / "scaling.png"
    result = _bench("scaling", f"--steps 5 --out {out}")
    assert result.returncode == 0, result.stderr
    sizes = re.findall(r"^ +(\d) +[\d,]+ +[\d.]+x$", result.stdout, re.M)
    assert sizes == ["1", "2", "4", "8"], result.stdout
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_logging_benchmark_reports_the_ratio():
    result = _bench("logging", "--steps 20 --rounds 2")
    assert result.returncode == 0, result.stderr
    assert re.search(r"every step / off, per round: median [\d.]+", result.stdout), result.stdout
    assert "40 records written" in result.stdout


@pytest.mark.slow
def test_step_benchmark_sweeps_sizes_against_the_best_hand_written_step():
    # Two sizes on one mesh: the sweep over meshes is the docs' block's
    # (docs/performance.md: mlp-38k on data=1 and data=2, exit 0 checked), and a cell's
    # own devices the test below. A cell's code is the same for every case; the gpt case
    # took 60 of this test's 90 s of CPU, and its step is tests/test_lm_model.py's.
    result = _bench(
        "step", "--cases mlp-38k,mlp-0.7m --meshes data=2 --rounds 1 --round-seconds 0.05"
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(
        r"^  (\S+) +(\S+)  (data=\d) +([\d,]+)  (per-leaf|raveled|one-device)"
        r" +([\d.]+)x +([\d.]+)x +([\d.]+)x +([\d.]+)x +([\d.]+)x +([\d.]+)x +(\d+)/(\d+)"
        r" +([\d.]+)x +([\d.]+)x$",
        result.stdout,
        re.M,
    )
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("mlp-38k", "38k", "data=2"),
        ("mlp-0.7m", "648k", "data=2"),
    ], result.stdout
    for _, _, _, rate, _, itself, jit, pmap, host, device, ahead, jdp_us, hand_us, *hosts in rows:
        assert int(rate.replace(",", "")) > 0  # the digits are on the devices: both fed arms
        assert min(float(x) for x in (itself, jit, pmap, host, device, ahead)) > 0
        assert int(jdp_us) > 0 and int(hand_us) > 0  # the host's microseconds a call
        assert min(float(ratio) for ratio in hosts) > 0  # jdp's and the copy's, to the hand's


def test_step_benchmark_refuses_an_unknown_case():
    result = _here("step", "--cases mlp-1t")
    assert result.returncode == 2
    assert "unknown case 'mlp-1t'" in result.stderr


def test_a_step_cell_that_fails_is_one_line_naming_it():
    result = _here("step", "--cases mlp-38k --meshes data=3 --rounds 1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jdp.bench: error: the mlp-38k cell on --mesh data=3 failed: global batch 128 is not "
        "divisible by the data axis (3 replicas); use a multiple of 3, e.g. --batch-size 126 "
        "or 129"
    ], result.stderr


@pytest.mark.slow
def test_a_step_cell_runs_with_the_devices_its_mesh_asks_for():
    # As `jdp.train --mesh data=1` runs: one device, not the test session's 8.
    environment = subprocess_env()
    flags = "--cell --cases mlp-38k --meshes data=1 --rounds 1 --round-seconds 0.05"
    result = _bench("step", flags, env=environment)
    assert result.returncode == 0, result.stderr
    cell = json.loads(result.stdout.splitlines()[-1])
    assert cell["devices"] == 1 and cell["row"].split()[:3] == ["mlp-38k", "38k", "data=1"]


@pytest.mark.slow
def test_dispatch_benchmark_reports_steps_per_call_and_collectives():
    result = _bench("dispatch", BENCH_RUNS["dispatch"], env=subprocess_env())  # a docs block's
    assert result.returncode == 0, result.stderr
    names = re.findall(r"^  (\S.*?\S) {2,}[\d,]+ +[\d.]+x", result.stdout, re.M)
    assert names == [
        "hand-written jit step, per leaf",
        "hand-written jit step, raveled",
        "jdp, jit",
        "jdp, jit, 4 steps per call",
    ], result.stdout
    volume = dict(
        re.findall(
            r"(fp32|bf16) all-reduce: .* bytes = ([\d.]+) x .*all-gathers: 0$", result.stdout, re.M
        )
    )
    assert abs(float(volume["fp32"]) - 1.0) <= 0.01, result.stdout
    assert abs(float(volume["bf16"]) - 0.5) <= 0.01, result.stdout


@pytest.mark.slow
def test_diloco_benchmark_reports_metric_bytes_and_speed_per_arm():
    result = _bench("diloco", BENCH_RUNS["diloco"], env=subprocess_env())  # a docs block's
    assert result.returncode == 0, result.stderr
    rows = re.findall(
        r"^  mlp on digits +(sync|DiLoCo H=\d+) +([\d.]+) +([\d,]+) +([\d.]+) +([\d,]+) +"
        r"([\d.]+)$",
        result.stdout,
        re.M,
    )
    assert [row[0] for row in rows] == ["sync", "DiLoCo H=1", "DiLoCo H=10"], result.stdout
    crossing = {arm: int(nbytes.replace(",", "")) for arm, _, nbytes, *_ in rows}
    # H=1 all-reduces the parameters across the groups every step, as sync does its
    # gradients (plus its few metric scalars); H=10 a tenth of that.
    assert 0.99 < crossing["DiLoCo H=1"] / crossing["sync"] <= 1.0
    assert abs(crossing["DiLoCo H=10"] * 10 - crossing["DiLoCo H=1"]) < 10  # whole bytes shown
    assert all(0.0 <= float(row[1]) <= 1.0 and int(row[4].replace(",", "")) > 0 for row in rows)


def test_diloco_benchmark_refuses_an_unknown_workload():
    result = _here("diloco", "--workloads resnet")
    assert result.returncode == 2
    assert "unknown workload resnet; choose from: mlp, gpt" in result.stderr


@pytest.mark.slow
def test_corpus_benchmark_reports_memory_and_input_wait_per_mesh():
    # Short windows: what is checked is the report, not the model's arithmetic.
    flags = "--gigabytes 0.01 --steps 6 --meshes data=1,data=2 --seq-len 32"
    result = _bench("corpus", flags, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("jdp.bench corpus: 5,000,000 tokens in 0.01 GiB"), lines
    for mesh, line in zip(("data=1", "data=2"), lines[1:], strict=True):
        assert line.strip().startswith(f"mesh {mesh}") and "(growth " in line, line
        assert re.search(r"input waiting \d+\.\d%; [\d,]+ tokens/s$", line), line


@pytest.mark.slow
def test_lm_benchmark_races_jdp_against_the_hand_written_step_on_the_same_model():
    # Each cell sets up the devices its mesh asks for, as `jdp.train` does; a docs block's.
    result = _bench("lm", BENCH_RUNS["lm"], timeout=300, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("jdp.bench lm: gpt small (0.83M parameters, vocabulary 256), T = 32")
    assert lines[1].startswith("model FLOPs per token: 5.15M, PaLM's count"), lines[1]
    rows = re.findall(
        r"^  (data=\d) +16  none  auto +(hand-written|jdp) +([\d,]+) +([\d.]+) +\d+ +- +([\d.]+)"
        r" +([\d.]+)x  [\d.]+-[\d.]+$",
        result.stdout,
        re.M,
    )
    assert [row[:2] for row in rows] == [("data=2", "hand-written"), ("data=2", "jdp")], (
        result.stdout
    )
    for _, arm, rate, ms, compile_s, ratio in rows:
        assert int(rate.replace(",", "")) > 0 and float(ms) > 0 and float(compile_s) >= 0
        assert float(ratio) == 1.0 if arm == "hand-written" else float(ratio) > 0
    checks = re.findall(
        r"jdp ([\d.]+), hand-written ([\d.]+): agree within ([\d.]+) \(dropout's noise\); "
        r"same initial parameters: yes$",
        result.stdout,
        re.M,
    )
    assert len(checks) == 1, result.stdout
    for jdp_loss, hand_loss, tolerance in checks:
        assert abs(float(jdp_loss) - float(hand_loss)) <= float(tolerance) < 0.5


def test_lm_benchmark_refuses_a_remat_it_does_not_have():
    result = _here("lm", "--remat some")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "jdp.bench: error: --remat 'some'; choose from: none, dots, full, attention"
    )


def test_the_hand_written_step_with_jdps_scalars_does_the_same_update(mesh1):
    """The sweep's third arm times the hand-written step carrying jdp's scalar arrays: it
    must update the parameters as the plain one does, and carry the arrays on."""
    import jax
    import numpy as np
    import optax

    import jdp
    from jdp.bench import arms

    model = jdp.models.get_model("mlp", jdp.load_split("digits", "train"))
    batch = {"image": np.ones((8, 8, 8, 1), np.float32), "label": np.arange(8) % 10}
    params, _ = jax.jit(model.init)(jax.random.key(0), batch)
    optimizer = optax.adam(1e-2)

    def first(step, *extra):
        copy = jax.tree.map(np.array, params)  # each step donates its own
        return step(copy, optimizer.init(copy), *extra, batch)

    plain = first(arms.hand_written_step(model, optimizer, mesh1, kind="one-device"))
    carried = first(arms.hand_written_with_scalars(model, optimizer), arms.jdp_scalars())
    assert jax.tree.all(jax.tree.map(np.array_equal, plain[0], carried[0]))
    count, key, scale, good, skipped = carried[2]
    assert (int(count), int(good), float(scale), int(skipped)) == (1, 1, 1.0, 0)
    assert np.array_equal(key, jax.random.key_data(jax.random.key(0)))
    assert set(carried[3]) == set(plain[2]) | {"lr"}


def test_lm_benchmarks_hand_written_optimizer_is_jdps_adamw(mesh1):
    import jax
    import numpy as np

    from jdp.bench import lm
    from jdp.training.config import TrainConfig
    from jdp.training.optimizer import config_optimizer

    config = TrainConfig(
        model="gpt",
        optimizer="adamw",
        lr=lm.LR,
        schedule="constant",
        warmup_steps=0,
        weight_decay=lm.WEIGHT_DECAY,
    )
    _, jdps = config_optimizer(config)
    hand = lm.hand_written_lm_step(
        lm.GPT(vocab_size=8),
        mesh1,
        np.float32,
        lr=lm.LR,
        weight_decay=lm.WEIGHT_DECAY,
        b1=lm.B1,
        b2=lm.B2,
    )
    params = {"kernel": np.full((2, 3), 0.5, np.float32), "bias": np.full(3, 0.5, np.float32)}
    grads = jax.tree.map(lambda leaf: leaf * 0.1, params)
    for optimizer in (jdps, hand.optimizer):
        state = optimizer.init(params)
        for _ in range(3):
            updates, state = optimizer.update(grads, state, params)
        if optimizer is jdps:
            expected = updates
    for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.interop
def test_keras_benchmark_races_fit_against_keras_and_the_step_alone():
    from helpers import interop

    interop("keras", load=False)  # Keras picks its backend as it is imported: in the benchmark
    result = _bench("keras", BENCH_RUNS["keras"], timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("jdp.bench keras: mlp small on digits (38k parameters)"), lines
    assert re.search(r"Keras 3\.\d+\.\d+ \(JAX backend\), JAX \d", lines[0]), lines[0]
    rows = re.findall(
        r"^  (1|2|median) +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+) +([\d.]+)x +([\d.]+)x"
        r" +([\d.]+)x$",
        result.stdout,
        re.M,
    )
    assert [row[0] for row in rows] == ["1", "2", "median"], result.stdout
    for _, *rates, by_keras, by_step, host_by_step in rows[:2]:
        keras, jdp, host, step = (int(rate.replace(",", "")) for rate in rates)
        assert min(keras, jdp, host, step) > 0
        # A round's ratios are its rates' own: printed to 3 decimals (half a unit, 5e-4),
        # from rates printed to the example (1e-3 relative covers rates over 1,000/s).
        for ratio, (over, under) in (
            (by_keras, (jdp, keras)),
            (by_step, (jdp, step)),
            (host_by_step, (host, step)),
        ):
            assert abs(float(ratio) - over / under) < 1e-3 * over / under + 5e-4
    loop = re.search(
        r"^  fit's loop alone .*: ([\d.]+) us a step, ([\d.]+) us of its "
        r"thread's CPU \(median of 2 runs\)$",
        result.stdout,
        re.M,
    )
    assert loop, result.stdout
    wall, cpu = float(loop[1]), float(loop[2])
    # One thread's CPU time cannot exceed the wall time it ran over (0.1: the print's rounding).
    assert 0 < cpu <= wall + 0.1


def test_keras_benchmark_refuses_a_run_of_one_step():
    result = _here("keras", "--steps 1")
    assert result.returncode == 2
    assert "need --steps >= 2 (the first is compilation)" in result.stderr


@pytest.mark.slow
def test_resume_benchmark_reads_the_programs_back_in_the_cached_arm():
    # The MLP: the mechanism is not the model's (a ResNet-20 took 86 s here, the MLP 33 s).
    result = _bench("resume", "--models mlp --rounds 1", timeout=300)
    assert result.returncode == 0, result.stderr
    (row,) = re.findall(r"^  mlp +([\d.]+) +([\d.]+) +([\d.]+)x  (.+)$", result.stdout, re.M)
    cached, compiling, ratio, read = row
    cached, compiling, ratio = float(cached), float(compiling), float(ratio)
    # Seconds print to 0.05 and the ratio to 0.005: compiling / cached moves by at most
    # 0.05 * (1 + ratio) / cached (to first order) from the unrounded ratio.
    assert abs(compiling / cached - ratio) <= 0.05 * (1 + ratio) / cached * 1.1 + 0.005
    assert re.fullmatch(r"\d+ programs?", read), read  # the cached arm read what it resumed


def test_startup_benchmark_sets_import_jdp_against_import_jax():
    result = _here("startup", "--rounds 1")
    assert result.returncode == 0, result.stderr
    rows = dict(re.findall(r"^  (.+?) +[\d.]+ s  ([\d.]+)x$", result.stdout, re.M))
    assert list(rows) == [
        'python -c "import jax"',
        'python -c "import jdp"',
        "import jdp; the step's API named",
        "python -m jdp.train --help",
    ]
    assert rows['python -c "import jax"'] == "1.00"
    assert float(rows['python -c "import jdp"']) > 0


def _xspace(kernels: list[tuple[str, float, float]], devices: int = 1):
    """A profiler trace with ``devices`` GPUs, each of whose streams runs ``(name, start
    us, length us)``."""
    from jax.profiler import ProfileData

    names = sorted({name for name, _, _ in kernels})
    events = "".join(
        f"events {{ metadata_id: {names.index(name) + 1} offset_ps: {int(start * 1e6)} "
        f"duration_ps: {int(length * 1e6)} }} "
        for name, start, length in kernels
    )
    metadata = "".join(
        f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{name}" }} }} '
        for i, name in enumerate(names)
    )
    gpus = "".join(
        f'planes {{ name: "/device:GPU:{device}" lines {{ name: "Stream #14(Compute)" '
        f'{events}}} lines {{ name: "XLA Ops" {events}}} {metadata}}} '
        for device in range(devices)
    )
    text = gpus + f'planes {{ name: "/host:CPU" lines {{ name: "python" {events}}} {metadata}}}'
    return ProfileData.from_serialized_xspace(ProfileData.text_proto_to_serialized_xspace(text))


def _traced(found, wall_ms=0.03, busy_ms=0.026):
    kernels, _, _ = found
    per_step = {name: [count, ns / 1e6] for name, (count, ns) in kernels.items()}
    return {"wall_ms": wall_ms, "busy_ms": busy_ms, "kernels": per_step}


def test_kernel_profiles_name_what_one_arm_runs_alone():
    from jdp.bench import kernels

    # jdp: the same gemm 10% slower, and a reduce the hand-written step does not run;
    # two kernels overlap for 1 us, which the busy time counts once. The hand-written
    # step runs fusion_1 twice and a copy of its own.
    jdp = kernels.device_kernels(
        _xspace([("gemm", 0, 11), ("fusion_1", 11, 2), ("reduce_36", 12, 3), ("gemm", 15, 11)])
    )
    assert jdp[1:] == (pytest.approx(26e3), 1)  # busy 0-26 us, the overlap once; 1 device
    assert jdp[0] == {"gemm": [2, 22e3], "fusion_1": [1, 2e3], "reduce_36": [1, 3e3]}
    hand = kernels.device_kernels(
        _xspace(
            [
                ("gemm", 0, 10),
                ("fusion_1", 10, 2),
                ("fusion_1", 12, 2),
                ("copy", 14, 1),
                ("gemm", 15, 10),
            ]
        )
    )
    lines = kernels.compare({"jdp": _traced(jdp), "hand-written": _traced(hand)})
    assert lines == [
        "kernels jdp: 0.030 ms a step; a device busy 0.026 ms, 4 kernels taking 0.027 ms",
        "kernels hand-written: 0.030 ms a step; a device busy 0.026 ms, 5 kernels taking 0.025 ms",
        "kernels both run: 1, 0.022 ms jdp, 0.020 ms hand-written (1.100x)",
        "  jdp alone:    0.003 ms  1x  reduce_36",
        "  jdp alone:    0.002 ms  1x  fusion_1; 2 in hand-written",
        "  hand-written alone:    0.004 ms  2x  fusion_1; 1 in jdp",
        "  hand-written alone:    0.001 ms  1x  copy",
    ]


def test_a_kernel_trace_is_per_step_and_per_device(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from jdp.bench import kernels

    # Two devices, each running 2 steps of a gemm (3 us) and a reduce (1 us).
    step = [("gemm", 0, 3), ("reduce", 3, 1), ("gemm", 4, 3), ("reduce", 7, 1)]
    monkeypatch.setattr(kernels.ProfileData, "from_file", lambda path: _xspace(step, devices=2))
    traced = kernels.trace(lambda count: jnp.zeros(count).block_until_ready(), 2, str(tmp_path))
    assert traced["devices"] == 2 and traced["steps"] == 2 and traced["wall_ms"] > 0
    assert traced["busy_ms"] == pytest.approx(0.004)  # 8 us of 2 steps, a device
    assert traced["kernels"] == {
        "gemm": [1, pytest.approx(0.003)],
        "reduce": [1, pytest.approx(0.001)],
    }
    # A second trace into the same folder is a trace of its own.
    assert kernels.trace(lambda count: None, 2, str(tmp_path))["devices"] == 2


def test_a_kernel_trace_on_the_cpu_says_it_has_none(tmp_path):
    import jax
    import jax.numpy as jnp

    from jdp.bench import kernels

    add = jax.jit(lambda x: x + 1)

    def loop(count):
        x = jnp.zeros(4)
        for _ in range(count):
            x = add(x)
        jax.block_until_ready(x)

    def broken(count):
        raise OSError("no tracer")

    traced = kernels.trace_arms({"a": loop, "b": loop}, 2, str(tmp_path))
    assert traced["a"]["steps"] == 2 and traced["a"]["kernels"] == {}
    assert kernels.compare(traced) == [
        "kernels: none in the trace (a CPU's XLA names none; on a GPU, its tracer did not start)"
    ]
    # A trace that fails is its arm's error, and the cell's other figures stand.
    failed = kernels.trace_arms({"a": loop, "b": broken}, 2, str(tmp_path))
    assert failed["b"] == {"error": "OSError: no tracer"}
    assert kernels.compare(failed) == ["kernels b: OSError: no tracer"]


def test_lm_benchmark_passes_profile_to_each_cells_process(monkeypatch):
    import argparse
    import subprocess as sp

    from jdp.bench import lm

    parser = argparse.ArgumentParser()
    lm.add_arguments(parser)
    args = parser.parse_args(["--profile", "traces"])
    ran = []
    monkeypatch.setattr(
        lm.subprocess,
        "run",
        lambda command, **_: ran.append(command) or sp.CompletedProcess(command, 0, "{}\n", ""),
    )
    assert lm._cell_in_own_process(args, "data=1", "none", "xla") == {}
    assert ran[0][ran[0].index("--profile") + 1] == "traces"


def test_host_instructions_count_a_call_from_two_dumps(tmp_path, monkeypatch):
    # Each arm's dumps: `calls` calls, then twice as many, each with the same cost of
    # starting and stopping the count (here 1,000), which the difference leaves out.
    from tools import host_instructions

    listed = {1: (5_000 + 1_000, 4_000), 2: (10_000 + 1_000, 8_000)}
    listed |= {3: (7_000 + 1_000, 5_000), 4: (14_000 + 1_000, 10_000)}
    for part in listed:
        (tmp_path / f"callgrind.out.{part}-01").write_text("")
        (tmp_path / f"callgrind.out.{part}-02").write_text("")  # another thread's: not read
    monkeypatch.setattr(
        host_instructions, "_counts", lambda path: listed[int(path.name.split(".")[2][0])]
    )
    counted = host_instructions.per_call(str(tmp_path), ["jdp", "one-device"], calls=10)
    assert counted == {"jdp": (500.0, 400.0), "one-device": (700.0, 500.0)}


def test_host_instructions_read_the_listing_less_the_allocator_and_by_part():
    from tools.host_instructions import PARTS, part_counts, split_counts

    listed = """\
--------------------------------------------------------------------------------
3,100 (100.0%)  PROGRAM TOTALS
--------------------------------------------------------------------------------
Ir              file:function
--------------------------------------------------------------------------------
1,500 (48.39%)  ./malloc/./malloc/malloc.c:_int_free [/usr/lib/x86_64-linux-gnu/libc.so.6]
1,200 (38.71%)  Python/ceval.c:_PyEval_EvalFrameDefault [/usr/lib/libpython3.11.so.1.0]
  250 ( 8.06%)  ???:jax::PjitFunction::Call() [/venv/site-packages/jaxlib/libjax_common.so]
   80 ( 2.58%)  Objects/dictobject.c:insertdict [/usr/bin/python3.11]
   50 ( 1.61%)  ???:xla::ifrt::PjRtArray::Create() [/opt/libjax_common.so]
   20 ( 0.65%)  ./string/memcmp-avx2-movbe.S:__memcmp_avx2_movbe [/usr/lib/libc.so.6]
"""
    assert split_counts(part_counts(listed)) == (3_100, 1_600)
    # Python's interpreter linked into the executable counts as Python; jaxlib's library
    # wherever it lies counts as jaxlib; the C library outside its allocator, as the rest.
    assert dict(zip(PARTS, part_counts(listed), strict=True)) == {
        "the allocator": 1_500,
        "Python": 1_280,
        "jaxlib": 300,
        "the rest": 20,
    }


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--meshes", "data=1"], "needs Valgrind (apt install valgrind)"),
        (["--cases", "mlp-1b"], "unknown case 'mlp-1b'; choose from: mlp-38k,"),
        (["--calls", "0"], "--calls 0, --batch-size 128: give 1 or more"),
    ],
)
def test_host_instructions_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, argv, line):
    from tools import host_instructions

    monkeypatch.setattr(host_instructions.shutil, "which", lambda name: None)
    assert host_instructions.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tools.host_instructions: {line}") and err.count("\n") == 1
