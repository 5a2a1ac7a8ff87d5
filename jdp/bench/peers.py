"""The PyTorch peers of ``python -m jdp.bench gpu``: what jdp's users would pick instead,
timed in the same rounds as jdp's step on the same device.

Each peer arm is a long-lived process of its own (`jdp.bench.peer_arms`) that
builds its model once and then runs as many steps as it is asked, one request at a
time: the JAX process and the peer take turns, so the two never share the device at
the same moment, and each arm is a callable ``count -> None`` like jdp's own
(`jdp.bench.arms.interleaved_rates`). The arms, each the peer's own code with the loop
around it written plainly, as its docs recommend:

- ``transformers``: Hugging Face's ``GPT2LMHeadModel`` (SDPA attention), the loss over
  the same next tokens jdp's cell trains on;
- ``nanogpt``: nanoGPT's own ``model.py`` and its ``configure_optimizers``, from a
  checkout the user names (``--nanogpt DIR``; nothing of it is copied into jdp), with
  its vocabulary of 50,304 and its pretraining dropout of 0, as its ``train.py`` has them;
- ``torchvision``: ``torchvision.models.resnet50``, channels-last, SGD with momentum;
- ``torch eager`` and ``torch graphs``: the sweep's MLPs in PyTorch, eager and under
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs; on a CPU, which has none,
  its default mode).

Every arm on a GPU: bf16 autocast where jdp's cell is bf16, fused AdamW or SGD,
``torch.compile`` (the eager arm aside). A ``--smoke`` run on a CPU, which must stay
cheap, keeps the GPT-2 and ResNet-50 arms eager and compiles the MLP alone (1.7 s on
two cores); each arm records what it chose.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jdp.errors import UsageError

# The arms of each part of the GPU run, in the order they race.
ARMS = {
    "gpt2": ("transformers", "nanogpt"),
    "resnet50": ("torchvision",),
    "sweep": ("torch eager", "torch graphs"),
}
ALL = tuple(arm for arms in ARMS.values() for arm in arms)
# What each arm imports besides torch.
NEEDS = {"transformers": "transformers", "torchvision": "torchvision"}
# Seconds a peer may take to build and compile, and to run one round's steps: far above
# what either should take, so that a hung peer ends its part rather than the run.
BUILD_SECONDS, ROUND_SECONDS = 900.0, 300.0


def choose(said: str, nanogpt: str) -> tuple[list[str], dict[str, str]]:
    """The arms ``--peers`` names (``auto``: every one this machine can run, ``none``:
    none) and, for each left out, why in a few words."""
    if said == "none":
        return [], {}
    names = ALL if said == "auto" else [n.strip() for n in said.split(",") if n.strip()]
    for name in names:
        if name not in ALL:
            raise UsageError(
                f"--peers: unknown arm {name!r}; choose from: {', '.join(ALL)}, or auto, or none"
            )
    if nanogpt and not os.path.isfile(os.path.join(nanogpt, "model.py")):
        raise UsageError(
            f"--nanogpt {nanogpt}: no model.py there; give a checkout of "
            "karpathy/nanoGPT (git clone https://github.com/karpathy/nanoGPT)"
        )
    chosen, skipped = [], {}
    for name in names:
        reason = _missing(name, nanogpt)
        if reason and said != "auto":
            raise UsageError(f"--peers {name}: {reason}")
        if reason:
            skipped[name] = reason
        else:
            chosen.append(name)
    return chosen, skipped


def _missing(arm: str, nanogpt: str) -> str | None:
    for module in ("torch", NEEDS.get(arm)):
        if module and importlib.util.find_spec(module) is None:
            return f"needs {module}: pip install {module}"
    if arm == "nanogpt" and not nanogpt:
        return "needs a nanoGPT checkout: --nanogpt DIR"
    return None


class Peer:
    """An arm in a process of its own: ``peer(count)`` runs ``count`` steps there and
    returns once they are done on its device; ``peer.info`` is what it built and chose
    (``compile_s``: its first step's seconds less a steady one's)."""

    def __init__(self, arm: str, spec: dict[str, Any]):
        self.arm = arm
        # Open as long as the process runs: closed in `close`.
        self._errors = tempfile.TemporaryFile("w+")  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "jdp.bench.peer_arms"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
            env=env,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._process.stdout, selectors.EVENT_READ)
        try:
            self.info = self._ask({"arm": arm, **spec}, BUILD_SECONDS)
        except Exception:
            self.close()
            raise

    def __call__(self, count: int) -> None:
        self.loss = self._ask({"steps": count}, ROUND_SECONDS)["loss"]

    def _ask(self, request: dict[str, Any], seconds: float) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        if not self._selector.select(timeout=seconds):
            raise TimeoutError(f"the {self.arm} peer did not answer in {seconds:.0f} s")
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.arm} peer ended: {self._stderr_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the {self.arm} peer: {answer['error']}")
        return answer

    def _stderr_tail(self) -> str:
        self._process.wait(timeout=30)
        self._errors.seek(0)
        lines = self._errors.read().strip().splitlines()
        return f"exit code {self._process.returncode}; " + " | ".join(lines[-3:])[-500:]

    def close(self) -> None:
        """Ends the process: its input closed, it ends its loop (killed after 60 s)."""
        if self._process.poll() is None:
            try:
                assert self._process.stdin is not None
                self._process.stdin.close()
                self._process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()
        self._selector.close()
        self._errors.close()


@contextlib.contextmanager
def racing(
    names: Sequence[str], spec_of: Callable[[str], dict[str, Any]]
) -> Iterator[tuple[dict[str, Peer], dict[str, str]]]:
    """The peers ``names`` built (``spec_of(name)``: what each trains), one after
    another, and the error of each that could not be; every process ended on the way
    out."""
    peers: dict[str, Peer] = {}
    failed: dict[str, str] = {}
    try:
        for name in names:
            try:
                peers[name] = Peer(name, spec_of(name))
            except Exception as error:
                failed[name] = f"{type(error).__name__}: {error}"[:500]
        yield peers, failed
    finally:
        for peer in peers.values():
            peer.close()


def results(
    peers: dict[str, Peer], failed: dict[str, str], rates: dict[str, list[float]], jdp: str = "jdp"
) -> dict[str, dict[str, Any]]:
    """What lands in the JSON for each peer, its rates taken out of ``rates``: its rate
    per round and median, jdp's ratio to it (within each round, as
    `jdp.bench.arms.ratios_to` takes them), and what it built and chose; or its error."""
    landed: dict[str, dict[str, Any]] = {}
    for name, peer in peers.items():
        own = rates.pop(name)
        ratio = statistics.median(j / p for j, p in zip(rates[jdp], own, strict=True))
        landed[name] = {
            "rates": own,
            "rate": statistics.median(own),
            "jdp_over_peer": ratio,
            **peer.info,
        }
    return landed | {name: {"error": error} for name, error in failed.items()}
