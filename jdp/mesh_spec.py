"""Mesh specs as the flags write them: the axis names, and the text that names them.

The axes jdp knows and the order a mesh lists them; ``--mesh`` specs
(``"data=4,model=2"``) and ``--axis-rules`` (``"mlp=model,embed=none"``) parsed
and checked, each mistake one line that names the fix; the devices a spec asks
for. Text and arithmetic, no JAX: `jdp.mesh` builds meshes from these specs, and
imports these names, so ``jdp.mesh.DATA_AXIS`` and ``jdp.mesh.parse_mesh_spec`` are
the same objects.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

from jdp.errors import UsageError

DATA_AXIS = "data"
# The outer axis of local SGD / DiLoCo: each index a group of data replicas that
# trains on its own between synchronisations (`jdp.diloco`).
GROUP_AXIS = "group"
# Parameters, gradients and optimizer state split over it, and the batch too (FSDP,
# ZeRO-3); XLA gathers each parameter where it is used (`jdp.layout`).
FSDP_AXIS = "fsdp"
# Tensor parallelism: attention heads and MLP hidden units split over it, as the
# parameters' logical axis names and the rules table say (`jdp.layout`).
MODEL_AXIS = "model"
# Axes jdp knows how to use, in the order a mesh lists them: the slowest link
# first (groups), the fastest last (tensor parallelism exchanges activations in
# every layer). An unknown name is far more often a typo than a wish.
KNOWN_AXES = (GROUP_AXIS, DATA_AXIS, FSDP_AXIS, MODEL_AXIS)
# Axes whose shards of the parameters differ: a mesh with either (of size > 1)
# trains a sharded layout.
SHARDING_AXES = (FSDP_AXIS, MODEL_AXIS)

# The XLA flag that simulates CPU devices (`jdp.simulate_cpu_devices`).
CPU_COUNT_FLAG = "--xla_force_host_platform_device_count"
_CPU_COUNT = re.compile(rf"{CPU_COUNT_FLAG}=\d+")
_SPEC_ITEM = re.compile(r"^([A-Za-z_]\w*)=(-?\d+)$")


def parse_mesh_spec(spec: str) -> tuple[tuple[str, int], ...]:
    """Parses ``"data=4,model=2"`` into ``(("data", 4), ("model", 2))``.

    A size of ``-1`` stands for all the devices the other axes leave; at most
    one axis may use it.

    Raises:
        UsageError: the spec is malformed, repeats an axis, names an unknown
            axis, or has a size that is not a positive integer or -1.
    """
    example = "e.g. data=8, data=-1, fsdp=8, data=2,fsdp=2,model=2 or group=2,data=4"
    items = [item.strip() for item in spec.split(",")] if spec.strip() else []
    if not items:
        raise UsageError(f"empty mesh spec; write NAME=SIZE[,NAME=SIZE...], {example}")
    axes: list[tuple[str, int]] = []
    for item in items:
        match = _SPEC_ITEM.match(item)
        if not match:
            raise UsageError(f"bad mesh spec {spec!r}: {item!r} is not NAME=SIZE; write {example}")
        name, size = match.group(1), int(match.group(2))
        if name not in KNOWN_AXES:
            raise UsageError(
                f"unknown mesh axis {name!r} in {spec!r}; axes are {', '.join(KNOWN_AXES)}"
            )
        if any(name == seen for seen, _ in axes):
            raise UsageError(f"mesh axis {name!r} appears twice in {spec!r}; give each axis once")
        if size == 0 or size < -1:
            raise UsageError(
                f"mesh axis {name!r} has size {size} in {spec!r}; sizes are positive "
                "integers, or -1 for all remaining devices"
            )
        axes.append((name, size))
    ranks = [KNOWN_AXES.index(name) for name, _ in axes]
    if ranks != sorted(ranks):
        order = ",".join(
            f"{name}={size}" for name, size in sorted(axes, key=lambda a: KNOWN_AXES.index(a[0]))
        )
        if GROUP_AXIS in [name for name, _ in axes[1:]]:
            why = (
                f"{GROUP_AXIS!r} must be the first axis, so that each group's devices are "
                "neighbours (one process or host each)"
            )
        else:
            why = f"axes go in the order {', '.join(KNOWN_AXES)} (the fastest link last)"
        raise UsageError(f"mesh {spec!r}: {why}; write {order}")
    if sum(size == -1 for _, size in axes) > 1:
        raise UsageError(
            f"more than one axis is -1 in {spec!r}; at most one axis can take the rest"
        )
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A ``--mesh`` spec read once (`parse`): what a run asks of the mesh before any
    device exists. A run's config holds one (`jdp.TrainConfig.mesh_spec`), and the
    rest of the run reads it, never the text again.

    Attributes:
        text: the spec as written (``"group=2,data=4"``).
        axes: ``((name, size), ...)`` in the spec's order; a size of -1 takes the
            devices the other axes leave.
    """

    text: str
    axes: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """``text`` read and checked (`parse_mesh_spec`: each mistake one line), once: the
        same text gives the same `MeshSpec` again."""
        return _parsed(text)

    @property
    def sizes(self) -> dict[str, int]:
        """``{name: size}`` of the axes the spec names."""
        return dict(self.axes)

    def has(self, axis: str) -> bool:
        """Whether the spec names ``axis`` (``group``: DiLoCo's groups)."""
        return any(name == axis for name, _ in self.axes)

    @property
    def devices(self) -> int | None:
        """The devices the spec needs, or None when an axis is -1 (then: all of them)."""
        if any(size == -1 for _, size in self.axes):
            return None
        return math.prod(size for _, size in self.axes)


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> MeshSpec:
    return MeshSpec(text, parse_mesh_spec(text))


def check_axis_rule(name: str, axis: str | None) -> None:
    """UsageError unless ``axis`` is None or an axis that splits parameters (``fsdp``,
    ``model``): ``data`` and ``group`` hold replicas, whole copies."""
    if axis is not None and axis not in SHARDING_AXES:
        raise UsageError(
            f"axis rule {name}={axis}: parameters split over {' or '.join(SHARDING_AXES)}; "
            f"use one of them, or none to keep {name!r} whole"
        )


def parse_axis_rules(text: str) -> dict[str, str | None]:
    """``"mlp=model,embed=none"`` -> ``{"mlp": "model", "embed": None}``: logical axis
    names mapped to mesh axes (`jdp.layout`), as ``--axis-rules`` writes them.

    Raises:
        UsageError: an item that is not NAME=AXIS, or an axis that does not split
            parameters (`check_axis_rule`).
    """
    rules: dict[str, str | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, axis = (part.strip() for part in item.partition("="))
        if not sep or not name or not axis:
            raise UsageError(
                f"bad axis rule {item!r}; write NAME=AXIS[,NAME=AXIS...], e.g. "
                "mlp=model,embed=fsdp or vocab=none"
            )
        rules[name] = None if axis.lower() == "none" else axis
        check_axis_rule(name, rules[name])
    return rules


def requested_device_count(spec: str) -> int | None:
    """Number of devices a spec needs, or None when an axis is -1 (then: all of them)."""
    return MeshSpec.parse(spec).devices


def child_environment(devices: int | None = None) -> dict[str, str]:
    """This process's environment for a fresh process jdp starts (a launched process, a
    benchmark's run): ``XLA_FLAGS`` kept, so the compiler options a user set apply to
    it too, but for the simulated CPU device count, which is ``devices`` when given and
    otherwise the fresh process's own (its command's ``--mesh`` asks for it)."""
    env = dict(os.environ)
    flags = _CPU_COUNT.sub("", env.pop("XLA_FLAGS", "")).split()
    if devices:
        flags.append(f"{CPU_COUNT_FLAG}={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env
