"""The PyTorch peers of ``python -m jdp.bench gpu``: what jdp's users would pick instead,
timed in the same rounds as jdp's step on the same device.

Each peer arm is a long-lived process of its own (``python -m jdp.bench.peers``) that
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
``torch.compile`` (the eager arm aside). A ``--smoke`` run on a CPU keeps the arms
eager but the graphs arm (compiling a GPT-2 or a ResNet-50 with Inductor takes minutes
of two cores); each arm records what it chose.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
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
# Seconds a peer may take to build and compile (Inductor on a GPT-2 took minutes) and
# to run one round's steps.
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
        (skipped.__setitem__(name, reason) if reason else chosen.append(name))
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
            [sys.executable, "-m", "jdp.bench.peers"],
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


# --- the peer's side: python -m jdp.bench.peers ------------------------------------------


def serve() -> int:
    """Builds the arm the first request names, then runs the steps each next one asks
    for, answering each with one JSON line; ends at the end of its input."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the libraries print goes to stderr, never into the answers

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    try:
        arm = _build(json.loads(sys.stdin.readline()))
    except Exception as error:
        answer({"error": f"{type(error).__name__}: {error}"[:1000]})
        return 1
    answer(arm.info)
    for line in sys.stdin:
        try:
            answer({"loss": arm.run(json.loads(line)["steps"])})
        except Exception as error:
            answer({"error": f"{type(error).__name__}: {error}"[:1000]})
            return 1
    return 0


class _Arm:
    """A PyTorch training step on one fixed batch, and how to run it ``count`` times."""

    def __init__(self, torch, step, batch, info: dict[str, Any], device: str):
        self.torch, self.step, self.batch, self.device = torch, step, batch, device
        started = time.perf_counter()
        self.run(1)  # compiles, where it compiles
        first = time.perf_counter() - started
        self.run(2)
        started = time.perf_counter()
        self.run(2)
        steady = (time.perf_counter() - started) / 2
        self.info = info | {
            "compile_s": round(max(0.0, first - steady), 2),
            "torch": torch.__version__,
            "device": device,
        }

    def run(self, count: int) -> float:
        loss = None
        for _ in range(count):
            loss = self.step(*self.batch)
        return float(loss)  # waits for the device


def _build(spec: dict[str, Any]) -> _Arm:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what PyTorch's tuning guide advises
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True  # cuDNN's autotuning, for the convolutions
    arm = spec["arm"]
    if arm in ("transformers", "nanogpt"):
        return _gpt2(torch, spec, device)
    if arm == "torchvision":
        return _resnet50(torch, spec, device)
    return _mlp(torch, spec, device)


def _autocast(torch, spec, device):
    import contextlib

    if spec["precision"] == "bf16":
        return lambda: torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext


def _compiled(torch, module, spec, device, mode=None):
    """``module`` under ``torch.compile`` (in ``mode``), unless a smoke run on a CPU."""
    if device == "cpu" and spec.get("smoke") and mode is None:
        return module, "none (a smoke run on the CPU)"
    if device == "cpu" and mode == "reduce-overhead":
        mode = None  # CUDA graphs need CUDA
    return torch.compile(module, mode=mode), f"torch.compile ({mode or 'default'} mode)"


def _gpt2(torch, spec, device) -> _Arm:
    import torch.nn.functional as F

    rows, length = spec["rows"], spec["seq_len"]
    if spec["arm"] == "transformers":
        from transformers import AutoModelForCausalLM, GPT2Config

        config = GPT2Config(
            vocab_size=spec["vocab"],
            n_positions=length,
            n_embd=spec["width"],
            n_layer=spec["layers"],
            n_head=spec["heads"],
            n_inner=spec["hidden"],
            resid_pdrop=spec["dropout"],
            embd_pdrop=spec["dropout"],
            attn_pdrop=0.0,
        )
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=spec["lr"],
            betas=spec["betas"],
            weight_decay=spec["weight_decay"],
            fused=device == "cuda",
        )
        vocab, chose = spec["vocab"], {"attention": "sdpa", "dropout": spec["dropout"]}

        def loss_of(model, inputs, targets):
            logits = model(input_ids=inputs).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    else:
        sys.path.insert(0, spec["nanogpt"])
        from model import GPT, GPTConfig  # nanoGPT's own

        config = GPTConfig(
            block_size=length,
            vocab_size=spec["nanogpt_vocab"],
            n_layer=spec["layers"],
            n_head=spec["heads"],
            n_embd=spec["width"],
            dropout=0.0,
            bias=True,
        )
        model = GPT(config).to(device)
        optimizer = model.configure_optimizers(
            spec["weight_decay"], spec["lr"], tuple(spec["betas"]), device
        )
        vocab = spec["nanogpt_vocab"]
        chose = {
            "attention": "F.scaled_dot_product_attention (nanoGPT's flash path)",
            "dropout": 0.0,
        }

        def loss_of(model, inputs, targets):
            return model(inputs, targets)[1]

    model.train()
    compiled, how = _compiled(torch, model, spec, device)
    autocast = _autocast(torch, spec, device)
    tokens = torch.randint(0, spec["vocab"], (rows, length + 1), device=device)

    def step(inputs, targets):
        with autocast():
            loss = loss_of(compiled, inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    count = sum(p.numel() for p in model.parameters())
    info = {
        "arm": spec["arm"],
        "params": count,
        "vocab": vocab,
        "rows": rows,
        "seq_len": length,
        "compile": how,
        "precision": _precision(spec),
        "optimizer": type(optimizer).__name__ + (" (fused)" if device == "cuda" else ""),
        **chose,
    }
    # Contiguous, as nanoGPT's get_batch stacks them (its loss views the targets flat).
    pair = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return _Arm(torch, step, pair, info, device)


def _resnet50(torch, spec, device) -> _Arm:
    import torch.nn.functional as F
    import torchvision

    model = torchvision.models.resnet50(num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    compiled, how = _compiled(torch, model, spec, device)
    autocast = _autocast(torch, spec, device)
    rows, px = spec["rows"], spec["px"]
    images = torch.randn(rows, 3, px, px, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (rows,), device=device)

    def step(images, labels):
        with autocast():
            loss = F.cross_entropy(compiled(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    info = {
        "arm": "torchvision",
        "params": sum(p.numel() for p in model.parameters()),
        "rows": rows,
        "px": px,
        "compile": how,
        "precision": _precision(spec),
        "layout": "channels-last",
        "optimizer": "SGD (momentum)",
        "cudnn_benchmark": device == "cuda",
    }
    return _Arm(torch, step, (images, labels), info, device)


def _mlp(torch, spec, device) -> _Arm:
    import torch.nn.functional as F

    widths = [spec["inputs"], *spec["hidden"]]
    layers: list[Any] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], spec["classes"])).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=spec["lr"], fused=device == "cuda")
    if spec["arm"] == "torch graphs":
        compiled, how = _compiled(torch, model, spec, device, mode="reduce-overhead")
    else:
        compiled, how = model, "none (eager)"
    rows = spec["rows"]
    inputs = torch.randn(rows, spec["inputs"], device=device)
    labels = torch.randint(0, spec["classes"], (rows,), device=device)
    # CUDA graphs replay into the same memory: each iteration begins a step, as
    # PyTorch's docs ask of a training loop under "reduce-overhead".
    begin = torch.compiler.cudagraph_mark_step_begin if "reduce" in how else lambda: None

    def step(inputs, labels):
        begin()
        loss = F.cross_entropy(compiled(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    info = {
        "arm": spec["arm"],
        "params": sum(p.numel() for p in model.parameters()),
        "rows": rows,
        "compile": how,
        "precision": "fp32",
        "optimizer": "Adam" + (" (fused)" if device == "cuda" else ""),
    }
    return _Arm(torch, step, (inputs, labels), info, device)


def _precision(spec) -> str:
    return "bf16 autocast" if spec["precision"] == "bf16" else "fp32"


if __name__ == "__main__":
    sys.exit(serve())
