"""``python -m jdp.bench keras``: ``python -m jdp.train --mesh data=1`` against Keras 3's
``model.fit`` on the JAX backend, the same model, batches and optimizer.

The model is jdp's default, ``mlp`` small (Dense(512, relu) -> Dense(10), 38k
parameters, Flax's LeCun-normal kernels and zero biases), on the bundled
digits. Keras gets the very batches jdp trains on, in its order: the loader's
reader (`jdp.data.loader.readers.TrainReader`) makes steps 0..N-1 of seed 0, already
scaled to floats, and ``model.fit`` takes them as one array with ``shuffle=False``
and ``epochs=1``, N steps. The optimizer is Adam (epsilon 1e-8, as Optax's) on
jdp's default schedule, as Keras writes it: ``CosineDecay`` from 0, 40 steps of
linear warmup to 3e-3 (the warmup jdp resolves for the run's length), cosine to
0; sparse categorical cross-entropy on logits, with the accuracy metric, as
jdp's step reports it too.

The "jdp" arm has the digits on the device, as ``--data-on-device auto`` places
them (`jdp.data.loader.on_device`); the "host" arm is the same run with
``--data-on-device off``, the host loader reading every batch. A last arm,
"step", is the cell ``python -m jdp.bench step --cases mlp-38k --meshes data=1``
times: the train step of the same run alone in a loop on one batch placed once (no
input, no actions), for as many steps. fit against it is what jdp's loop, its input
and its actions cost the step.

A last line times fit's loop alone (`loop_run`): the jdp run with its step replaced
by one that returns at once, in microseconds a step of wall time and of the loop's
thread's CPU time, the median of one run a round: what the loop costs the host.

Each run is a process of its own on one CPU device (``JAX_PLATFORMS=cpu``, no
simulated device count): Keras's with ``KERAS_BACKEND=jax`` set before Keras is
imported, and jdp's as a user runs it, ``python -m jdp.train --mesh data=1``.
Each round runs keras, jdp, then step; each arm's figure is its median
over the rounds, the ratio the median of the rounds' own ratios (arms run next
to each other share the machine's load).

Both arms are timed alike, from the end of the first step, waited for (so the
compilation and the first step are left out), to the end of the last, waited
for: examples/s over the N - 1 steps between. jdp's is its summary line's
``examples/s`` (`jdp.training.results.SteadyTimer`); Keras's a callback that
waits for the model's state after step 0 in ``on_train_batch_begin`` of step 1
and reads the clock in ``on_train_batch_end`` of the last step, whose logs
Keras has turned into floats (the step is done), before the epoch's end (which
compiles the metrics' results). That hook is marked ``async_safe``: Keras keeps
dispatching its batch-end callbacks off the loop's path, as it does without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from jdp.bench.common import report_lines
from jdp.errors import UsageError
from jdp.mesh_spec import child_environment

# Seconds one run may take: the default 4,000 steps take about 2 s and the start-up
# (imports, data, compilation) a few more on the 2-core development machine.
RUN_TIMEOUT = 600
_SUMMARY_RATE = re.compile(r"^jdp\.train: steps=\d+ .*examples/s=(\d+)", re.M)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=4000, help="steps of each run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of keras, then jdp")
    parser.add_argument("--batch-size", type=int, default=128)
    # One Keras run, or one run of jdp's step alone, in this process, printed as JSON:
    # what each round starts.
    parser.add_argument("--keras-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--step-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-run", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int | None:
    if args.steps < 2 or args.rounds < 1 or args.batch_size < 1:
        raise UsageError(
            f"need --steps >= 2 (the first is compilation), --rounds >= 1 and --batch-size "
            f">= 1, got {args.steps}, {args.rounds} and {args.batch_size}"
        )
    if args.step_run:
        print(json.dumps({"examples_per_sec": step_run(args.steps, args.batch_size)}))
        return 0
    if args.loop_run:
        print(json.dumps(loop_run(args.steps, args.batch_size)))
        return 0
    check_keras()
    if args.keras_run:
        print(json.dumps(keras_run(args.steps, args.batch_size)))
        return 0
    bench_keras(
        args.steps, args.rounds, args.batch_size, on_line=lambda line: print(line, flush=True)
    )
    return 0


def check_keras() -> None:
    """UsageError (one line, exit 2) unless Keras 3 can be imported."""
    if importlib.util.find_spec("keras") is None:
        raise UsageError("this benchmark runs Keras 3, which is not installed: pip install keras")
    from importlib.metadata import version

    if int(version("keras").split(".")[0]) < 3:
        raise UsageError(
            f"this benchmark runs Keras 3 on JAX, not Keras {version('keras')}: "
            "pip install --upgrade keras"
        )


def bench_keras(
    steps: int, rounds: int, batch_size: int, *, on_line: Callable[[str], None] = print
) -> list[str]:
    """The rounds, each a Keras run, a jdp run and a run of jdp's step alone, and the
    medians; returns the lines."""
    lines, emit = report_lines(on_line)
    rates: dict[str, list[float]] = {"keras": [], "jdp": [], "host": [], "step": []}
    for round_ in range(rounds):
        keras = _keras_process(steps, batch_size)
        rates["keras"].append(keras["examples_per_sec"])
        rates["jdp"].append(_jdp_process(steps, batch_size))
        rates["host"].append(_jdp_process(steps, batch_size, "off"))
        rates["step"].append(_step_process(steps, batch_size))
        if round_ == 0:
            emit(
                f"jdp.bench keras: mlp small on digits (38k parameters), global batch "
                f"{batch_size}, Adam on jdp's default schedule, {steps} steps a run, "
                f"{rounds} rounds of keras, jdp (python -m jdp.train --mesh data=1, the data "
                f"on the device), host (the same with --data-on-device off) and step (its "
                f"train step alone, on one placed batch), each run a process on "
                f"one CPU device ({keras['device']}); examples/s from the end of the first "
                f"step to the end of the last; Keras {keras['keras']} (JAX backend), JAX "
                f"{keras['jax']}"
            )
            emit(
                f"  {'round':<8}{'keras ex/s':>12}{'jdp ex/s':>12}{'host ex/s':>12}"
                f"{'step ex/s':>12}{'jdp / keras':>13}{'jdp / step':>12}"
                f"{'host / step':>13}"
            )
        emit(_round_line(str(round_ + 1), {arm: values[-1] for arm, values in rates.items()}))
    medians = {arm: statistics.median(values) for arm, values in rates.items()}
    ratios = {  # the median of the rounds' own ratios
        (arm, other): statistics.median(
            j / o for j, o in zip(rates[arm], rates[other], strict=True)
        )
        for arm, other in _RATIOS
    }
    emit(_round_line("median", medians, ratios))
    loops = [_loop_process(steps, batch_size) for _ in range(rounds)]
    wall, cpu = (statistics.median(loop[key] for loop in loops) for key in ("wall_us", "cpu_us"))
    emit(
        f"  fit's loop alone (its step replaced by one that returns at once; input, actions "
        f"and ledger as run): {wall:.1f} us a step, {cpu:.1f} us of its thread's CPU "
        f"(median of {rounds} runs)"
    )
    return lines


_RATIOS = (("jdp", "keras"), ("jdp", "step"), ("host", "step"))


def _round_line(name: str, rates: dict[str, float], ratios: dict | None = None) -> str:
    ratios = ratios or {(arm, other): rates[arm] / rates[other] for arm, other in _RATIOS}
    return (
        f"  {name:<8}{rates['keras']:>12,.0f}{rates['jdp']:>12,.0f}{rates['host']:>12,.0f}"
        f"{rates['step']:>12,.0f}{ratios['jdp', 'keras']:>12.3f}x"
        f"{ratios['jdp', 'step']:>11.3f}x{ratios['host', 'step']:>12.3f}x"
    )


def _environment() -> dict[str, str]:
    """This environment on one CPU device: no simulated device count, JAX on the CPU."""
    env = child_environment()
    # Keras's own layers promote ranks implicitly, which a caller's "raise" refuses
    # (jdp's tests set it): every arm runs with JAX's default.
    env.pop("JAX_NUMPY_RANK_PROMOTION", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["KERAS_BACKEND"] = "jax"
    return env


def _run(command: list[str], what: str) -> str:
    """``command``'s stdout; UsageError naming ``what`` when it fails or hangs."""
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=_environment()
        )
    except subprocess.TimeoutExpired:
        raise UsageError(f"the {what} run took over {RUN_TIMEOUT} s and was stopped") from None
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if line.strip()]
        reason = said[-1] if said else f"exit code {result.returncode}"
        raise UsageError(f"the {what} run failed: {reason.removeprefix('jdp.bench: error: ')}")
    return result.stdout


def _keras_process(steps: int, batch_size: int) -> dict[str, Any]:
    command = [
        sys.executable,
        *"-m jdp.bench keras --keras-run --steps".split(),
        str(steps),
        "--batch-size",
        str(batch_size),
    ]
    return json.loads(_run(command, "Keras").strip().splitlines()[-1])


def _jdp_process(steps: int, batch_size: int, on_device: str = "auto") -> float:
    """The examples/s of ``python -m jdp.train --mesh data=1``'s summary line."""
    command = [
        sys.executable,
        *"-m jdp.train --mesh data=1 --steps".split(),
        str(steps),
        "--batch-size",
        str(batch_size),
        "--data-on-device",
        on_device,
    ]
    out = _run(command, "jdp")
    found = _SUMMARY_RATE.search(out)
    if found is None:
        raise UsageError(f"the jdp run printed no summary line: {out.strip()[-200:]!r}")
    return float(found.group(1))


def _step_process(steps: int, batch_size: int) -> float:
    command = [
        sys.executable,
        *"-m jdp.bench keras --step-run --steps".split(),
        str(steps),
        "--batch-size",
        str(batch_size),
    ]
    return json.loads(_run(command, "step").strip().splitlines()[-1])["examples_per_sec"]


def _loop_process(steps: int, batch_size: int) -> dict[str, float]:
    command = [
        sys.executable,
        *"-m jdp.bench keras --loop-run --steps".split(),
        str(steps),
        "--batch-size",
        str(batch_size),
    ]
    return json.loads(_run(command, "loop").strip().splitlines()[-1])


def step_run(steps: int, batch_size: int) -> float:
    """The steady examples/s of ``python -m jdp.train --mesh data=1``'s train step alone, in
    this process: as `jdp.bench.step` times it, one batch placed once, at most two calls
    in flight, over the steps after the first (timed as `SteadyTimer` times fit's)."""
    from jdp.bench.arms import jdp_loop
    from jdp.bench.step import first_batch
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.run import build

    run = build(
        TrainConfig(mesh="data=1", steps=steps, batch_size=batch_size), Console(enabled=False)
    )
    loop = jdp_loop(run.train_step, run, first_batch(run, batch_size), run.optimizer)
    loop(1)  # compiles, and runs the first step
    started = time.perf_counter()
    loop(steps - 1)
    return (steps - 1) * batch_size / (time.perf_counter() - started)


def loop_run(steps: int, batch_size: int) -> dict[str, float]:
    """fit's loop alone, in this process: ``python -m jdp.train --mesh data=1``'s run, its
    input, actions and ledger as they are, with the train step replaced by one that
    gives back its first call's outputs at once. Microseconds a step of wall time and
    of the loop's thread's CPU time, from the end of the first call to the last: what
    the loop costs the host between steps, which a step on the same cores (XLA:CPU)
    pays for, and one on an accelerator hides only while it is slower than that."""
    import dataclasses

    import jax

    import jdp.training.loop
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig

    build, first = jdp.training.loop.build, []

    def instant(*args, **kwargs):
        run = build(*args, **kwargs)

        def train_step(state, batch):
            if not first:  # compiles and runs the real step once
                first.append(jax.block_until_ready(run.train_step(state, batch)))
            return first[0]

        return dataclasses.replace(run, train_step=train_step)

    clocks: dict[int, tuple[float, float]] = {}

    def clock(progress) -> None:  # a plain callable: fit calls it after every call
        if progress.step in (1, steps) and not progress.final:
            clocks[progress.step] = (time.perf_counter(), time.thread_time())

    jdp.training.loop.build = instant
    try:
        jdp.fit(
            TrainConfig(mesh="data=1", steps=steps, batch_size=batch_size),
            console=Console(enabled=False),
            callbacks=[clock],
        )
    finally:
        jdp.training.loop.build = build
    (wall_0, cpu_0), (wall_1, cpu_1) = clocks[1], clocks[steps]
    per_step = 1e6 / (steps - 1)
    return {"wall_us": (wall_1 - wall_0) * per_step, "cpu_us": (cpu_1 - cpu_0) * per_step}


def _jdp_inputs(steps: int, batch_size: int):
    """``(x, y, classes, config)``: steps 0..steps-1 of jdp's default run, as Keras reads
    them, and the config that run resolves (its warmup for this length)."""
    import numpy as np

    from jdp.data.loader import TrainReader
    from jdp.report.console import Console
    from jdp.training.config import TrainConfig
    from jdp.training.run import load_data, resolve

    config = TrainConfig(mesh="data=1", steps=steps, batch_size=batch_size)
    train = load_data(config).train
    config = resolve(config, len(train), Console(enabled=False), own_optimizer=False)
    reader = TrainReader(train, batch_size=batch_size, seed=config.seed, rows=slice(None))
    batches = reader.steps(0, steps)
    x = np.concatenate([batch[train.input_key] for batch in batches])
    y = np.concatenate([batch[train.label_key] for batch in batches])
    return x, y, train.num_classes, config


def keras_run(steps: int, batch_size: int) -> dict[str, Any]:
    """One Keras ``model.fit`` of ``steps`` steps in this process; its steady examples/s."""
    os.environ["KERAS_BACKEND"] = "jax"  # before Keras is imported
    x, y, classes, config = _jdp_inputs(steps, batch_size)
    import jax
    import keras

    from jdp.training.optimizer import peak_lr

    keras.utils.set_random_seed(config.seed)
    model = keras.Sequential(
        [
            keras.Input(shape=x.shape[1:]),
            keras.layers.Flatten(),
            keras.layers.Dense(512, activation="relu", kernel_initializer="lecun_normal"),
            keras.layers.Dense(classes, kernel_initializer="lecun_normal"),
        ]
    )
    schedule = keras.optimizers.schedules.CosineDecay(
        # Keras wants a decay of one step at least; a run all warmup never reaches it.
        0.0,
        max(1, steps - config.warmup_steps),
        alpha=0.0,
        warmup_target=peak_lr(config),
        warmup_steps=config.warmup_steps,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(schedule, epsilon=1e-8),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    clock = _steady_clock(keras, jax, steps)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[clock]
    )
    return {
        "examples_per_sec": (steps - 1) * batch_size / clock.seconds,
        "loss": history.history["loss"][-1],
        "keras": keras.__version__,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }


def _steady_clock(keras, jax, steps: int):
    """A Keras callback timing steps 1..N-1 as `SteadyTimer` times jdp's (see the module)."""

    class SteadyClock(keras.callbacks.Callback):
        # Keras may call the batch-end hook off the loop, as it calls History's: this
        # one only reads the clock, after Keras turned the last step's logs into floats.
        async_safe = True
        started = ended = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:  # step 0 (and the compilation) ran: wait for its state
                jax.block_until_ready(self.model._jax_state)
                self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch == steps - 1:  # the logs are floats: the last step is done
                self.ended = time.perf_counter()

        @property
        def seconds(self) -> float:
            return self.ended - self.started

    return SteadyClock()
