"""ResNet-20 on CIFAR-10 with BatchNorm over the global batch and augmentation.

The reference documents' image classifier trained under ``MirroredStrategy``,
grown to the network people train on CIFAR: He et al.'s ResNet-20 (2016,
section 4.2) with their recipe: SGD with momentum 0.9, learning rate 0.1 at
batch 128 (scaled linearly with the batch), weight decay 1e-4, divided by 10
at 50% and 75% of training; each image padded by 4, randomly cropped back to
32x32 and flipped. BatchNorm averages its statistics over the replicas (the
``SyncBatchNorm`` of PyTorch), so 8 devices train as 1 device on the same batch.

    python examples/cifar_resnet.py                               # 30 epochs, resnet20
    python examples/cifar_resnet.py --epochs 182 --model resnet18 --model-size standard
    python examples/cifar_resnet.py --smoke                       # a few steps, for tests

CIFAR-10 must be prepared in TFDS (``python -m jdp.data prepare cifar10`` where
the network reaches it); without it the example says why and uses the digits.
"""

import argparse
import sys

import jdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--model", default="resnet20", help="resnet20 or resnet18")
    parser.add_argument("--model-size", default="standard", help="small or standard")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--data-dir", default=None, help="TFDS data directory")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    args = parser.parse_args()
    jdp.simulate_cpu_devices(args.devices)  # before any JAX computation; no-op on accelerators

    dataset = "cifar10"
    try:
        train = jdp.load_split(dataset, "train", args.data_dir)
    except jdp.UsageError as error:
        print(f"{error}\nusing the bundled digits instead (no augmentation)", file=sys.stderr)
        dataset, train = "digits", jdp.load_split("digits", "train", args.data_dir)
    print(f"{dataset}: {len(train)} training images, augmented: {train.transform.augments}")

    epoch = len(train) // args.batch_size
    steps = 10 if args.smoke else args.epochs * epoch
    config = jdp.TrainConfig(
        mesh="data=-1",
        model=args.model,
        model_size=args.model_size,
        dataset=dataset,
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        steps=steps,
        optimizer="momentum",
        momentum=0.9,
        lr=0.1,
        lr_scaling="linear",
        lr_reference_batch=128,
        schedule="piecewise",
        lr_boundaries=f"{steps // 2},{steps * 3 // 4}",
        warmup_steps=0 if args.smoke else min(2 * epoch, steps // 10),
        weight_decay=1e-4,
        eval_every=0 if args.smoke else 5 * epoch,
    )
    result = jdp.fit(config)
    print(result.summary_line())


if __name__ == "__main__":
    main()
