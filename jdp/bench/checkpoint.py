"""``python -m jdp.bench checkpoint``: how long the training loop is blocked by an
async save and by a synchronous save of the same state, and how long a restore takes."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

from jdp.checkpoint import Checkpointer
from jdp.mesh import make_mesh
from jdp.report.console import quiet_absl
from jdp.state import create_train_state
from jdp.training.run import setup_devices


def bench_checkpoint(mesh_spec: str, *, size_mb: int, repeats: int) -> list[str]:
    """Times async and synchronous saves of an Adam state of ``size_mb`` MB of params."""
    setup_devices(mesh_spec)
    mesh = make_mesh(mesh_spec)
    width = 4096
    rows = max(1, size_mb * 2**20 // (4 * width * 4))
    params = {f"layer{i}": jnp.zeros((rows, width)) for i in range(4)}
    state = create_train_state(params, optax.adam(1e-3), mesh)
    # Random values everywhere, moments included: Orbax compresses, and zeros would
    # make the files (and the saves) unrealistically small.
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    leaves = [
        jax.jit(
            lambda key, leaf: jax.random.normal(key, leaf.shape, leaf.dtype),
            out_shardings=leaf.sharding,
        )(key, leaf)
        if leaf.ndim == 2
        else leaf
        for key, leaf in zip(keys, leaves, strict=True)
    ]
    state = jax.tree.unflatten(treedef, leaves)
    megabytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20
    blocked, total = {}, {}
    # Orbax's absl warnings (a save waiting on the one before it) are what is timed here.
    with tempfile.TemporaryDirectory(prefix="jdp-bench-") as root, quiet_absl():
        for mode in ("sync", "async"):
            directory = os.path.join(root, mode)
            with Checkpointer(directory, keep=1, async_save=mode == "async") as checkpoints:
                saves = iter(range(1, repeats + 2))

                def save(checkpoints=checkpoints, saves=saves):
                    checkpoints.save(state.replace(step=jnp.int32(next(saves))), loader_step=0)

                save()  # first save compiles and creates directories
                checkpoints.wait()
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    save()
                    returned = time.perf_counter()
                    checkpoints.wait()
                    times.append((returned - started, time.perf_counter() - started))
                blocked[mode] = statistics.median(t[0] for t in times)
                total[mode] = statistics.median(t[1] for t in times)
        with Checkpointer(directory) as checkpoints:
            restores = []
            for _ in range(repeats):
                started = time.perf_counter()
                checkpoints.restore(state)
                restores.append(time.perf_counter() - started)
    lines = [
        f"jdp.bench checkpoint: TrainState of {megabytes:,.0f} MB (params + Adam moments), "
        f"mesh {mesh_spec} ({mesh.devices.size} x {jax.devices()[0].device_kind}), "
        f"median of {repeats}",
        f"  synchronous save: loop blocked {blocked['sync']:.3f} s",
        f"  async save:       loop blocked {blocked['async']:.3f} s "
        f"({blocked['async'] / blocked['sync']:.1%} of synchronous), "
        f"committed after {total['async']:.3f} s",
        f"  restore (latest, onto the mesh): {statistics.median(restores):.3f} s",
    ]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default="data=8")
    parser.add_argument("--size-mb", type=int, default=128, help="parameter megabytes")
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> None:
    print("\n".join(bench_checkpoint(args.mesh, size_mb=args.size_mb, repeats=args.repeats)))
