"""``python -m jdp.bench scaling``: examples/s of one train step and global batch on 1,
2, 4 and 8 devices, as a table and a PNG."""

from __future__ import annotations

import argparse
import dataclasses

import jax

from jdp.bench.common import add_run_flags, config_from, steps_per_sec
from jdp.bench.step import (
    first_batch,
)
from jdp.report.console import Console
from jdp.report.writers import output_file
from jdp.training.config import TrainConfig
from jdp.training.run import build, setup_devices


def bench_scaling(config: TrainConfig, *, steps: int, out: str) -> list[str]:
    """Examples/s of one train step and global batch on 1, 2, 4 and 8 devices; writes a PNG."""
    out = output_file(out, "--out")  # before the measuring: a FIFO or a device is refused
    setup_devices("data=8")  # the largest mesh first: devices are set up once per process
    sizes = [size for size in (1, 2, 4, 8) if size <= len(jax.devices())]
    rates = []
    for size in sizes:
        run = build(dataclasses.replace(config, mesh=f"data={size}"), Console(enabled=False))
        batch = first_batch(run, config.batch_size)
        rates.append(steps_per_sec(run, batch, steps) * config.batch_size)
    device = jax.devices()[0]
    kind = device.device_kind + (" (simulated devices)" if device.platform == "cpu" else "")
    _plot_scaling(sizes, rates, out, f"{config.model}, global batch {config.batch_size}, {kind}")
    lines = [
        f"jdp.bench scaling: {config.model} on {config.dataset}, global batch "
        f"{config.batch_size}, {steps} steps timed per mesh, {kind}",
        f"  {'devices':>7}{'examples/s':>14}{'/ 1 device':>12}",
    ]
    lines += [
        f"  {size:>7}{rate:>14,.0f}{rate / rates[0]:>11.2f}x"
        for size, rate in zip(sizes, rates, strict=True)
    ]
    lines.append(f"  plot: {out}")
    return lines


def _plot_scaling(sizes: list[int], rates: list[float], out: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, rates, marker="o", label=label)
    ax.plot(sizes, [rates[0] * size for size in sizes], "--", color="gray", label="linear scaling")
    # Both axes linear, so that linear scaling is the straight guide it is drawn as.
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.minorticks_off()
    ax.set(
        xlabel="devices on the data axis",
        ylabel="examples / s",
        title="Throughput against devices (measured)",
        ylim=(0, max(max(rates), rates[0] * sizes[-1]) * 1.1),
    )
    ax.yaxis.set_major_formatter("{x:,.0f}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, mesh=None, dataset=True)
    parser.add_argument("--steps", type=int, default=200, help="train steps timed per mesh")
    parser.add_argument("--out", default="scaling.png", help="PNG to write")


def run(args: argparse.Namespace) -> None:
    print("\n".join(bench_scaling(config_from(args), steps=args.steps, out=args.out)))
