"""Local SGD and DiLoCo: groups of replicas that synchronise every H steps.

A mesh with a ``group`` axis (``group=2,data=4``) runs ordinary synchronous
data parallelism inside each group, over ``data``, every step. Across groups
nothing is communicated between synchronisations: each group trains its own
copy of the parameters with the inner optimizer on its block of every global
batch. Every ``sync_every`` steps the groups average their parameters over
``group`` (one all-reduce of the parameter bytes), the difference from the
parameters of the last synchronisation is the outer gradient, and an outer
optimizer applies it (Douillard et al. 2023, "DiLoCo": Nesterov momentum, lr 0.7,
momentum 0.9). Outer SGD with lr 1 and no momentum is local SGD: the groups'
plain average.

In the `TrainState`, ``params`` are the parameters as of the last
synchronisation, ``opt_state`` the outer optimizer's state and ``model_state``
the groups' averaged model state: evaluation, inference and ``load_params`` use
them. ``groups`` holds what each group trains between synchronisations
(`GroupState`), every leaf with a leading axis of one entry per group, sharded
over ``group``. Group ``g`` trains on the ``g``-th block of rows of every global
batch, so the data order stays a function of ``(seed, step)``.

The package holds what `jdp.state` builds on: `outer` (the outer loop, `diloco`)
and `state` (the groups' state and `has_groups`). The steps are compiled where every
step is, in `jdp.step`: `jdp.step.group_maths` (each device's maths) and
`jdp.step.groups` (the inner step and the synchronisation over the mesh;
`jdp.make_sync_step`).
"""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.diloco.outer": ("OUTER_OPTIMIZERS", "Outer", "diloco", "outer_from_flags"),
        "jdp.diloco.state": ("GroupState", "group_count", "has_groups"),
    },
)
