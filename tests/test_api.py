import jdp


def test_public_names_are_pinned():
    assert sorted(jdp.__all__) == [
        "Checkpointer",
        "FitResult",
        "Loader",
        "LossScale",
        "Precision",
        "Split",
        "TrainConfig",
        "TrainState",
        "UsageError",
        "create_train_state",
        "distributed",
        "eval_batches",
        "evaluate",
        "fit",
        "load_params",
        "load_split",
        "make_eval_step",
        "make_mesh",
        "make_optimizer",
        "make_precision",
        "make_schedule",
        "make_train_step",
        "models",
        "shard_batch",
        "simulate_cpu_devices",
        "train_batches",
    ]
    for name in jdp.__all__:
        assert getattr(jdp, name) is not None


def test_train_config_rejects_bad_values():
    import pytest

    for kwargs, needle in [
        ({"model": "vit"}, "unknown model 'vit'; choose one of: cnn, gpt, mlp, resnet18,"),
        ({"model_size": "huge"}, "unknown model size 'huge'; choose one of: small, standard"),
        ({"dataset": "nope"}, "unknown dataset 'nope'"),
        ({"backend": "tpu"}, "unknown backend 'tpu'"),
        ({"mesh": "data=0"}, "sizes are positive"),
        ({"steps": 0}, "--steps must be at least 1"),
        ({"warmup_steps": 500, "steps": 100}, "warmup \\(500 steps\\) is longer than training"),
        ({"lr": -1.0}, "--lr must be positive"),
        ({"optimizer": "adagrad"}, "unknown optimizer 'adagrad'"),
        ({"schedule": "step"}, "unknown schedule 'step'"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"reduce_dtype": "int8"}, "unknown reduce dtype 'int8'"),
        ({"accumulate": 0}, "--accumulate must be at least 1"),
        ({"lr_boundaries": "a,b", "schedule": "piecewise"}, "write steps"),
    ]:
        with pytest.raises(jdp.UsageError, match=needle):
            jdp.TrainConfig(**kwargs)
