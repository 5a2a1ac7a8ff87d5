"""The project's own tooling, beside the package and not installed with it: what only
jdp's tests, docs and release work use. Each runs from a checkout's root:

- ``python -m tools.readme``: the README's figures table, its rows run, checked or
  rewritten; ``python -m tools.numerics``: this machine's numerics fingerprint, which
  the check keys on;
- ``python -m tools.faults``: the fault trials (kill -9, bit flips, bad data, a stolen
  lock, a killed launcher, a bad path given to each tool: ``tools.fault_trials``,
  ``tools.tool_faults``);
- ``python -m tools.gpu_docs JSON...``: the docs' GPU section from ``python -m jdp.bench
  gpu``'s JSON files;
- ``python -m tools.host_instructions``: the host's instructions a call of jdp's step and
  of the hand-written one, counted under Valgrind (what ``jdp.bench step``'s host column
  times, without the machine's noise), and in which part of the process jdp's are more;
- ``python -m tools.bundle DIR``: the wheels an offline GPU machine needs to run the
  GPU benchmark.

What a user runs to judge jdp on their own machine stays in the package:
``python -m jdp.bench``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType


def command_line(prog: str, module: ModuleType, argv: Sequence[str] | None) -> int:
    """A tool's command line: ``module``'s ``add_arguments`` and ``run``, a count below
    what it can be refused in one line (exit 2)."""
    from jdp.bench.common import HelpWithDefaults, out_of_range

    parser = argparse.ArgumentParser(
        prog=prog,
        description=(module.__doc__ or "").splitlines()[0].replace("``", ""),
        formatter_class=HelpWithDefaults,
    )
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    if bad := out_of_range(args):
        print(f"{prog}: error: {bad}", file=sys.stderr)
        return 2
    return module.run(args) or 0
