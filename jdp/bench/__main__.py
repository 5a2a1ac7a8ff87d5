"""``python -m jdp.bench``: figures measured side by side in one process run.

``input``: how fast the loader makes batches (with and without Grain workers),
how fast the train step consumes them on the same batch shape, and the share of
a real training run's loop spent waiting for input.

``checkpoint``: how long the training loop is blocked by an async save and by a
synchronous save of the same state, and how long a restore takes.

``step``: jdp's train step (both backends) against the fastest hand-written ``jit``
step, over four model sizes and three meshes, each cell in a process of its own
with the devices its mesh asks for (`jdp.bench.step`).

``dispatch``: one model in detail: several steps per call, host dispatch time
per step, and the collectives of the step as jdp emits it.

``scaling``: examples/s of one train step and global batch on 1, 2, 4 and 8
devices, as a table and a PNG.

``logging``: the step loop with metrics written every step (JSONL and
TensorBoard) against no logging, in interleaved rounds.

``multihost``: for each model of the ``step`` sweep, the same train step and
global batch in 1 process x 1 device and in 2 processes x 1 device (started by
``jdp.launch``), with the gradient all-reduce alone timed three ways.

``diloco``: synchronous data parallelism against DiLoCo (H = 1, 10, 50) on the
same workloads: final test metric, bytes crossing between the groups per step
(from the compiled programs), examples/s; in 1 process or 2 (gloo).

``memory``: for one model on several layouts (``data=8``, ``fsdp=8``, ZeRO-1,
``model``), the bytes per device of parameters and optimizer state, the compiled
step's arguments and temporaries, and its collectives by mesh axis.

``corpus``: gpt trained on a memory-mapped token corpus of 2 GB on disk: the
process's memory growth and the loop's input waiting, on ``data=1`` and ``data=8``.

``lm``: the ``gpt`` language model's step at a size and sequence length given by
flags, jdp's against a hand-written JAX + Optax step of the same model: tokens/s,
MFU, compile time, ratio; ``--remat`` and ``--attention`` sweeps (`jdp.bench.lm`);
``--profile DIR`` traces both arms and names the kernels one runs alone (`jdp.bench.kernels`).

``keras``: ``python -m jdp.train --mesh data=1`` against Keras 3's ``model.fit`` on
the JAX backend: the same MLP, batches in the same order and Adam schedule, each
run a process of its own on one CPU device, in interleaved rounds.

``resume``: a resumed run's seconds to its first step with its programs read from
the compilation cache against compiled again, for gpt and resnet20.

``startup``: ``import jax`` against ``import jdp``, the API's first use and
``python -m jdp.train --help``, each in fresh processes, in interleaved rounds.

``gpu``: every accelerator figure in one run within a wall budget (GPT-2 124M,
ResNet-50, the JPEG loader, the small-model sweep, a correctness check), as JSON
(`jdp.bench.gpu`).

The project's own tooling (the README's figures, the fault trials, the docs'
GPU section, an offline machine's wheels) is in ``tools/`` beside the package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jdp.bench import (
    checkpoint,
    corpus,
    diloco,
    dispatch,
    gpu,
    inputs,
    keras,
    lm,
    logs,
    memory,
    multihost,
    resume,
    scaling,
    startup,
    step,
)
from jdp.bench.common import HelpWithDefaults, out_of_range
from jdp.tool import command

# command -> (module, help)
BENCHMARKS = {
    "input": (inputs, "loader vs train step, input waiting in a run"),
    "checkpoint": (checkpoint, "async vs synchronous save, restore time"),
    "step": (step, "jdp's step vs the best hand-written one, over model sizes and meshes"),
    "dispatch": (dispatch, "one model: steps per call, host dispatch per step, collective volume"),
    "scaling": (scaling, "examples/s against 1, 2, 4, 8 devices, PNG"),
    "logging": (logs, "step loop with metrics every step vs none"),
    "multihost": (multihost, "each model in 1 process x 1 device vs 2 processes x 1 device"),
    "diloco": (diloco, "sync data parallelism vs DiLoCo: metric, bytes across groups, speed"),
    "corpus": (corpus, "gpt on a 2 GB memory-mapped token corpus: memory growth, input wait"),
    "memory": (memory, "bytes per device of a model on each layout (data, fsdp, model, ZeRO-1)"),
    "keras": (keras, "jdp.train --mesh data=1 vs Keras 3's model.fit: same model, data, Adam"),
    "resume": (resume, "a resume's seconds to its first step: compilation cache vs compiling"),
    "startup": (startup, "import jax vs import jdp, the API's first use, jdp.train --help"),
    "lm": (lm, "gpt's step vs a hand-written JAX + Optax one: tokens/s, MFU, remat, attention"),
    "gpu": (gpu, "every accelerator figure in one budgeted run"),
}


@command("jdp.bench")
def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="jdp.bench", description=description)
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(BENCHMARKS) + "}"
    )
    for name, (module, help_text) in BENCHMARKS.items():
        command = commands.add_parser(name, help=help_text, formatter_class=HelpWithDefaults)
        module.add_arguments(command)
    worker = commands.add_parser("multihost-worker")  # one process of `multihost`: no help
    multihost.add_arguments(worker, worker=True)
    args = parser.parse_args(argv)
    if bad := out_of_range(args):
        print(f"jdp.bench: error: {bad}", file=sys.stderr)
        return 2
    if args.command == "multihost-worker":
        multihost.run_worker(args)
        return 0
    return BENCHMARKS[args.command][0].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
