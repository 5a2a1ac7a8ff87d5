"""GPT-2 weights from and to Hugging Face ``transformers``, checked in round trips
through ``transformers`` itself (on torch): jdp's logits are ``GPT2LMHeadModel``'s."""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

import jdp
from jdp.errors import UsageError
from jdp.export import main as export
from jdp.models.hf import write_hf
from jdp.models.transformer import EPSILON
from tests.closeness import EPS32, relative_distance
from tests.helpers import interop, run_cli, run_python

pytestmark = pytest.mark.interop


def _stack():
    """``(torch, transformers)``, imported where a test needs them, not as the suite is
    collected: a worker that runs none of these tests never loads PyTorch."""
    return interop("torch", "transformers")


# GPT-2's shape at toy size; vocabulary 256 so the bundled corpus (UTF-8 bytes) fits.
TOY = {"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}
# Logits of the same weights in two float32 programs differ by rounding only. Each of
# the products in sequence (per layer: query, key, value, scores, weighted values,
# output, and the two feed-forward ones; then the head) can move its result by at most
# K * EPS32 relatively, K <= 128 terms summed (Higham's bound for any summation order),
# and the relative errors at most add up: (8 * layers + 1) * 128 * EPS32 = 2.6e-4 for
# two layers. Seen: 1.8e-7 (three seeds). A mapping error is far above it: the planted
# one below (LayerNorm epsilon 1e-6 for GPT-2's 1e-5) moves the logits by 6e-3.
PRODUCTS = 8 * TOY["n_layer"] + 1
LOGITS_BOUND = PRODUCTS * 128 * EPS32


def _hf_model(directory, seed=0, **overrides):
    torch, transformers = _stack()
    config = transformers.GPT2Config(
        **{**TOY, "bos_token_id": None, "eos_token_id": None, **overrides}
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    return model


def _hf_logits(model, tokens):
    torch, _ = _stack()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _tokens(rows=3, length=24, vocab=TOY["vocab_size"]):
    return np.random.default_rng(0).integers(0, vocab, (rows, length))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "gpt2"
    return directory, _hf_model(directory)


@pytest.mark.slow
def test_gpt2_weights_give_transformers_logits(toy):
    directory, model = toy
    gpt = jdp.models.from_hf(directory)
    assert gpt.module.epsilon == 1e-5 and gpt.module.layers == TOY["n_layer"]
    tokens = _tokens()
    expected = _hf_logits(model, tokens)
    got = gpt.module.apply({"params": gpt.params}, jnp.asarray(tokens))
    assert relative_distance(got, expected) <= LOGITS_BOUND
    # The bound can fail: the planted epsilon is a model jdp would otherwise make.
    planted = gpt.module.clone(epsilon=EPSILON)
    wrong = planted.apply({"params": gpt.params}, jnp.asarray(tokens))
    assert relative_distance(wrong, expected) > 10 * LOGITS_BOUND


@pytest.mark.slow
def test_greedy_generation_matches_transformers(toy):
    torch, _ = _stack()
    directory, model = toy
    gpt = jdp.models.from_hf(directory)
    prompt = _tokens(rows=2, length=5)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[:, 5:].numpy()
    got = jdp.models.generate(gpt.module, gpt.params, prompt, max_new_tokens=8, temperature=0)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("how", ["sharded", "bfloat16", "hub_names"])
def test_other_ways_the_weights_are_saved(toy, tmp_path, how):
    """Sharded files with an index, half precision, and the Hub's GPT-2 names (no
    ``transformer.`` prefix, causal-mask buffers, the tied head written out)."""
    torch, _ = _stack()
    directory, model = toy
    if how == "sharded":
        model.save_pretrained(tmp_path, max_shard_size="20KB")
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    elif how == "bfloat16":  # read exactly as float32: the rounded model's logits
        model = copy.deepcopy(model).to(torch.bfloat16)
        model.save_pretrained(tmp_path)
        model = model.to(torch.float32)
    else:
        from safetensors.numpy import load_file, save_file

        tensors = {
            k.removeprefix("transformer."): v
            for k, v in load_file(directory / "model.safetensors").items()
        }
        tensors["lm_head.weight"] = tensors["wte.weight"]
        for layer in range(TOY["n_layer"]):
            tensors[f"h.{layer}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
        save_file(tensors, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    gpt = jdp.models.from_hf(tmp_path)
    tokens = _tokens()
    got = gpt.module.apply({"params": gpt.params}, jnp.asarray(tokens))
    assert relative_distance(got, _hf_logits(model, tokens)) <= LOGITS_BOUND


def _rewritten(directory, tmp_path, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            lambda t: t.update({"transformer.h.0.mlp.c_fc.weight": np.zeros((32, 7), np.float32)}),
            "the tensor h.0.mlp.c_fc.weight is (32, 7), and config.json makes it (32, 128)",
        ),
        (lambda t: t.pop("transformer.h.1.ln_2.bias"), "the tensor h.1.ln_2.bias is missing"),
        (
            lambda t: t.update({"transformer.h.0.extra": np.zeros(3, np.float32)}),
            "the tensor h.0.extra is not GPT-2's",
        ),
        (
            lambda t: t.update({"lm_head.weight": np.ones((256, 32), np.float32)}),
            "the tensor lm_head.weight is not GPT-2's",
        ),
    ],
)
def test_tensors_that_do_not_fit_are_named(toy, tmp_path, change, needle):
    with pytest.raises(UsageError) as error:
        jdp.models.from_hf(_rewritten(toy[0], tmp_path, change))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_a_config_that_is_not_gpt2_is_refused(toy, tmp_path):
    config = json.loads((toy[0] / "config.json").read_text())
    for key, value, needle in [
        ("model_type", "llama", "is a 'llama' model"),
        ("activation_function", "relu", "activation_function 'relu'"),
        ("n_head", None, "states no n_head; GPT-2's config.json has them"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(UsageError, match=needle):
            jdp.models.from_hf(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        jdp.models.from_hf(tmp_path / "nowhere")


@pytest.mark.slow
def test_an_export_loads_in_transformers_with_jdps_logits(tmp_path):
    """A gpt trained by jdp (its own epsilon, scanned layers), exported and loaded."""
    _, transformers = _stack()
    run = str(tmp_path / "run")
    config = jdp.TrainConfig(
        mesh="data=2",
        model="gpt",
        dataset="python_stdlib",
        seq_len=32,
        batch_size=8,
        steps=3,
        warmup_steps=1,
        ckpt_dir=run,
    )
    jdp.fit(config, console=jdp.Console(enabled=False))
    assert export([run, "--to", "hf", str(tmp_path / "out")]) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    loaded = jdp.load_model(run)
    tokens = _tokens(length=32)
    module = jdp.models.gpt_for(loaded.params)
    got = module.apply({"params": meta.unbox(loaded.params)}, jnp.asarray(tokens))
    # gpt small: 4 layers of products over at most 512 terms (its hidden width).
    bound = (8 * 4 + 1) * 512 * EPS32
    assert relative_distance(got, _hf_logits(model, tokens)) <= bound
    # An export into a directory that holds files would mix two models: refused.
    assert export([run, "--to", "hf", str(tmp_path / "out")]) == 2


@pytest.mark.slow
def test_fine_tuning_from_gpt2_weights_through_the_cli(toy, tmp_path):
    """--init-from hf:DIR trains from the weights (one step at lr 1e-12 leaves them),
    checkpoints, resumes, and evaluates with DIR gone: the checkpoint records the shape."""
    directory = tmp_path / "gpt2"
    _hf_model(directory, bos_token_id=0, eos_token_id=0)
    run = tmp_path / "run"
    flags = [
        *"--mesh data=2 --model gpt --dataset python_stdlib --batch-size 8".split(),
        "--init-from",
        f"hf:{directory}",
        "--ckpt-dir",
        str(run),
        *"--ckpt-every 2 --warmup-steps 1 --lr 1e-12".split(),
    ]
    first = run_cli(*flags, "--steps", "2", devices=2)
    assert first.returncode == 0, first.stderr
    assert f"gpt of hf:{directory}" in first.stdout
    saved, _ = jdp.checkpoint.read_params(run)
    assert relative_distance(saved, jdp.models.from_hf(directory).params) < 1e-6
    again = run_cli(*flags, "--steps", "4", devices=2)
    assert again.returncode == 0 and f"resuming from step 2 in {run}" in again.stdout, again.stderr
    os.rename(directory, tmp_path / "moved")
    evaluated = run_cli("--eval-only", "--ckpt-dir", str(run), "--mesh", "data=2", devices=2)
    assert evaluated.returncode == 0 and "evaluated step=4" in evaluated.stdout, evaluated.stderr
    record = jdp.checkpoint.read_record(os.path.join(run, "4"))
    assert record.config["architecture"]["epsilon"] == 1e-5
    # Exported back, the weights' special tokens are the source's (recorded at import).
    assert export([str(run), "--to", "hf", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 0)


@pytest.mark.slow
def test_bad_imports_and_exports_are_one_line(toy, tmp_path):
    directory = toy[0]
    wrong_model = run_cli("--model", "mlp", "--init-from", f"hf:{directory}", "--steps", "1")
    shape = _rewritten(directory, tmp_path, lambda t: t.pop("transformer.wpe.weight"))
    missing = run_cli(
        *"--model gpt --dataset python_stdlib --init-from".split(), f"hf:{shape}", "--steps", "1"
    )
    export = run_python(
        "-m", "jdp.export", str(tmp_path / "none"), "--to", "hf", str(tmp_path / "o")
    )
    for result, needle in [
        (wrong_model, "loads GPT-2's weights; use --model gpt"),
        (missing, "the tensor wpe.weight is missing"),
        (export, "no checkpoint in"),
    ]:
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_jdp_gpt_written_as_gpt2_loads_in_transformers(tmp_path):
    """`write_hf` on jdp's own epsilon (1e-6), as a library user calls it."""
    _, transformers = _stack()
    gpt = jdp.models.GPT(vocab_size=40, width=16, heads=2, layers=2, hidden=32, max_len=8)
    params = meta.unbox(jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    write_hf(tmp_path, gpt, jax.tree.map(np.asarray, params["params"]))
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = _tokens(length=8, vocab=40)
    got = gpt.apply(params, jnp.asarray(tokens))
    assert relative_distance(got, _hf_logits(model, tokens)) <= LOGITS_BOUND
