"""The training state: one pytree holding everything a step reads and writes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jdp import layout
from jdp.diloco.outer import Outer
from jdp.diloco.state import (
    GroupState,
    check_outer,
    groups_sharding,
    has_groups,
    start_groups,
)
from jdp.errors import UsageError
from jdp.mesh import check_mesh, group_size, replicated
from jdp.optim import check_optimizer
from jdp.precision import LossScale, Precision


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where a `TrainState`'s arrays live: the static description a step picks its
    program by (`TrainState.placement`).

    Attributes:
        kind: ``"replicated"`` (every array whole on every device), ``"sharded"``
            (some split over the mesh: ``fsdp``, ``model``, ZeRO-1) or ``"groups"``
            (DiLoCo's: the groups' state split over ``group``).
        key: the state's structure and each array's sharding: the programs of a
            sharded state are compiled, and found again, by it.
    """

    kind: Literal["replicated", "sharded", "groups"]
    key: tuple

    def __post_init__(self):
        # A step hashes the state's structure, this included, on every call.
        object.__setattr__(self, "_hash", hash((self.kind, self.key)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Placement):
            return NotImplemented
        return self._hash == other._hash and (self.kind, self.key) == (other.kind, other.key)

    @classmethod
    def of(cls, state: TrainState) -> Placement:
        """Reads ``state``'s placement from its arrays."""
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple(getattr(leaf, "sharding", None) for leaf in leaves))
        if has_groups(state):
            kind = "groups"
        elif all(s is None or s.is_fully_replicated for s in key[1]):
            kind = "replicated"
        else:
            kind = "sharded"
        return cls(kind, key)


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training, as one pytree of arrays.

    Attributes:
        step: number of steps taken (int32 scalar); an fp16 step whose update
            was skipped for a non-finite gradient still counts, since it consumed
            its batch.
        params: the model parameters.
        opt_state: the optimizer's state.
        model_state: non-trained model variables, e.g. BatchNorm statistics
            (``{"batch_stats": ...}``); an empty dict for models without any.
        rng: the base PRNG key as raw key data (``jax.random.key_data``); the step
            derives a fresh key per step and replica from it. `key` is the typed key.
        loss_scale: dynamic loss-scale state (scale 1 unless fp16 loss scaling is on).
        groups: with DiLoCo groups (a mesh with a ``group`` axis), what each group
            trains between synchronisations (`GroupState`); ``params``,
            ``opt_state`` and ``model_state`` are then the synchronised parameters,
            the outer optimizer's state and the averaged model state, and the
            groups' loss scales stand for ``loss_scale``. None otherwise.
        rng_impl: the name of ``rng``'s PRNG implementation (static, not an array).

    The key is held as raw data because a typed key array costs the host a
    Python round trip on every call of a compiled step (its pytree is rebuilt
    in Python), which was a third of the dispatch time of a small model's step.

    Update it with ``state.replace(...)``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    loss_scale: LossScale
    groups: GroupState | None = None
    rng_impl: str = flax.struct.field(pytree_node=False, default="threefry2x32")

    @functools.cached_property
    def placement(self) -> Placement:
        """Where the arrays live (`Placement`): read from them on first use, then kept
        with this state object (a new one, from ``replace``, ``jax.tree.map`` or
        ``jax.device_put``, reads its own); a step's output state carries its
        input's, so a training loop reads it once."""
        return Placement.of(self)

    @property
    def key(self) -> jax.Array:
        """The base PRNG key, typed (``rng`` wrapped with its implementation)."""
        return jax.random.wrap_key_data(self.rng, impl=self.rng_impl)


def create_train_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    rng: jax.Array | None = None,
    model_state: Any = None,
    precision: Precision | None = None,
    outer: Outer | None = None,
    param_specs: Any = None,
    shard_optimizer: bool = False,
) -> TrainState:
    """Creates a `TrainState` on ``mesh``, laid out as `jdp.layout` says.

    On a mesh of ``data`` alone every leaf is replicated. With ``fsdp`` or
    ``model`` the parameters are split by ``param_specs`` (default: the
    default rule, `jdp.param_specs` without names) and the optimizer's state
    follows them. The optimizer state is created on the mesh by a compiled
    ``optimizer.init``, so it never passes through one device first; parameters
    already on the mesh in their layout (`jdp.models.Model.init_on_mesh`) stay there.

    Args:
        params: the model parameters (a pytree of arrays).
        optimizer: any ``optax.GradientTransformation``.
        mesh: the training mesh.
        rng: the base PRNG key (dropout), typed (``jax.random.key``) or raw
            (``jax.random.PRNGKey``); ``jax.random.key(0)`` when omitted.
        model_state: non-trained variables such as BatchNorm statistics.
        precision: the step's `Precision`; with fp16 loss scaling the state starts
            at its initial scale.
        outer: DiLoCo's outer loop (`jdp.diloco`), needed and only allowed on a
            mesh with a ``group`` axis: ``optimizer`` is then the inner one, each
            group's state starts from ``params``, and ``opt_state`` is the outer
            optimizer's.
        param_specs: each parameter's ``PartitionSpec`` (`jdp.param_specs`, which
            reads logical axis names); default: the default rule.
        shard_optimizer: ZeRO-1: split the optimizer's state over ``data`` too
            (the default rule), the parameters as they are.

    Returns:
        A `TrainState` at step 0: step count, key, loss scale and model state
        replicated; parameters and optimizer state in their layout (the groups'
        state split over ``group``).

    Raises:
        UsageError: a ``group`` axis without ``outer``, or ``outer`` without one;
            groups with a sharded layout.

    Examples:
        >>> mesh = jdp.make_mesh("data=8")
        >>> params = {"w": jnp.zeros((4, 1))}
        >>> state = jdp.create_train_state(params, optax.adam(1e-3), mesh, rng=jax.random.key(0))
        >>> int(state.step), state.params["w"].sharding.is_fully_replicated
        (0, True)
    """
    rng_impl, rng = _checked_key(rng, optimizer, mesh)
    model_state = {} if model_state is None else model_state

    def build(params, model_state, rng):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            model_state=model_state,
            rng=rng,
            loss_scale=LossScale.create(precision),
            rng_impl=rng_impl,
        )

    check_outer(mesh, outer, laid_out=param_specs is not None or shard_optimizer)
    if outer is None:
        shardings = state_shardings(
            params,
            optimizer,
            mesh,
            param_specs=param_specs,
            shard_optimizer=shard_optimizer,
            rng_impl=rng_impl,
        )
        return jax.jit(build, out_shardings=shardings)(params, model_state, rng)
    groups = group_size(mesh)

    def build_groups(params, model_state, rng):
        return start_groups(build(params, model_state, rng), outer, groups)

    sharding = replicated(mesh)
    shardings = TrainState(
        step=sharding,
        params=sharding,
        opt_state=sharding,
        model_state=sharding,
        rng=sharding,
        loss_scale=sharding,
        groups=groups_sharding(mesh),
        rng_impl=rng_impl,
    )
    return jax.jit(build_groups, out_shardings=shardings)(params, model_state, rng)


def _checked_key(rng: Any, optimizer: Any, mesh: Any) -> tuple[str, jax.Array]:
    """`create_train_state`'s arguments checked (each refused in one line), and its key's
    implementation name and raw data: from a typed key (``jax.random.key``), a raw one
    (``jax.random.PRNGKey``, of the default implementation) or None (key 0)."""
    check_mesh(mesh)
    check_optimizer(optimizer)
    rng = jax.random.key(0) if rng is None else rng
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_impl(rng), jax.random.key_data(rng)
    raw = jax.random.key_data(jax.random.key(0))
    if dtype != raw.dtype or np.shape(rng) != raw.shape:
        raise UsageError(
            f"rng must be a key, e.g. jax.random.key(0), got {type(rng).__name__} of "
            f"{dtype or 'no dtype'} {list(np.shape(rng))}"
        )
    return jax.config.jax_default_prng_impl, rng


def carry_placement(state: TrainState, where: Placement) -> TrainState:
    """``state``, known to live as ``where`` says (a step's output, in its input's
    layout): its `TrainState.placement` is not read from the arrays again."""
    state.__dict__["placement"] = where
    return state


def state_shardings(
    params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    param_specs: Any = None,
    shard_optimizer: bool = False,
    rng_impl: str = "threefry2x32",
) -> TrainState:
    """Where `create_train_state` puts each field (a tree of ``NamedSharding``, a prefix
    of the state's: one for the model state, the step count, the key and the loss
    scale, all replicated). ``params`` may be shapes."""
    sharding = replicated(mesh)
    specs = layout.param_specs(params, mesh) if param_specs is None else param_specs
    opt_specs = layout.optimizer_specs(
        optimizer, params, specs, mesh, shard_optimizer=shard_optimizer
    )
    return TrainState(
        step=sharding,
        params=layout.shardings(specs, mesh),
        opt_state=layout.shardings(opt_specs, mesh),
        model_state=sharding,
        rng=sharding,
        loss_scale=sharding,
        rng_impl=rng_impl,
    )


def placed(abstract: Any, shardings: Any) -> Any:
    """``abstract`` (shapes, as ``jax.eval_shape`` gives them) with the shardings of
    ``shardings``, a prefix tree of it: what ``lower`` takes to compile for a layout
    without any array."""
    is_sharding = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    return jax.tree.map(
        lambda sharding, sub: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub
        ),
        shardings,
        abstract,
        is_leaf=is_sharding,
    )
