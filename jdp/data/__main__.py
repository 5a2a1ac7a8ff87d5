"""``python -m jdp.data prepare NAME [--data-dir DIR]``: download and prepare a dataset once.

Run it where the network reaches the dataset's host (a login node, a laptop),
then point ``--data-dir`` of training runs at the same directory, or a copy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jdp.data.sources import DATASETS, prepare
from jdp.errors import UsageError


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="jdp.data", description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="download and prepare a dataset")
    prepare_parser.add_argument("name", choices=sorted(DATASETS))
    prepare_parser.add_argument(
        "--data-dir", default=None, help="TFDS data directory (default: $TFDS_DATA_DIR)"
    )
    args = parser.parse_args(argv)
    try:
        path = prepare(args.name, args.data_dir)
    except UsageError as error:
        print(f"jdp.data: error: {error}", file=sys.stderr)
        return 2
    print(f"jdp.data: {args.name} prepared in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
