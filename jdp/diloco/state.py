"""DiLoCo's part of the training state: what each group trains between
synchronisations, the one question the rest of jdp asks a state about DiLoCo
(`has_groups`), and the checks of a state's groups against its mesh."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.diloco.outer import Outer
from jdp.errors import UsageError
from jdp.mesh import GROUP_AXIS, is_sharded
from jdp.precision import LossScale


@flax.struct.dataclass
class GroupState:
    """What each DiLoCo group trains between synchronisations (`jdp.diloco`); every
    leaf ``(groups, ...)``, sharded over the mesh's ``group`` axis.

    Attributes:
        params: each group's parameters.
        opt_state: each group's inner optimizer state (kept across synchronisations).
        model_state: each group's model state (BatchNorm statistics), averaged at
            synchronisation.
        loss_scale: each group's loss scale (fp16) and skipped-step count.
    """

    params: Any
    opt_state: Any
    model_state: Any
    loss_scale: LossScale


def has_groups(state: Any) -> bool:
    """Whether ``state`` (a `jdp.TrainState`) trains DiLoCo groups: the one question the
    rest of jdp asks a state about DiLoCo."""
    return getattr(state, "groups", None) is not None


def group_count(state: Any) -> int:
    """How many DiLoCo groups ``state`` trains; 0 without groups."""
    return jax.tree.leaves(state.groups)[0].shape[0] if has_groups(state) else 0


def check_outer(mesh: Mesh, outer: Outer | None, *, laid_out: bool) -> None:
    """UsageError unless ``outer`` is given exactly on a mesh with a ``group`` axis, and
    groups come without a sharded layout (``laid_out``: param specs or ZeRO-1 asked)."""
    grouped = GROUP_AXIS in mesh.shape
    if grouped != (outer is not None):
        raise UsageError(
            "a mesh with a 'group' axis trains DiLoCo groups: pass outer=jdp.diloco(...)"
            if grouped
            else "outer= (DiLoCo) needs a mesh with a 'group' axis, e.g. group=2,data=4"
        )
    if grouped and laid_out:
        raise UsageError(
            "DiLoCo groups train replicated parameters: drop param_specs and shard_optimizer"
        )
    if grouped:
        check_group_mesh(mesh)


def check_group_mesh(mesh: Mesh) -> None:
    """UsageError for a mesh with groups and a sharded layout (``fsdp``, ``model``)."""
    if is_sharded(mesh):
        raise UsageError(
            f"mesh {dict(mesh.shape)}: DiLoCo groups train replicated parameters; drop the "
            "'fsdp' and 'model' axes, or the 'group' axis"
        )


def start_groups(state: Any, outer: Outer, groups: int) -> Any:
    """``state`` (a `jdp.TrainState` at step 0) with DiLoCo's groups: each starts from its
    parameters, optimizer, model state and loss scale; ``opt_state`` becomes the outer
    optimizer's. Traced inside `jdp.create_train_state`'s compiled build."""
    each = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (groups, *x.shape)), tree)  # noqa: E731
    return state.replace(
        opt_state=outer.optimizer.init(state.params),
        groups=GroupState(
            params=each(state.params),
            opt_state=each(state.opt_state),
            model_state=each(state.model_state),
            loss_scale=each(state.loss_scale),
        ),
    )


def groups_sharding(mesh: Mesh) -> NamedSharding:
    """Where the groups' state lives: split over ``group``."""
    return NamedSharding(mesh, PartitionSpec(GROUP_AXIS))
