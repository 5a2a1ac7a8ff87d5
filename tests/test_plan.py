"""`python -m jdp.plan`: its bytes per device against hand arithmetic, its compiled
figures against the program jdp's step compiles."""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import run_python

import jdp
from jdp import plan

FLOAT = 4  # bytes of a float32
VOCAB = 50257


def _gpt_leaves(width, layers, hidden, max_len, heads):
    """GPT's parameters as (elements, split over fsdp by jdp's rules) pairs, by hand.

    The rules put every dimension named ``embed`` on fsdp (the width divides by
    8 in both configurations); the vocabulary, ``mlp`` and ``heads`` go to
    ``model``, absent here. A leaf the rules leave whole is split by the default
    rule when it holds at least 16 KiB: of these, only the MLP's bias of the
    1.3B model (8,192 floats). The query/key/value biases (heads x head width)
    stay whole.
    """
    head = width // heads
    leaves = [(VOCAB * width, True), (max_len * width, True), (2 * width, True)]  # final LN
    for _ in range(layers):
        leaves += [(2 * width, True)] * 2  # two LayerNorms
        leaves += [(width * heads * head, True)] * 4  # query, key, value, out kernels
        leaves += [(heads * head, False)] * 3  # query, key, value biases
        leaves += [(width, True)]  # out bias
        leaves += [(width * hidden, True)] * 2  # MLP kernels
        leaves += [(hidden, hidden * FLOAT >= 16 * 1024), (width, True)]  # MLP biases
    return leaves


CONFIGS = {
    "standard": dict(width=768, layers=12, hidden=3072, max_len=1024, heads=12),  # GPT-2 small
    "1.3b": dict(width=2048, layers=24, hidden=8192, max_len=2048, heads=16),  # GPT-3 XL
}


@pytest.mark.parametrize("size", sorted(CONFIGS))
@pytest.mark.parametrize("mesh", ["fsdp=8", "data=8,fsdp=8", "data=32,fsdp=8"])
def test_bytes_per_device_match_hand_arithmetic(size, mesh):
    leaves = _gpt_leaves(**CONFIGS[size])
    fsdp = 8
    params = FLOAT * sum(n // fsdp if split else n for n, split in leaves)
    result = run_python(
        *"-m jdp.plan --mesh".split(),
        mesh,
        *"--model gpt --model-size".split(),
        size,
        "--seq-len",
        str(CONFIGS[size]["max_len"]),
        "--no-compile",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    total = sum(n for n, _ in leaves)
    if size == "standard":
        assert total == 124_439_808  # GPT-2 small, as published
    assert f"{total:,} parameters" in result.stdout
    found = re.search(
        r"parameters ([\d,]+) bytes .*gradients ([\d,]+) bytes .*optimizer state ([\d,]+) bytes",
        result.stdout,
    )
    got = [int(part.replace(",", "")) for part in found.groups()]
    # AdamW: two moments laid out as the parameters, and one int32 step count.
    assert got == [params, params, 2 * params + 4]


def test_zero1_splits_the_optimizer_state_over_data():
    model, batch = plan.build_model("gpt", "standard", vocab=VOCAB, seq_len=1024, image=())
    replicated = plan.state_bytes(model, batch, {"data": 8})
    zero1 = plan.state_bytes(model, batch, {"data": 8}, shard_optimizer=True)
    assert zero1.params == replicated.params
    # Leaves of at least 16 KiB split 8 ways; the small ones (biases, the count) stay.
    assert replicated.optimizer / 8 <= zero1.optimizer <= 1.05 * replicated.optimizer / 8


@pytest.mark.slow
def test_the_compiled_figures_are_the_steps(devices):
    """The planner's temporaries and collectives are those of the program `make_train_step`
    compiles for real arrays on the same mesh."""
    model, batch = plan.build_model("gpt", "small", vocab=1000, seq_len=64, image=())
    figures = plan.state_bytes(model, batch, {"data": 2, "fsdp": 4})
    plan.compiled_figures(figures, model, batch, 16, precision="fp32", shard_optimizer=False)
    mesh = jdp.make_mesh("data=2,fsdp=4")
    optimizer = optax.adamw(1e-3)
    params, model_state, specs = model.init_on_mesh(jax.random.key(0), batch, mesh)
    state = jdp.create_train_state(
        params, optimizer, mesh, model_state=model_state, param_specs=specs
    )
    step = jdp.make_train_step(model.loss_fn, optimizer, mesh, has_model_state=True)
    rows = {k: np.zeros((16, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    compiled = step.lower(state, jdp.shard_batch(rows, mesh)).compile()
    assert figures.temporaries == compiled.memory_analysis().temp_size_in_bytes
    assert figures.params == sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.params)
    )
    # FSDP's collectives: the parameters gathered over fsdp (their bytes whole), the
    # gradients reduced over fsdp and over data; nothing else crosses an axis.
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    assert figures.collectives["all-gather over fsdp"] <= whole
    assert set(figures.collectives) == {
        "all-gather over fsdp",
        "all-reduce over fsdp",
        "all-reduce over data",
    }


@pytest.mark.slow
def test_the_planner_fits_and_suggests_for_a_device():
    # The MLP: the comparison and the suggestion are the point, not the model; its ten
    # layouts compile in 8 s where the gpt's took 45 (its layouts' figures are checked above).
    result = run_python(
        *"-m jdp.plan --mesh data=8 --model mlp --batch-size 16".split(),
        *"--device v5e --suggest".split(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    compared = re.findall(r"^mesh (\S+) \(8 devices\)", result.stdout, re.M)
    assert {"data=8", "data=1,fsdp=8", "data=4,model=2", "data=2,fsdp=2,model=2"} <= set(compared)
    assert result.stdout.count("Google TPU v5e: needs") == len(compared)
    assert result.stdout.count("roofline step") == len(compared)
    suggested = re.search(r"jdp.plan: suggest --mesh (\S+)", result.stdout).group(1)
    # The suggestion is the compared layout with the shortest roofline step.
    steps = dict(
        re.findall(r"^mesh (\S+) .*?roofline step ([\d.]+) ms", result.stdout, re.M | re.S)
    )
    assert suggested == min(steps, key=lambda mesh: float(steps[mesh]))


def test_a_mesh_the_batch_cannot_split_is_one_line():
    result = run_python(
        *"-m jdp.plan --mesh data=4,fsdp=4 --batch-size 8 --no-compile".split(),
        timeout=120,
    )
    assert result.returncode == 2
    assert "use a multiple of 16" in result.stderr and len(result.stderr.splitlines()) == 1


def test_the_mesh_form_of_device_groups():
    """XLA's ``replica_groups=mesh[...]`` form: ids laid out over the named axes (an
    iota, transposed), one group per index of the axes not reduced over."""
    from jdp.collectives import _groups

    line = (
        "%ag = f32[8]{0} all-gather(%p), replica_groups=mesh['axis_0'=4,'axis_1'=2], "
        "device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}"
    )
    # ids [0,4,1,5,2,6,3,7] as a 4x2 grid; gathered over axis_0: the columns.
    assert _groups(line, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    plain = "%ar = f32[] all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}"
    assert _groups(plain, 8) == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_planner_builds_image_and_sequence_models(name):
    from jdp.plan_costs import build_model

    model, batch = build_model(name, "small", vocab=32, seq_len=16, image=(8, 8, 1))
    params, _ = jax.eval_shape(model.init, jax.random.key(0), batch)
    assert jax.tree.leaves(params)
    assert ("image" in batch) == (name == "mlp")


def test_a_gpus_kernels_and_fusions_are_planned_by_their_stand_ins():
    """On a GPU in bf16 or fp16 a run's attention is cuDNN's fused kernel, which keeps no
    scores: the plan compiles ``blocked`` attention there, and only there; gpt's unrolled
    layers on a GPU compile with ``--remat dots``; what is asked for is kept."""
    import argparse

    from jdp.plan_stand_ins import planned_attention, planned_remat

    def args(device, precision, attention="auto", remat="none", unroll=False, size="124m"):
        return argparse.Namespace(
            device=device,
            precision=precision,
            attention=attention,
            remat=remat,
            unroll_layers=unroll,
            model="gpt",
            model_size=size,
        )

    assert planned_attention(args("h100", "bf16")) == "blocked"
    assert planned_attention(args("a100", "fp16", size="1.3b")) == "blocked"  # heads of 128
    assert planned_attention(args("h200", "fp32")) == planned_attention(args("v5e", "bf16"))
    assert planned_attention(args(None, "bf16")) == "xla"
    seq2seq = vars(args("h100", "bf16", size="standard")) | {"model": "seq2seq"}  # padded
    assert planned_attention(argparse.Namespace(**seq2seq)) == "xla"
    assert planned_attention(args("h100", "bf16", "xla")) == "xla"
    assert planned_attention(args(None, "fp32", "cudnn")) == "blocked"
    assert planned_remat(args("h100", "bf16", unroll=True)) == "dots"
    assert planned_remat(args("h100", "fp32")) == planned_remat(args("v5p", "bf16", unroll=True))
    assert planned_remat(args("h100", "fp32")) == "none"
    assert planned_remat(args("h100", "bf16", remat="full", unroll=True)) == "full"


def test_the_plans_compile_flags_keep_the_users():
    from jdp.plan_stand_ins import MEMORY_SCHEDULE, compile_flags

    flags = compile_flags("--xla_foo=1 --xla_disable_hlo_passes=a,b").split()
    assert flags[:2] == ["--xla_foo=1", MEMORY_SCHEDULE]
    assert flags[2] == "--xla_disable_hlo_passes=while-loop-invariant-code-motion,a,b"


def _own_peaks():
    """Each GPT-2 cell of the GPU runs in docs/gpu/ whose peak was its own: the first
    cell's, or one above the cell's before (the peak is the process's, never lower)."""
    import json
    import pathlib

    docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "gpu"
    for path in sorted(docs.glob("*.json")):
        cells = json.loads(path.read_text())["parts"].get("gpt2", {}).get("cells", [])
        before = 0
        for cell in cells:
            if cell.get("peak_bytes", 0) > before and cell["devices"] == 1:
                yield path.name, cell
            before = max(before, cell.get("peak_bytes", 0))


@pytest.mark.slow
@pytest.mark.scheduled  # per change: the GPU smoke run's cell planned (test_bench_gpu.py)
def test_the_plan_of_each_measured_gpt2_cell_is_within_a_quarter_of_its_peak():
    """The planner is how a user sizes a GPU they do not have: for every GPT-2 cell whose
    peak a GPU run measured (the allocator's peak, which also holds the hand-written
    arm's state, about 1.4 GiB), the plan's bytes a device needs are within 25% of it."""
    import json

    from jdp.bench.gpu_plan import KINDS
    from jdp.plan_stand_ins import GPUS

    plans, checked = {}, []
    for name, cell in _own_peaks():
        setting = cell["cell"]
        device = next(name for key, name in KINDS.items() if key in cell["kind"])
        argv = (
            "--model",
            "gpt",
            "--model-size",
            setting["model_size"],
            "--mesh",
            "data=1",
            "--batch-size",
            str(setting["batch_size"]),
            "--seq-len",
            str(setting["seq_len"]),
            "--precision",
            setting["precision"],
            "--remat",
            setting["remat"],
            "--attention",
            setting["attention"],
            "--device",
            device,
            "--loss-chunks",
            str(setting.get("loss_chunks", 1)),
            *(["--unroll-layers"] if setting["unroll"] else []),
        )
        # The GPUs of GPUS compile the same stand-ins, so their plans need the same bytes:
        # one plan each (an H100's cell and an H200's of the same settings share one).
        key = tuple("gpu" if arg in GPUS else arg for arg in argv)
        if key not in plans:
            result = run_python("-m", "jdp.plan", "--json", *argv, timeout=600)
            assert result.returncode == 0, result.stderr
            plans[key] = json.loads(result.stdout.strip().splitlines()[-1])["need"]
        checked.append((name, argv, plans[key] / cell["peak_bytes"]))
    assert len(plans) >= 3, checked  # scanned and unrolled with cuDNN's attention, XLA's
    assert all(0.75 <= ratio <= 1.25 for _, _, ratio in checked), checked
