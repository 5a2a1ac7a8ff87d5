"""``python -m jdp.data prepare|tokenize|pack``: prepare a dataset, tokenize text, pack images.

``prepare NAME [--data-dir DIR]`` downloads and prepares a catalog dataset once:
run it where the network reaches the dataset's host (a login node, a laptop),
then point ``--data-dir`` of training runs at the same directory, or a copy.

``tokenize FILE_OR_DIR... --out DIR`` writes the text files' tokens as llm.c
shards, a training and a validation split (`jdp.data.formats.tokenize`); train on them
with ``--dataset tokens:DIR``.

``pack FOLDER --out DIR`` writes a class-folder tree's images (its train,
validation and test folders when it has them) into array_record shards, bytes
unchanged and in the same order (`jdp.data.formats.image_sources`); train on them with
``--dataset images:DIR``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from jdp.data.formats.corpora import CORPORA, prepare_stdlib
from jdp.data.formats.image_sources import pack
from jdp.data.formats.tokenize import tokenize
from jdp.data.splits.sources import DATASETS, prepare
from jdp.report.writers import check_writable
from jdp.tool import command


@command("jdp.data")
def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="jdp.data", description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="download and prepare a dataset")
    prepare_parser.add_argument("name", choices=sorted([*DATASETS, *CORPORA]))
    prepare_parser.add_argument(
        "--data-dir", default=None, help="TFDS data directory (default: $TFDS_DATA_DIR)"
    )
    _add_tokenize(commands)
    pack_parser = commands.add_parser("pack", help="pack a class-folder tree of images")
    pack_parser.add_argument("folder", help="class folders, or train/ (validation/, test/) of them")
    pack_parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    shard_help = "the most megabytes of images in one shard (default: 1024)"
    pack_parser.add_argument("--shard-mb", type=float, default=1024, metavar="MB", help=shard_help)
    args = parser.parse_args(argv)
    if args.command == "pack" and not (math.isfinite(args.shard_mb) and args.shard_mb > 0):
        print(f"jdp.data: error: --shard-mb {args.shard_mb}: give a size above 0", file=sys.stderr)
        return 2
    if out := args.out if args.command != "prepare" else args.data_dir:
        check_writable(out, "--out" if args.command != "prepare" else "--data-dir")
    if args.command == "pack":
        packed = pack(args.folder, args.out, shard_bytes=int(args.shard_mb * 2**20))
        for split, facts in packed.items():
            megabytes = facts["bytes"] / 2**20
            print(
                f"jdp.data: {split or 'images'}: {facts['count']:,} images, "
                f"{megabytes:,.1f} MB in {facts['shards']} shard(s)"
            )
        print(f"jdp.data: packed into {args.out}; train with --dataset images:{args.out}")
        return 0
    if args.command == "tokenize":
        meta = tokenize(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            name=args.name,
            seed=args.seed,
        )
        print(f"jdp.data: {_tokenized(meta)}, in {args.out}")
        return 0
    if args.name in CORPORA:
        path = prepare_stdlib(args.data_dir)
    else:
        path = prepare(args.name, args.data_dir)
    print(f"jdp.data: {args.name} prepared in {path}")
    return 0


def _add_tokenize(commands) -> None:
    parser = commands.add_parser(
        "tokenize", help="tokenize text files into llm.c token shards (train and val)"
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="FILE_OR_DIR",
        help="text files, or directories walked for them",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    parser.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|PATH",
        help="UTF-8 bytes (default), or a Hugging Face tokenizer.json",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="the share of bytes set apart for validation (default: 0.01)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="encoding processes (default: one per CPU; 1: this one)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="the most tokens in one shard (default: 100,000,000)",
    )
    parser.add_argument(
        "--name",
        default="corpus",
        help="the shards' prefix: NAME_train_000000.bin (default: corpus)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the validation documents")


def _tokenized(meta: dict) -> str:
    """What was written, in a line: documents, tokens per split, shards, vocabulary."""
    documents = sum(meta["documents"].values()) - (meta["val_split"] == "tail")
    skipped = f" ({meta['skipped']:,} skipped: not text)" if meta["skipped"] else ""
    shards = sum(meta["shards"].values())
    tokens = meta["tokens"]
    return (
        f"{documents:,} document{'s' * (documents != 1)}{skipped}, {tokens['train']:,} train "
        f"and {tokens['val']:,} val tokens in {shards:,} shard{'s' * (shards != 1)}, "
        f"vocabulary {meta['vocab_size']:,}"
    )


if __name__ == "__main__":
    sys.exit(main())
