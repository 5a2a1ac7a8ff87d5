"""The reference DDP Transformer, the jdp way: numbers to words with Noam, clipping, fp16.

Mirrors the PyTorch ``DistributedDataParallel`` example of the reference documents:
an encoder-decoder Transformer (d_model 128, 4 heads, 2 + 2 layers) learns
``"123" -> "one two three"`` with Adam under the Noam schedule, gradients
clipped to norm 1 and fp16 mixed precision with dynamic loss scaling (PyTorch's
``autocast`` + ``GradScaler``). DDP's process per GPU, ``DistributedSampler`` and
gradient all-reduce are the mesh's ``data`` axis here; the loss is a mean over
examples, so 1 device and 8 compute the same update.

fp16 is the default on a GPU; a TPU computes in bf16, and a CPU, where half
precision is emulated and slow, in fp32.

    python examples/seq2seq_transformer.py                 # full run, 600 steps
    python examples/seq2seq_transformer.py --precision bf16
    python examples/seq2seq_transformer.py --smoke         # a few steps, for tests
"""

import argparse

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--precision", help="fp16 (the reference's), bf16 or fp32")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators

    import jax
    import numpy as np

    platform = jax.default_backend()
    precision = args.precision or {"gpu": "fp16", "tpu": "bf16"}.get(platform, "fp32")
    config = jdp.TrainConfig(
        mesh="data=-1",
        model="seq2seq",
        dataset="numbers2words",
        batch_size=128,
        steps=10 if args.smoke else 600,
        optimizer="adam",
        schedule="noam",  # linear warmup, then inverse square root decay
        lr=3e-3,  # the peak, reached at the end of warmup
        warmup_steps=5 if args.smoke else 100,
        clip_norm=1.0,
        precision=precision,
        eval_every=0 if args.smoke else 200,
    )
    result = jdp.fit(config)

    # Translate a few test numbers by greedy decoding with the trained parameters
    # (read on this host: a single-process run; several processes would gather them
    # first with jax.experimental.multihost_utils.process_allgather).
    test = jdp.load_split("numbers2words", "test")
    model = jdp.models.get_model("seq2seq", test)
    params, model_state = jax.device_get((result.state.params, result.state.model_state))
    batch = test.read(np.arange(5))

    words = jdp.models.translate(model, params, model_state, batch, bos=test.bos, eos=test.eos)
    for source, decoded in zip(batch["source"], words, strict=True):
        print(f"{test.decode(source).replace(' ', '')} -> {test.decode(decoded)}")
    print(result.summary_line())  # test_accuracy: exact match of the whole sequence


if __name__ == "__main__":
    main()
