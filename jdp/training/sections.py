"""The sections of `jdp.training.config.TrainConfig`'s fields, and what holds for each: a
resumed run may change some (where and how it runs, not what it computes), the
processes of one run may differ in others; ``--help`` lists the flags by what they do."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Section:
    """A group of `TrainConfig` fields, and what holds for each of them."""

    name: str
    resumable: bool  # a resumed run may change it: where and how it runs, not what it computes
    per_process: bool  # the processes of one run may differ in it


MODEL = Section("model", resumable=False, per_process=False)
DATA = Section("data", resumable=False, per_process=False)
INPUT = Section("input", resumable=True, per_process=True)  # where and how batches load
LAYOUT = Section("layout", resumable=True, per_process=False)  # mesh, backend, step packing
OPTIMIZER = Section("optimizer", resumable=False, per_process=False)  # the built-in one
STEP = Section("step", resumable=False, per_process=False)
DILOCO = Section("diloco", resumable=False, per_process=False)  # only on a group axis
LENGTH = Section("length", resumable=True, per_process=False)  # steps: see loop's resume
EVALUATION = Section("evaluation", resumable=True, per_process=False)  # and stopping early
CHECKPOINTS = Section("checkpoints", resumable=True, per_process=False)
PROCESS = Section("process", resumable=True, per_process=True)  # who each process is
HEALTH = Section("health", resumable=True, per_process=False)  # lost processes, replicas
OBSERVABILITY = Section("observability", resumable=True, per_process=False)


def _flag(section: Section, default, help_text: str, *, shown: str | None = None):
    """A `TrainConfig` field of ``section`` (what a resume may change), listed by ``--help``
    under ``shown`` (what the flag does) where that differs."""
    metadata = {"help": help_text, "section": section, "shown": shown or section.name}
    return dataclasses.field(default=default, metadata=metadata)
