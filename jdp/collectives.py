"""What a compiled program communicates, read from its HLO: each collective's bytes and
which mesh axes its device groups cross.

Read after XLA's SPMD partitioning (``lowered.compile().as_text()``), where every
collective names its device groups explicitly. A device id there is the
device's position in the mesh (``mesh.devices.flat``). What is counted is each
op's result shape as written, once; with ``loops=True`` a collective inside a
loop's body (a scanned layer's gather) counts once per iteration, as XLA records
the loop's trip count (once where it records none). An asynchronous
``*-start`` op whose result is an (operand, result) tuple counts both (XLA:CPU,
which jdp's figures come from, emits synchronous collectives).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from jax.sharding import Mesh

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[\w]+\[[\d,]*\](?:\{[\d,]*\})?)\s+"
    r"(?P<op>" + "|".join(_OPS) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op: its kind, the bytes of its result on one device, and its
    device groups (positions in the mesh)."""

    op: str
    nbytes: int
    groups: tuple[tuple[int, ...], ...]

    def crosses(self, mesh: Mesh, axis: str) -> bool:
        """Whether some device group holds devices at different indices of ``axis``."""
        position = list(mesh.axis_names).index(axis)
        for group in self.groups:
            coords = {np.unravel_index(device, mesh.devices.shape)[position] for device in group}
            if len(coords) > 1:
                return True
        return False


def _bytes(shape: str) -> int:
    total = 0
    for array in _ARRAY.finditer(shape):
        dims = [int(d) for d in array.group("dims").split(",") if d]
        digits = re.search(r"\d+", array.group("dtype"))  # pred (a byte each) has none
        bits = int(digits.group()) if digits else 8
        total += math.prod(dims) * max(1, bits // 8)
    return total


def _groups(line: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of one op: ``{{0,1},{2,3}}``, the iota form ``[2,4]<=[8]`` (with
    an optional transpose ``[4,2]<=[2,4]T(1,0)``), the mesh form (`_mesh_groups`), or a
    permute's pairs."""
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return tuple(
            tuple(int(d) for d in group.split(",") if d)
            for group in re.findall(r"\{([\d,]*)\}", explicit.group(1))
        )
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(math.prod(int(d) for d in iota.group(2).split(",")))
        ids = ids.reshape([int(d) for d in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return tuple(tuple(int(d) for d in row) for row in ids.reshape(shape))
    named = re.search(
        r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
        r"(?:,\s*device_ids=\((?P<ids>\[[\d,]*\](?:T\([\d,]*\))?|\{[\d,]*\})\))?"
        r"\s*\{(?P<over>[^}]*)\}",
        line,
    )
    if named:
        return _mesh_groups(named.group("axes"), named.group("ids"), named.group("over"))
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if pairs:
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))
    return (tuple(range(devices)),)  # no groups given: all devices


def _mesh_groups(axes: str, ids: str | None, over: str) -> tuple[tuple[int, ...], ...]:
    """The groups of XLA's mesh form: ``replica_groups=mesh['axis_0'=4,'axis_1'=2],
    device_ids=([2,4]T(1,0)) {'axis_0'}``: the device ids (an iota, reshaped and
    transposed, or listed) laid out over the named axes, one group per index of the
    axes not in braces."""
    sizes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", axes)]
    total = math.prod(size for _, size in sizes)
    if ids is None:
        order = np.arange(total)
    elif ids.strip().startswith("["):
        iota = re.match(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?", ids)
        dims = [int(d) for d in iota.group(1).split(",")]
        order = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(2):
            order = order.transpose([int(d) for d in iota.group(2).split(",")])
        order = order.ravel()
    else:
        order = np.array([int(d) for d in re.findall(r"\d+", ids)])
    grid = order.reshape([size for _, size in sizes])
    reduced = {name for name in re.findall(r"'([^']+)'", over)}
    inside = [i for i, (name, _) in enumerate(sizes) if name in reduced]
    outside = [i for i in range(len(sizes)) if i not in inside]
    grid = grid.transpose(outside + inside)
    width = math.prod(sizes[i][1] for i in inside)
    return tuple(tuple(int(d) for d in row) for row in grid.reshape(-1, width))


def collectives(hlo_text: str, devices: int, *, loops: bool = False) -> list[Collective]:
    """Every collective of a compiled program's HLO text, over ``devices`` devices; with
    ``loops``, the bytes of one inside a loop's body times the loop's iterations."""
    repeats = _repeats(hlo_text) if loops else {}
    found, computation = [], None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
        match = _LINE.search(line)
        if match:
            times = repeats.get(computation, 1)
            nbytes = _bytes(match.group("shape")) * times
            found.append(Collective(match.group("op"), nbytes, _groups(line, devices)))
    return found


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) ")
_BODY = re.compile(r"\bbody=%(?P<name>[\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"')
_CALLED = re.compile(r"(?:calls|to_apply|condition)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")


def _repeats(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs in one run of the program: a loop's body
    its trip count times as often as the computation holding the loop."""
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, computation = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            entry = computation if line.startswith("ENTRY") else entry
            continue
        if computation is None:
            continue
        callees = calls.setdefault(computation, [])
        body = _BODY.search(line)
        if body:
            trips = _TRIPS.search(line)
            callees.append((body.group("name"), int(trips.group("n")) if trips else 1))
        callees += [(name, 1) for name in _CALLED.findall(line)]
        for branches in _BRANCHES.findall(line):
            callees += [(name.strip().lstrip("%"), 1) for name in branches.split(",")]
    repeats: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        repeats[name] = repeats.get(name, 0) + times
        for callee, trips in calls.get(name, ()):
            visit(callee, times * trips)

    if entry is not None:
        visit(entry, 1)
    return repeats


def bytes_across(hlo_text: str, mesh: Mesh, axis: str) -> int:
    """Bytes per device of the collectives whose device groups cross ``axis``."""
    return sum(
        op.nbytes for op in collectives(hlo_text, mesh.devices.size) if op.crosses(mesh, axis)
    )
