"""``python -m jdp.train``: parse the flags, call `jdp.loop.fit`, print one summary line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jdp.distributed import ReplicaMismatchError
from jdp.errors import NonFiniteError, UsageError
from jdp.flags import parse_flags
from jdp.loop import fit
from jdp.report.console import Console


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_flags(argv)
        console = Console()
        result = fit(config, console=console)
    except UsageError as error:
        sys.stderr.write(f"jdp.train: error: {error}\n")
        return 2
    except (ReplicaMismatchError, NonFiniteError) as error:
        sys.stderr.write(f"jdp.train: error: {error}\n")
        return 1
    console.line(result.summary_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
