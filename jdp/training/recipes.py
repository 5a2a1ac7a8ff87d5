"""Recipes: named runs with the result they are expected to reach (``--recipe NAME``).

A recipe is a TOML file (``jdp/recipes/NAME.toml``, or any path): a ``[recipe]``
table first, stating the command, the metric of the run's summary line and its
expected final value, the wall time and the hardware it was measured on, and
whether it was (``status = "measured"``) or is still open (``"open: why"``); then
``[flags]``, the `TrainConfig` fields it sets (other flags override them); then
``[smoke]``, the fields its smoke form changes so it runs in seconds (the tests
run every recipe's smoke form). Each value is read as its flag is: a key no flag
is, a key outside its table, or a value of the wrong type is refused, naming it.
A layer that sets ``steps`` and not ``epochs`` turns the layers' ``epochs`` off:
the command line always wins. A measured recipe names the README figures row
that checks it (``checked_by``): its configuration is the row's and its expected
value the row's figure, both held by the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import tomllib
import types
import typing
from typing import Any, Literal

from jdp.errors import UsageError, check_input_file
from jdp.training.config import TrainConfig

# What a recipe's [recipe] table states (checked_by only when measured).
STATEMENT = ("command", "metric", "expected", "wall", "hardware", "status")
# What else it may state: the metric's tolerance, the row that checks it, a throughput.
OPTIONAL = ("tolerance", "checked_by", "throughput")
TABLES = ("recipe", "flags", "smoke")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    statement: dict[str, Any]  # the [recipe] table
    flags: dict[str, Any]
    smoke: dict[str, Any]

    @property
    def measured(self) -> bool:
        return self.statement["status"] == "measured"

    def config(self, *, smoke: bool = False, **overrides: Any) -> TrainConfig:
        """The recipe's `TrainConfig` (its smoke form), ``overrides`` applied last."""
        return TrainConfig(**layered(self.flags, self.smoke if smoke else {}, overrides))


def layered(*layers: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``layers``, each over the ones before: a layer that sets ``steps``
    without ``epochs`` turns ``epochs`` off (a recipe's epochs would beat its steps).

    Examples:
        >>> layered({"epochs": 90, "lr": 0.1}, {"steps": 2})
        {'epochs': 0, 'lr': 0.1, 'steps': 2}
    """
    fields: dict[str, Any] = {}
    for layer in layers:
        if "steps" in layer and "epochs" not in layer and fields.get("epochs"):
            fields["epochs"] = 0
        fields.update(layer)
    return fields


def recipe_line(recipe: Recipe, given: dict[str, Any]) -> str:
    """What a run from ``recipe`` says first: what the recipe set, and what the command
    line (``given``) overrode.

    Examples:
        >>> recipe_line(load_recipe("imagenet-resnet50"), {"steps": 2, "lr": 0.2})[-84:]
        'the command line overrides lr=0.2 (was 0.1); sets steps=2, which turns epochs=90 off'
    """

    def settings(fields: dict[str, Any]) -> str:
        return " ".join(f"{key}={_plain(value)}" for key, value in fields.items())

    line = f"jdp: recipe {recipe.name} sets {settings(recipe.flags)}"
    overrode = {key: value for key, value in given.items() if key in recipe.flags}
    if overrode:
        was = ", ".join(_plain(recipe.flags[key]) for key in overrode)
        line += f"; the command line overrides {settings(overrode)} (was {was})"
    added = {key: value for key, value in given.items() if key not in recipe.flags}
    if added:
        line += f"; {'sets' if overrode else 'the command line sets'} {settings(added)}"
    if "steps" in given and "epochs" not in given and recipe.flags.get("epochs"):
        line += f", which turns epochs={recipe.flags['epochs']} off"
    return line


def recipe_names() -> list[str]:
    """The recipes jdp ships, by name."""
    folder = importlib.resources.files("jdp") / "recipes"
    return sorted(
        entry.name[: -len(".toml")] for entry in folder.iterdir() if entry.name.endswith(".toml")
    )


def load_recipe(name: str) -> Recipe:
    """The recipe ``name`` (one of `recipe_names`) or at the path ``name`` (a .toml file).

    Raises:
        UsageError: an unknown name, or a file that is not a recipe (named).

    Examples:
        >>> recipe = load_recipe("digits-mlp")
        >>> recipe.statement["metric"], recipe.config().mesh, recipe.config(smoke=True).steps
        ('test_accuracy', 'data=8', 20)
    """
    if name.endswith(".toml") or os.sep in name:
        path, text = name, _read(name)
    elif name in recipe_names():
        path = f"jdp/recipes/{name}.toml"
        text = (importlib.resources.files("jdp") / "recipes" / f"{name}.toml").read_text()
    else:
        raise UsageError(
            f"unknown recipe {name!r}; choose one of: {', '.join(recipe_names())}, or give "
            "the path of a .toml recipe"
        )
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"recipe {path}: not TOML ({error})") from None
    _check_tables(tables, path)
    flags, smoke = (
        {key: _value(path, table, key, value) for key, value in tables.get(table, {}).items()}
        for table in ("flags", "smoke")
    )
    recipe = Recipe(
        os.path.basename(path).removesuffix(".toml"), tables.get("recipe", {}), flags, smoke
    )
    _check(recipe, path)
    if "flags" not in tables:
        raise UsageError(f"recipe {path}: no [flags] table; put the flags it sets under [flags]")
    return recipe


def _check_tables(tables: dict[str, Any], path: str) -> None:
    """Tables and keys where a recipe holds them: a flag outside [flags] (a forgotten
    header puts it in the table above) is refused, not left out."""
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    for key, value in tables.items():
        if key in TABLES and isinstance(value, dict):
            continue
        where = f"sets {key} outside its tables" if key in fields else f"holds {key!r}"
        raise UsageError(
            f"recipe {path}: {where}; a recipe holds the tables [recipe], [flags] (the "
            "flags it sets) and [smoke]"
        )
    for table in ("flags", "smoke"):
        held = tables.get(table, {})
        if "steps" in held and held.get("epochs"):
            raise UsageError(
                f"recipe {path}: [{table}] sets both steps and epochs, and epochs would decide "
                "the run's length; keep one"
            )
    for key in tables.get("recipe", {}):
        if key in fields:
            raise UsageError(
                f"recipe {path}: [recipe] sets {key}, a flag; put it under [flags] (the "
                "[flags] header is missing above it, or it sits above that header)"
            )
        if key not in STATEMENT + OPTIONAL:
            raise UsageError(
                f"recipe {path}: [recipe] states {key!r}; it states "
                f"{', '.join(STATEMENT + OPTIONAL)}"
            )


@functools.cache
def _hints() -> dict[str, Any]:
    """`TrainConfig`'s field types, resolved once (each recipe key is read by one)."""
    return typing.get_type_hints(TrainConfig)


def _value(path: str, table: str, key: str, value: Any) -> Any:
    """``value`` as the flag ``key`` takes it (an int where a float belongs is a float),
    or a UsageError naming the table, the key and what it takes."""
    hint = _hints().get(key)
    if hint is None:
        return value  # an unknown key: _check names it with the others
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value == "":  # as an empty flag value: none
            return None
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    flag = f"--{key.replace('_', '-')}"
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value in choices:
            return value
        wants = "one of " + ", ".join(f'"{choice}"' for choice in choices)
    elif hint is bool:
        if isinstance(value, bool):
            return value
        wants = "true or false"
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        wants = "an integer"
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        wants = "a number"
    elif isinstance(value, str):
        return value
    else:
        wants = 'a string in quotes (as "data=8")'
    raise UsageError(
        f"recipe {path}: [{table}] {key} = {_toml(value)} is not what {flag} takes; give {wants}"
    )


def _plain(value: Any) -> str:
    """A value as a flag takes it: true/false, a string without its quotes."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _toml(value: Any) -> str:
    """A value as the recipe wrote it (TOML, not Python)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _read(path: str) -> str:
    check_input_file(path, "recipe")
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as error:
        raise UsageError(f"recipe {path}: not readable ({error.strerror})") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8 (a Latin-1 editor's é is not)
        raise UsageError(
            f"recipe {path}: not UTF-8 text (byte {error.start}); save it as UTF-8"
        ) from None


def _check(recipe: Recipe, path: str) -> None:
    missing = [key for key in STATEMENT if key not in recipe.statement]
    if missing:
        raise UsageError(f"recipe {path}: its [recipe] table states no {', '.join(missing)}")
    status = recipe.statement["status"]
    if status != "measured" and not str(status).startswith("open"):
        raise UsageError(f"recipe {path}: status {status!r}; give measured or open: WHY")
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    for table in ("flags", "smoke"):
        unknown = sorted(set(getattr(recipe, table)) - fields)
        if unknown:
            raise UsageError(
                f"recipe {path}: [{table}] sets {', '.join(unknown)}, which no flag is "
                "(a field of jdp.TrainConfig, as --batch-size is batch_size)"
            )
