"""A checkpoint's record: what it says of itself besides its arrays, as one typed value.

`Checkpointer.save` writes it beside the arrays (as JSON, with each array's digest
and the record's own); a resume, ``--eval-only`` and `jdp.load_model` read it back
through `Record.read`, so the keys are named in this one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

GROUPS_PREFIX = "groups/"  # the arrays of DiLoCo's groups, each (groups, ...)

# A recorded config holds a `jdp.TrainConfig`'s fields and, beside them, these facts (a
# run writes them, `jdp.training.run.recorded_config`; `RunSettings` reads them).
DATA_FACTS = "data"  # the data's shape, for jdp.load_model to rebuild a built-in model
ARCHITECTURE = "architecture"  # gpt's shape as weights set it (--init-from hf:DIR)
SPECIAL_TOKENS = "special_tokens"  # those weights' bos and eos ids, for jdp.export
DATA_FINGERPRINT = "data_fingerprint"  # what the run trained on (`jdp.data.splits.fingerprints`)
WARMUP_CHOSEN = "warmup_steps_chosen_by_jdp"  # the warmup was jdp's choice, not the user's
BEST = "best_checkpoint"  # the metric and mode the run keeps its best checkpoint by
YOURS = "yours"  # the model, dataset or optimizer the user brought


@dataclasses.dataclass(frozen=True)
class Record:
    """A checkpoint's record.

    Attributes:
        step: the state's step count when it was saved.
        loader_step: where the data loader resumes: the global batches consumed.
        config: the run's settings as recorded (`jdp.TrainConfig` fields), or {}.
        arrays: each array by its name in the state (``params/Dense_0/kernel``):
            ``{"shape": [...], "dtype": "float32", "digest": ...}``.
        metrics: what chose the best checkpoint, if anything did.
        ledger: the data ledger through this step (`jdp.data.splits.ledger`): ``{"step",
            "since", "indices"[, "bytes"]}``, or {} (none kept, or an older jdp's).
    """

    step: int
    loader_step: int
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    ledger: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, meta: Mapping[str, Any], *, step: int = 0) -> Record:
        """The record of a checkpoint's JSON ``meta``; what a record written by an older
        jdp lacks takes ``step`` (the step directory's) or stays empty."""
        saved_step = int(meta.get("step", step))
        arrays, config = meta.get("arrays", {}), meta.get("config", {})
        return cls(
            step=saved_step,
            loader_step=int(meta.get("loader_step", saved_step)),
            config=dict(config) if isinstance(config, Mapping) else {},
            arrays=dict(arrays) if isinstance(arrays, Mapping) else {},
            metrics=dict(meta.get("metrics") or {}),
            ledger=dict(meta.get("ledger") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON ``meta`` the checkpoint holds (before its digests are added)."""
        return dataclasses.asdict(self)

    @property
    def groups(self) -> int:
        """How many DiLoCo groups the checkpoint's state trained (0 without groups),
        read from its arrays' shapes, whatever the recorded config says."""
        return next(
            (
                array["shape"][0]
                for name, array in self.arrays.items()
                if name.startswith(GROUPS_PREFIX)
            ),
            0,
        )

    @property
    def run(self) -> RunSettings:
        """The recorded config read by name (`RunSettings`)."""
        return RunSettings(self.config)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """A recorded config read by name: a checkpoint's (`Record.run`), or a run's
    ``config.json``. What an older jdp's record lacks reads as that jdp ran.

    Attributes:
        values: the config as recorded (`jdp.LoadedModel.config`).
    """

    values: Mapping[str, Any]

    @property
    def model(self) -> str:
        return self.values.get("model", YOURS)

    @property
    def dataset(self) -> str:
        return self.values.get("dataset", "")

    @property
    def yours(self) -> bool:
        """Whether the run trained a model or data the user brought (not rebuilt by name)."""
        recorded = (str(self.values.get(name, "")) for name in ("model", "dataset"))
        return any(value.startswith(YOURS) for value in recorded)

    @property
    def data(self) -> dict[str, Any]:
        """The data facts (`jdp.data.splits.facts`): kind, vocabulary, tokenizer ...; {} before
        they were recorded."""
        return dict(self.values.get(DATA_FACTS) or {})

    @property
    def architecture(self) -> dict[str, Any]:
        """gpt's shape as weights set it, or {} (the size's)."""
        return dict(self.values.get(ARCHITECTURE) or {})

    @property
    def special_tokens(self) -> dict[str, int | None] | None:
        return self.values.get(SPECIAL_TOKENS) or None

    @property
    def fingerprint(self) -> dict[str, str]:
        return dict(self.values.get(DATA_FINGERPRINT) or {})

    @property
    def mesh(self) -> str:
        return self.values.get("mesh", "?")

    @property
    def steps(self) -> int | None:
        return self.values.get("steps")

    @property
    def ckpt_dir(self) -> str | None:
        return self.values.get("ckpt_dir")

    @property
    def best(self) -> dict[str, str]:
        """What the run keeps its best checkpoint by; accuracy, before that was recorded."""
        return self.values.get(BEST) or {"metric": "accuracy", "mode": "max"}

    @property
    def chosen_warmup(self) -> int | None:
        """The warmup jdp chose for the run (a default cut to a shorter run); None when the
        user chose it."""
        warmup = self.values.get("warmup_steps")
        return warmup if self.values.get(WARMUP_CHOSEN) and isinstance(warmup, int) else None

    @property
    def as_ran(self) -> dict[str, Any]:
        """The values, with what an older jdp did not record as it ran (a gpt's layers were
        unrolled before scanned layers were recorded)."""
        older = {"unroll_layers": True} if self.model == "gpt" else {}
        return {**older, **self.values}
