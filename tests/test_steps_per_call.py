"""Several optimizer steps per call: the same result as single steps, batches stacked;
``--steps-per-call auto``."""

import dataclasses
import re
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from closeness import assert_drift_within
from helpers import (
    assert_bitwise_equal,
    init_params,
    regression_data,
    regression_loss,
    run_cli,
    saved_arrays,
    subprocess_env,
)

import jdp
from jdp.training import calls


def _single_steps(mesh, backend, batches, optimizer):
    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh, backend=backend, lr_schedule=lambda c: c
    )
    losses = []
    for batch in batches:
        state, metrics = step(state, jdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("spec", ["data=8", "data=1"])
def test_k_steps_per_call_equal_k_single_steps(devices, backend, spec):
    mesh = jdp.make_mesh(spec)
    optimizer = optax.adam(1e-2)
    batches = [regression_data(seed) for seed in range(8)]
    single, single_losses = _single_steps(mesh, backend, batches, optimizer)

    state = jdp.create_train_state(init_params(), optimizer, mesh)
    step = jdp.make_train_step(
        regression_loss, optimizer, mesh, backend=backend, steps_per_call=4, lr_schedule=lambda c: c
    )
    losses, counts = [], []
    for first in (0, 4):
        stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *batches[first : first + 4])
        state, metrics = step(state, jdp.shard_batch(stacked, mesh, stacked=True))
        assert metrics["loss"].shape == (4,)
        losses += jax.device_get(metrics["loss"]).tolist()
        counts += jax.device_get(metrics["lr"]).tolist()
    assert int(state.step) == 8
    assert counts == [0, 1, 2, 3, 4, 5, 6, 7]  # one metric value per step, in order
    # A scanned step is another compiled program: Adam's results agree to rounding
    # (closeness.py). The losses are means of 64 non-negative terms: 64 * 1.2e-7 apart
    # at most, plus the parameters' drift, second order in the loss.
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    assert_drift_within(jax.device_get(state.params), jax.device_get(single.params))


def test_steps_per_call_must_be_positive(mesh8):
    with pytest.raises(jdp.UsageError, match="steps_per_call must be whole numbers of 1 or more"):
        jdp.make_train_step(regression_loss, optax.sgd(0.1), mesh8, steps_per_call=0)


def test_loader_stacks_consecutive_steps(mesh8):
    split = jdp.load_split("digits", "train")
    with jdp.train_batches(split, mesh8, batch_size=64, seed=3, start_step=4) as single:
        singles = [jax.device_get(next(single)) for _ in range(8)]
    with jdp.train_batches(
        split, mesh8, batch_size=64, seed=3, start_step=4, steps_per_call=4
    ) as stacked:
        calls = [jax.device_get(next(stacked)) for _ in range(2)]
        assert stacked.position == 12
    for call, first in zip(calls, (0, 4), strict=True):
        for key in ("image", "label"):
            assert call[key].shape[0] == 4
            np.testing.assert_array_equal(
                call[key], np.stack([b[key] for b in singles[first : first + 4]])
            )


@pytest.mark.parametrize("on_device", [False, True])
def test_loader_closes_a_gap_before_a_period_with_a_shorter_call(mesh8, on_device):
    # 4 steps a call, periods 5 and 6, from step 2: calls of 4 where no multiple of a
    # period comes sooner, a shorter call up to it (of one step: its batch unstacked);
    # read in chunks of several calls (steps=None), on the host or gathered on the devices.
    from jdp.data.loader import CallBounds, call_steps, on_host
    from jdp.data.loader.on_device import on_devices

    split = jdp.load_split("digits", "train")
    if on_device:
        split = on_devices(split, mesh8)
    with jdp.train_batches(on_host(split), mesh8, batch_size=64, seed=3, start_step=2) as single:
        singles = [jax.device_get(next(single)) for _ in range(20)]
    plan, step = [], 2
    while step < 20:
        plan.append(call_steps(step, 4, CallBounds((5, 6))))
        step += plan[-1]
    assert plan == [3, 1, 4, 2, 3, 3, 2]  # steps 3-5, 6, 7-10, 11-12, 13-15, 16-18, 19-20
    with jdp.train_batches(
        split,
        mesh8,
        batch_size=64,
        seed=3,
        start_step=2,
        steps_per_call=4,
        bounds=CallBounds((5, 6)),
    ) as planned:
        first = 0
        for ran in plan:
            call = jax.device_get(next(planned))
            for key in ("image", "label"):
                want = (
                    singles[first][key]
                    if ran == 1
                    else np.stack([b[key] for b in singles[first : first + ran]])
                )
                np.testing.assert_array_equal(call[key], want)
            first += ran
        assert planned.position == 20


def test_no_call_crosses_the_profile_window_your_callbacks_or_diloco_s_synchronisation(
    tmp_path,
):
    # The profile's window bounds calls at its two ends only; your periodic callbacks and
    # DiLoCo's synchronisation at each multiple of their periods, as the run's own.
    from jdp.data.loader import calls_from
    from jdp.training.calls import call_bounds

    def lengths(config, callbacks=()):
        return [ran for _, ran in calls_from(0, 200, 64, call_bounds(config, callbacks))]

    config = jdp.TrainConfig(steps=200, log_every=100, eval_every=0)
    profiled = dataclasses.replace(config, profile_steps="10:15", log_dir=str(tmp_path))
    assert lengths(profiled) == [9, 6, 64, 21, 64, 36]
    assert lengths(config, [jdp.actions.Callback(print, every=50)]) == [50] * 4
    groups = dataclasses.replace(config, mesh="group=2,data=4", log_every=200, sync_every=40)
    assert lengths(groups) == [40] * 5


def test_a_forced_call_stops_at_every_period_bitwise_the_run_at_one(devices, tmp_path):
    """4 steps a call with periods it does not divide (log every 5, evaluate every 6, save
    every 10, 26 steps): a shorter call closes each call's gap to a period, so every
    logged step, evaluation and save is the run at 1's, bitwise, and so is a run resumed
    from the save at step 10."""
    import shutil

    def run(steps_per_call, name):
        config = jdp.TrainConfig(
            mesh="data=8",
            steps=26,
            warmup_steps=4,
            log_every=5,
            eval_every=6,
            ckpt_every=10,
            keep=10,
            ckpt_dir=str(tmp_path / name),
            steps_per_call=steps_per_call,
        )
        return jdp.fit(config, console=jdp.Console(enabled=False))

    def logged(result):
        return [(r["step"], r.get("loss"), r.get("lr"), r.get("test_loss")) for r in result.history]

    single, forced = run(1, "single"), run(4, "forced")
    assert [record[0] for record in logged(single)] == [5, 6, 10, 12, 15, 18, 20, 24, 25, 26]
    assert logged(forced) == logged(single)
    assert_bitwise_equal(
        saved_arrays(tmp_path / "forced", 10), saved_arrays(tmp_path / "single", 10)
    )
    jax.tree.map(np.testing.assert_array_equal, forced.state.params, single.state.params)
    for later in (path for path in (tmp_path / "forced").iterdir() if path.name.isdigit()):
        if int(later.name) > 10:  # the saves after step 10's, the best's among them
            shutil.rmtree(later)
    resumed = run(4, "forced")
    assert logged(resumed) == logged(single)[3:]  # from step 12 on: resumed at 10
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, single.state.params)
    assert resumed.test_accuracy == single.test_accuracy


def _cli(*flags):
    return run_cli("--mesh", "data=8", "--steps", "80", *flags)


@pytest.mark.slow
def test_cli_steps_per_call_prints_the_same_run():
    import re

    summary = re.compile(r"train_loss=(\S+) test_loss=(\S+) test_accuracy=(\S+)")
    # Evaluations every 30 steps, which 8 does not divide: shorter calls close the gaps.
    single = _cli("--eval-every", "30")
    several = _cli("--eval-every", "30", "--steps-per-call", "8")
    assert single.returncode == 0 and several.returncode == 0, several.stderr
    assert summary.search(several.stdout).groups() == summary.search(single.stdout).groups()
    evaluations = re.compile(r"^step \d+: test_loss=.*$", re.M)
    assert evaluations.findall(several.stdout) == evaluations.findall(single.stdout)
    assert "step 30: test_loss=" in several.stdout
    said = "jdp: --steps-per-call 8: 8 does not divide --log-every 20, --eval-every 30; a shorter"
    assert said in several.stdout


def test_flops_per_step_do_not_grow_with_steps_per_call(mesh8):
    # MFU uses the lowered call's FLOPs as one step's: XLA counts a scan's body once.
    from jdp.report.throughput import step_flops

    optimizer = optax.sgd(0.1)
    flops = {}
    for k in (1, 4):
        state = jdp.create_train_state(init_params(), optimizer, mesh8)
        step = jdp.make_train_step(regression_loss, optimizer, mesh8, steps_per_call=k)
        batch = regression_data()
        if k > 1:
            batch = jax.tree.map(lambda x, k=k: np.stack([x] * k), batch)
        lowered = step.lower(state, jdp.shard_batch(batch, mesh8, stacked=k > 1))
        flops[k] = step_flops(lowered, 8, per_step_loops=int(k > 1))
    assert flops[4] == pytest.approx(flops[1], rel=0.01)


def test_a_stack_of_the_wrong_length_is_refused(mesh8):
    optimizer = optax.sgd(0.1)
    state = jdp.create_train_state(init_params(), optimizer, mesh8)
    step = jdp.make_train_step(regression_loss, optimizer, mesh8, steps_per_call=4)
    batch = jax.tree.map(lambda x: np.stack([x] * 3), regression_data())
    with pytest.raises(jdp.UsageError, match="steps_per_call=4 takes that many batches"):
        step(state, jdp.shard_batch(batch, mesh8, stacked=True))


def test_auto_calls_never_cross_a_period_or_the_start(tmp_path):
    from jdp.training.calls import MOST_STEPS, longest_call

    config = jdp.TrainConfig(steps=400, log_every=20, eval_every=200, ckpt_every=0)
    assert longest_call(config, 0) == 20
    assert longest_call(config, 30) == 10  # resumed at step 30: calls end at 40, 50, ...
    assert longest_call(jdp.TrainConfig(steps=400, log_every=7), 0) == 1
    assert longest_call(jdp.TrainConfig(steps=1280, log_every=640, eval_every=0), 0) == MOST_STEPS
    profiled = jdp.TrainConfig(steps=400, log_every=20, profile_steps="11:14", log_dir=tmp_path)
    assert longest_call(profiled, 0) == 2


def test_auto_takes_the_smallest_call_that_leaves_the_host_under_its_share():
    from jdp.training.calls import steps_for_share

    # A one-step call of 100 us, 40 of them the host's: 40 / (40 + 60 k) < 3% from k = 22.
    assert steps_for_share(40.0, 100.0, 64) == 32  # the divisors of 64 above 22
    assert steps_for_share(40.0, 100.0, 20) == 20  # none under it: the longest call
    assert steps_for_share(1.0, 1000.0, 20) == 1  # a long step: one a call
    assert steps_for_share(10.0, 100.0, 20) == 4  # 10 / (10 + 90 k) < 3% from k = 4


def _paying(monkeypatch, steps=None):
    """Every call of several steps pays back its compile (``saving``), as in a long run;
    with ``steps``, the host's share asks for that many."""
    monkeypatch.setattr(calls, "saving", lambda host_us, steps, remaining: float("inf"))
    if steps is not None:
        monkeypatch.setattr(calls, "steps_for_share", lambda host, call, longest: steps)


def _counting_probe(monkeypatch) -> list[int]:
    """The one-step calls each probe of ``--steps-per-call auto`` makes, appended once it
    has made them."""
    probed, probe = [], calls._one_step_call

    def counted(step, *args, **kwargs):
        made = [0]

        def counting(*call):
            made[0] += 1
            return step(*call)

        try:
            return probe(counting, *args, **kwargs)
        finally:
            probed.append(made[0])

    monkeypatch.setattr(calls, "_one_step_call", counted)
    return probed


@pytest.mark.parametrize("spec", ["data=1", "data=8"])
def test_auto_is_bitwise_the_run_at_one_step_a_call(devices, spec, monkeypatch, capsys):
    _paying(monkeypatch, steps=10)  # the longest call the periods allow
    probed = _counting_probe(monkeypatch)
    config = jdp.TrainConfig(
        mesh=spec, steps=40, warmup_steps=4, log_every=10, eval_every=20, steps_per_call=1
    )
    auto = jdp.fit(dataclasses.replace(config, steps_per_call="auto"), console=jdp.Console())
    said = capsys.readouterr().out
    assert "--steps-per-call auto: 10 steps a call (the host took" in said, said
    assert "a call of 10 is bitwise 10 single steps here" in said
    assert probed == [1 + calls.TIMED_CALLS]  # a run that repays a longer call: all timed
    single = jdp.fit(config, console=jdp.Console(enabled=False))
    jax.tree.map(np.testing.assert_array_equal, auto.state.params, single.state.params)
    assert [r["loss"] for r in auto.history] == [r["loss"] for r in single.history]
    assert auto.test_accuracy == single.test_accuracy


def test_auto_keeps_one_step_a_call_where_a_call_rounds_otherwise(devices, monkeypatch, capsys):
    # The cnn's convolutions compile otherwise inside XLA:CPU's loop: a call of 2 steps is
    # not bitwise 2 single steps, which auto checks and says, keeping one step a call.
    _paying(monkeypatch, steps=2)
    config = jdp.TrainConfig(
        mesh="data=1", model="cnn", steps=4, steps_per_call="auto", log_every=2, eval_every=0
    )
    result = jdp.fit(config, console=jdp.Console())
    out = capsys.readouterr().out
    assert "--steps-per-call auto: 1 step a call (the host took" in out
    assert "a call of 2 steps rounds otherwise than 2 single steps with this model here" in out
    assert result.steps == 4


def test_auto_keeps_one_step_a_call_where_the_run_is_too_short_to_pay_for_another_compile(
    devices, monkeypatch, capsys
):
    """The default: a run as short as the README's (400 steps) would save less host time
    than compiling a call of several steps takes, so it builds and checks none, and one
    timed call settles that: its probe takes no more steps the run does not take."""
    monkeypatch.setattr(calls, "steps_for_share", lambda host, call, longest: 10)
    # No call repays its compile, whatever this machine's timings: one timed call says so.
    monkeypatch.setattr(calls, "saving", lambda host_us, steps, remaining: 0.0)
    built = []
    monkeypatch.setattr(calls, "same_bits", lambda run, state, batches: built.append(batches))
    probed = _counting_probe(monkeypatch)
    result = jdp.fit(jdp.TrainConfig(mesh="data=8", steps=40, log_every=10), console=jdp.Console())
    assert probed == [2]  # the call that compiles, and one timed
    said = capsys.readouterr().out
    assert re.search(
        r"--steps-per-call auto: 1 step a call \(the host took \d+% of a one-step call, \d+ of "
        r"\d+ us; \d+ steps a call would save \d+\.\d\d s over the run's 40 steps, less than "
        r"compiling it takes \(~\d\.\d\d s\)\)",
        said,
    ), said
    assert result.steps == 40 and built == []


def test_a_short_run_saves_less_than_a_compile_and_a_long_one_more():
    from jdp.training.calls import saving

    # 600 us of the host's a call, 4 steps a call: 450 us saved a step.
    assert saving(600.0, 4, 400) == pytest.approx(0.18)  # under the ~0.5 s of a compile
    assert saving(600.0, 4, 20_000) == pytest.approx(9.0)
    assert saving(600.0, 1, 20_000) == 0.0


def test_your_callbacks_periods_bound_the_call_and_a_plain_function_keeps_one():
    from jdp.actions import Callback, EarlyStopping
    from jdp.training.calls import callback_periods, longest_call

    config = jdp.TrainConfig(steps=400, log_every=20, eval_every=200, ckpt_every=0)
    every_5 = Callback(lambda progress: None, every=5)
    assert callback_periods([every_5, Callback(print)]) == [5, 0]
    assert longest_call(config, 0, callback_periods([every_5])) == 5
    assert callback_periods([lambda progress: False]) is None  # called after every call
    assert callback_periods([EarlyStopping(patience=2)]) is None  # rules of its own


def test_your_stream_of_batches_keeps_one_step_a_call_untimed(devices, capsys):
    split = jdp.load_split("digits", "train")
    batches = [
        {"image": split.image[i : i + 64], "label": split.label[i : i + 64]} for i in (0, 64)
    ]
    config = jdp.TrainConfig(mesh="data=8", steps=4, log_every=2, eval_every=0, batch_size=64)
    result = jdp.fit(config, train=jdp.data.from_batches(batches), console=jdp.Console())
    out = capsys.readouterr().out
    assert "--steps-per-call auto: 1 step a call (your stream of batches is read once" in out
    assert result.steps == 4


def test_auto_leaves_a_large_state_untimed(devices, monkeypatch, capsys):
    monkeypatch.setattr(calls, "MOST_STATE_BYTES", 0)  # every state is "large"
    config = jdp.TrainConfig(mesh="data=1", steps=4, steps_per_call="auto", log_every=2)
    assert jdp.fit(config, console=jdp.Console()).steps == 4
    assert "--steps-per-call auto: 1 step a call (a state of 0.0 GiB" in capsys.readouterr().out


def test_auto_on_the_command_line_and_a_bad_value_in_one_line():
    from jdp.training.flags import parse_flags

    assert parse_flags(["--steps-per-call", "auto"]).steps_per_call == "auto"
    assert parse_flags(["--steps-per-call", "4"]).steps_per_call == 4
    refused = run_cli("--steps-per-call", "many")
    assert refused.returncode == 2
    assert (
        "--steps-per-call: give a whole number or auto" in refused.stderr
        and len(refused.stderr.splitlines()) == 1
    )


class _DenseNet(nn.Module):
    """Dense, BatchNorm over the global batch, dropout: what a call must carry from step to
    step besides the parameters (statistics, each step's draw)."""

    @nn.compact
    def __call__(self, x, *, train=False):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name="data")(x)
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x)


def _dense_run(mesh, steps_per_call, batches, precision, accumulate):
    model = jdp.models.from_linen(_DenseNet(), jdp.models.classification())
    optimizer = optax.adam(1e-2)
    params, model_state = jax.jit(model.init)(jax.random.key(0), batches[0])
    state = jdp.create_train_state(
        params,
        optimizer,
        mesh,
        model_state=model_state,
        rng=jax.random.key(1),
        precision=jdp.make_precision(precision),
    )
    step = jdp.make_train_step(
        model.loss_fn,
        optimizer,
        mesh,
        has_model_state=True,
        precision=jdp.make_precision(precision),
        accumulate=accumulate,
        steps_per_call=steps_per_call,
    )
    losses = []
    for first in range(0, len(batches), steps_per_call):
        calls = batches[first : first + steps_per_call]
        batch = (
            jax.tree.map(lambda *leaves: np.stack(leaves), *calls)
            if steps_per_call > 1
            else calls[0]
        )
        state, metrics = step(state, jdp.shard_batch(batch, mesh, stacked=steps_per_call > 1))
        losses += np.atleast_1d(jax.device_get(metrics["loss"])).tolist()
    return jax.device_get((state.params, state.model_state, state.loss_scale)), losses


@pytest.mark.parametrize(
    ("spec", "precision", "accumulate"), [("data=1", "fp32", 1), ("data=8", "fp16", 2)]
)
def test_k_steps_a_call_are_bitwise_with_batchnorm_dropout_fp16_and_accumulation(
    devices, spec, precision, accumulate
):
    """Where XLA compiles the step alike inside its loop (dense layers), a call of K steps
    is bitwise K single steps: BatchNorm's statistics, dropout's draws, fp16's loss scale
    and accumulated micro-batches included; K = 3 and 4 over 12 steps."""
    split = jdp.load_split("digits", "train")
    batches = [
        {"image": split.image[i * 32 : (i + 1) * 32], "label": split.label[i * 32 : (i + 1) * 32]}
        for i in range(12)
    ]
    mesh = jdp.make_mesh(spec)
    single, single_losses = _dense_run(mesh, 1, batches, precision, accumulate)
    for k in (3, 4):
        scanned, losses = _dense_run(mesh, k, batches, precision, accumulate)
        jax.tree.map(np.testing.assert_array_equal, scanned, single)
        assert losses == single_losses


# Long enough on 8 simulated devices for a kill to land between the first save and the
# last (about 3 s apart: the 38k MLP steps in a few milliseconds there), and no longer.
_KILLED = "--mesh data=8 --steps 600 --ckpt-every 60 --eval-every 0 --log-every 60"


def _killed_run(ckpt_dir, *flags):
    command = [sys.executable, "-m", "jdp.train", *_KILLED.split(), "--ckpt-dir", str(ckpt_dir)]
    return [*command, *flags]


@pytest.mark.slow
def test_a_run_at_4_steps_a_call_killed_and_resumed_is_bitwise_the_run_at_1(tmp_path):
    single = subprocess.run(
        _killed_run(tmp_path / "single", "--steps-per-call", "1"),
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    assert single.returncode == 0, single.stderr
    flags = _killed_run(tmp_path / "killed", "--steps-per-call", "4")
    process = subprocess.Popen(flags, stdout=subprocess.DEVNULL, env=subprocess_env())
    deadline = time.monotonic() + 120
    while not (tmp_path / "killed" / "60").is_dir():
        assert process.poll() is None and time.monotonic() < deadline, "no save to kill after"
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL, "the run ended before it was killed"
    assert not (tmp_path / "killed" / "600").exists()
    resumed = subprocess.run(
        flags, capture_output=True, text=True, timeout=240, env=subprocess_env()
    )
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"^jdp: resuming from step \d+ in ", resumed.stdout, re.M)
    assert_bitwise_equal(
        saved_arrays(tmp_path / "killed", 600), saved_arrays(tmp_path / "single", 600)
    )
