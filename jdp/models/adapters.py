"""A user's Flax module, Linen or NNX, in the forms jdp's step builders take.

`from_linen` and `from_nnx` wrap a module and an `Objective` (what to minimise
and measure on its outputs, `jdp.models.objectives`) into a `Model`
(`jdp.models.model`): ``init`` for the parameters and model state, ``loss_fn``
for `jdp.make_train_step` and ``metrics_fn`` for `jdp.make_eval_step`, both in
the ``has_model_state`` form. Mutable state such as BatchNorm statistics travels
as ``model_state``; dropout draws from the step's rng, which differs per replica
and per step, or with ``rows_arg`` per example of the global batch, the same on
any mesh (`jdp.models.dropout`).

BatchNorm normalises with the statistics of the batch it sees. For the
statistics of the global batch, as one device on the whole batch would compute,
give it ``axis_name=jdp.models.DATA_AXIS`` (``"data"``): the mean and variance are
then averaged over the replicas in training. Without it each replica normalises
with its own rows (PyTorch DDP without SyncBatchNorm); either way the running
averages are averaged over the replicas after each step, so replicas agree.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.errors import UsageError
from jdp.layout import logical_names
from jdp.models.model import Model as Model
from jdp.models.objectives import Batch as Batch
from jdp.models.objectives import Objective as Objective
from jdp.models.objectives import classification as classification
from jdp.models.objectives import sequence as sequence
from jdp.rngs import RowKey

Inputs = str | Sequence[str] | Callable[[Batch], tuple]


def _input_fn(inputs: Inputs) -> Callable[[Batch], tuple]:
    if callable(inputs):
        return inputs
    keys = (inputs,) if isinstance(inputs, str) else tuple(inputs)

    def arguments(batch):
        missing = [key for key in keys if key not in batch]
        if missing:
            raise UsageError(
                f"the model reads batch key(s) {', '.join(map(repr, missing))} and the batches "
                f"hold {', '.join(sorted(map(repr, batch)))}; pass inputs= naming its keys, or "
                f"a function of the batch"
            )
        return tuple(batch[key] for key in keys)

    return arguments


# Keywords that switch a module between training and evaluation: True in training
# for the first kind, False in training for the second.
_TRAINING_KEYWORDS = ("train", "training", "is_training")
_EVALUATION_KEYWORDS = ("deterministic", "use_running_average", "eval", "inference")
AUTO = "auto"


def _call_parameters(module) -> list[inspect.Parameter] | None:
    """The parameters of the module's ``__call__`` after ``self``; None if unreadable."""
    try:
        signature = inspect.signature(type(module).__call__)
    except (TypeError, ValueError):
        return None
    return list(signature.parameters.values())[1:]


def _count_inputs(inputs: Inputs) -> int | None:
    if callable(inputs):
        return None
    return 1 if isinstance(inputs, str) else len(tuple(inputs))


def _training_switch(module, train_arg: str | None, inputs: Inputs) -> tuple[str, bool] | None:
    """``(keyword, inverted)`` of the module's training switch, checked against its signature.

    Raises a one-line UsageError, before anything is traced, for what cannot be
    mapped: a ``train_arg`` the signature lacks, or more required arguments than
    ``inputs`` gives.
    """
    name = type(module).__name__
    parameters = _call_parameters(module)
    if parameters is None:
        return (train_arg, False) if train_arg not in (None, AUTO) else None
    names = [p.name for p in parameters]
    open_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    if train_arg == AUTO:
        found = [k for k in _TRAINING_KEYWORDS + _EVALUATION_KEYWORDS if k in names]
        switch = (found[0], found[0] in _EVALUATION_KEYWORDS) if found else None
    elif train_arg is None:
        switch = None
    elif train_arg in names or open_keywords:
        switch = (train_arg, train_arg in _EVALUATION_KEYWORDS)
    else:
        raise UsageError(
            f"{name}.__call__ takes no keyword {train_arg!r} (it takes {', '.join(names)}); "
            f"pass train_arg=None to from_linen, or the name of its training switch"
        )
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = [  # what the batch's inputs fill, in order
        p for p in parameters if p.kind in positional and (switch is None or p.name != switch[0])
    ]
    required = [p for p in takes if p.default is inspect.Parameter.empty]
    given = _count_inputs(inputs)
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    if given is not None and (len(required) > given or (given > len(takes) and not varargs)):
        raise UsageError(
            f"{name}.__call__ takes ({', '.join(names)}) and jdp would pass {given} "
            f"argument(s) from the batch (inputs={inputs!r}); pass inputs= naming one batch key "
            "per argument, or a function of the batch"
        )
    return switch


def from_linen(
    module,
    objective: Objective,
    *,
    inputs: Inputs = "image",
    train_arg: str | None = AUTO,
    rng_streams: Sequence[str] = ("dropout",),
    rows_arg: str | None = None,
) -> Model:
    """Wraps a Flax Linen module.

    Args:
        module: an unbound ``flax.linen.Module``.
        objective: its loss and metrics, e.g. `classification()` or `sequence()`.
        inputs: the batch key (or keys) passed positionally to the module, or a
            function ``batch -> tuple of arguments``.
        train_arg: the keyword that switches training behaviour (dropout on,
            BatchNorm on batch statistics). ``"auto"`` reads ``__call__``'s
            signature: ``train``, ``training`` or ``is_training`` is passed True in
            training, ``deterministic``, ``use_running_average``, ``eval`` or
            ``inference`` False, and a module without any (Flax's MNIST ``CNN``)
            gets none. Name one to choose it; None passes none.
        rng_streams: the rng collections the module draws from in training; each
            gets its own key from the step's per-replica, per-step rng.
        rows_arg: the keyword by which the module takes its rows' indices in the
            step's global batch and draws its dropout per example from them
            (`jdp.models.dropout`, as the built-in Transformers do); its rng is then
            the step's, the same on every replica, so no mesh changes the run.

    Every variable collection other than ``params`` (``batch_stats`` for
    BatchNorm) becomes ``model_state`` and is updated in training.

    Raises:
        UsageError: at once, before any device is touched, for a signature jdp
            cannot map (a named ``train_arg`` it lacks, more required arguments
            than ``inputs`` gives).
    """
    arguments = _input_fn(inputs)
    switch = _training_switch(module, train_arg, inputs)

    def mode(train: bool) -> dict[str, bool]:
        if switch is None:
            return {}
        keyword, inverted = switch
        return {keyword: train != inverted}

    def boxed(rng, batch):
        streams = {name: jax.random.fold_in(rng, i + 1) for i, name in enumerate(rng_streams)}
        return dict(module.init({"params": rng, **streams}, *arguments(batch), **mode(False)))

    def init(rng, batch):
        variables, _ = logical_names(boxed(rng, batch))  # the arrays, unboxed
        params = variables.pop("params")
        return params, variables

    def names(rng, batch):
        return logical_names(jax.eval_shape(boxed, rng, batch)["params"])[1]

    def apply(params, model_state, batch, *, train, rng=None):
        variables = {"params": params, **model_state}
        if not train:
            return module.apply(variables, *arguments(batch), **mode(False)), model_state
        given = arguments(batch)
        keywords = mode(True)
        if isinstance(rng, RowKey):  # the step's key, and where this slice's rows start
            keywords[rows_arg] = rng.first_row + jnp.arange(jax.tree.leaves(given)[0].shape[0])
            rng = rng.key
        rngs = {name: jax.random.fold_in(rng, i) for i, name in enumerate(rng_streams)}
        if not model_state:
            return module.apply(variables, *given, rngs=rngs, **keywords), {}
        outputs, updated = module.apply(
            variables, *given, rngs=rngs, mutable=list(model_state), **keywords
        )
        return outputs, dict(updated)

    return Model(init, apply, objective, names=names, row_keys=rows_arg is not None)


def _split_nnx(module, others) -> tuple[tuple[Any, Any], tuple[Any, Any, Any], list[str]]:
    """``((train_def, eval_def), (params, model_state, rng_state), streams)`` of an NNX module.

    The two graph definitions set ``deterministic`` and ``use_running_average``
    on the sub-modules that have them, False for training and True for evaluation.
    The three states (each an ``nnx.State``) hold its ``nnx.Param`` variables, the
    variables ``others`` selects and its rng state; ``streams`` are the tags of its
    rng streams, sorted.
    """
    from flax import nnx

    def split(train: bool):
        view = nnx.view(
            module, deterministic=not train, use_running_average=not train, raise_if_not_found=False
        )
        return nnx.split(view, nnx.Param, others, nnx.RngState)

    (train_def, params, state, rngs), (eval_def, *_) = split(True), split(False)
    streams = sorted(
        {v.tag for v in jax.tree.leaves(rngs, is_leaf=lambda x: isinstance(x, nnx.Variable))}
    )
    return (train_def, eval_def), (params, state, rngs), streams


def _as_state(template, pure):
    """A new State shaped like ``template`` holding ``pure``'s values (in this trace)."""
    from flax import nnx

    copied = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(copied, pure)
    return copied


def from_nnx(module, objective: Objective, *, inputs: Inputs = "image") -> Model:
    """Wraps a Flax NNX module (already constructed, so already initialised).

    Training runs the module with ``deterministic=False`` and
    ``use_running_average=False`` set on the sub-modules that have them (Dropout,
    BatchNorm), evaluation with both True. ``params`` are its ``nnx.Param``
    variables; ``model_state`` the other variables (BatchNorm's ``BatchStat``) except
    rng state: every rng stream the module holds (Dropout given ``rngs=``) is
    reseeded from the step's per-replica, per-step rng. A module whose
    ``__call__`` takes ``rngs`` (Flax's NNX MNIST tutorial passes them to
    ``nnx.Dropout`` at call time) is given ``nnx.Rngs`` drawn from that rng in
    training and ``rngs=None`` in evaluation. Both are plain nested dicts.
    ``init`` returns the module's current values and ignores its rng; `jdp.fit`
    puts the trained values back into ``module`` (``update``).

    A module built before `jdp.fit` started JAX with one CPU device; on a
    machine without an accelerator, ``fit`` starts the CPU backend again with the
    devices its mesh needs, and the module's values move over.

    Args:
        module: an ``nnx.Module``.
        objective: its loss and metrics.
        inputs: as for `from_linen`.

    Examples:
        >>> from flax import nnx
        >>> model = jdp.models.from_nnx(nnx.Linear(64, 10, rngs=nnx.Rngs(0)),
        ...                             jdp.models.classification())
        >>> params, model_state = model.init(jax.random.key(0), None)
        >>> sorted(params), model_state
        (['bias', 'kernel'], {})
    """
    from flax import nnx

    arguments = _input_fn(inputs)
    others = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))  # the model state's variables
    (train_def, eval_def), (params, state, rngs), streams = _split_nnx(module, others)
    takes_rngs = any(p.name == "rngs" for p in _call_parameters(module) or [])
    # Host copies of the values: they outlive a restart of the CPU backend (see
    # above). Rng keys cannot be NumPy arrays; arrays of a stopped backend still work.
    initial = [
        jax.tree.map(np.asarray, nnx.to_pure_dict(params)),
        jax.tree.map(np.asarray, nnx.to_pure_dict(state)),
        nnx.to_pure_dict(rngs),
    ]

    def init(rng, batch):
        del rng, batch
        return initial[0], initial[1]

    def apply(params_now, state_now, batch, *, train, rng=None):
        graphdef = train_def if train else eval_def
        model = nnx.merge(
            graphdef,
            _as_state(params, params_now),
            _as_state(state, state_now),
            _as_state(rngs, initial[2]),
        )
        if train and streams:
            nnx.reseed(model, **{tag: jax.random.fold_in(rng, i) for i, tag in enumerate(streams)})
        given = {}
        if takes_rngs:
            given["rngs"] = nnx.Rngs(jax.random.fold_in(rng, len(streams))) if train else None
        outputs = model(*arguments(batch), **given)
        if not train:
            return outputs, state_now
        return outputs, nnx.to_pure_dict(nnx.state(model, others))

    def update(params_now, state_now) -> None:
        nnx.update(module, _as_state(params, params_now), _as_state(state, state_now))

    return Model(init, apply, objective, update)
