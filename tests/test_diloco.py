"""DiLoCo and local SGD: groups of replicas that synchronise every H steps.

The maths (H=1 local SGD is data parallelism; DiLoCo's outer step against a plain
JAX one), where each group's parameters live, what crosses the ``group`` axis in
the compiled programs, and the run's guarantees: resume after SIGKILL, several
processes, one-line refusals.
"""

import random
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_drift_within
from helpers import (
    assert_bitwise_equal,
    assert_trees_close,
    init_params,
    regression_data,
    regression_loss,
    run_cli,
    saved_arrays,
    saves_after,
    subprocess_env,
)

import jdp
from jdp.checkpoint import load_params
from jdp.collectives import Collective, bytes_across, collectives
from jdp.mesh import GROUP_AXIS

STEPS = 5


def _batches(count=STEPS):
    return [regression_data(seed) for seed in range(count)]


def _train(spec, outer, batches, optimizer, *, steps_per_call=1, after=None):
    """Trains with the public API on ``spec``; synchronises every ``outer.sync_every``
    steps when the mesh has groups. ``after(step, state)`` sees each step's state."""
    mesh = jdp.make_mesh(spec)
    grouped = GROUP_AXIS in mesh.shape
    state = jdp.create_train_state(init_params(), optimizer, mesh, outer=outer if grouped else None)
    step = jdp.make_train_step(regression_loss, optimizer, mesh, steps_per_call=steps_per_call)
    sync = jdp.make_sync_step(outer, mesh) if grouped else None
    for first in range(0, len(batches), steps_per_call):
        chunk = batches[first : first + steps_per_call]
        if steps_per_call > 1:
            batch = jdp.shard_batch(
                jax.tree.map(lambda *xs: np.stack(xs), *chunk), mesh, stacked=True
            )
        else:
            batch = jdp.shard_batch(chunk[0], mesh)
        state, _ = step(state, batch)
        done = first + steps_per_call
        if after is not None:
            after(done, state)
        if sync is not None and done % sync.every == 0:
            state = sync(state)
    return state


@pytest.mark.parametrize("spec", ["group=2,data=4", "group=8,data=1"])
def test_h1_local_sgd_is_synchronous_data_parallelism(devices, spec):
    """Outer SGD with lr 1 and no momentum after every step replaces the parameters by
    the groups' average; with an inner optimizer linear in the gradient that is the
    update of the average gradient over the whole batch."""
    inner = optax.sgd(0.05, momentum=0.9)
    local_sgd = jdp.diloco(sync_every=1, lr=1.0, momentum=0.0)
    grouped = _train(spec, local_sgd, _batches(), inner)
    synchronous = _train("data=8", None, _batches(), inner)
    assert_trees_close(jax.device_get(grouped.params), jax.device_get(synchronous.params))
    assert int(grouped.step) == STEPS


def _by_group(leaf, mesh):
    """``{group: [the leaf's bytes on each of its devices]}``."""
    position = list(mesh.devices.flat)
    copies = {}
    for shard in leaf.addressable_shards:
        index = np.unravel_index(position.index(shard.device), mesh.devices.shape)[0]
        copies.setdefault(int(index), []).append(np.asarray(shard.data)[0])
    return copies


def test_groups_drift_between_synchronisations_and_agree_after():
    mesh = jdp.make_mesh("group=2,data=4")
    outer = jdp.diloco(sync_every=4)
    seen = {}

    def after(step, state):
        leaf = state.groups.params["w1"]
        assert leaf.sharding.spec == jax.sharding.PartitionSpec(GROUP_AXIS)
        copies = _by_group(leaf, mesh)
        for group, arrays in copies.items():  # within a group, every replica alike
            for array in arrays[1:]:
                np.testing.assert_array_equal(array, arrays[0], err_msg=f"group {group}")
        seen[step] = (copies[0][0], copies[1][0], np.asarray(state.params["w1"]))

    state = _train("group=2,data=4", outer, _batches(6), optax.adam(1e-2), after=after)
    first, second, synchronised = seen[3]
    assert not np.array_equal(first, second), "the groups train on different rows"
    np.testing.assert_array_equal(synchronised, np.asarray(init_params()["w1"]))
    # After the synchronisation at step 4, every group continues from the outer result.
    for arrays in _by_group(state.groups.params["w1"], mesh).values():
        assert not np.array_equal(arrays[0], np.asarray(state.params["w1"]))  # steps 5, 6
    synced = _train("group=2,data=4", outer, _batches(4), optax.adam(1e-2))
    for arrays in _by_group(synced.groups.params["w1"], mesh).values():
        np.testing.assert_array_equal(arrays[0], np.asarray(synced.params["w1"]))
    assert not np.array_equal(np.asarray(synced.params["w1"]), np.asarray(init_params()["w1"]))


def _plain_diloco(batches, inner, outer_tx, *, groups, sync_every):
    """DiLoCo on one device, as the paper writes it: each group trains on its block of
    rows with its own inner state; at a synchronisation the outer gradient is the
    synchronised parameters minus the groups' mean."""
    grad = jax.jit(jax.grad(regression_loss))
    outer = init_params()
    outer_state = outer_tx.init(outer)
    local = [outer] * groups
    inner_states = [inner.init(outer) for _ in range(groups)]
    for index, batch in enumerate(batches, start=1):
        rows = len(batch["x"]) // groups
        for g in range(groups):
            block = {key: value[g * rows : (g + 1) * rows] for key, value in batch.items()}
            updates, inner_states[g] = inner.update(
                grad(local[g], block, None), inner_states[g], local[g]
            )
            local[g] = optax.apply_updates(local[g], updates)
        if index % sync_every == 0:
            mean = jax.tree.map(lambda *xs: sum(xs) / groups, *local)
            outer_grad = jax.tree.map(jnp.subtract, outer, mean)
            updates, outer_state = outer_tx.update(outer_grad, outer_state, outer)
            outer = optax.apply_updates(outer, updates)
            local = [outer] * groups
    return outer, local


def test_the_outer_step_is_nesterov_on_the_groups_average_change(devices):
    inner = optax.sgd(0.05)
    outer = jdp.diloco(sync_every=2)  # Nesterov, lr 0.7, momentum 0.9: the paper's
    batches = _batches(6)
    state = _train("group=2,data=4", outer, batches, inner)
    expected, _ = _plain_diloco(
        batches, inner, optax.sgd(0.7, momentum=0.9, nesterov=True), groups=2, sync_every=2
    )
    assert_trees_close(jax.device_get(state.params), expected)


def test_several_steps_per_call_equal_single_steps(devices):
    outer = jdp.diloco(sync_every=4)
    single = _train("group=2,data=4", outer, _batches(8), optax.adam(1e-2))
    scanned = _train("group=2,data=4", outer, _batches(8), optax.adam(1e-2), steps_per_call=2)
    assert_trees_close(jax.device_get(scanned.params), jax.device_get(single.params))
    assert_trees_close(
        jax.device_get(scanned.groups.opt_state), jax.device_get(single.groups.opt_state)
    )


def _programs(steps_per_call=1):
    mesh = jdp.make_mesh("group=2,data=4")
    outer = jdp.diloco(sync_every=4)
    state = jdp.create_train_state(init_params(), optax.adam(1e-2), mesh, outer=outer)
    step = jdp.make_train_step(
        regression_loss, optax.adam(1e-2), mesh, steps_per_call=steps_per_call
    )
    data = regression_data()
    if steps_per_call > 1:
        data = jax.tree.map(lambda x: np.stack([x] * steps_per_call), data)
    batch = jdp.shard_batch(data, mesh, stacked=steps_per_call > 1)
    inner = step.lower(state, batch).compile().as_text()
    sync = jdp.make_sync_step(outer, mesh).lower(state).compile().as_text()
    return mesh, inner, sync


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_only_the_synchronisation_communicates_across_groups(devices, steps_per_call):
    mesh, inner, sync = _programs(steps_per_call)
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(init_params()))
    assert bytes_across(inner, mesh, GROUP_AXIS) == 0
    assert bytes_across(inner, mesh, "data") >= param_bytes  # the gradients' all-reduce
    assert bytes_across(sync, mesh, GROUP_AXIS) == param_bytes  # 1.00x the parameters
    assert bytes_across(sync, mesh, "data") == 0


def test_collectives_read_every_form_of_device_groups():
    mesh = jdp.make_mesh("group=2,data=4")
    text = "\n".join(
        [
            "%a = f32[10]{0} all-reduce(%x), replica_groups={{0,1,2,3},{4,5,6,7}}",
            "%b = (f32[4,16]{1,0}, bf16[3]{0}) all-reduce(%y, %z), "
            "replica_groups=[4,2]<=[2,4]T(1,0)",
            "%c = f32[8]{0} all-gather-start(%w), replica_groups=[2,4]<=[8], dimensions={0}",
            "%d = f32[2]{0} collective-permute(%v), source_target_pairs={{0,4},{4,0}}",
            "%e = f32[2]{0} add(%v, %v)",
        ]
    )
    found = collectives(text, 8)
    assert found == [
        Collective("all-reduce", 40, ((0, 1, 2, 3), (4, 5, 6, 7))),
        Collective("all-reduce", 4 * 16 * 4 + 3 * 2, ((0, 4), (1, 5), (2, 6), (3, 7))),
        Collective("all-gather", 32, ((0, 1, 2, 3), (4, 5, 6, 7))),
        Collective("collective-permute", 8, ((0, 4), (4, 0))),
    ]
    assert [op.crosses(mesh, GROUP_AXIS) for op in found] == [False, True, False, True]
    assert [op.crosses(mesh, "data") for op in found] == [True, False, True, False]


def test_evaluation_uses_the_synchronised_parameters(devices):
    mesh = jdp.make_mesh("group=2,data=4")
    state = _train("group=2,data=4", jdp.diloco(sync_every=4), _batches(3), optax.adam(1e-2))

    def metrics_fn(params, batch):
        return {"loss": jnp.mean((batch["x"] @ params["w1"]) ** 2, axis=1)}

    batches = [jdp.shard_batch(regression_data(9), mesh)]
    on_groups = jdp.evaluate(jdp.make_eval_step(metrics_fn, mesh), state, batches)
    mesh8 = jdp.make_mesh("data=8")
    plain = jdp.create_train_state(init_params(), optax.adam(1e-2), mesh8)
    on_start = jdp.evaluate(
        jdp.make_eval_step(metrics_fn, mesh8), plain, [jdp.shard_batch(regression_data(9), mesh8)]
    )
    assert on_groups == pytest.approx(on_start, rel=1e-6)  # no sync yet: the initial params


def test_api_refusals_are_one_line(devices):
    mesh = jdp.make_mesh("group=2,data=4")
    outer = jdp.diloco(sync_every=2)
    with pytest.raises(jdp.UsageError, match=r"pass outer=jdp\.diloco"):
        jdp.create_train_state(init_params(), optax.sgd(0.1), mesh)
    with pytest.raises(jdp.UsageError, match="needs a mesh with a 'group' axis"):
        jdp.create_train_state(init_params(), optax.sgd(0.1), jdp.make_mesh("data=8"), outer=outer)
    with pytest.raises(jdp.UsageError, match="has no 'group' axis"):
        jdp.make_sync_step(outer, jdp.make_mesh("data=8"))
    with pytest.raises(jdp.UsageError, match="maps over one axis"):
        jdp.make_train_step(regression_loss, optax.sgd(0.1), mesh, backend="pmap")
    with pytest.raises(jdp.UsageError, match=r"'group' must be the first axis.*group=2,data=4"):
        jdp.make_mesh("data=4,group=2")
    with pytest.raises(jdp.UsageError, match="sync_every must be at least 1"):
        jdp.diloco(sync_every=0)
    state = jdp.create_train_state(init_params(), optax.sgd(0.1), mesh, outer=outer)
    step = jdp.make_train_step(regression_loss, optax.sgd(0.1), mesh)
    with pytest.raises(jdp.UsageError, match="the state has none"):
        step(state.replace(groups=None), jdp.shard_batch(regression_data(), mesh))
    with pytest.raises(jdp.UsageError, match=r"does not split over 8 replicas"):
        step(state, regression_data(rows=36))  # a host batch, placed by jit
    new, _ = step(state, jdp.shard_batch(regression_data(), mesh))
    with pytest.raises(jdp.UsageError, match="donated its arrays"):
        jdp.make_sync_step(outer, mesh)(state)
    assert int(jdp.make_sync_step(outer, mesh)(new).step) == 1


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--sync-every", "10"], "--sync-every set DiLoCo's groups, and --mesh data=8 has none"),
        (["--mesh", "data=4,group=2"], "'group' must be the first axis"),
        (
            ["--mesh", "group=2"],
            "no 'data' axis; data parallelism shards the batch over it, "
            "e.g. jdp.make_mesh('group=2,data=1')",
        ),
        (["--mesh", "group=2,data=4", "--backend", "pmap"], "run with --backend jit"),
        (
            [
                "--mesh",
                "group=2,data=4",
                "--sync-every",
                "7",
                "--steps-per-call",
                "2",
                "--steps",
                "8",
            ],
            "--sync-every 7 is not a multiple of --steps-per-call 2",
        ),
        (["--mesh", "group=2,data=4", "--outer-momentum", "1"], "--outer-momentum must be in"),
        (
            ["--mesh", "group=2,data=4", "--sync-every", "4", "--eval-every", "6"],
            "--eval-every 6 is not a multiple of --sync-every 4",
        ),
        (["--mesh", "group=2,data=4", "--batch-size", "60"], "(8 replicas over 2 groups)"),
    ],
)
def test_cli_refusals_are_one_line_and_exit_2(flags, needle):
    flags = flags if "--mesh" in flags else ["--mesh", "data=8", *flags]
    result = run_cli(*flags, "--steps", "8", timeout=120)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


# A DiLoCo run long enough (CNN, BatchNorm statistics averaged too) for a kill to land
# mid-run; saves every 10 steps fall between synchronisations (every 15).
_RUN = [
    *"--mesh group=2,data=4 --sync-every 15 --model cnn --steps 60".split(),
    *"--warmup-steps 5 --batch-size 64 --ckpt-every 10".split(),
]


def _steps_in(directory):
    return {int(path.name) for path in directory.iterdir() if path.name.isdigit()}


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    reference = tmp_path / "uninterrupted"
    result = run_cli(*_RUN, "--ckpt-dir", reference)
    assert result.returncode == 0, result.stderr
    assert "jdp: DiLoCo: 2 groups of 4 replicas" in result.stdout

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "jdp.train", *_RUN, "--ckpt-dir", str(killed)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )
    deadline = time.monotonic() + 120
    while not (killed.exists() and 10 in _steps_in(killed)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    time.sleep(random.uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run ended before it was killed"
    resumed = run_cli(*_RUN, "--ckpt-dir", killed)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"^jdp: resuming from step \d+ in ", resumed.stdout, re.M)
    saved = saved_arrays(killed, 60)
    assert any(name.startswith("['groups']") for name in saved), sorted(saved)
    assert_bitwise_equal(saved, saved_arrays(reference, 60))


@pytest.mark.slow
def test_a_checkpoint_of_groups_resumes_only_with_as_many_groups(tmp_path):
    result = run_cli(
        *"--mesh group=2,data=4 --sync-every 4 --steps 8 --warmup-steps 0".split(),
        "--ckpt-dir",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    for mesh in (["data=8"], ["group=4,data=2", "--sync-every", "4"]):
        refused = run_cli("--mesh", *mesh, "--steps", "16", "--ckpt-dir", tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert "2 DiLoCo groups" in refused.stderr, refused.stderr
    # The synchronised parameters are the checkpoint's params: they evaluate on any mesh.
    tested = re.search(r"test_loss=[\d.]+ test_accuracy=[\d.]+", result.stdout).group(0)
    for mesh in ("data=8", "group=4,data=2"):
        evaluated = run_cli("--mesh", mesh, "--eval-only", "--ckpt-dir", tmp_path)
        assert evaluated.returncode == 0, evaluated.stderr
        assert tested in evaluated.stdout, (tested, evaluated.stdout)
    # The same number of groups resumes, however the mesh is written.
    resumed = run_cli(
        *"--mesh group=-1,data=4 --sync-every 4 --steps 12 --warmup-steps 0".split(),
        "--ckpt-dir",
        tmp_path,
        devices=8,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "jdp: resuming from step 8" in resumed.stdout


@pytest.mark.slow
def test_two_processes_hold_one_group_each_and_match_one_process(tmp_path):
    run = "--mesh group=2,data=4 --sync-every 10 --steps 60 --warmup-steps 10".split()
    single = run_cli(*run, "--ckpt-dir", tmp_path / "one")
    assert single.returncode == 0, single.stderr
    command = [
        sys.executable,
        *"-m jdp.launch --nproc 2 --devices-per-process 4 --".split(),
        sys.executable,
        "-m",
        "jdp.train",
        *run,
        "--ckpt-dir",
        str(tmp_path / "two"),
    ]
    two = subprocess.run(command, capture_output=True, text=True, timeout=240, env=subprocess_env())
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "jdp: DiLoCo groups by process: group 0: process 0; group 1: process 1" in two.stdout
    # Gloo and XLA sum the data axis's gradients in other orders (closeness.py).
    assert_drift_within(load_params(str(tmp_path / "two")), load_params(str(tmp_path / "one")))


def test_the_replica_check_compares_each_groups_devices_among_themselves(devices):
    from jdp.actions import Progress
    from jdp.distributed import ReplicaMismatchError
    from jdp.training.run_actions import CheckReplicas

    state = _train("group=2,data=4", jdp.diloco(sync_every=4), _batches(3), optax.adam(1e-2))
    check = CheckReplicas(1)
    check.run(Progress(step=3, steps=3, state=state))  # the groups differ; each agrees inside
    leaf = state.groups.params["b1"]
    blocks = [np.asarray(shard.data) + (shard.device.id == 5) for shard in leaf.addressable_shards]
    placed = [
        jax.device_put(block, shard.device)
        for block, shard in zip(blocks, leaf.addressable_shards, strict=True)
    ]
    diverged = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, placed)
    params = {**state.groups.params, "b1": diverged}
    broken = state.replace(groups=state.groups.replace(params=params))
    with pytest.raises(
        ReplicaMismatchError,
        match="on process 0 device 5 are not those the other 3 devices of their group hold",
    ):
        check.run(Progress(step=3, steps=3, state=broken))


def test_a_group_gone_non_finite_is_never_saved_and_stops_the_run(devices, tmp_path, capfd):
    """The metrics are one group's; a save and the guard check every group's parameters."""
    from jdp.training.finite import GuardFinite

    state = _train("group=2,data=4", jdp.diloco(sync_every=4), _batches(2), optax.adam(1e-2))
    leaf = state.groups.params["b1"]
    poisoned = jax.device_put(
        np.asarray(leaf) * np.array([1.0, np.nan], np.float32)[:, None], leaf.sharding
    )
    broken = state.replace(
        groups=state.groups.replace(params={**state.groups.params, "b1": poisoned})
    )
    metrics = {"loss": jnp.float32(0.5)}  # group 0's: finite
    on_disk, then, progress = saves_after(tmp_path, broken, state, metrics)
    assert (on_disk, then) == ([], [2])
    assert "not saving step 2: a DiLoCo group's parameters are not finite" in capfd.readouterr().err
    # The guard decides on the groups' state too, as every process reads it alike.
    guard = GuardFinite(every=1, skipping=False, max_skipped_fraction=0.25, ckpt_dir=None)
    guard.run(progress)  # the finite state
    progress.after_call(2, 1, broken, metrics)
    with pytest.raises(jdp.NonFiniteError, match="a DiLoCo group's parameters are not finite"):
        guard.run(progress)


def test_accumulation_in_groups_equals_whole_batches(devices):
    """Micro-batches scanned inside each group's step (their carry varies by group)."""
    mesh = jdp.make_mesh("group=2,data=4")
    outer = jdp.diloco(sync_every=2)
    results = []
    for accumulate in (1, 2):
        state = jdp.create_train_state(init_params(), optax.sgd(0.05), mesh, outer=outer)
        step = jdp.make_train_step(regression_loss, optax.sgd(0.05), mesh, accumulate=accumulate)
        sync = jdp.make_sync_step(outer, mesh)
        for index, batch in enumerate(_batches(4), start=1):
            state, _ = step(state, jdp.shard_batch(batch, mesh))
            if index % 2 == 0:
                state = sync(state)
        results.append(jax.device_get(state.params))
    assert_trees_close(results[1], results[0])
