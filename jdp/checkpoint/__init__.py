"""Orbax checkpoints of a whole run: async saves, retention, resume, restore onto another mesh.

A checkpoint is one Orbax step directory with two items: ``state``, the whole
`TrainState` (params, optimizer state, model state, step, rng as raw key data,
loss scale) in Orbax's array format, and ``meta``, JSON with the loader position
the config that made the run, the shape, dtype and digest of every array
(`digest.py`) and a digest of the record itself. Orbax writes into a temporary
directory and renames it when complete, so a step directory either is a whole
checkpoint or was damaged afterwards: cut short, deleted in part, or with bytes
changed in place. Restore checks all of it; damaged checkpoints are set aside
with a warning naming what failed. The record is one typed value (`Record`,
`record.py`), read by a resume, ``--eval-only`` and `jdp.load_model`. One run at
a time owns the directory (`jdp.distributed.lock`). Nothing is ever unpickled.
"""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.checkpoint.checkpointer": ("Checkpointer",),
        "jdp.checkpoint.params": (
            "latest_record",
            "load_params",
            "read_checkpoint",
            "read_params",
            "read_record",
            "step_directory",
        ),
        "jdp.checkpoint.record": ("Record",),
        "jdp.checkpoint.storage": ("warn",),
    },
)
