"""``python -m jdp.bench gpu``'s PyTorch peers at toy sizes on the CPU: each arm built in a
process of its own from the peer's own code (Hugging Face's ``GPT2LMHeadModel``,
torchvision's ResNet-50, the sweep's MLP in PyTorch eager and compiled), raced in the
same rounds as jdp's step, and landed in the JSON and the table."""

from __future__ import annotations

import json

import pytest

from tests.helpers import interop, run_tool

pytestmark = pytest.mark.interop

ARMS = ("transformers", "torchvision", "torch eager", "torch graphs")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pytorch_peers_race_jdp_in_the_same_rounds(tmp_path):
    interop("torch", "transformers", "torchvision", load=False)  # the peers' processes import them
    out = tmp_path / "gpu.json"
    result = run_tool(
        "jdp.bench.__main__",
        "gpu",
        "--smoke",
        "--parts",
        "gpt2,resnet50,sweep",
        "--peers",
        ",".join(ARMS),
        "--out",
        out,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["peers"] == {"racing": list(ARMS), "left_out": {}}
    parts = data["parts"]
    raced = {
        "transformers": parts["gpt2"]["cells"][0]["peers"]["transformers"],
        "torchvision": parts["resnet50"]["peers"]["torchvision"],
        **parts["sweep"]["cases"][0]["peers"],
    }
    assert list(raced) == list(ARMS)
    for arm, peer in raced.items():
        assert "error" not in peer, (arm, peer)
        assert len(peer["rates"]) == 2 and min(peer["rates"]) > 0, (arm, peer)  # 2 smoke rounds
        assert peer["jdp_over_peer"] > 0 and peer["compile_s"] >= 0, (arm, peer)
        assert peer["device"] == "cpu" and peer["torch"], (arm, peer)
    # The same model as jdp's cell: GPT-2's layout at the smoke's size, its vocabulary of
    # 256 bytes, 4 rows of 32 tokens; jdp's counts the same parameters (the positions
    # table, the tied embedding).
    gpt = parts["gpt2"]["cells"][0]
    assert (raced["transformers"]["rows"], raced["transformers"]["seq_len"]) == (4, 32)
    assert raced["transformers"]["params"] == gpt["params"], (raced["transformers"], gpt["params"])
    assert raced["transformers"]["attention"] == "sdpa"
    assert raced["torchvision"]["params"] == 25_557_032  # ResNet-50, as torchvision counts it
    mlp = parts["sweep"]["cases"][0]
    assert raced["torch eager"]["params"] == raced["torch graphs"]["params"] == 38_410
    assert mlp["params"] == "38k"
    assert raced["torch eager"]["compile"] == "none (eager)"
    assert raced["torch graphs"]["compile"] == "torch.compile (default mode)"  # no CUDA graphs
    table = result.stdout.split("--- jdp.bench gpu,", 1)[1]
    for arm in ARMS:
        assert f"  vs {arm} (PyTorch " in table, arm
    # The docs' generator: the peers' targets and the README's line read the same JSON.
    from tools import gpu_docs

    merged = gpu_docs.merge([str(out)])
    rows = gpu_docs.targets(merged)[-3:]  # the peers' three, measured
    for row, key in zip(rows, ("gpt2_peer", "resnet_peer", "sweep_peer"), strict=True):
        assert row.startswith(f"| {gpu_docs.TARGETS[key][1]} |"), row
        assert row.endswith(("| met |", "| missed |")), row
    best = max(("transformers",), key=lambda arm: raced[arm]["rate"])
    assert f"the best PyTorch arm ({best}, " in gpu_docs.readme_line(merged)
    assert "torchvision's (" in gpu_docs.readme_line(merged)
