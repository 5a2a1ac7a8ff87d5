"""Splits on the devices: placed once, each step's rows gathered there, no host read.

A split whose examples are arrays in host memory (``Split``, ``ArraySplit``
without ``map``, a generated ``SequenceSplit``; a memory-mapped token corpus on
request) is preprocessed whole on the host, by the same NumPy code the loader
runs per batch, and placed on every device (`OnDevice`). A training step's
batch is then gathered on the devices from its indices, the same ``(seed,
step)`` order as the host loader's (`jdp.data.loader.readers`), and augmented there
(crop and flip are data movement: the same values as the host's); the host
computes only the indices, a chunk of steps at a time, and places them (a short
run reads its chunks from the host's copy of the split instead, compiling no chunk's
gather: `jdp.data.loader.gathers`). So the batch of every step is bitwise the host
loader's, and the data ledger's digests are the same.

Every device holds the whole split: any example can fall in any device's rows
of a global batch, and each device reads its rows from its own copy, with no
communication. With several processes each places the split on its own devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jdp.data.formats.transforms import Transform
from jdp.data.loader.gathers import COMPILE_STEPS, FLIPS, HOST_COPY_BYTES, OFFSETS, ROWS, Gathers
from jdp.data.loader.readers import EvalReader, TrainReader, _stream
from jdp.data.loader.streams import BatchStream
from jdp.data.splits.ledger import LEDGER_KEY
from jdp.data.splits.ledger import marks as ledger_marks
from jdp.errors import UsageError
from jdp.mesh import MASK_KEY, device_bytes, replicated

MODES = ("auto", "on", "off")
# `auto` gives the splits at most this share of the memory a device has left once the
# training state is counted twice (the state, and as much again for the step's gradients
# and temporaries): the model's activations need the rest.
SHARE = 0.25


class OnDevice:
    """``split`` placed whole on every device of ``mesh``; otherwise the split itself.

    Pass it wherever a split goes (`jdp.train_batches`, `jdp.eval_batches`,
    ``jdp.fit(train=...)``): its batches are gathered on the devices, bitwise the
    ones the host loader makes of ``split``. Every other attribute is the split's.
    ``host_copy``: keep the preprocessed arrays on the host too, for a short run's
    chunks (`jdp.data.loader.gathers`); an evaluation's split needs none.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> train = jdp.data.on_devices(jdp.load_split("digits", "train", data_dir=tmp), mesh)
        >>> with jdp.train_batches(train, mesh, batch_size=128, seed=0) as batches:
        ...     batch = next(batches)
        >>> batch["image"].shape, len(train), train.nbytes
        ((128, 8, 8, 1), 1438, 373880)
    """

    def __init__(self, split, mesh: Mesh, *, host_copy: bool = True):
        if (reason := cannot_place(split, corpus=True)) is not None:
            raise UsageError(f"this split cannot go on the devices: {reason}")
        self.split, self.mesh = split, mesh
        host = preprocessed(split, np.arange(len(split)))
        self.nbytes = sum(value.nbytes for value in host.values())
        sharding = replicated(mesh)
        self.arrays = {
            name: jax.make_array_from_callback(
                value.shape, sharding, lambda index, v=value: v[index]
            )
            for name, value in host.items()
        }
        transform = split.transform
        augments = isinstance(transform, Transform) and transform.augments
        self.padding = transform.crop_padding if augments else 0
        self.flip = bool(augments and transform.flip)
        kept = None  # the host's copy, for a short run's chunks (`jdp.data.loader.gathers`)
        if host_copy and self.nbytes <= HOST_COPY_BYTES:
            kept = {name: np.asarray(v, self.arrays[name].dtype) for name, v in host.items()}
        self.gathers = Gathers(
            self.arrays, kept, mesh, input_key=split.input_key, padding=self.padding
        )

    def __len__(self) -> int:
        return len(self.split)

    def __getattr__(self, name: str):
        if name == "split":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.split, name)

    def gather(self, item: dict, *, stacked: bool = False, chunk: bool = False, group: int = 1):
        """An index batch placed on the mesh (`shard_batch`) -> the batch it names, on the
        devices. ``stacked``: several steps' on axis 0, kept so; ``chunk``: several steps'
        on axis 0, given back as a list of batches (one transfer and one call a chunk), or
        of stacks of ``group`` steps each (calls of several steps)."""
        return self.gathers.gather(item, stacked=stacked, chunk=chunk, group=group)

    def gathered(self, item, *, stacked: bool = False, place: bool = True):
        """A host index batch (or a chunk's list of them) -> its batch (list) on the
        devices, bitwise the host loader's. ``place`` is ignored: a gather's batches are
        on the devices (`HostChunks` reads a short run's on the host)."""
        return self.gathers.gathered(item, stacked=stacked)

    def for_steps(self, steps: int | None) -> OnDevice | HostChunks:
        """What a training loader of ``steps`` steps (None: not known) gathers with:
        this split, or for fewer than `COMPILE_STEPS` its chunks read from the host's
        copy (`jdp.data.loader.gathers`)."""
        return self if steps is None or steps >= COMPILE_STEPS else HostChunks(self)


class HostChunks:
    """An `OnDevice` whose chunks are read from its host copy: no chunk's gather compiled."""

    def __init__(self, placed: OnDevice):
        self.placed = placed

    def gathered(self, item, *, stacked: bool = False, place: bool = True):
        return self.placed.gathers.gathered(item, stacked=stacked, compiles=False, place=place)


def on_host(split):
    """The split as the host loader reads it: an `OnDevice`'s own, else ``split``."""
    return split.split if isinstance(split, OnDevice) else split


def on_devices(split, mesh: Mesh) -> OnDevice:
    """``split`` placed whole on every device of ``mesh`` (see `OnDevice`).

    Raises:
        UsageError: a split that cannot go: batches of your own, images decoded a batch
            at a time, a ``map=`` function or another transform that runs on the host.
    """
    return OnDevice(split, mesh)


def cannot_place(split, *, corpus: bool) -> str | None:
    """Why ``split`` stays on the host, or None. ``corpus``: whether a memory-mapped token
    corpus may go (`auto` leaves it on the host: placing it reads it whole first)."""
    if isinstance(split, BatchStream) or not hasattr(split, "read"):
        return "its batches come from an iterable of your own"
    if getattr(split, "decodes", False):
        return "its images are decoded a batch at a time"
    if split.map is not None:
        return "its map= function runs on the host"
    if split.transform is not None and not isinstance(split.transform, Transform):
        return "its transform runs on the host"
    if hasattr(split, "shards") and not corpus:
        return "a token corpus is read from its files as it trains (on reads it whole)"
    return None


def preprocessed(split, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The rows at ``indices`` as the host loader gives them before augmenting."""
    batch = split.read(indices)
    if split.transform is not None:  # elementwise: the same values as per batch
        batch[split.input_key] = split.transform(batch[split.input_key])
    return batch


class IndexReader(TrainReader):
    """`TrainReader`'s steps as index batches for `OnDevice.gather`: the rows, the
    augmentation's draws, the ledger's marks; nothing read (but with ``ledger`` bytes)."""

    def steps(self, first: int, count: int) -> list[dict[str, np.ndarray]]:
        size, split = self.batch_size, self.split
        stream = _stream(self.seed, first * size, (first + count) * size, len(split))
        indices = stream.reshape(count, size)[:, self.rows]
        batches = [{ROWS: one.astype(np.int32)} for one in indices]
        if self.ledger != "off":
            read = split.read(indices.reshape(-1)) if self.ledger == "bytes" else None
            marks = ledger_marks(first + 1, size, self.rows, stream.reshape(count, size), read)
            for batch, mark in zip(batches, marks, strict=True):
                batch[LEDGER_KEY] = mark
        if split.padding or split.flip:
            for step, batch in zip(range(first, first + count), batches, strict=True):
                draw = self.draw(step)
                batch[OFFSETS], batch[FLIPS] = draw.offsets.astype(np.int32), draw.flips
        return batches


class EvalIndexReader(EvalReader):
    """`EvalReader`'s batches as index batches: the rows (padding repeats row 0) and ``mask``."""

    def __call__(self, number: int) -> dict[str, np.ndarray]:
        indices = np.arange(number * self.batch_size, (number + 1) * self.batch_size)
        real = indices < len(self.split)
        return {
            ROWS: np.where(real, indices, 0)[self.rows].astype(np.int32),
            MASK_KEY: real[self.rows].astype(np.float32),
        }


def place(
    mode: str,
    splits: dict,
    mesh: Mesh,
    *,
    state_bytes: int,
    workers: int = 0,
    say: Callable[[str], None] = print,
) -> dict:
    """The splits (``{name: split or None}``, training first) with those that go on the
    devices as `OnDevice`; ``say`` is given the line that says what ``mode`` chose (none
    for ``off``).

    ``auto`` places them in order while they fit within `SHARE` of the memory each device
    has left by ``state_bytes`` (twice: the state and the step's gradients); the training
    split first, or none. ``on`` places them all, or refuses naming the sizes.

    Raises:
        UsageError: ``on`` with a split that cannot go or does not fit.
    """
    if mode not in MODES:
        raise UsageError(f"--data-on-device {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off":
        return splits
    given = {name: split for name, split in splits.items() if split is not None}
    memory = device_bytes(mesh)
    if memory is None:  # an accelerator that keeps no statistics
        if mode == "auto":
            say(
                "jdp: data on the host (this device's memory cannot be read; "
                "--data-on-device on places it)"
            )
            return splits
        memory = 2**62
    left = memory - 2 * state_bytes
    room = left if mode == "on" else int(SHARE * left)
    if mode == "auto" and workers:
        say("jdp: data on the host (--loader-workers asks for host workers)")
        return splits
    chosen, total = {}, 0
    for name, split in given.items():
        reason = cannot_place(split, corpus=mode == "on")
        size = None if reason else _size(split)
        if reason is None and total + size > room:
            with_others = " with the splits before it" if total else ""
            reason = (
                f"{_mb(total + size)}{with_others}, and a device has "
                f"{_mb(room)} for data ({_mb(memory)}, less 2 x {_mb(state_bytes)} of "
                f"training state{'' if mode == 'on' else f', times {SHARE:g}'})"
            )
        if reason is not None:
            if mode == "on":
                raise UsageError(
                    f"--data-on-device on: the {name} split cannot go on the devices: {reason}; "
                    "use --data-on-device auto (or off) to read it on the host"
                )
            if not chosen:
                say(f"jdp: data on the host: the {name} split stays there: {reason}")
                return splits
            break
        chosen[name], total = size, total + size
    training = next(iter(splits))  # an evaluation's split keeps no host copy: never read
    placed = {
        name: OnDevice(split, mesh, host_copy=name == training) if name in chosen else split
        for name, split in splits.items()
    }
    said = ", ".join(
        f"{name} {len(given[name]):,} examples ({_mb(size)})" for name, size in chosen.items()
    )
    rest = [name for name in given if name not in chosen]
    host = f"; {', '.join(rest)} on the host" if rest else ""
    unused = "; --loader-workers unused" if workers else ""
    say(
        f"jdp: data on each device: {said}{host}, each step's rows gathered there "
        f"(--data-on-device {mode}{unused})"
    )
    return placed


def _size(split) -> int:
    """The bytes of the split preprocessed, from one row's (before reading it all)."""
    row = preprocessed(split, np.zeros(1, np.int64))
    return len(split) * sum(value.nbytes for value in row.values())


def _mb(nbytes: int) -> str:
    """``nbytes`` in KiB, MiB or GiB, whichever reads as a number from 1 to 1023."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 2**10:,.1f} KiB"


def state_bytes(state) -> int:
    """The bytes of ``state`` on one device (the largest share, for a state laid out)."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(state):
        for shard in getattr(leaf, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)
