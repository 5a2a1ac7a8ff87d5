"""What a run reports.

`console`: the lines and progress bar (process 0), and quieting absl's warnings;
`logger`: the metric logger, fetching step metrics off the loop's path;
`writers`: the writers it hands records to (JSONL, TensorBoard) and their
protocol; `events`: TensorBoard's event-file encoding; `throughput`: FLOPs,
peaks and MFU; `run_info`: ``config.json`` and ``run.json``.
"""
