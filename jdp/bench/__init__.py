"""``python -m jdp.bench``: jdp's figures, each measured side by side in one process run."""
