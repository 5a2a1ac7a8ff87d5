"""Command-line flags, derived from `TrainConfig`'s fields and their types; ``--preset``.

Every field is a flag (``batch_size`` -> ``--batch-size``), parsed by its type:
``int``, ``float``, ``str``, a ``Literal`` of choices, ``bool`` (a switch, and its
``--no-`` form), or one of those or ``None`` (an empty value; refused for the paths in
`NEVER_EMPTY`). ``--preset NAME`` starts from a named configuration
(`jdp.training.presets`), ``--recipe NAME`` from a recipe, a run with its expected
result (`jdp.training.recipes`); flags given with either override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

from jdp.errors import UsageError
from jdp.training.config import TrainConfig
from jdp.training.presets import PRESETS
from jdp.training.recipes import layered, load_recipe, recipe_line, recipe_names


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as every jdp error is."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _parser_of(hint: Any) -> tuple[Callable[[str], Any], str | None]:
    """How to read a flag of type ``hint``: the conversion and a metavar (choices)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        read, metavar = _parser_of(inner)
        return (lambda text: read(text) if text else None), metavar
    if typing.get_origin(hint) is Literal:
        return str, "{" + ",".join(args) + "}"
    if int in args:  # a number, or one of a Literal's words (``int | Literal["auto"]``)
        (words,) = [typing.get_args(arg) for arg in args if arg is not int]

        def number_or_word(text: str) -> int | str:
            if text in words or text.lstrip("-").isdigit():
                return text if text in words else int(text)
            raise argparse.ArgumentTypeError(f"give a whole number or {' or '.join(words)}")

        return number_or_word, "{N," + ",".join(words) + "}"
    if hint in (int, float, str):
        return hint, None
    raise TypeError(f"TrainConfig field of type {hint!r} has no flag parser")


# The paths whose empty value (an unset variable in a script) would turn off what they
# name in silence: the checkpoints, the logs, the initialisation.
NEVER_EMPTY = ("ckpt_dir", "log_dir", "init_from")


def _not_empty(read: Callable[[str], Any]) -> Callable[[str], Any]:
    def path(text: str) -> Any:
        if not text.strip():
            raise argparse.ArgumentTypeError("empty; give a path, or leave the flag out")
        return read(text)

    return path


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=prog, description="Data-parallel training with jdp.")
    parser.add_argument(
        "--preset",
        metavar="{" + ",".join(PRESETS) + "}",
        help="start from a named configuration; the other flags override it",
    )
    parser.add_argument(
        "--recipe",
        metavar="{" + ",".join(recipe_names()) + "}|PATH.toml",
        help="start from a recipe, a run with its expected result (see docs/cli.md#recipes); "
        "the other flags override it",
    )
    hints = typing.get_type_hints(TrainConfig)
    sections = {}  # --help lists the flags by what they do
    for field in dataclasses.fields(TrainConfig):
        name = field.metadata["shown"]
        if name not in sections:
            sections[name] = parser.add_argument_group(f"{name} flags")
        group = sections[name]
        flag, hint = f"--{field.name.replace('_', '-')}", hints[field.name]
        if hint is bool:  # --no-FLAG too: a preset or recipe's switch can be turned off
            # (argparse reads any "--no-" flag as off: --no-resume stays a plain switch)
            negative = field.name.startswith("no_")
            action = "store_true" if negative else argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=None, help=field.metadata["help"])
            continue
        read, metavar = _parser_of(hint)
        if field.name in NEVER_EMPTY:
            read = _not_empty(read)
        help_text = field.metadata["help"]
        if field.default is not None and "default" not in help_text:
            help_text += f" (default: {field.default})"
        group.add_argument(flag, type=read, metavar=metavar, help=help_text)
    return parser


def parse_flags(argv: Sequence[str] | None = None, *, prog: str = "jdp.train") -> TrainConfig:
    """Parses command-line flags (``--batch-size 256``) into a `TrainConfig`.

    Examples:
        >>> parse_flags(["--preset", "digits-cnn", "--steps", "100"]).model
        'cnn'
    """
    return parse_command(argv, prog=prog)[0]


def parse_command(
    argv: Sequence[str] | None = None, *, prog: str = "jdp.train"
) -> tuple[TrainConfig, list[str]]:
    """`parse_flags`, and the lines a run starts with to say where its settings came
    from (a recipe's, and which of them the command line overrode)."""
    parser = _parser(prog)
    args = vars(parser.parse_args(argv))
    preset, recipe = args.pop("preset"), args.pop("recipe")
    if preset is not None and preset not in PRESETS:
        parser.error(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if preset is not None and recipe is not None:
        parser.error("give --preset or --recipe, not both")
    given = {name: value for name, value in args.items() if value is not None}
    if given.get("epochs") and "steps" in given:
        parser.error("give --epochs or --steps, not both")
    if recipe is None:
        base = PRESETS[preset]() if preset else TrainConfig()
        return dataclasses.replace(base, **layered({"epochs": base.epochs}, given)), []
    try:
        loaded = load_recipe(recipe)
        config = TrainConfig(**layered(loaded.flags, given))
    except UsageError as error:
        parser.error(str(error))
    return config, [recipe_line(loaded, given)]
