"""``python -m tools.bundle DIR``: the wheels an offline machine needs to run jdp.

Run on a machine with a network, for a target without one (an air-gapped cluster,
a locked cloud image)::

    python -m tools.bundle DIR --have FREEZE --python 3.12 \\
        --platform manylinux_2_28_x86_64

``FREEZE`` is the target's ``pip freeze`` or ``pip list`` output. jdp's
dependencies are resolved for the target's Python and platform by pip's own
resolver (``pip install --dry-run --report``), the packages the target already
has pinned at its versions; DIR then gets jdp's wheel and the wheels of every
package in that closure the target lacks, and nothing else. On the target::

    pip install --no-index --find-links DIR jdp

``--resolve-only`` prints the packages the target lacks without downloading;
with ``--offline`` the closure is read from this environment's installed
packages instead of pip's resolver (what the test suite checks, with no network).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence

from jdp.errors import UsageError, check_input_file
from jdp.tool import command
from tools import command_line

LIMIT_MB = 60  # what a bundle carried to a GPU machine may weigh


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(text: str) -> dict[str, str]:
    """``{name: version}`` from ``pip freeze`` (``name==1.0``, ``name @ URL``) or
    ``pip list`` (its table, or ``name (1.0)``) output; ``""`` where no version is given."""
    have: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-")) or set(line) <= set("- "):
            continue
        if "==" in line:
            name, version = line.split("==", 1)
        elif " @ " in line:
            name, version = line.split(" @ ", 1)[0], ""
        elif line.endswith(")") and " (" in line:
            name, version = line[:-1].split(" (", 1)
        else:
            words = line.split()
            if words[0].lower() == "package":
                continue
            name, version = words[0], (words[1] if len(words) > 1 else "")
        have[normalize(name.strip())] = version.strip()
    return have


def platforms(platform: str) -> list[str]:
    """``platform`` and the older manylinux tags a machine of it also runs (pip
    matches each tag exactly, so each is named)."""
    found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not found:
        return [platform]
    newest, arch = int(found.group(1)), found.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(newest, 4, -1)]
    aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{alias}_{arch}" for n, alias in aliases.items() if n <= newest]


def jdp_requirements() -> list[str]:
    """jdp's own dependencies (no extras), as its installed metadata states them."""
    required = importlib.metadata.requires("jdp") or []
    return [line for line in required if "extra ==" not in line]


def _target_flags(python: str, platform: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in platforms(platform):
        flags += ["--platform", tag]
    return flags


def pip_closure(
    requirements: list[str], python: str, platform: str, have: dict[str, str], built: str
) -> dict[str, str]:
    """``{name: version}`` of every package ``requirements`` need on the target, by pip's
    resolver; the packages the target has are pinned at its versions (their local
    labels, ``+cu130``, dropped). A dependency published only as source (``promise``,
    which TFDS needs) is built here into a wheel in ``built``, which must then be
    pure Python (``py3-none-any``) to run on the target."""
    pins: list[str] = []
    pinned = False
    while True:  # the closure; again with each source-only package built; with the pins
        with tempfile.TemporaryDirectory() as scratch:
            report = os.path.join(scratch, "report.json")
            constraints = os.path.join(scratch, "constraints.txt")
            pathlib.Path(constraints).write_text("\n".join(pins) + "\n")
            command = [
                sys.executable,
                *"-m pip install --dry-run --ignore-installed --quiet".split(),
                "--report",
                report,
                "-c",
                constraints,
                "--find-links",
                built,
                "--target",
                os.path.join(scratch, "target"),
                *_target_flags(python, platform),
                *requirements,
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                source_only = re.search(
                    r"No matching distribution found for ([\w.-]+)", done.stderr
                )
                if source_only and build_pure_wheel(source_only.group(1), built):
                    continue
                said = [
                    line
                    for line in done.stderr.splitlines()
                    if line.strip() and not line.startswith("WARNING")
                ]
                where = "with the target's versions pinned" if pinned else "for the target"
                raise UsageError(
                    f"pip could not resolve jdp's dependencies {where}: " + " / ".join(said[-3:])
                )
            installs = json.loads(pathlib.Path(report).read_text())["install"]
        closure = {
            normalize(item["metadata"]["name"]): item["metadata"]["version"] for item in installs
        }
        if pinned:
            return closure
        pins = [f"{name}=={have[name].split('+')[0]}" for name in closure if have.get(name)]
        pinned = True
        if not pins:
            return closure


def build_pure_wheel(name: str, directory: str) -> bool:
    """Builds ``name``'s newest release from source into ``directory``; False when it
    cannot be built here or the wheel is not pure Python (it would not run there)."""
    os.makedirs(directory, exist_ok=True)
    before = set(os.listdir(directory))
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", directory, name]
    if subprocess.run(command, capture_output=True, timeout=900).returncode != 0:
        return False
    new = set(os.listdir(directory)) - before
    if all(wheel.endswith("-none-any.whl") for wheel in new) and new:
        return True
    for wheel in new:
        os.remove(os.path.join(directory, wheel))
    return False


def local_closure(requirements: list[str], python: str) -> dict[str, str]:
    """``{name: version}`` of the closure of ``requirements`` among this environment's
    installed packages, markers read for the target's Python and for the extras each
    package was asked with (``etils[epath]`` brings ``fsspec``); no network."""
    from packaging.requirements import Requirement

    environment = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python}
    closure: dict[str, str] = {}
    expanded: dict[str, set[str]] = {}  # each package's extras already followed
    pending = [(line, ("",)) for line in requirements]  # a requirement, its asker's extras
    while pending:
        line, extras = pending.pop()
        requirement = Requirement(line)
        marker = requirement.marker
        if marker and not any(marker.evaluate(environment | {"extra": e}) for e in extras):
            continue
        name = normalize(requirement.name)
        wanted = {"", *requirement.extras} - expanded.setdefault(name, set())
        if not wanted:
            continue
        try:
            distribution = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            raise UsageError(
                f"{requirement.name} is not installed here; resolve without "
                "--offline (pip's resolver, over the network)"
            ) from None
        closure[name] = distribution.version
        expanded[name] |= wanted
        pending += [(dependency, tuple(wanted)) for dependency in distribution.requires or []]
    return closure


def lacking(closure: dict[str, str], have: dict[str, str]) -> dict[str, str]:
    """The packages of ``closure`` that the target has none of."""
    return {name: version for name, version in sorted(closure.items()) if name not in have}


def source_root() -> pathlib.Path:
    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise UsageError(
            "tools.bundle builds jdp's wheel from its source: run it from a checkout of jdp"
        )
    return root


def write_bundle(directory: str, missing: dict[str, str], python: str, platform: str) -> list[str]:
    """jdp's wheel and ``missing``'s wheels into ``directory`` (which may hold the pure
    wheels built while resolving); the files' lines to print."""
    os.makedirs(directory, exist_ok=True)
    present = {normalize(path.name.split("-")[0]) for path in pathlib.Path(directory).glob("*.whl")}
    missing = {name: version for name, version in missing.items() if name not in present}
    build = [
        sys.executable,
        *"-m pip wheel --quiet --no-deps -w".split(),
        directory,
        str(source_root()),
    ]
    subprocess.run(build, check=True, timeout=900)
    if missing:
        download = [
            sys.executable,
            *"-m pip download --quiet --no-deps -d".split(),
            directory,
            *_target_flags(python, platform),
            *(f"{name}=={version}" for name, version in missing.items()),
        ]
        subprocess.run(download, check=True, timeout=900)
    files = sorted(pathlib.Path(directory).glob("*.whl"))
    return [f"  {path.name}  {path.stat().st_size / 1e6:.2f} MB" for path in files]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundle",
        metavar="DIR",
        nargs="?",
        default="",
        help="the folder the wheels an offline target needs are written into",
    )
    parser.add_argument(
        "--resolve-only",
        action="store_true",
        help="print the packages the target lacks, download nothing",
    )
    parser.add_argument(
        "--have",
        metavar="FREEZE",
        default="",
        help="the target's `pip freeze` or `pip list` output (a file)",
    )
    parser.add_argument("--python", default="3.12", help="the target's Python version")
    parser.add_argument(
        "--platform", default="manylinux_2_28_x86_64", help="the target's newest wheel platform tag"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="read the closure from this environment's packages, not pip's",
    )


# The Pythons jdp runs on (pyproject.toml's requires-python, to the newest released).
PYTHONS = ("3.11", "3.12", "3.13", "3.14")


def _check_target(python: str, platform: str, offline: bool) -> None:
    """A target pip can resolve for: a Python jdp runs on and a wheel platform tag; with
    ``--offline`` (this environment's packages) only this machine's kind of platform,
    whose wheels those are."""
    if ".".join(python.split(".")[:2]) not in PYTHONS or not re.fullmatch(
        r"3\.\d+(\.\d+)?", python
    ):
        raise UsageError(f"--python {python!r}: give a Python jdp runs on: {', '.join(PYTHONS)}")
    if not re.fullmatch(r"[a-z0-9_]+", platform):
        raise UsageError(
            f"--platform {platform!r}: give a wheel platform tag, e.g. manylinux_2_28_x86_64"
        )
    here = sysconfig.get_platform().replace("-", "_").replace(".", "_")  # linux_x86_64
    system, _, machine = here.partition("_")
    kinds = ("manylinux", "linux") if system == "linux" else (system,)
    if offline and not (platform.startswith(kinds) and platform.endswith(machine)):
        raise UsageError(
            f"--offline reads this machine's installed packages ({here}), which cannot speak "
            f"for --platform {platform}; resolve without --offline (pip's resolver, over the "
            "network)"
        )


def run(args: argparse.Namespace) -> int:
    if not (args.bundle or args.resolve_only):
        raise UsageError("give DIR, the folder the wheels go into, or --resolve-only")
    if not args.have:
        raise UsageError(
            "--have FREEZE: the target's `pip freeze` or `pip list` output, saved "
            "to a file there (an empty file for a bare Python)"
        )
    if not os.path.exists(args.have):
        raise UsageError(f"--have {args.have}: no such file")
    check_input_file(args.have, "--have")
    try:
        have = read_have(pathlib.Path(args.have).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(
            f"--have {args.have} is not text: give the target's `pip freeze` or `pip list` "
            "output, saved to a file"
        ) from None
    _check_target(args.python, args.platform, args.offline)
    requirements = jdp_requirements()
    if args.offline:
        closure = local_closure(requirements, args.python)
    else:
        os.makedirs(args.bundle or ".", exist_ok=True)
        built = args.bundle or tempfile.mkdtemp(prefix="jdp-built-")
        closure = pip_closure(requirements, args.python, args.platform, have, built)
    missing = lacking(closure, have)
    print(
        f"jdp's dependencies for Python {args.python} on {args.platform}: {len(closure)} "
        f"packages, {len(closure) - len(missing)} on the target, {len(missing)} to carry:"
    )
    for name, version in missing.items():
        print(f"  {name}=={version}")
    if args.resolve_only:
        return 0
    lines = write_bundle(args.bundle, missing, args.python, args.platform)
    total = sum(p.stat().st_size for p in pathlib.Path(args.bundle).glob("*.whl")) / 1e6
    print("\n".join([f"{args.bundle}:", *lines, f"  together {total:.1f} MB"]))
    if total > LIMIT_MB:
        print(
            f"tools.bundle: the bundle weighs {total:.1f} MB, over the {LIMIT_MB} MB "
            "a GPU machine's carry allows",
            file=sys.stderr,
        )
    print(f"on the target: pip install --no-index --find-links {args.bundle} jdp")
    return 0


@command("tools.bundle")
def main(argv: Sequence[str] | None = None) -> int:
    return command_line("tools.bundle", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
