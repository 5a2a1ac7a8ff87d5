"""A run's splits: datasets by name and your own, checked before the model is built,
and what a run records of them (their facts, fingerprint, and the ledger of which
examples each step held).

The rest of jdp imports this wing through this face; its modules import each other
directly."""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.data.splits.checks": ("check_splits",),
        "jdp.data.splits.custom": (
            "from_arrays",
            "holdout",
            "load_named",
        ),
        "jdp.data.splits.facts": (
            "data_facts",
            "split_shape",
        ),
        "jdp.data.splits.fingerprints": ("fingerprint",),
        "jdp.data.splits.ledger": (
            "BATCH",
            "Ledger",
            "TOTAL",
        ),
        "jdp.data.splits.sources": (
            "Split",
            "load_split",
        ),
    },
)
