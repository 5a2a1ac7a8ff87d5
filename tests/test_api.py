import jdp


def test_public_names_are_pinned():
    assert sorted(jdp.__all__) == [
        "Action",
        "Callback",
        "Checkpointer",
        "CompiledStep",
        "Console",
        "DataLedgerError",
        "EarlyStopping",
        "FitResult",
        "GroupState",
        "LoadedModel",
        "Loader",
        "LossScale",
        "NonFiniteError",
        "Outer",
        "PeriodicAction",
        "Precision",
        "Progress",
        "Split",
        "Summary",
        "SyncStep",
        "TrainConfig",
        "TrainState",
        "UsageError",
        "actions",
        "create_train_state",
        "data",
        "data_parallel_step",
        "diloco",
        "distributed",
        "eval_batches",
        "evaluate",
        "fit",
        "layout",
        "load_model",
        "load_params",
        "load_split",
        "make_eval_step",
        "make_mesh",
        "make_optimizer",
        "make_precision",
        "make_schedule",
        "make_sync_step",
        "make_train_step",
        "models",
        "param_specs",
        "predict",
        "shard_batch",
        "simulate_cpu_devices",
        "summary",
        "train_batches",
    ]
    for name in jdp.__all__:  # each documented where it is defined
        assert (getattr(jdp, name).__doc__ or "").strip(), f"jdp.{name} has no docstring"


def test_train_config_rejects_bad_values():
    import pytest

    for kwargs, needle in [
        ({"model": "vit"}, "unknown model 'vit'; choose one of: cnn, gpt, mlp, resnet18,"),
        ({"model_size": "huge"}, "unknown model size 'huge'; choose one of: small, standard"),
        ({"dataset": "nope"}, "unknown dataset 'nope'"),
        ({"backend": "tpu"}, "unknown backend 'tpu'"),
        ({"mesh": "data=0"}, "sizes are positive"),
        ({"steps": 0}, "--steps must be at least 1"),
        ({"lr": -1.0}, r"--lr must be in \(0, 3.40282e\+38\], got -1.0"),
        ({"optimizer": "adagrad"}, "unknown optimizer 'adagrad'"),
        ({"schedule": "step"}, "unknown schedule 'step'"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"reduce_dtype": "int8"}, "unknown reduce dtype 'int8'"),
        ({"accumulate": 0}, "--accumulate must be at least 1"),
        ({"lr_boundaries": "a,b", "schedule": "piecewise"}, "write steps"),
        ({"lr_boundaries": "5,,10", "schedule": "piecewise"}, "write steps"),
        ({"early_stop_patience": 2}, "counts evaluations; add --eval-every N"),
        ({"early_stop_patience": -1}, "--early-stop-patience must be >= 0"),
        ({"early_stop_metric": "f1"}, "unknown early stop metric 'f1'; choose one of: loss, accu"),
        ({"warmup_steps": -1}, "--warmup-steps must be >= 0"),
        # A config made in code: each value of its field's type, else one line.
        ({"steps": "10"}, r"--steps '10' is a str; give a whole number"),
        ({"steps": float("nan")}, r"--steps nan is a float; give a whole number"),
        ({"batch_size": 1.5}, r"--batch-size 1.5 is a float; give a whole number"),
        ({"mesh": 8}, r"--mesh 8 is an int; give text"),
        ({"grad_norm": 1}, r"--grad-norm 1 is an int; give True or False"),
        ({"steps_per_call": "x"}, r"--steps-per-call 'x' is a str; give a whole number or auto"),
    ]:
        with pytest.raises(jdp.UsageError, match=needle):
            jdp.TrainConfig(**kwargs)


def test_the_library_refuses_arguments_of_the_wrong_kind_in_one_line():
    """What a user of the library can pass by mistake: each refused with a line that names
    it, never a deep error or a silent wrong step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import pytest

    mesh, params, adam = jdp.make_mesh("data=2"), {"w": jnp.zeros((4, 1))}, optax.adam(1e-3)

    def loss_fn(params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    rows = {"x": np.ones((4, 4), np.float32), "y": np.ones((4, 1), np.float32)}
    batch = jdp.shard_batch(rows, mesh)
    state0 = jdp.create_train_state(params, adam, mesh)
    for make, needle in [
        (lambda: jdp.create_train_state(params, optax.adam, mesh), "an optax.GradientTrans"),
        (lambda: jdp.create_train_state(params, adam, "data=2"), "mesh must be a jax.sharding"),
        (lambda: jdp.create_train_state(params, adam, mesh, rng=jnp.zeros(3)), "rng must be a"),
        (lambda: jdp.make_train_step("loss", adam, mesh), "loss_fn must be a function"),
        (lambda: jdp.make_train_step(loss_fn, adam, mesh, accumulate=1.5), "whole numbers"),
        (lambda: jdp.shard_batch({"x": np.ones((0, 4))}, mesh), "the batch has no rows"),
        (lambda: jdp.fit({"steps": 2}), "fit takes a jdp.TrainConfig, got dict"),
        (lambda: jdp.fit(jdp.TrainConfig(), callbacks=[3]), "3 is not callable"),
        (lambda: jdp.predict(loss_fn, params, rows["x"], mesh=mesh), "a split or a dict of"),
        (lambda: jdp.predict(loss_fn, params, rows, mesh=mesh, batch_size=0), "batch_size 0"),
        (lambda: jdp.create_train_state({**params, "n": "x"}, adam, mesh), r"\['n'\] is a str"),
        (lambda: jdp.param_specs(params, mesh, names={"v": None}), "names must have the"),
        (lambda: jdp.param_specs(params, {"fsdp": 2, "fdsp": 1}), "axes are group, data"),
        (lambda: jdp.make_sync_step(None, mesh), "takes DiLoCo's outer loop"),
        (lambda: jdp.make_mesh("data=2", devices=["cpu:0"] * 2), "devices must be JAX"),
        (lambda: jdp.make_mesh("data=2", devices=[]), "devices must be JAX"),
        (lambda: jdp.shard_batch({"x": np.array(["a", 1] * 2)}, mesh), "of strings or Python"),
        (lambda: jdp.fit(jdp.TrainConfig(), train=rows["x"]), "train= takes a split"),
        (lambda: jdp.data.from_arrays(rows["x"], np.zeros(4, int), num_classes=0), "1 or more"),
        (lambda: jdp.make_eval_step(lambda p, b: b["x"], mesh)(state0, batch), "a dict of named"),
    ]:
        with pytest.raises(jdp.UsageError, match=needle):
            make()
    step, state = (
        jdp.make_train_step(loss_fn, adam, mesh),
        jdp.create_train_state(params, adam, mesh),
    )
    with pytest.raises(jdp.UsageError, match=r"called as step\(state, batch\), a jdp.TrainState"):
        step(batch, state)
    # A state made with another optimizer than the step's would step with the step's and
    # carry the other's state unchanged.
    sgd = jdp.make_train_step(loss_fn, optax.sgd(0.1), mesh)
    with pytest.raises(jdp.UsageError, match="another optimizer's than this step's"):
        sgd(state, batch)
    assert jax.tree.leaves(step(state, batch)[0].params)[0].shape == (4, 1)  # still whole


def test_the_config_choices_are_the_registries():
    """TrainConfig names its choices as Literal types (it imports nothing above it); each
    must be what the module that owns the name accepts."""
    import typing

    from jdp import optim, precision, step
    from jdp.data.formats import corpora, tokens
    from jdp.data.splits import custom, sources
    from jdp.diloco.outer import OUTER_OPTIMIZERS
    from jdp.models import hf
    from jdp.models.attention import ATTENTION_IMPLEMENTATIONS
    from jdp.models.registry import MODELS, SIZES
    from jdp.models.transformer import REMAT_POLICIES
    from jdp.training import choices as config_choices
    from jdp.training import config_checks

    def choices(alias):
        return set(typing.get_args(alias))

    assert choices(config_choices.Backend) == set(step.BACKENDS)
    assert choices(config_choices.ModelName) == set(MODELS)
    assert choices(config_choices.ModelSize) == set(SIZES)
    assert choices(config_choices.Remat) == {"none", "attention", *REMAT_POLICIES}
    assert choices(config_choices.Attention) == set(ATTENTION_IMPLEMENTATIONS)
    assert choices(config_checks.DatasetName) == (
        set(sources.DATASETS) | set(sources.GENERATED) | set(corpora.CORPORA)
    )
    # The config checks what the data reads.
    assert (*custom.PREFIXES, tokens.TOKENS_PREFIX) == config_checks.DATASET_PREFIXES
    assert hf.PREFIX == config_checks.HF_PREFIX
    assert choices(config_choices.OptimizerName) == set(optim.OPTIMIZERS)
    assert choices(config_choices.ScheduleName) == set(optim.SCHEDULES)
    assert choices(config_choices.LrScaling) == set(optim.LR_SCALING)
    assert choices(config_choices.PrecisionName) == set(precision.PRECISIONS)
    assert choices(config_choices.ReduceDtype) <= set(precision.PRECISIONS)
    assert choices(config_choices.OuterOptimizerName) == set(OUTER_OPTIMIZERS)


def test_the_config_imports_nothing_above_it():
    import ast
    import pathlib

    from jdp.training import config, config_checks, config_types, sections

    imported = set()
    for module in (config, config_checks, config_types, sections):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jdp"):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    # The config, its checks and sections, and below them only errors and the mesh spec.
    checks = {"jdp.training.sections", "jdp.training.config_types"}
    assert {name.rsplit(".", 1)[0] for name in imported} - checks == {
        "jdp.training",
        "jdp.errors",
        "jdp.mesh_spec",
    }
    assert {name.rsplit(".", 1)[0] for name in imported if name.startswith("jdp.training")} == {
        "jdp.training",
        *checks,
    }


# What a program pays for before it touches a name: none of these may load with
# `import jdp` (and its faces), nor while `python -m jdp.train` reads its flags.
BACKENDS = (
    "jax",
    "jaxlib",
    "optax",
    "flax",
    "orbax",
    "grain",
    "tensorflow_datasets",
    "tensorflow",
    "array_record",
    "tensorstore",
    "matplotlib",
    "PIL",
    "simplejpeg",
    "sklearn",
    "tokenizers",
    "safetensors",
    "tqdm",
    "mlflow",
    "wandb",
    "ray",
    "torch",
    "transformers",
)


def test_import_jdp_loads_no_backend():
    """In a fresh process (what it measures is what a fresh process loads): the faces,
    and ``python -m jdp.train``'s flags, ``--help`` included, load none of `BACKENDS`."""
    import ast

    from helpers import run_python

    code = (
        "import sys, contextlib, io\n"
        "import jdp, jdp.data, jdp.models, jdp.checkpoint, jdp.training, jdp.distributed\n"
        "import jdp.diloco, jdp.train\n"
        "jdp.train.parse_flags(['--steps', '3', '--mesh', 'data=2'])\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    jdp.train.main(['--help'])\n"
        "print(sorted({name.split('.')[0] for name in sys.modules}))\n"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded = set(ast.literal_eval(result.stdout.strip().splitlines()[-1]))
    assert loaded & set(BACKENDS) == set()


def test_a_run_that_saves_nothing_and_starts_no_worker_loads_neither_orbax_nor_grain():
    """Each is a few tenths of a second of a fresh process's start: Orbax is imported where
    a checkpoint is written or read, Grain where the loader starts worker processes."""
    import ast

    from helpers import run_python

    code = (
        "import sys\n"
        "from jdp.train import main\n"
        "code = main(['--mesh', 'data=1', '--steps', '2', '--eval-batches', '1'])\n"
        "print(code, sorted({name.split('.')[0] for name in sys.modules}))\n"
    )
    result = run_python("-c", code, timeout=120, devices=1)
    assert result.returncode == 0, result.stderr
    code, loaded = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert code == "0"
    assert {"jax", "flax"} <= set(ast.literal_eval(loaded))  # it trained
    assert {"orbax", "grain"} & set(ast.literal_eval(loaded)) == set()


def test_every_face_gives_each_of_its_names():
    import importlib

    names = ("checkpoint", "data", "diloco", "distributed", "models", "training")
    for face in (jdp, *(importlib.import_module(f"jdp.{name}") for name in names)):
        for name in face.__all__:
            assert getattr(face, name) is not None, f"{face.__name__}.{name}"
            assert name in dir(face)
    assert callable(jdp.diloco) and jdp.diloco.__module__ == "jdp.diloco.outer"
    with __import__("pytest").raises(AttributeError, match="no attribute 'nope'"):
        jdp.nope  # noqa: B018
