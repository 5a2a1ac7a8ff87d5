"""The peers' side of `jdp.bench.peers`: ``python -m jdp.bench.peer_arms`` builds the
PyTorch arm its first request names, then runs the steps each next request asks for,
answering each with one JSON line on its standard output (what the libraries print
goes to its standard error).

The arms, each the peer's own code with the loop around it written plainly, as its
docs recommend: Hugging Face's ``GPT2LMHeadModel`` (SDPA attention); nanoGPT's own
``model.py`` and ``configure_optimizers`` from the checkout the user names;
``torchvision.models.resnet50``, channels-last, SGD with momentum; the sweep's MLPs,
eager and under ``torch.compile(mode="reduce-overhead")``. On a GPU: bf16 autocast
where jdp's cell is bf16, fused optimizers, ``torch.compile``, TF32 and cuDNN's
autotuning as nanoGPT's train.py and PyTorch's tuning guide set them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from typing import Any


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
    """A GPT-2 arm on the cell's rows of tokens: the model, its optimizer and its loss
    from `_transformers` or `_nanogpt`, the loop around them plain."""
    rows, length = spec["rows"], spec["seq_len"]
    build = _transformers if spec["arm"] == "transformers" else _nanogpt
    model, optimizer, loss_of, chose = build(torch, spec, device)
    model.train()
    compiled, how = _compiled(torch, model, spec, device)
    autocast = _autocast(torch, spec, device)
    tokens = torch.randint(0, spec["vocab"], (rows, length + 1), device=device)

    step = _step(lambda inputs, targets: loss_of(compiled, inputs, targets), optimizer, autocast)

    info = {
        "arm": spec["arm"],
        "params": sum(p.numel() for p in model.parameters()),
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


def _transformers(torch, spec, device):
    """Hugging Face's GPT-2 at the cell's sizes, SDPA attention, dropout where jdp's
    model has it (embeddings and residual branches), AdamW; the loss over the same next
    tokens as jdp's."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(
        vocab_size=spec["vocab"],
        n_positions=spec["seq_len"],
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

    def loss_of(model, inputs, targets):
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    chose = {"vocab": spec["vocab"], "attention": "sdpa", "dropout": spec["dropout"]}
    return model, optimizer, loss_of, chose


def _nanogpt(torch, spec, device):
    """nanoGPT's own model and optimizer from the user's checkout, its vocabulary padded
    and its dropout as its train.py pretrains GPT-2; its own loss."""
    sys.path.insert(0, spec["nanogpt"])
    from model import GPT, GPTConfig  # nanoGPT's own

    config = GPTConfig(
        block_size=spec["seq_len"],
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

    def loss_of(model, inputs, targets):
        return model(inputs, targets)[1]

    chose = {
        "vocab": spec["nanogpt_vocab"],
        "attention": "F.scaled_dot_product_attention (nanoGPT's flash path)",
        "dropout": 0.0,
    }
    return model, optimizer, loss_of, chose


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

    step = _step(lambda x, y: F.cross_entropy(compiled(x), y), optimizer, autocast)

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
    begin = torch.compiler.cudagraph_mark_step_begin if "reduce" in how else None
    loss_of = lambda x, y: F.cross_entropy(compiled(x), y)  # noqa: E731
    step = _step(loss_of, optimizer, contextlib.nullcontext, begin)

    info = {
        "arm": spec["arm"],
        "params": sum(p.numel() for p in model.parameters()),
        "rows": rows,
        "compile": how,
        "precision": "fp32",
        "optimizer": "Adam" + (" (fused)" if device == "cuda" else ""),
    }
    return _Arm(torch, step, (inputs, labels), info, device)


def _step(loss_of, optimizer, autocast, begin=None):
    """A training step as PyTorch's docs write the loop: ``begin()`` (CUDA graphs' step
    mark), the loss under ``autocast()``, backward, the optimizer's step, the gradients
    set to None; the loss back, detached."""

    def step(*batch):
        if begin is not None:
            begin()
        with autocast():
            loss = loss_of(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _precision(spec) -> str:
    return "bf16 autocast" if spec["precision"] == "bf16" else "fp32"


if __name__ == "__main__":
    sys.exit(serve())
