"""Flags derived from TrainConfig's typed fields, and the named presets."""

import dataclasses
import re

import pytest
from helpers import run_tool

import jdp
from jdp.training import config
from jdp.training.flags import parse_flags
from jdp.training.presets import PRESETS


def test_each_field_is_a_flag_read_by_its_type():
    flags = "--batch-size 256 --lr 1e-2 --model cnn --num-processes 1 --no-resume --ckpt-dir /x"
    config = parse_flags([*flags.split(" "), "--data-dir", ""])
    assert config.batch_size == 256 and config.lr == 0.01 and config.model == "cnn"
    assert config.num_processes == 1 and config.no_resume is True
    assert config.ckpt_dir == "/x" and config.data_dir is None
    assert parse_flags([]) == jdp.TrainConfig()
    # A switch a recipe turns on, the command line turns off.
    assert parse_flags(["--recipe", "gpt2-124m"]).unroll_layers is True
    assert parse_flags(["--recipe", "gpt2-124m", "--no-unroll-layers"]).unroll_layers is False


def test_flags_refuse_bad_values_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_flags(["--batch-size", "many"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch-size: invalid" in err
    with pytest.raises(jdp.UsageError, match="unknown model 'vit'; choose one of: cnn, gpt"):
        parse_flags(["--model", "vit"])
    # An unset variable in a script (--ckpt-dir "$DIR") never turns the checkpoints off.
    for argv, needle in [
        (["--ckpt-dir", ""], "argument --ckpt-dir: empty; give a path, or leave the flag out"),
        (["--steps-per-call", "abc"], "argument --steps-per-call: give a whole number or auto"),
    ]:
        with pytest.raises(SystemExit) as stop:
            parse_flags(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and needle in err


def test_help_shows_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse_flags(["--help"])
    out = capsys.readouterr().out
    assert "--model {cnn,gpt,mlp,resnet18,resnet20,resnet50,seq2seq}" in out
    assert "--preset {digits-mlp,digits-cnn," in out
    # Listed by what a flag does: steps per call packs the step, the seed is no model's.
    groups = dict(re.findall(r"\n(\w+) flags:\n(.*?)(?=\n\w+ flags:|\Z)", out, re.S))
    assert "--steps-per-call" in groups["step"] and "--seed" in groups["seed"]
    assert "--seed" not in groups["model"] and "--steps-per-call" not in groups["layout"]


def test_a_preset_is_a_start_that_flags_override(capsys):
    assert parse_flags(["--preset", "digits-mlp"]) == jdp.TrainConfig()
    config = parse_flags(["--preset", "digits-resnet20", "--mesh", "data=1"])
    assert (config.model, config.lr, config.mesh) == ("resnet20", 1e-2, "data=1")
    # The README's runs, by name.
    assert parse_flags(["--preset", "numbers2words-gpt"]) == parse_flags(
        ["--model", "gpt", "--dataset", "numbers2words"]
    )
    with pytest.raises(SystemExit) as stop:
        parse_flags(["--preset", "imagenet"])
    assert stop.value.code == 2
    assert "unknown preset 'imagenet'; choose one of: digits-mlp" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_config(name):
    config = PRESETS[name]()
    assert isinstance(config, jdp.TrainConfig)
    assert dataclasses.replace(config) == config  # validates again


@pytest.mark.slow
def test_a_preset_trains(capsys):
    from jdp.train import main

    assert main(["--preset", "digits-cnn", "--mesh", "data=2", "--steps", "40"]) == 0
    assert "jdp: cnn small (" in capsys.readouterr().out


@pytest.mark.parametrize(
    "command", ["jdp.train", "jdp.launch", "jdp.plot", "jdp.data", "jdp.bench", "jdp.bench step"]
)
def test_help_reads_as_plain_text(command):
    from helpers import run_python

    result = run_python("-m", *command.split(), "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout and "(default: None)" not in result.stdout
    assert "multihost-worker" not in result.stdout


@pytest.mark.parametrize(
    ("command", "flags", "said"),
    [
        (
            "jdp.data.__main__",
            ["pack"],
            "jdp.data pack: error: the following arguments are required: ",
        ),
        ("jdp.bench.__main__", ["nope"], "jdp.bench: error: argument "),
        ("jdp.plan", ["--bogus"], "jdp.plan: error: unrecognized arguments: --bogus"),
        ("jdp.plan", ["--seq-len", "-5"], "jdp.plan: error: --seq-len must be in [1, 2**31), "),
        ("jdp.plan", ["--vocab-size", str(10**10)], "--vocab-size must be in [1, 2**31)"),
        ("jdp.replay", [], "jdp.replay: error: the following arguments are required: "),
        ("jdp.launch", ["--nproc", "x", "--", "ls"], "jdp.launch: error: argument --nproc: "),
        ("jdp.launch", ["--nproc", str(10**6), "--", "ls"], "more processes than this machine's"),
    ],
)
def test_every_tools_usage_error_is_one_line(command, flags, said):
    result = run_tool(command, *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and lines[0].endswith("(see --help)"), lines


def _unsectioned(cls) -> list[str]:
    return [
        field.name
        for field in dataclasses.fields(cls)
        if not isinstance(field.metadata.get("section"), config.Section)
    ]


def test_every_config_field_declares_its_section():
    assert _unsectioned(jdp.TrainConfig) == []
    planted = dataclasses.make_dataclass(
        "Planted", [("new_flag", int, 0)], bases=(jdp.TrainConfig,), frozen=True
    )
    assert _unsectioned(planted) == ["new_flag"]
    # What the run reads by kind of field is derived from the sections.
    assert set(config.fields_of(resumable=True)) == config.TOPOLOGY_FIELDS
    assert "mesh" in config.TOPOLOGY_FIELDS and "lr" not in config.TOPOLOGY_FIELDS
    assert config.DILOCO_FIELDS == ("sync_every", "outer_optimizer", "outer_lr", "outer_momentum")
    assert set(config.fields_of(per_process=True)) == {
        "coordinator",
        "num_processes",
        "process_id",
        "startup_timeout",
        "data_dir",
        "loader_workers",
        "prefetch",
        "data_on_device",
        "compile_cache",
    }


def test_a_gpt_reshaped_by_its_flags_is_named_so():
    """The run's first lines name the model: a size's name alone would be wrong."""
    from jdp.models.registry import GPT_SHAPE

    assert config.GPT_SHAPE == GPT_SHAPE  # the config may not import the registry
    assert jdp.TrainConfig(model="gpt").model_label == "gpt small"
    reshaped = jdp.TrainConfig(model="gpt", model_size="124m", layers=2, width=64)
    assert reshaped.model_label == "gpt 124m with --layers 2 --width 64"
