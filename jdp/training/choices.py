"""The choices of `TrainConfig`'s fields that name things: each a `Literal`, whose values
the flags offer and the registries agree with (tests/test_api.py): the step's backends,
the built-in models and sizes, the datasets, optimizers, schedules, LR scaling rules and
precisions."""

from typing import Literal

Backend = Literal["jit", "pmap"]
ModelName = Literal["cnn", "gpt", "mlp", "resnet18", "resnet20", "resnet50", "seq2seq"]
ModelSize = Literal["small", "standard", "124m", "350m", "774m", "1.3b"]
Remat = Literal["none", "dots", "full", "attention"]
Attention = Literal["auto", "xla", "cudnn", "blocked"]
OptimizerName = Literal["sgd", "momentum", "nesterov", "adam", "adamw", "lamb", "lars"]
ScheduleName = Literal["constant", "cosine", "linear", "noam", "piecewise"]
LrScaling = Literal["none", "linear", "sqrt"]
PrecisionName = Literal["fp32", "bf16", "fp16"]
ReduceDtype = Literal["fp32", "bf16"]
EarlyStopMetric = Literal["loss", "accuracy"]
TokenDtype = Literal["", "uint16", "uint32", "int32"]
BestMode = Literal["auto", "max", "min"]
NanPolicy = Literal["stop", "skip", "ignore"]
Auto = Literal["auto"]  # a number's field whose value the run chooses (--steps-per-call)
DataLedger = Literal["indices", "bytes", "off"]
DataOnDevice = Literal["auto", "on", "off"]
OuterOptimizerName = Literal["nesterov", "sgd"]
