"""The typed, frozen run configuration and its command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from jdp.data.sources import check_dataset
from jdp.errors import UsageError
from jdp.mesh import parse_mesh_spec
from jdp.models import check_model
from jdp.step import BACKENDS


def _flag(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Invalid values raise `UsageError`."""

    mesh: str = _flag("data=-1", "device mesh, e.g. data=8, data=-1 (all devices), data=4,model=2")
    backend: str = _flag("jit", "step backend: jit (jit over shard_map) or pmap")
    model: str = _flag("mlp", "built-in model: mlp or cnn")
    dataset: str = _flag("digits", "dataset name; digits is bundled and works offline")
    data_dir: str | None = _flag(
        None, "TFDS data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)"
    )
    batch_size: int = _flag(128, "global batch size, split over the data axis")
    steps: int = _flag(400, "number of training steps")
    lr: float = _flag(3e-3, "peak learning rate (Adam, linear warmup then cosine decay)")
    warmup_steps: int = _flag(40, "steps of linear learning-rate warmup from 0")
    eval_every: int = _flag(0, "evaluate on the test split every N steps (0: only at the end)")
    seed: int = _flag(0, "seed for initialisation and the data order")

    def __post_init__(self):
        parse_mesh_spec(self.mesh)
        if self.backend not in BACKENDS:
            raise UsageError(
                f"unknown backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}"
            )
        check_model(self.model)
        check_dataset(self.dataset)
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise UsageError(
                f"--warmup-steps {self.warmup_steps} must be between 0 and --steps {self.steps}"
            )
        if self.eval_every < 0:
            raise UsageError("--eval-every must be 0 (only at the end) or a positive step count")


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as every jdp error is."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _parse_optional_str(text: str) -> str | None:
    return text or None


def parse_flags(argv: Sequence[str] | None = None, *, prog: str = "jdp.train") -> TrainConfig:
    """Parses command-line flags (``--batch-size 256``) into a `TrainConfig`."""
    parser = _OneLineParser(prog=prog, description="Data-parallel training with jdp.")
    for field in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float, "str": str}.get(str(field.type), _parse_optional_str)
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            default=field.default,
            help=f"{field.metadata['help']} (default: {field.default})",
        )
    return TrainConfig(**vars(parser.parse_args(argv)))
