"""``python -m jdp.export CKPT_DIR --to hf OUT``: a trained gpt as a Hugging Face GPT-2.

Writes ``config.json`` and ``model.safetensors`` in ``OUT``, which
``transformers.GPT2LMHeadModel.from_pretrained(OUT)`` loads and which computes
jdp's logits (`jdp.models.hf`); the corpus's ``tokenizer.json`` goes beside them
when the run's corpus has one. A padded vocabulary (the published sizes pad
GPT-2's 50,257 tokens to 50,304) is written as it is: the extra rows are tokens
no tokenizer makes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

import jax
import numpy as np

from jdp.checkpoint.record import RunSettings
from jdp.errors import UsageError
from jdp.inference import load_model
from jdp.models.generate import gpt_for
from jdp.models.hf import write_hf
from jdp.models.transformer import stack_layers
from jdp.report.writers import check_writable
from jdp.sampling import check_language_model, corpus_directory, epsilon_of
from jdp.tool import command

FORMATS = ("hf",)


def export_hf(path: str | os.PathLike, out: str | os.PathLike, step: str | int = "latest") -> str:
    """Writes the gpt of checkpoint ``path`` (``step``: latest, best or a number) as a
    ``transformers`` GPT-2 directory ``out``, which must be new or empty; returns
    what it wrote, in words.

    Raises:
        UsageError: not a checkpoint of a gpt, or ``out`` not empty.
    """
    out = os.fspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"{out} exists and is not an empty directory; choose a new OUT")
    loaded = load_model(path, step)
    settings = RunSettings(loaded.config)
    if settings.model != "gpt":
        check_language_model(loaded.config, to="export")  # one line for what it is instead
        raise UsageError(f"the checkpoint holds --model {settings.model}; export a gpt")
    check_writable(out, "OUT")
    epsilon = epsilon_of(settings)
    params = jax.tree.map(np.asarray, loaded.params)
    module = gpt_for(params, epsilon=epsilon)
    if module.unroll:  # written before scanned layers
        params = stack_layers(params, module.layers)
    write_hf(out, module, jax.tree.map(np.asarray, params), _special(settings))
    tokenizer = _tokenizer(settings)
    if tokenizer:
        shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
    return (
        f"GPT-2 of {module.layers} layers, width {module.width}, vocabulary "
        f"{module.vocab_size}, {module.max_len} positions, from step {loaded.step}"
        + (" (with the corpus's tokenizer.json)" if tokenizer else "")
    )


def _special(settings: RunSettings) -> dict[str, int | None]:
    """GPT-2's ``bos_token_id`` and ``eos_token_id`` for the export: the Hugging Face
    weights' the run started from (recorded then), else the corpus's end-of-document id
    (GPT-2's ``<|endoftext|>`` is both), else none."""
    if settings.special_tokens:
        return settings.special_tokens
    eos = settings.data.get("eos_id")
    return {"bos_token_id": eos, "eos_token_id": eos}


def _tokenizer(settings: RunSettings) -> str | None:
    """The run's corpus's ``tokenizer.json``, if it has one and it is there."""
    name = settings.data.get("tokenizer")
    directory = corpus_directory(settings.dataset)
    if not name or name == "bytes" or directory is None:
        return None
    path = os.path.join(directory, name)
    return path if os.path.isfile(path) else None


@command("jdp.export")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    step = int(args.step) if args.step.isdigit() else args.step
    what = export_hf(args.ckpt_dir, args.out, step)
    print(f"jdp.export: wrote {args.out}: {what}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jdp.export", description=__doc__.splitlines()[0].replace("``", "")
    )
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a --ckpt-dir, or one step of it")
    parser.add_argument("--to", required=True, choices=FORMATS, help="hf: transformers' GPT-2")
    parser.add_argument("out", metavar="OUT", help="the directory to write (new or empty)")
    parser.add_argument("--step", default="latest", help="latest (default), best, or a number")
    return parser


if __name__ == "__main__":
    sys.exit(main())
