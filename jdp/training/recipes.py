"""Recipes: named runs with the result they are expected to reach (``--recipe NAME``).

A recipe is a TOML file (``jdp/recipes/NAME.toml``, or any path): a ``[recipe]``
table first, stating the command, the metric of the run's summary line and its
expected final value, the wall time and the hardware it was measured on, and
whether it was (``status = "measured"``) or is still open (``"open: why"``); then
``[flags]``, the `TrainConfig` fields it sets (other flags override them); then
``[smoke]``, the fields its smoke form changes so it runs in seconds (the tests
run every recipe's smoke form). A measured recipe names the README figures row
that checks it (``checked_by``): its configuration is the row's and its expected
value the row's figure, both held by the tests.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import tomllib
from typing import Any

from jdp.errors import UsageError
from jdp.training.config import TrainConfig

# What a recipe's [recipe] table states (checked_by only when measured).
STATEMENT = ("command", "metric", "expected", "wall", "hardware", "status")


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
        return TrainConfig(**{**self.flags, **(self.smoke if smoke else {}), **overrides})


def recipe_names() -> list[str]:
    """The recipes jdp ships, by name."""
    folder = importlib.resources.files("jdp") / "recipes"
    return sorted(entry.name[: -len(".toml")] for entry in folder.iterdir()
                  if entry.name.endswith(".toml"))  # fmt: skip


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
    recipe = Recipe(
        os.path.basename(path).removesuffix(".toml"),
        tables.get("recipe", {}),
        tables.get("flags", {}),
        tables.get("smoke", {}),
    )
    _check(recipe, path)
    return recipe


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError as error:
        raise UsageError(f"recipe {path}: not readable ({error.strerror})") from None


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
