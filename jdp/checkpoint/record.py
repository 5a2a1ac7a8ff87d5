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
        ledger: the data ledger through this step (`jdp.data.ledger`): ``{"step",
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
            (array["shape"][0] for name, array in self.arrays.items()
             if name.startswith(GROUPS_PREFIX)),
            0,
        )  # fmt: skip
