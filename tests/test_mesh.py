import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import jdp
from jdp.mesh import check_batch_size, parse_mesh_spec, process_rows
from jdp.mesh_spec import MeshSpec, child_environment


@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        ("data=8", {"data": 8}),
        ("data=-1", {"data": 8}),
        ("data=1", {"data": 1}),
        ("data=4,model=2", {"data": 4, "model": 2}),
        ("data=-1,model=2", {"data": 4, "model": 2}),
        (" data = 2 ".replace(" ", ""), {"data": 2}),
    ],
)
def test_make_mesh_shapes(devices, spec, shape):
    mesh = jdp.make_mesh(spec)
    assert dict(mesh.shape) == shape
    assert mesh.axis_types == (AxisType.Auto,) * len(shape)


def test_a_configs_mesh_is_read_once_into_the_spec_the_run_reads(devices):
    config = jdp.TrainConfig(mesh="group=2,data=-1")
    spec = config.mesh_spec
    assert spec == MeshSpec("group=2,data=-1", (("group", 2), ("data", -1)))
    assert config.mesh_spec is spec  # read once, not again
    assert "mesh_spec" not in vars(config)  # TrainConfig(**vars(config)) still works
    assert spec.has("group") and not spec.has("fsdp")
    assert (spec.sizes, spec.devices) == ({"group": 2, "data": -1}, None)
    assert MeshSpec.parse("data=2,model=2").devices == 4
    assert dict(jdp.make_mesh(spec).shape) == dict(jdp.make_mesh(spec.text).shape)
    with pytest.raises(jdp.UsageError, match="unknown mesh axis 'dat'"):
        jdp.TrainConfig(mesh="dat=8")


def test_mesh_uses_the_first_devices(devices):
    mesh = jdp.make_mesh("data=2")
    assert list(mesh.devices.flat) == devices[:2]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("data=16", "needs 16 devices but 8 are present"),
        ("data=0", "sizes are positive"),
        ("data=-3", "sizes are positive"),
        ("foo", "is not NAME=SIZE"),
        ("", "empty mesh spec"),
        ("data=2,data=4", "appears twice"),
        ("dta=8", "unknown mesh axis 'dta'"),
        ("data=-1,model=-1", "at most one axis"),
        ("data=-1,model=3", "do not divide"),
        ("data=4,model=4", "needs 16 devices"),
    ],
)
def test_bad_mesh_specs_name_the_fix(devices, spec, needle):
    with pytest.raises(jdp.UsageError, match=needle) as error:
        jdp.make_mesh(spec)
    assert "\n" not in str(error.value)


def test_a_fresh_process_keeps_your_xla_flags_but_the_device_count(monkeypatch):
    """A launched process or a benchmark's run compiles with the options the user set
    (here an instruction set); the simulated device count is its own or the one asked."""
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2"
    )
    assert child_environment()["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
    assert child_environment(2)["XLA_FLAGS"] == (
        "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2"
    )
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in child_environment()


def test_parse_keeps_order():
    assert parse_mesh_spec("data=4,fsdp=2,model=1") == (("data", 4), ("fsdp", 2), ("model", 1))


def test_batch_must_divide_the_data_axis(mesh8):
    check_batch_size(64, mesh8)
    with pytest.raises(
        jdp.UsageError, match=r"not divisible by the data axis \(8 .*--batch-size 96"
    ):
        check_batch_size(100, mesh8)
    # With fsdp the rows split over both axes, and the line names both.
    with pytest.raises(jdp.UsageError, match=r"data and fsdp axes \(1 replica x 8 shards\)"):
        check_batch_size(4, jdp.make_mesh("fsdp=8"))


def test_shard_batch_places_rows_on_the_data_axis(mesh8):
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    batch = jdp.shard_batch({"x": x, "y": np.arange(16)}, mesh8)
    assert batch["x"].shape == (16, 2)
    assert batch["x"].sharding.spec == PartitionSpec("data")
    for shard in batch["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
    assert len({shard.device for shard in batch["x"].addressable_shards}) == 8


def test_shard_batch_rejects_uneven_rows(mesh8):
    with pytest.raises(jdp.UsageError, match="not divisible by its 8 data replicas"):
        jdp.shard_batch({"x": np.zeros((12, 2))}, mesh8)
    with pytest.raises(jdp.UsageError, match="share one leading"):
        jdp.shard_batch({"x": np.zeros((8, 2)), "y": np.zeros(16)}, mesh8)


def test_process_rows_single_process(mesh8):
    assert process_rows(mesh8, 64) == slice(0, 64)


def test_a_mesh_too_large_for_launched_processes_names_their_devices(monkeypatch):
    from jdp.mesh import _cpu_hint

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert _cpu_hint(jax.devices()[:4], 8) == (
        ", or give each of the 2 processes 4 CPU devices (jdp.launch --devices-per-process 4)"
    )
