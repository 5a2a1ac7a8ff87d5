"""Global batches to the devices: their order by ``(seed, step)``, read on the host
(Grain's workers for its work) or gathered on the devices, and streams in your own
order.

The rest of jdp imports this wing through this face; its modules import each other
directly."""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.data.loader.on_device": (
            "on_host",
            "place",
            "state_bytes",
        ),
        "jdp.data.loader.pipeline": (
            "Loader",
            "check_train_batch",
            "eval_batches",
            "places_ahead",
            "train_batches",
        ),
        "jdp.data.loader.readers": (
            "CallBounds",
            "EvalReader",
            "TrainReader",
            "call_steps",
            "calls_from",
            "global_batch_indices",
        ),
        "jdp.data.loader.streams": ("BatchStream",),
        "jdp.data.loader.workers": ("host_batches",),
    },
)
