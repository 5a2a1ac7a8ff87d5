"""An evaluation never costs the training before it: a failing one saves the state
first and says where, and one that is not finite chooses and stops nothing."""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

import jdp
from jdp.checkpoint import params
from jdp.training import run_actions

QUIET = jdp.Console(enabled=False)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    return jdp.data.from_arrays(x, (x[:, 0] > 0).astype(np.int32))


@pytest.mark.slow
def test_a_failing_final_evaluation_keeps_the_trained_state(tmp_path, monkeypatch):
    def lost(eval_step, state, batches):  # the device gone while evaluating
        raise RuntimeError("INTERNAL: device lost\nand more lines of XLA's")

    monkeypatch.setattr(run_actions, "evaluate", lost)
    config = jdp.TrainConfig(
        mesh="data=2", steps=20, batch_size=16, warmup_steps=2, ckpt_dir=str(tmp_path)
    )
    with pytest.raises(jdp.UsageError) as raised:
        jdp.fit(config, train=_data(), test=_data(), console=QUIET)
    assert str(raised.value) == (
        "evaluating the test split at step 20 failed (RuntimeError: INTERNAL: device lost); "
        f"the trained state is kept in {tmp_path} (step 20)"
    )
    monkeypatch.undo()
    with jdp.Checkpointer(str(tmp_path)) as checkpoints:
        assert checkpoints.steps() == [20]
    # Rerun: the finished run is evaluated, not trained again.
    result = jdp.fit(config, train=_data(), test=_data(), console=QUIET)
    assert result.steps == 20 and np.isfinite(result.test_loss)


class NanWhenEvaluating(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        logits = nn.Dense(2)(x)
        return logits if train else logits * jnp.nan


def test_a_nan_evaluation_names_its_split_and_stops_nothing_early(tmp_path):
    model = jdp.models.from_linen(NanWhenEvaluating(), jdp.models.classification())
    config = jdp.TrainConfig(
        mesh="data=2",
        steps=200,
        batch_size=16,
        warmup_steps=2,
        eval_every=20,
        early_stop_patience=2,
        ckpt_dir=str(tmp_path),
        ckpt_every=10,
    )
    with pytest.raises(
        jdp.NonFiniteError,
        match=r"^the validation split's loss is nan at step 20, though its inputs are finite "
        r".*it chooses no checkpoint and stops nothing; the trained state is kept in .* "
        r"\(step 20\)$",
    ):
        jdp.fit(config, model=model, train=_data(), validation=_data(), console=QUIET)


class NanWeights(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(2, kernel_init=lambda key, shape, dtype: jnp.full(shape, jnp.nan, dtype))(x)


def test_parameters_that_are_not_finite_are_named_not_the_data():
    """NaN weights (imported, say): checked, and named, whichever reads a loss first."""
    model = jdp.models.from_linen(NanWeights(), jdp.models.classification())
    for eval_every in (1, 0):  # the evaluation reads first, or the training loss's guard
        config = jdp.TrainConfig(
            mesh="data=2", steps=40, batch_size=16, warmup_steps=0, eval_every=eval_every
        )
        with pytest.raises(
            jdp.NonFiniteError,
            match=r"the parameters themselves are not finite "
            r"\(the initial or imported weights",
        ):
            jdp.fit(config, model=model, train=_data(), validation=_data(), console=QUIET)


def test_eval_only_reads_the_latest_again_when_a_live_run_rotates_it(tmp_path, monkeypatch):
    """The step it chose removed as it is read (a live run keeping its latest few): the
    new latest is read, not a line blaming the path."""
    import shutil

    config = jdp.TrainConfig(
        mesh="data=2", steps=4, batch_size=16, warmup_steps=0, ckpt_dir=str(tmp_path), ckpt_every=2
    )
    jdp.fit(config, train=_data(), test=_data(), console=QUIET)
    real, removed = params._read_arrays, []

    def rotated(step_dir, *args):  # the live run's rotation, at the worst moment
        if not removed:
            removed.append(step_dir)
            shutil.rmtree(step_dir)
        return real(step_dir, *args)

    monkeypatch.setattr(params, "_read_arrays", rotated)
    evaluated = jdp.fit(
        dataclasses.replace(config, eval_only=True), train=_data(), test=_data(), console=QUIET
    )
    assert removed == [str(tmp_path / "4")] and evaluated.steps == 2
    # A flag its run set otherwise is refused, never dropped in silence.
    with pytest.raises(jdp.UsageError, match=r"as its run made it, which --seed 5 \(it ran 0\)"):
        jdp.fit(dataclasses.replace(config, eval_only=True, seed=5), console=QUIET)


def test_data_without_a_held_out_split_evaluates_nothing_and_says_so():
    config = jdp.TrainConfig(mesh="data=2", steps=2, batch_size=16, warmup_steps=0)
    with pytest.raises(jdp.UsageError, match=r"--eval-every 1: your data has no validation or"):
        jdp.fit(dataclasses.replace(config, eval_every=1), train=_data(), console=QUIET)
    result = jdp.fit(config, train=_data(), console=QUIET)  # no figure stands in for one
    assert "test_" not in result.summary_line() and "val_" not in result.summary_line()


def test_eval_only_of_a_missing_directory_makes_none(tmp_path):
    missing = tmp_path / "none"
    with pytest.raises(jdp.UsageError, match=r"^no checkpoint in .*none; pass a --ckpt-dir"):
        jdp.fit(jdp.TrainConfig(eval_only=True, ckpt_dir=str(missing)), console=QUIET)
    assert not missing.exists()
