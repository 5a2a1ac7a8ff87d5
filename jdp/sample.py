"""``python -m jdp.sample CKPT_DIR --prompt TEXT``: continue a prompt with a trained language model.

Loads the checkpoint's `gpt`, encodes the prompt with its corpus's tokenizer,
samples with a key/value cache (`jdp.models.generate`) and prints the new text.
The logic is `jdp.sampling`'s; `training_sample` is the line a run prints at its end.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax

from jdp.data.formats import is_corpus, load_corpus
from jdp.models import hf
from jdp.models.registry import context
from jdp.models.transformer import EPSILON
from jdp.sampling import DEFAULT_NEW_TOKENS, TEMPERATURE, TOP_K, load_sampler, sample_line
from jdp.tool import command
from jdp.training.config import TrainConfig
from jdp.training.results import FitResult


@command("jdp.sample")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sampler = load_sampler(args.ckpt_dir, _step(args.step), tokenizer=args.tokenizer)
    text = sampler.sample(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
    )
    print(text)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jdp.sample", description=__doc__.splitlines()[0].replace("``", "")
    )
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a --ckpt-dir, or one step of it")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_NEW_TOKENS,
        metavar="N",
        help=f"default {DEFAULT_NEW_TOKENS}; past the model's context each is "
        "read from its last tokens (a sliding window, as nanoGPT)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=TEMPERATURE,
        help=f"0: greedy (default {TEMPERATURE}, nanoGPT's)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=TOP_K,
        metavar="K",
        help=f"draw among the K most likely tokens (default {TOP_K}, nanoGPT's; 0: all)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", default="latest", help="latest (default), best, or a number")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="bytes|PATH",
        help="the corpus's tokenizer.json, when not beside the corpus",
    )
    return parser


def _step(step: str) -> str | int:
    return int(step) if step.isdigit() else step


def training_sample(config: TrainConfig, result: FitResult) -> str | None:
    """The sample line a language model's run prints at its end (`jdp.sampling.sample_line`),
    on process 0, when it trained a built-in gpt on a token corpus whose tokenizer is
    found; None otherwise. It never fails the run: a failure is one line on stderr."""
    if result.preempted or config.model != "gpt" or not is_corpus(config.dataset):
        return None
    if jax.process_index() != 0:
        return None
    try:
        splits = load_corpus(
            config.dataset,
            seq_len=config.seq_len or context(config.model, config.model_size),
            data_dir=config.data_dir,
            vocab_size=config.vocab_size or None,
            dtype=config.token_dtype or None,
        )
        directory = hf.directory_of(config.init_from)  # GPT-2's weights: their epsilon
        epsilon = hf.read_architecture(directory)["epsilon"] if directory else EPSILON
        return sample_line(result.state.params, splits, epsilon=epsilon)
    except Exception as error:  # the run is done and saved: a sample is not worth failing it
        sys.stderr.write(f"jdp: no sample: {type(error).__name__}: {error}\n")
        return None


if __name__ == "__main__":
    sys.exit(main())
