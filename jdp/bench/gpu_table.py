"""The table ``python -m jdp.bench gpu`` prints at its end (and ``python -m
tools.gpu_docs`` writes into the docs), from the parts' JSON."""

from __future__ import annotations

import statistics
from typing import Any

from jdp.bench import gpu_plan
from jdp.bench.arms import ratios_to


def compiler_text(setting: dict[str, Any]) -> str:
    """The compiler settings a GPT-2 cell turned, as a user sets them for a run:
    XLA_FLAGS's options and JAX's effort level; "" for the defaults."""
    said = [f"--{name}={str(value).lower()}" for name, value in setting.get("xla", {}).items()]
    if setting.get("optimization"):
        said.append(f"JAX_OPTIMIZATION_LEVEL={setting['optimization']}")
    return " ".join(said)


def setting_text(setting: dict[str, Any]) -> str:
    layers = "unrolled" if setting["unroll"] else "scanned"
    compiler = compiler_text(setting)
    chunks = setting.get("loss_chunks", 1)
    return (
        f"attention {setting['attention']}, remat {setting['remat']}, {layers}"
        + (f", loss in {chunks} chunks" if chunks > 1 else "")
        + (", FP8 products" if setting.get("fp8") else "")
        + (f", {compiler}" if compiler else "")
    )


def gpt_numbers(result: dict[str, Any]) -> dict[str, float]:
    rates = result["rates"]
    jdp, hand = statistics.median(rates["jdp"]), statistics.median(rates["hand-written"])
    numbers = {"jdp": jdp, "hand": hand, "ratio": ratios_to(rates, "hand-written")["jdp"]}
    peak = result["peak"]
    if peak:
        numbers["mfu"] = result["flops_per_token"] * jdp / peak
        numbers["mfu_causal"] = result["flops_per_token_causal"] * jdp / peak
    return numbers


def gpt_line(result: dict[str, Any]) -> str:
    n = gpt_numbers(result)
    mfu = f", MFU {n['mfu']:.1%} (causal {n['mfu_causal']:.1%})" if "mfu" in n else ""
    check = "agree" if result["check"]["agree"] else "DISAGREE"
    return (
        f"  gpt2 {setting_text(result['setting'])}: jdp {n['jdp']:,.0f} tokens/s, hand-written "
        f"{n['hand']:,.0f}, {n['ratio']:.3f}x{mfu}; first losses {check}"
    )


def table(data: dict[str, Any]) -> list[str]:
    """The run's figures as printed at its end (and by ``python -m tools.gpu_docs``)."""
    parts, lines = data["parts"], []
    for part, lines_of in LINES.items():
        result = parts.get(part)
        if result and "error" not in result:
            lines += lines_of(result)
    for part, result in parts.items():
        if "error" in result:
            lines.append(f"{part}: FAILED: {result['error'][:300]}")
    return lines


def _machine(machine: dict[str, Any]) -> list[str]:
    v, peak = machine["versions"], machine["peak_flops"]
    extra = ", ".join(f"{k} {v[k]}" for k in ("driver", "cuda", "cudnn") if k in v)
    return [
        f"{machine['kind']} ({machine['platform']}), {machine['cores']} cores; JAX {v['jax']}, "
        f"jaxlib {v['jaxlib']}, Python {v['python']}" + (f", {extra}" if extra else ""),
        f"bf16 {machine['matmul_n']}-cube product: {machine['matmul_flops'] / 1e12:,.1f} TFLOP/s"
        + (
            f" ({machine['matmul_flops'] / peak:.0%} of the data sheet's {peak / 1e12:,.0f})"
            if peak
            else ""
        ),
    ]


def _gpt2(gpt: dict[str, Any]) -> list[str]:
    lines = [
        f"GPT-2 {gpt['size']}, T = {gpt['seq_len']}, {gpt['rows']} rows, "
        f"{gpt.get('precision', 'bf16')}:",
        f"  {'attention':<10}{'remat':<6}{'layers':<10}{'rows':>5}{'jdp tokens/s':>13}"
        f"{'hand tokens/s':>14}{'ratio':>8}{'MFU':>7}{'causal':>8}{'peak mem':>9}  compiler",
    ]
    for index, cell in enumerate(gpt["cells"]):
        s = cell["setting"]
        layers = "unrolled" if s["unroll"] else "scanned"
        if "error" in cell:
            lines.append(
                f"  {s['attention']:<10}{s['remat']:<6}{layers:<10}  {cell['error'][:60]}"
                f"  {compiler_text(s)}"
            )
            continue
        n = gpt_numbers(cell)
        mfu = f"{n['mfu']:>7.1%}{n['mfu_causal']:>8.1%}" if "mfu" in n else f"{'-':>7}{'-':>8}"
        memory = f"{'-':>9}"  # the process's peak so far: a cell's own only for the first
        if index == 0 and cell.get("peak_bytes"):
            memory = f"{cell['peak_bytes'] / 2**30:>7.1f}GB"
        rows = cell["cell"]["batch_size"]
        lines.append(
            f"  {s['attention']:<10}{s['remat']:<6}{layers:<10}{rows:>5}"
            f"{n['jdp']:>13,.0f}{n['hand']:>14,.0f}{n['ratio']:>7.3f}x{mfu}"
            f"{memory}  {compiler_text(s) or 'default'}"
        )
        lines += [text for text in (gpu_plan.line(cell),) if text]
    for cell in gpt["cells"][:1]:  # the PyTorch peers race the first cell
        lines += peer_lines(cell.get("peers", {}), "tokens", cell)
    lines += [f"  {setting_text(s)}: not run (budget)" for s in gpt["skipped_for_budget"]]
    if gpt.get("partial"):  # landed after a cell, and the run ended before the part did
        lines.append("  (the run ended within this part: the cells after these were not run)")
    return lines


def _resnet50(resnet: dict[str, Any]) -> list[str]:
    line = (
        f"ResNet-50 {resnet['size']}, {resnet['px']} px synthetic, {resnet['rows']} rows, "
        f"{resnet.get('precision', 'bf16')}: jdp {resnet['jdp']:,.0f} images/s, "
        f"hand-written {resnet['hand']:,.0f}, {resnet['ratio']:.3f}x"
    )
    rates = {arm: statistics.median(each) for arm, each in resnet["rates"].items()}
    ratios = {arm: rate / rates["hand-written"] for arm, rate in rates.items()}
    return [line, *lever_lines(resnet, ratios), *peer_lines(resnet.get("peers", {}), "images")]


def lever_lines(landed: dict[str, Any], ratios: dict[str, float]) -> list[str]:
    """A line for each lever raced (`jdp.bench.levers`): jdp's step under it, to the
    hand-written step, beside jdp's own."""
    return [
        f"  lever {name}: jdp {ratios[f'jdp, {name}']:.3f}x (as a run compiles it "
        f"{ratios['jdp']:.3f}x)"
        for name in landed.get("levers", {})
    ]


def peer_lines(peers: dict[str, Any], unit: str, cell: dict[str, Any] | None = None) -> list[str]:
    """A line for each PyTorch peer: its rate, jdp's ratio to it (within each round),
    its compile time and what it chose; with a GPT-2 ``cell``, its MFU by the cell's
    counts of FLOPs per token."""
    lines = []
    for arm, peer in peers.items():
        if "error" in peer:
            lines.append(f"  vs {arm}: FAILED: {peer['error'][:200]}")
            continue
        mfu = ""
        if cell and cell.get("peak"):
            mfu = (
                f", MFU {cell['flops_per_token'] * peer['rate'] / cell['peak']:.1%} "
                f"(causal {cell['flops_per_token_causal'] * peer['rate'] / cell['peak']:.1%})"
            )
        chose = ", ".join(f"{key} {peer[key]}" for key in ("attention", "layout") if key in peer)
        lines.append(
            f"  vs {arm} (PyTorch {peer['torch']}): {peer['rate']:,.0f} {unit}/s{mfu}; jdp "
            f"{peer['jdp_over_peer']:.3f}x; compile {peer['compile_s']:.1f} s; "
            f"{peer['compile']}, {peer['precision']}, {peer['optimizer']}"
            + (f", {chose}" if chose else "")
        )
    return lines


def _loader(loader: dict[str, Any]) -> list[str]:
    need = ""
    if "device_rate" in loader:
        need = (
            f"; one device at {loader['device_rate']:,.0f} images/s needs "
            f"{loader['cores_per_device']:.1f} such cores"
        )
    # Runs before `worker_window` timed the workers from the first batch, while the
    # others were still starting: their figure is not the workers' rate.
    when = (
        ""
        if "timed_batches" in loader
        else " (timed from the first batch, the other workers still starting)"
    )
    return [
        f"JPEG loader ({loader['jpegs']} JPEGs of ImageNet's sizes, {loader['mean_kb']:.0f} "
        f"KB): {loader['per_core']:,.0f} images/s on one core, "
        f"{loader['with_workers']:,.0f} with {loader['workers']} workers{when}"
        f"{need}"
    ]


def _sweep(sweep: dict[str, Any]) -> list[str]:
    lines = []
    for case in sweep["cases"]:
        r, o = case["ratios"], case.get("overhead")
        where = (
            f"; kernels {o['hand-written']['kernels']} vs {o['jdp']['kernels']}, host "
            f"{o['hand-written']['dispatch_us']:.0f}{_scalars(o)} vs "
            f"{o['jdp']['dispatch_us']:.0f} us a call"
            if o
            else ""
        )
        fed = (
            f", fed from the host {r['fed from the host']:.3f}x, fed on the device "
            f"{r['fed on the device']:.3f}x"
            if "fed on the device" in r
            else ""
        )
        lines.append(
            f"sweep {case['case']} ({case['params']}), {case['rows']} rows: "
            f"hand-written {case['rates']['hand-written']:,.0f} examples/s; jdp "
            f"{r['jdp']:.3f}x, 4 steps per call {r['jdp, 4 steps per call']:.3f}x"
            f"{fed}{where}"
        )
        lines += lever_lines(case, r)
        lines += peer_lines(case.get("peers", {}), "examples")
    return lines


def _scalars(overhead: dict[str, Any]) -> str:
    """The hand-written step's host time with jdp's scalar arrays, where measured."""
    with_them = overhead.get("hand-written, jdp's scalars")
    if not with_them:
        return ""
    if "error" in with_them:
        return f" (with jdp's scalars: {with_them['error']})"
    return f" ({with_them['dispatch_us']:.0f} with jdp's scalars)"


def _correctness(check: dict[str, Any]) -> list[str]:
    return [
        f"correctness: {check['steps']} steps of gpt small, fp32: "
        f"{'within' if check['within'] else 'OUTSIDE'} the derived tolerance (worst step "
        f"at {check['worst']:.2f} of it; last loss {check['accelerator'][-1]:.6f} here, "
        f"{check['cpu'][-1]:.6f} on the CPU)"
    ]


# Each part's lines, in the order the parts run.
LINES = {
    "machine": _machine,
    "gpt2": _gpt2,
    "resnet50": _resnet50,
    "loader": _loader,
    "sweep": _sweep,
    "correctness": _correctness,
}
