"""Device meshes from specs like ``"data=8"``, simulated CPU devices, sharding helpers.

The specs and the axis names are read in `jdp.mesh_spec` (no JAX there) and
imported here, where jdp and your code find them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jdp.errors import UsageError
from jdp.mesh_spec import CPU_COUNT_FLAG
from jdp.mesh_spec import DATA_AXIS as DATA_AXIS
from jdp.mesh_spec import FSDP_AXIS as FSDP_AXIS
from jdp.mesh_spec import GROUP_AXIS as GROUP_AXIS
from jdp.mesh_spec import KNOWN_AXES as KNOWN_AXES
from jdp.mesh_spec import MODEL_AXIS as MODEL_AXIS
from jdp.mesh_spec import SHARDING_AXES as SHARDING_AXES
from jdp.mesh_spec import MeshSpec as MeshSpec
from jdp.mesh_spec import check_axis_rule as check_axis_rule
from jdp.mesh_spec import parse_axis_rules as parse_axis_rules
from jdp.mesh_spec import parse_mesh_spec as parse_mesh_spec
from jdp.mesh_spec import requested_device_count as requested_device_count

# Batch key that marks real rows (1) and padding (0) in eval batches.
MASK_KEY = "mask"


def check_spec_fits_batch(spec: MeshSpec, global_batch: int) -> None:
    """`check_batch_size` from the spec alone, before any device exists (when ``data`` is
    not -1): a mesh too large for the batch is refused before it is made."""
    axes = spec.sizes
    split = math.prod(axes.get(name, 1) for name in (GROUP_AXIS, DATA_AXIS, FSDP_AXIS))
    if split > 0:
        _check_batch_split(global_batch, split, axes.get(GROUP_AXIS, 1), axes.get(FSDP_AXIS, 1))


def device_bytes(mesh: Mesh) -> int | None:
    """What one device of ``mesh`` holds: its memory, or on a CPU its share of this
    machine's (simulated devices share it); None where neither can be read."""
    device = mesh.devices.flat[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend that keeps no statistics
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    return total // max(1, local)


def simulate_cpu_devices(count: int) -> bool:
    """Asks JAX for ``count`` CPU devices, so a mesh can be tried on a laptop.

    Only the CPU platform is affected: on a machine with an accelerator, JAX still
    runs on the accelerator. A count the user already set in ``XLA_FLAGS`` is
    left alone.

    Returns:
        True when the request was made, False when ``XLA_FLAGS`` already sets a count.

    Called after JAX started on the CPU with fewer devices (an NNX model built
    first, say), it starts the CPU backend again with ``count`` devices; arrays
    made before remain usable, and jit or ``jax.device_put`` move them onto the
    new devices.

    Raises:
        UsageError: JAX's backends are already initialised with fewer CPU devices
            in a run of several processes, where they cannot be started again.

    Examples:
        At the top of a script, before any JAX computation (here ``XLA_FLAGS``
        already asks for 8, so the call has nothing to do):

        >>> jdp.simulate_cpu_devices(8)
        False
        >>> len(jax.devices("cpu"))
        8
    """
    if CPU_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
        return False
    from jax._src import xla_bridge  # no public way to ask "already started?"

    if xla_bridge.backends_are_initialized():
        if jax.default_backend() != "cpu":
            return False  # the mesh is made of the accelerators
        have = len(jax.devices("cpu"))
        if have >= count:
            return False
        if jax.process_count() > 1:
            raise UsageError(
                f"JAX already started with {have} CPU device(s), {count} wanted; call "
                f"jdp.simulate_cpu_devices({count}) before any JAX computation, or set "
                f"XLA_FLAGS={CPU_COUNT_FLAG}={count} before starting Python"
            )
        # Started already (say, by building a Flax NNX model): start the CPU
        # backend again with more devices. Arrays made before stay readable on
        # the old one, and jit and device_put move them onto the new devices.
        from jax.extend import backend

        backend.clear_backends()
    jax.config.update("jax_num_cpu_devices", count)
    return True


def make_mesh(spec: str | MeshSpec, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a mesh from a spec such as ``"data=8"``, ``"fsdp=8"`` or ``"data=4,model=2"``.

    All axes are ``AxisType.Auto``: inside the train step the ``data`` (and
    ``group``) axes are manual (``shard_map``), and ``fsdp`` and ``model`` are
    shardings that XLA propagates, inserting their collectives. A spec with
    ``fsdp`` or ``model`` but no ``data`` gets ``data=1`` (one replica).

    Args:
        spec: comma-separated ``NAME=SIZE``; ``-1`` takes the remaining devices (or
            a `MeshSpec`, read already).
        devices: the devices to use; defaults to ``jax.devices()``.

    Returns:
        A ``jax.sharding.Mesh`` over the first ``prod(sizes)`` devices.

    Raises:
        UsageError: the spec is malformed or asks for more devices than are present.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> dict(mesh.shape)
        {'data': 8}
    """
    spec = spec if isinstance(spec, MeshSpec) else MeshSpec.parse(spec)
    axes = spec.axes
    names = [name for name, _ in axes]
    if DATA_AXIS not in names and any(name in SHARDING_AXES for name in names):
        # One replica: the step's all-reduce over ``data`` is then over one device.
        at = int(GROUP_AXIS in names)
        axes = (*axes[:at], (DATA_AXIS, 1), *axes[at:])
    devices = list(jax.devices() if devices is None else np.ravel(devices))  # 2-D arrays too
    if not devices or not all(isinstance(device, jax.Device) for device in devices):
        raise UsageError(
            f"devices must be JAX devices (from jax.devices()), one or more; got "
            f"{[type(device).__name__ for device in devices[:3]]}"
        )
    fixed = math.prod(size for _, size in axes if size != -1)
    if any(size == -1 for _, size in axes):
        if len(devices) % fixed:
            raise UsageError(
                f"mesh {spec.text!r}: {len(devices)} devices do not divide by the fixed axes' "
                f"product {fixed}; choose sizes whose product divides {len(devices)}"
                + (
                    f" (without an accelerator, give every axis a size, e.g. "
                    f"{spec.text.replace('-1', '2')}, and jdp simulates the CPU devices)"
                    if devices[0].platform == "cpu"
                    else ""
                )
            )
        axes = tuple((name, len(devices) // fixed if size == -1 else size) for name, size in axes)
    needed = math.prod(size for _, size in axes)
    if needed > len(devices):
        raise UsageError(
            f"mesh {spec.text!r} needs {needed} devices but {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} present; use at most {len(devices)} "
            f"(e.g. --mesh data={len(devices)} or data=-1){_cpu_hint(devices, needed)}"
        )
    names = tuple(name for name, _ in axes)
    shape = tuple(size for _, size in axes)
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices[:needed]
    )


def _cpu_hint(devices: Sequence[jax.Device], needed: int) -> str:
    if not devices or devices[0].platform != "cpu":
        return ""
    if (processes := jax.process_count()) > 1:  # a launcher's processes, devices each
        each = -(-needed // processes)
        return (
            f", or give each of the {processes} processes {each} CPU devices (jdp.launch "
            f"--devices-per-process {each})"
        )
    return (
        f", or simulate {needed} CPU devices: jdp.simulate_cpu_devices({needed}) before "
        f"the first JAX computation (or XLA_FLAGS={CPU_COUNT_FLAG}={needed})"
    )


def on_cpus(mesh: Mesh) -> bool:
    """Whether every device of ``mesh`` is a CPU (simulated devices included)."""
    return all(device.platform == "cpu" for device in mesh.devices.flat)


def check_mesh(mesh: Any) -> None:
    """Refuses, in one line, a ``mesh`` argument that is not a `jax.sharding.Mesh`."""
    if not isinstance(mesh, Mesh):
        raise UsageError(
            f"mesh must be a jax.sharding.Mesh, e.g. jdp.make_mesh('data=8'), got "
            f"{type(mesh).__name__} {str(mesh)[:40]!r}"
        )


def data_size(mesh: Mesh) -> int:
    """Size of the mesh's ``data`` axis (the number of data-parallel replicas)."""
    check_mesh(mesh)
    if DATA_AXIS not in mesh.shape:
        example = (
            f"{GROUP_AXIS}={mesh.shape[GROUP_AXIS]},data=1"
            if GROUP_AXIS in mesh.shape
            else "data=8"
        )
        raise UsageError(
            f"mesh {dict(mesh.shape)} has no {DATA_AXIS!r} axis; data parallelism "
            f"shards the batch over it, e.g. jdp.make_mesh('{example}')"
        )
    return mesh.shape[DATA_AXIS]


def group_size(mesh: Mesh) -> int:
    """Number of DiLoCo groups: the size of the mesh's ``group`` axis, 1 without one."""
    return mesh.shape.get(GROUP_AXIS, 1)


def manual_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the step's ``shard_map`` maps by hand: ``group`` (when the mesh has it),
    then ``data``. Its gradient all-reduce is over ``data``; ``fsdp`` and ``model`` stay
    shardings XLA partitions."""
    data_size(mesh)
    return (GROUP_AXIS, DATA_AXIS) if GROUP_AXIS in mesh.shape else (DATA_AXIS,)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a global batch's rows split over: `manual_axes`, then ``fsdp`` (when the
    mesh has it, of size > 1). Group ``g`` takes the ``g``-th of ``group_size`` equal
    blocks of rows; each data replica's rows split again over ``fsdp``."""
    return manual_axes(mesh) + ((FSDP_AXIS,) if mesh.shape.get(FSDP_AXIS, 1) > 1 else ())


def batch_split(mesh: Mesh) -> int:
    """Into how many slices a global batch splits: groups x data replicas x fsdp shards."""
    return math.prod(mesh.shape[axis] for axis in batch_axes(mesh))


def is_sharded(mesh: Mesh) -> bool:
    """Whether ``mesh`` splits parameters: an ``fsdp`` or ``model`` axis of size > 1."""
    return any(mesh.shape.get(axis, 1) > 1 for axis in SHARDING_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value every device holds whole (parameters, optimizer state)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh, *, stacked: bool = False) -> NamedSharding:
    """The sharding of a global batch: the rows split over `batch_axes` (``data``, with
    ``group`` and ``fsdp`` when the mesh has them).

    ``stacked``: several steps' batches stacked on a leading axis, rows second.
    """
    axes = batch_axes(mesh)
    rows = axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, PartitionSpec(None, rows) if stacked else PartitionSpec(rows))


def check_batch_size(global_batch: int, mesh: Mesh) -> None:
    """Checks that a global batch splits evenly over the data axis (and the groups, and
    the fsdp shards).

    Raises:
        UsageError: naming the nearest sizes that would work.
    """
    shards = mesh.shape.get(FSDP_AXIS, 1)
    _check_batch_split(global_batch, batch_split(mesh), group_size(mesh), shards)


def _check_batch_split(global_batch: int, split: int, groups: int = 1, shards: int = 1) -> None:
    """``split``: the slices a batch splits into, ``shards`` of them fsdp's (1: none)."""
    if global_batch < 1 or global_batch % split:
        lower = max(split, global_batch // split * split)
        over = f" over {groups} groups" if groups > 1 else ""
        replicas = f"{split // shards} replica{'s' * (split // shards != 1)}{over}"
        axis = f"data axis ({replicas})"
        if shards > 1:
            axis = f"data and fsdp axes ({replicas} x {shards} shards)"
        raise UsageError(
            f"global batch {global_batch} is not divisible by the {axis}; use a multiple of "
            f"{split}, e.g. --batch-size {lower} or {lower + split}"
        )


def shard_batch(batch: Mapping[str, Any] | Any, mesh: Mesh, *, stacked: bool = False) -> Any:
    """Turns this process's slice of a global batch into global arrays sharded on ``data``.

    Each process passes the rows it loaded (the whole batch when there is one
    process); the result is a pytree of global ``jax.Array`` whose leading
    dimension is the global batch, split over the ``data`` axis.

    Args:
        batch: a pytree of numpy arrays, all with the same leading dimension.
        mesh: the training mesh.
        stacked: leaves are ``(steps, rows, ...)``, several steps' batches for a
            step built with ``steps_per_call``; the rows are split.

    Returns:
        The same pytree of global ``jax.Array``.

    Raises:
        UsageError: the rows do not split evenly over this process's replicas.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> batch = jdp.shard_batch({"x": np.zeros((64, 3), np.float32)}, mesh)
        >>> batch["x"].shape, batch["x"].sharding.spec == jax.sharding.PartitionSpec("data")
        ((64, 3), True)
    """
    sharding = batch_sharded(mesh, stacked=stacked)
    local_replicas = max(1, batch_split(mesh) // jax.process_count())
    leaves = jax.tree.leaves(batch)
    axis = 1 if stacked else 0
    rows = {np.shape(leaf)[axis] if np.ndim(leaf) > axis else None for leaf in leaves}
    if len(rows) != 1 or None in rows:
        raise UsageError(
            f"batch leaves must share one leading (batch) dimension, got {sorted(map(str, rows))}"
        )
    (local_rows,) = rows
    kinds = {getattr(getattr(leaf, "dtype", None), "kind", None) for leaf in leaves}
    if kinds & {"O", "S", "U"}:  # strings, Python objects, rows of unequal length
        raise UsageError(
            "a batch holds numeric arrays, and one of these is of strings or Python objects "
            "(or of rows of unequal length); encode them as numbers first"
        )
    if local_rows < 1:  # a mean over no rows is NaN, never an error
        raise UsageError("the batch has no rows; give each data replica at least one")
    if local_rows % local_replicas:
        raise UsageError(
            f"this process's batch has {local_rows} rows, not divisible by its "
            f"{local_replicas} data replicas; use a global batch that divides evenly"
        )
    if jax.process_count() == 1:
        # Local data is the global batch: one transfer call for the whole pytree.
        return jax.device_put(batch, sharding)
    return jax.tree.map(
        lambda leaf: jax.make_array_from_process_local_data(sharding, np.asarray(leaf)), batch
    )


def rows_by_process(
    mesh: Mesh, global_batch: int, process_of: Callable[[Any], int] | None = None
) -> dict[int, slice]:
    """The rows of a global batch each process's devices hold, as read off the sharding.

    ``process_of`` maps a device to its process (default: ``device.process_index``);
    tests pass another mapping to lay out several processes in one.

    Raises:
        ValueError: a process's rows are not one contiguous block (a device order
            jdp does not load for).
    """
    process_of = process_of or (lambda device: device.process_index)
    spans: dict[int, set[tuple[int, int]]] = {}
    for device, index in batch_sharded(mesh).devices_indices_map((global_batch,)).items():
        span = (index[0].start or 0, index[0].stop or global_batch)
        spans.setdefault(process_of(device), set()).add(span)
    rows = {}
    for process, process_spans in spans.items():
        ordered = sorted(process_spans)
        start, stop = ordered[0][0], ordered[-1][1]
        if sum(b - a for a, b in ordered) != stop - start:
            raise ValueError(f"process {process}'s rows {ordered} are not one contiguous block")
        rows[process] = slice(start, stop)
    return rows


def process_rows(mesh: Mesh, global_batch: int) -> slice:
    """The rows of a global batch this process's devices hold (see ``rows_by_process``)."""
    return rows_by_process(mesh, global_batch)[jax.process_index()]
