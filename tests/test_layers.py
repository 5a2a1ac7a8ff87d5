"""The package's layers, held by a test: what may import what, and how big a unit may grow.

A module belongs to one layer and imports only from its own layer or lower ones:

    ground < library < services < training < tools

- ground: errors, the version and the tools' answer to bad input, importing only each other;
- library: the mesh, layouts, precision, optimizers, the state, actions and the step;
- services: report, data, models, checkpoints, processes and inference;
- training: the only readers of ``TrainConfig`` (config, flags, presets, the run, ``fit``);
- tools: the command-line tools and the public face, ``jdp/__init__.py``.

Every import counts, inside functions and under ``TYPE_CHECKING`` too. Beyond the
layers: no import cycles, between modules or between packages (``jdp.diloco`` may build
on nothing that builds on it: a top-level module is a package of its own here), no
``import jdp`` (the public face) inside the package, and no private name (``_x``) taken
from a module of another package.
"""

import ast
import io
import pathlib
import tokenize
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "jdp"
TOOLS = PACKAGE.parent / "tools"
ORDER = ("ground", "library", "services", "training", "tools")
# A module's layer, by its name below jdp (the longest listed prefix decides).
LAYERS = {
    "errors": "ground", "version": "ground", "lazy": "ground", "tool": "ground",
    "mesh": "library", "mesh_spec": "library", "layout": "library", "layout_checks": "library",
    "precision": "library",
    "optim": "library", "rngs": "library",
    "state": "library", "actions": "library", "step": "library", "replica": "library",
    "replica_eval": "library",
    "reduce": "library", "diloco": "library",
    "report": "services", "data": "services", "models": "services", "checkpoint": "services",
    "distributed": "services",
    "inference": "services", "collectives": "services", "sampling": "services",
    "training": "training",
    "train": "tools", "plan": "tools", "plan_costs": "tools", "plan_stand_ins": "tools",
    "launch": "tools", "plot": "tools",
    "bench": "tools", "sample": "tools", "export": "tools", "on_ray": "tools", "replay": "tools",
    "replay_step": "tools",
    "data.__main__": "tools", "": "tools",
}  # fmt: skip
# Units that read in one sitting: a module of at most 400 lines, a function of at most
# 80 (docstring included), counted as the formatter writes them (CI runs `ruff format
# --check`). A unit of one concept may be longer: it is listed here with its length,
# which it may not exceed, and why it stays whole.
MODULE_LINES, FUNCTION_LINES = 400, 80
FIT_LINES = 60  # the loop a reader reads first
OVER_TODAY: dict[str, int] = {
    # TrainConfig: a field per flag in its sections, and the values read from them.
    "jdp/training/config.py": 472,
    # The run built in the order each part needs the last; messages, parts and the
    # config's optimizer are apart.
    "jdp/training/run.py": 438,
    "jdp/training/run.py::build": 111,
    # The public builders: their docstrings are the contract (the bodies are 38 and 42).
    "jdp/step/builders.py::make_train_step": 105,
    "jdp/state.py::create_train_state": 97,
    # GPT-2's names both ways: reading and writing share the one table of names.
    "jdp/models/hf.py": 411,
    # One comparison: jdp's run and Keras's fit on the same batches, each in its process.
    "jdp/bench/keras.py": 405,
    # The GPU run's training parts: the matrix rate, GPT-2's cells and ResNet-50.
    "jdp/bench/gpu_models.py": 420,
}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``jdp/data/splits/sources.py`` -> ``data.sources``; ``jdp/__init__.py`` -> ``""``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(name: str) -> str | None:
    prefixes = [key for key in LAYERS if name == key or name.startswith(key + ".")]
    return LAYERS[max(prefixes, key=len)] if prefixes else LAYERS.get(name)


def _lazy_imports(node: ast.AST) -> Iterator[tuple[str, str, int]]:
    """What a face built with ``lazy.attach(__name__, {module: names}, submodules=...)``
    imports on first use, as if it were imported at once."""
    func = node.func if isinstance(node, ast.Call) else None
    if not (isinstance(func, ast.Attribute) and func.attr == "attach" and len(node.args) == 2):
        return
    table = node.args[1]
    for key, names in zip(table.keys, table.values, strict=True):
        for name in names.elts:
            yield key.value.removeprefix("jdp").lstrip("."), name.value, node.lineno


def imports(name: str, source: str, known: set[str]) -> Iterator[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for each jdp import in a module,
    the names a lazy face imports on first use included."""
    package = name.rsplit(".", 1)[0] if "." in name else ""
    for node in ast.walk(ast.parse(source)):
        yield from _lazy_imports(node)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "jdp" or alias.name.startswith("jdp."):
                    yield alias.name.removeprefix("jdp").lstrip("."), "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "jdp" or (node.module or "").startswith("jdp."):
                target = node.module.removeprefix("jdp").lstrip(".")
            else:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}".lstrip(".")
                if submodule in known:
                    yield submodule, "", node.lineno
                else:
                    yield target, alias.name, node.lineno


# Packages in wings, each wing a face the rest of jdp imports (jdp/data: formats, splits
# and order, the loader); inside the package the wings' modules import each other.
WINGED = ("data",)


def _wing_module(target: str) -> tuple[str, str] | None:
    """(package, package.wing) where ``target`` is a module inside a wing of a `WINGED`
    package (``data.loader.pipeline``); else None."""
    parts = target.split(".")
    if len(parts) >= 3 and parts[0] in WINGED:
        return parts[0], f"{parts[0]}.{parts[1]}"
    return None


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule in ``sources`` (module name -> its source), one line each."""
    known = set(sources)
    found, edges = [], {name: set() for name in sources}
    for name, source in sources.items():
        layer = layer_of(name)
        if layer is None:
            found.append(f"jdp.{name} has no layer: add it to LAYERS")
            continue
        own_package = name.rsplit(".", 1)[0] if "." in name else None
        for target, imported, line in imports(name, source, known):
            where = f"jdp.{name}:{line}"
            if target == "" and not imported.startswith("__"):
                found.append(f"{where} imports jdp, the public face, from inside the package")
                continue
            if target in known:
                edges[name].add(target)
            target_layer = layer_of(target)
            if target_layer and ORDER.index(target_layer) > ORDER.index(layer):
                found.append(f"{where} ({layer}) imports jdp.{target} ({target_layer})")
            target_package = target.rsplit(".", 1)[0] if "." in target else None
            private = imported.startswith("_") and not imported.startswith("__")
            if private and (own_package is None or own_package != target_package):
                found.append(f"{where} takes jdp.{target}.{imported}, a private name")
            wing = _wing_module(target)
            if wing and name != wing[0] and not name.startswith(f"{wing[0]}."):
                found.append(f"{where} reaches into jdp.{target}: import its face, jdp.{wing[1]}")
    found.extend(f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(edges))
    for cycle in _cycles(_package_edges(edges)):
        found.append(f"packages import each other: {' -> '.join(cycle)}")
    return found


def _package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between packages below jdp (``data.sources`` is ``data``); the
    public face, which imports everything, is left out."""
    found = {name.split(".")[0]: set() for name in edges if name}
    for name, targets in edges.items():
        if name:
            own = name.split(".")[0]
            found[own] |= {target.split(".")[0] for target in targets if target} - {own}
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected part of the import graph that has one."""
    cycles, done = [], set()
    for start in sorted(edges):
        stack, path, on_path = [(start, iter(sorted(edges[start])))], [start], {start}
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(path.pop())
                done.add(node)
            elif child in on_path:
                cycle = [*path[path.index(child) :], child]
                if not any(set(cycle) <= set(seen) for seen in cycles):
                    cycles.append(cycle)
            elif child not in done and child in edges:
                stack.append((child, iter(sorted(edges[child]))))
                path.append(child)
                on_path.add(child)
    return cycles


def _sources(root: pathlib.Path = PACKAGE) -> dict[str, str]:
    return {module_name(path, root): path.read_text() for path in sorted(root.rglob("*.py"))}


def test_the_package_keeps_its_layers():
    assert violations(_sources()) == []


@pytest.mark.parametrize(
    ("module", "planted", "expected"),
    [
        (
            "mesh",
            "from jdp.training.run import fit",
            "jdp.mesh:1 (library) imports jdp.training.run (training)",
        ),
        ("errors", "import jdp.mesh", "jdp.errors:1 (ground) imports jdp.mesh (library)"),
        ("step", "from jdp import checkpoint", "(library) imports jdp.checkpoint (services)"),
        (
            "models.cnn",
            "def f():\n    from jdp.training.loop import fit",
            "imports jdp.training.loop (training)",
        ),
        ("checkpoint", "import jdp", "jdp.checkpoint:1 imports jdp, the public face"),
        ("bench.memory", "from jdp.plan import _x", "takes jdp.plan._x, a private name"),
        ("mesh", "from jdp.state import TrainState", "import cycle: "),
        ("diloco.outer", "from jdp.step.contract import bounded", "packages import each other: "),
        ("wheel", "", "jdp.wheel has no layer"),
        (
            "training.run",
            "from jdp.data.loader.pipeline import train_batches",
            "reaches into jdp.data.loader.pipeline: import its face, jdp.data.loader",
        ),
        (
            "mesh",
            'from jdp import lazy\nlazy.attach(__name__, {"jdp.training.loop": ("fit",)})',
            "jdp.mesh:2 (library) imports jdp.training.loop (training)",
        ),
    ],
)
def test_a_planted_violation_fails(module, planted, expected):
    sources = _sources()
    sources[module] = planted + "\n" + sources.get(module, "")
    assert any(expected in line for line in violations(sources)), violations(sources)


def _long_units() -> dict[str, int]:
    """Modules over MODULE_LINES and functions over FUNCTION_LINES, with their lengths: the
    package's, and the project's tooling beside it (``tools/``)."""
    found = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *TOOLS.rglob("*.py")]):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent).as_posix()
        if len(text.splitlines()) > MODULE_LINES:
            found[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    found[f"{name}::{node.name}"] = length
    return found


def test_fit_reads_in_one_sitting():
    source = (PACKAGE / "training" / "loop.py").read_text()
    (fit,) = (
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "fit"
    )
    assert fit.end_lineno - fit.lineno + 1 <= FIT_LINES


def test_no_unit_grows_past_its_limit():
    grown = {
        unit: (length, OVER_TODAY.get(unit))
        for unit, length in _long_units().items()
        if length > OVER_TODAY.get(unit, MODULE_LINES if "::" not in unit else FUNCTION_LINES)
    }
    assert grown == {}, f"(lines now, allowed) of each unit over its limit: split them: {grown}"


# What a literal table's rows are made of: constants, names, calls of them (a row's type).
_TABLE_NODES = (
    ast.Constant,
    ast.Name,
    ast.Attribute,
    ast.Call,
    ast.keyword,
    ast.Dict,
    ast.List,
    ast.Tuple,
    ast.BinOp,
    ast.UnaryOp,
    ast.operator,
    ast.unaryop,
    ast.expr_context,
)


def _unformatted(source: str) -> list[int]:
    """The lines of ``source`` that keep the formatter out (``# fmt: skip``, ``off``)
    anywhere but at the end of a literal table: a module's or class's constant dict,
    list or tuple over several lines, whose rows a reader reads across."""
    tree = ast.parse(source)
    tables = set()
    for node in [
        *tree.body,
        *(n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body),
    ]:
        value = getattr(node, "value", None)
        literal = isinstance(value, ast.Dict | ast.List | ast.Tuple) and all(
            isinstance(leaf, _TABLE_NODES) for leaf in ast.walk(value)
        )
        if literal and value.end_lineno > value.lineno:
            tables.add(node.end_lineno)
    comments = (
        token
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    )
    return [
        token.start[0]
        for token in comments
        if token.string.replace(" ", "").startswith(("#fmt:", "#yapf:"))
        and not (token.string.endswith("fmt: skip") and token.start[0] in tables)
    ]


def test_the_formatter_formats_all_but_literal_tables():
    roots = [PACKAGE, TOOLS, PACKAGE.parent / "tests", PACKAGE.parent / "examples"]
    found = {
        path.relative_to(PACKAGE.parent).as_posix(): lines
        for root in roots
        for path in sorted(root.rglob("*.py"))
        if (lines := _unformatted(path.read_text()))
    }
    assert found == {}, f"lines the formatter may not touch, outside literal tables: {found}"


def test_a_marker_outside_a_table_is_found():
    source = (
        "TABLE = {\n    'a': 1,\n}  # fmt: skip\n"
        "def f():\n    rows = [\n        1,\n    ]  # fmt: skip\n"
        "x = compute(\n    1,\n)  # fmt: skip\n"
        "# fmt: off\n"
    )
    assert _unformatted(source) == [7, 10, 11]


def _handlers(source: str) -> list[str]:
    """The function around each ``except`` of ``source``, and each one-element list
    assigned to a name (closure state such as ``switched = [False]``)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, ast.FunctionDef):
                inner = child.name if function == "<module>" else f"{function}.{child.name}"
            if isinstance(child, ast.ExceptHandler):
                found.append(f"except in {function}")
            if (
                isinstance(child, ast.Assign)
                and isinstance(child.value, ast.List)
                and len(child.value.elts) == 1
                and isinstance(child.value.elts[0], ast.Constant)
            ):
                found.append(f"one-element list in {function}")
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_the_step_picks_its_program_without_catching_errors():
    """The step chooses its program from the mesh and the state's placement: in
    jdp/step only the steps' calls catch an error, to say in one line why the
    arguments were refused (`as_step`, `lean.py`'s, `data_parallel_step`'s), or the function an
    axis name it does not bind (`bound_axes`, reading JAX's error in `unbound_axis`),
    and no one-element list holds closure state."""
    found = {
        f"{path.name}: {what}"
        for path in sorted((PACKAGE / "step").glob("*.py"))
        for what in _handlers(path.read_text())
    }
    assert found == {
        "contract.py: except in as_step.call",
        "lean.py: except in _runner.run",
        "adopt.py: except in _called.step",
        "axes.py: except in bound_axes.traced",
        "axes.py: except in unbound_axis.trace",
    }


def test_the_handler_check_sees_a_planted_switch():
    planted = "def program(state):\n    switched = [False]\n    try:\n        pass\n"
    planted += "    except ValueError:\n        switched[0] = True\n"
    assert _handlers(planted) == ["one-element list in program", "except in program"]
