"""Periodic actions: when they fire, user actions in `fit`, and early stopping."""

import math

import pytest

import jdp
from jdp.actions import PeriodicAction, Progress


class Recorder(PeriodicAction):
    def __init__(self, every=0, *, at_end=False):
        super().__init__(every, at_end=at_end)
        self.steps = []

    def run(self, progress):
        self.steps.append((progress.step, progress.final))


def drive(action, *, start, end, calls):
    """Calls ``action`` as `fit` does: a pass before the first call, after each, and at the end."""
    progress = Progress(step=start, steps=end, state=None)
    action(progress)
    for step in range(start + calls, end + 1, calls):
        progress.after_call(step, calls, None, None)
        action(progress)
    progress.final = True
    action(progress)
    return progress


def test_a_periodic_action_fires_at_multiples_once_per_call_and_at_the_end():
    action = Recorder(3, at_end=True)
    drive(action, start=0, end=10, calls=1)
    assert action.steps == [(3, False), (6, False), (9, False), (10, True)]

    # Four steps a call: fires after the call in which a multiple of 6 was reached.
    action = Recorder(6)
    drive(action, start=0, end=24, calls=4)
    assert action.steps == [(8, False), (12, False), (20, False), (24, False)]

    # At most once a step: a run ending on a multiple does not run it twice.
    action = Recorder(5, at_end=True)
    drive(action, start=0, end=10, calls=1)
    assert action.steps == [(5, False), (10, False)]

    # A resumed run starts counting at its first step, not at 0.
    action = Recorder(4)
    drive(action, start=8, end=16, calls=1)
    assert action.steps == [(12, False), (16, False)]

    assert Recorder(0, at_end=True) and not Recorder(0).steps
    with pytest.raises(jdp.UsageError, match="every must be 0"):
        Recorder(-1)


def test_an_action_skipped_while_quiet_fires_as_one_called_after_every_call():
    """`fit` calls an action only after calls past its `quiet_through`: the steps it runs
    at are those of an action called after every call, for any every, steps per call
    and start."""
    for every, calls, start, end in [(3, 1, 0, 10), (6, 4, 0, 24), (4, 1, 8, 17), (5, 3, 2, 31)]:
        called_each, skipping = Recorder(every, at_end=True), Recorder(every, at_end=True)
        drive(called_each, start=start, end=end, calls=calls)
        progress = Progress(step=start, steps=end, state=None)
        skipping(progress)
        quiet = skipping.quiet_through(progress)
        for step in range(start + calls, end + 1, calls):
            progress.after_call(step, calls, None, None)
            if step > quiet:
                skipping(progress)
                quiet = skipping.quiet_through(progress)
        progress.final = True
        skipping(progress)
        assert skipping.steps == called_each.steps, (every, calls, start)

    progress = Progress(step=40, steps=100, state=None)
    assert Recorder(20).quiet_through(progress) == 59
    assert Recorder(0).quiet_through(progress) == jdp.actions.NEVER  # nothing periodic

    class OwnRule(Recorder):  # a rule of its own: called after every call
        def due(self, progress):
            return progress.step % 7 == 0

    assert OwnRule(20).quiet_through(progress) == 40
    assert jdp.EarlyStopping().quiet_through(progress) == 40


@pytest.mark.slow
def test_fit_calls_plain_callables_after_every_call_and_periodic_actions_when_due():
    calls, every_seven = [], Recorder(7, at_end=True)
    config = jdp.TrainConfig(mesh="data=2", steps=30, warmup_steps=4, log_every=10)
    callbacks = [lambda progress: calls.append(progress.step), every_seven]
    result = jdp.fit(config, callbacks=callbacks, console=jdp.Console(enabled=False))
    assert calls == [0, *range(1, 31), 30]  # before the first call, after each, at the end
    assert every_seven.steps == [(7, False), (14, False), (21, False), (28, False), (30, True)]
    assert result.history.steps("loss") == [10, 20, 30]  # the train loss, logged as before


def evaluations(action, values):
    """Feeds ``action`` one evaluation per step 10, 20, ...; returns the progress."""
    progress = Progress(step=0, steps=10 * len(values), state=None)
    for index, value in enumerate(values):
        progress.after_call(10 * (index + 1), 10, None, None)
        progress.evaluated = {"loss": value, "accuracy": 1 - value, "count": 100}
        action(progress)
        if progress.stop_reason:
            break
    return progress


def test_early_stopping_counts_evaluations_without_improvement():
    progress = evaluations(jdp.EarlyStopping(patience=2), [0.5, 0.4, 0.45, 0.41, 0.3])
    assert progress.step == 40 and progress.finish
    assert progress.stop_reason == (
        "early stopping: test loss has not improved on 0.4000 (step 20) for 2 evaluations"
    )
    # An improvement resets the count; min_delta sets how much counts.
    assert evaluations(jdp.EarlyStopping(patience=2), [0.5, 0.4, 0.45, 0.3, 0.35]).step == 50
    assert evaluations(jdp.EarlyStopping(patience=2, min_delta=0.2), [0.5, 0.4, 0.35]).step == 30
    # mode="max": higher is better.
    stopper = jdp.EarlyStopping("accuracy", patience=1, mode="max")
    assert evaluations(stopper, [0.5, 0.4, 0.6]).step == 30  # 1 - loss rises, then falls
    assert stopper.best_step == 20
    # Steps without an evaluation are not counted.
    progress = Progress(step=0, steps=10, state=None)
    progress.after_call(1, 1, None, None)
    assert not jdp.EarlyStopping(patience=1)(progress)
    with pytest.raises(jdp.UsageError, match="no test metric 'f1'; the evaluation gives "):
        evaluations(jdp.EarlyStopping("f1"), [0.5])
    with pytest.raises(jdp.UsageError, match="patience >= 1"):
        jdp.EarlyStopping(patience=0)


@pytest.mark.slow
def test_fit_calls_a_user_action_with_the_state_and_metrics(tmp_path, capsys):
    seen = []

    def look(progress):
        seen.append(
            (progress.step, int(progress.state.step), math.isfinite(progress.metrics["loss"]))
        )

    config = jdp.TrainConfig(mesh="data=2", steps=24, warmup_steps=4, steps_per_call=4)
    result = jdp.fit(config, callbacks=[jdp.Callback(look, every=10, at_end=True)])
    # At 4 steps a call, no call crosses the callback's 10 (calls of 4, 4, 2, 4, 4, 2, 4):
    # it sees steps 10 and 20, then 24, the end; the first lines say so.
    assert seen == [(10, 10, True), (20, 20, True), (24, 24, True)]
    assert "4 does not divide a callback's every 10; a shorter call" in capsys.readouterr().out
    assert result.steps == 24 and result.stopped is None


@pytest.mark.slow
def test_early_stopping_ends_a_run_with_its_final_evaluation_and_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    config = jdp.TrainConfig(
        mesh="data=2", steps=100, warmup_steps=5, eval_every=10, ckpt_dir=str(ckpt)
    )
    # No evaluation after the first beats the best by 10: the third evaluation stops the run.
    stopper = jdp.EarlyStopping(patience=2, min_delta=10.0)
    result = jdp.fit(config, callbacks=[stopper])
    assert result.steps == 30 and int(result.state.step) == 30
    assert result.stopped.startswith("early stopping: test loss has not improved on ")
    assert math.isfinite(result.test_loss) and result.test_accuracy > 0.5
    out = capsys.readouterr().out
    assert "jdp: early stopping: " in out and "stopping at step 30" in out
    assert out.count("step 30: test_loss=") == 1  # the end reuses the evaluation at 30
    with jdp.Checkpointer(str(ckpt)) as checkpoints:
        assert checkpoints.steps()[-1] == 30


@pytest.mark.slow
def test_the_early_stop_flags_stop_a_cli_run(capsys):
    from jdp.train import main

    # A learning rate of 1e-9 moves no prediction: the second evaluation's accuracy
    # equals the first's, which is no improvement.
    flags = "--mesh data=1 --steps 200 --warmup-steps 5 --lr 1e-9 --eval-every 20"
    code = main([*flags.split(), "--early-stop-patience", "1", "--early-stop-metric", "accuracy"])
    out = capsys.readouterr().out
    assert code == 0
    assert "jdp: early stopping: test accuracy has not improved on " in out
    assert "jdp.train: steps=40 " in out
