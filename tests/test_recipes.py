"""Recipes (``--recipe NAME``): each states its expected result, a measured one is its
README figures row (whose figure the suite checks by running it), and every recipe's
smoke form runs, on stand-in data where the recipe's needs a download."""

from __future__ import annotations

import pathlib
import shlex

import numpy as np
import pytest
import tensorflow_datasets as tfds
from catalog import prepare
from helpers import run_cli

import jdp
from jdp.bench.images import write_tree
from jdp.data.formats.shards import write_llmc, write_meta
from jdp.errors import UsageError
from jdp.training.flags import parse_flags
from jdp.training.recipes import STATEMENT, load_recipe, recipe_names
from tools import readme

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
# The recipes the wave promised: the digits MLP, the CIFAR ResNet, the reference
# Transformer, GPT-2 124M on a token corpus and the small LM on the bundled corpus.
PROMISED = {
    "digits-mlp",
    "cifar10-resnet20",
    "numbers2words-seq2seq",
    "gpt2-124m",
    "python-stdlib-gpt",
}


def test_every_recipe_states_its_result():
    assert set(recipe_names()) >= PROMISED
    for name in recipe_names():
        recipe = load_recipe(name)
        assert set(STATEMENT) <= set(recipe.statement), name
        text = (pathlib.Path(jdp.__file__).parent / "recipes" / f"{name}.toml").read_text()
        tables = [line for line in text.splitlines() if line.startswith("[")]
        assert tables[0] == "[recipe]", name  # the statement comes first
        assert recipe.statement["command"].startswith(f"python -m jdp.train --recipe {name}")
        recipe.config(), recipe.config(smoke=True)  # both are valid configurations


@pytest.mark.parametrize("name", [n for n in recipe_names() if load_recipe(n).measured])
def test_a_measured_recipe_is_the_readme_row_that_checks_it(name):
    recipe = load_recipe(name)
    rows = {row.command: row for row in readme.table(README)}
    row = rows[recipe.statement["checked_by"]]
    words = shlex.split(row.command)
    assert words[:3] == ["python", "-m", "jdp.train"]
    assert parse_flags(["--recipe", name]) == parse_flags(words[3:])
    # The figures it states are the row's, and the row's are what its command prints
    # (tests/test_readme.py runs it): `python -m tools.readme --write` keeps both.
    assert f"{recipe.statement['expected']:.4f}" == row.accuracy
    assert f"{recipe.statement['tolerance']:.4f}" == row.tolerance
    assert recipe.statement["wall"] == f"{row.wall} s"
    assert f", {recipe.statement['hardware']}, numerics" in README


def test_the_readme_lists_every_recipe_with_its_result():
    for name in recipe_names():
        statement = load_recipe(name).statement
        line = next((l for l in README.splitlines() if f"`{name}`" in l), "")  # noqa: E741
        assert str(statement["expected"]) in line or f"{statement['expected']:.4f}" in line, name


def _stand_in_data(recipe, tmp_path) -> list[str]:
    """Flags that point a recipe whose data is a download at data made here."""
    dataset = recipe.config().dataset
    if dataset == "cifar10":
        prepare(tfds.image_classification.Cifar10, tmp_path, {"train": 64, "test": 16}, (32, 32, 3))
        return ["--data-dir", str(tmp_path)]
    if dataset.startswith("images:"):  # JPEGs of ImageNet's sizes, in class folders
        write_tree(str(tmp_path / "images"), {"train": 32, "test": 16}, classes=4)
        return ["--dataset", f"images:{tmp_path / 'images'}"]
    if dataset.startswith("tokens:"):  # GPT-2's vocabulary: the model at its real size
        rng = np.random.default_rng(0)
        for split, count in (("train", 20_000), ("val", 2_000)):
            write_llmc(tmp_path / f"corpus_{split}_000000.bin", rng.integers(0, 50257, count))
        write_meta(tmp_path, {"vocab_size": 50257})
        return ["--dataset", f"tokens:{tmp_path}"]
    return []


# Smoke forms whose path a per-change run takes from the CLI already are in the scheduled
# lane: the gpt on python_stdlib (tests/test_tokens.py), seq2seq on numbers2words
# (tests/test_cli.py), and GPT-2 small, the same gpt on a token corpus at 124M parameters
# (100 s of CPU; its parameters are counted in tests/test_lm_model.py).
# The recipe's own reading is every other recipe's too.
ALSO_RUN = {
    "python-stdlib-gpt": "test_a_language_model_trains_on_python_stdlib_from_the_cli",
    "numbers2words-seq2seq": "test_tiny_seq2seq_run_on_numbers2words",
    "gpt2-124m": "test_gpt2_124m_has_gpt2s_parameters",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.scheduled] if name in ALSO_RUN else [])
        for name in recipe_names()
    ],
)
def test_every_recipes_smoke_form_runs(name, tmp_path):
    recipe = load_recipe(name)

    def flag(key, value):  # a switch, or its --no- form
        name = key.replace("_", "-")
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no-{name}"
        return f"--{name}={value}"

    smoke = [flag(key, value) for key, value in recipe.smoke.items()]
    # A fresh process: a recipe's mesh (data=-1) takes the devices the machine has, one CPU
    # here, where this process's 8 would each hold GPT-2 small and its Adam state.
    result = run_cli(
        "--recipe", name, *smoke, *_stand_in_data(recipe, tmp_path), timeout=280, fresh=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first = result.stdout.splitlines()[0]  # what the recipe set, and what the smoke overrode
    assert first.startswith(f"jdp: recipe {name} sets ") and " steps=" in first, first
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("jdp.train: steps=") and f"{recipe.statement['metric']}=" in summary


def test_a_recipe_of_your_own_and_bad_ones(tmp_path):
    mine = tmp_path / "mine.toml"
    statement = "\n".join(f'{key} = "x"' for key in STATEMENT if key != "status")
    mine.write_text(f'[recipe]\n{statement}\nstatus = "open: mine"\n[flags]\nsteps = 7\n')
    assert parse_flags(["--recipe", str(mine), "--lr", "0.1"]).steps == 7
    bad = [
        ('[recipe]\ncommand = "x"\n', "states no metric, expected, wall, hardware, status"),
        (f'[recipe]\n{statement}\nstatus = "maybe"\n', "status 'maybe'; give measured or open"),
        (
            f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nbatch = 3\n',
            "[flags] sets batch, which no flag is",
        ),
        ("[recipe\n", "not TOML"),
        (f'[recipe]\n{statement}\nstatus = "open"\n', "no [flags] table"),
        # [flags] forgotten: its keys land in the table above, or outside any table.
        (
            f'[recipe]\n{statement}\nstatus = "open"\nsteps = 7\n',
            "[recipe] sets steps, a flag; put it under [flags]",
        ),
        (
            f'steps = 7\n[recipe]\n{statement}\nstatus = "open"\n[flags]\n',
            "sets steps outside its tables",
        ),
        (
            f'[recipe]\n{statement}\nstatus = "open"\ncolour = "red"\n[flags]\n',
            "[recipe] states 'colour'",
        ),
        (f'[recipe]\n{statement}\nstatus = "open"\n[flag]\nsteps = 7\n', "holds 'flag'"),
        # Each value as its flag takes it: no string for a number, no number for a mesh.
        (
            f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nbatch_size = "64"\n',
            '[flags] batch_size = "64" is not what --batch-size takes; give an integer',
        ),
        (f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nsteps = 2.5\n', "give an integer"),
        (f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nlr = "1e-3"\n', "give a number"),
        (
            f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nmesh = 8\n',
            "mesh = 8 is not what --mesh takes; give a string in quotes",
        ),
        (f'[recipe]\n{statement}\nstatus = "open"\n[flags]\ngrad_norm = 1\n', "give true or false"),
        (f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nsteps = true\n', "integer"),
        (
            f'[recipe]\n{statement}\nstatus = "open"\n[flags]\n[smoke]\nprecision = "fp64"\n',
            '[smoke] precision = "fp64" is not what --precision takes; give one of "fp32"',
        ),
    ]
    for text, needle in bad:
        mine.write_text(text)
        with pytest.raises(UsageError) as error:
            load_recipe(str(mine))
        assert needle in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UsageError, match="unknown recipe 'nope'; choose one of: cifar10"):
        load_recipe("nope")
    assert load_recipe("digits-mlp").config() == jdp.TrainConfig(mesh="data=8")  # the default run
    # An integer where a float belongs is that float, as --lr 1 is.
    mine.write_text(f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nlr = 1\n')
    assert load_recipe(str(mine)).flags["lr"] == 1.0


def test_the_command_line_wins_over_a_recipe_steps_over_its_epochs_included(tmp_path):
    config = parse_flags(["--recipe", "imagenet-resnet50", "--steps", "2", "--lr", "0.2"])
    assert (config.steps, config.epochs, config.lr, config.model) == (2, 0, 0.2, "resnet50")
    assert parse_flags(["--recipe", "imagenet-resnet50", "--epochs", "3"]).epochs == 3
    # A recipe's own smoke form likewise: its steps turn its epochs off.
    mine = tmp_path / "mine.toml"
    statement = "\n".join(f'{key} = "x"' for key in STATEMENT if key != "status")
    mine.write_text(
        f'[recipe]\n{statement}\nstatus = "open"\n[flags]\nepochs = 90\n[smoke]\nsteps = 2\n'
    )
    assert (load_recipe(str(mine)).config(smoke=True).epochs, parse_flags([]).epochs) == (0, 0)
    assert load_recipe(str(mine)).config().epochs == 90
    # The run says so in its first line.
    run = run_cli(
        *"--recipe digits-mlp --steps 3 --lr 0.01 --eval-every 0".split(),
        "--ckpt-dir",
        tmp_path / "run",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == (
        "jdp: recipe digits-mlp sets mesh=data=8; the command line sets steps=3 lr=0.01 "
        f"eval_every=0 ckpt_dir={tmp_path / 'run'}"
    )


def test_rewriting_the_readme_rows_rewrites_the_recipes_they_check(tmp_path):
    text = (pathlib.Path(jdp.__file__).parent / "recipes" / "digits-mlp.toml").read_text()
    row = readme.Row("python -m jdp.train --mesh data=8", "0.9700", "", "0.0112", "3.1", "1")
    mine = tmp_path / "digits-mlp.toml"
    mine.write_text(readme.synced_recipe(text, row, "2 x AMD EPYC"))
    recipe = load_recipe(str(mine))
    stated = {key: recipe.statement[key] for key in ("expected", "tolerance", "wall", "hardware")}
    assert stated == {
        "expected": 0.97,
        "tolerance": 0.0112,
        "wall": "3.1 s",
        "hardware": "2 x AMD EPYC",
    }
    assert recipe.flags == load_recipe("digits-mlp").flags  # the rest as it was, comments too
    assert mine.read_text().count("#") == text.count("#")
