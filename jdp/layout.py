"""Where each array of the training state lives on a mesh.

A parameter's layout comes from its logical axis names (``("embed", "mlp")`` for
a Dense kernel, given by ``nn.with_logical_partitioning`` in a Linen model) and
one rules table that maps each name to a mesh axis (`RULES`). A dimension whose
size the axis does not divide stays whole, and an axis serves one dimension of
a leaf at most. Then, on a mesh with ``fsdp``, every leaf that the rules did not
split over ``fsdp`` and that is at least `MIN_SHARDED_BYTES` splits its largest
dimension the axis divides (the default rule): a model without names, a user's,
is sharded too. Without names nothing is split over ``model``: tensor
parallelism needs to know which dimensions pair up (Megatron's column- and
row-parallel matrices), and only names say so.

The optimizer's state follows the parameters it mirrors (Adam's moments are
laid out as the parameters); its other leaves (step counts) are replicated.
With ``shard_optimizer`` (ZeRO-1) the optimizer's state splits over ``data``
as well, by the default rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.errors import UsageError
from jdp.layout_checks import check_leaves, check_rules_apply, checked_sizes, names_by_leaf
from jdp.mesh import DATA_AXIS, FSDP_AXIS, KNOWN_AXES, MODEL_AXIS, check_axis_rule

# Logical axis name -> mesh axis (None: never split). The names the built-in models
# use; pass ``rules=`` to override some of them or to add your model's.
RULES: tuple[tuple[str, str | None], ...] = (
    ("embed", FSDP_AXIS),  # the model width: FSDP splits it
    ("mlp", MODEL_AXIS),  # MLP hidden units: column- then row-parallel
    ("heads", MODEL_AXIS),  # attention heads
    ("kv", None),  # the width of one head
    ("vocab", MODEL_AXIS),  # the token embedding's rows and the logits
    ("length", None),  # positions
    ("conv_in", FSDP_AXIS),  # a convolution's input channels
    ("conv_out", MODEL_AXIS),  # its output channels (and their BatchNorm)
    ("classes", None),  # a classifier's logits
    ("spatial", None),  # a convolution's window
    ("layers", None),  # scanned layers' stacking axis (`STACKED`)
)
# The name of scanned layers' stacking axis (``nn.scan``'s ``metadata_params``).
STACKED = "layers"
# The parameters' key under which a model keeps its scanned layers (`jdp.models.GPT`'s):
# jdp's sharded step gathers them over ``fsdp`` one layer at a time (`gather_layer`).
SCANNED_LAYERS = "blocks"
_LAYER_SHARDINGS: contextvars.ContextVar[Any] = contextvars.ContextVar("layers", default=None)


@contextlib.contextmanager
def gathering_layers(gathered: Any, split: Any = None):
    """While a step traces its model: `gather_layer` lays one scanned layer's parameters
    out as ``gathered`` and their gradient as ``split`` (trees like one layer's, of
    `NamedSharding`; None: no layout asked)."""
    token = _LAYER_SHARDINGS.set(None if gathered is None else (gathered, split))
    try:
        yield
    finally:
        _LAYER_SHARDINGS.reset(token)


def gather_layer(variables: Any) -> Any:
    """One scanned layer's ``{"params": ...}`` where the layer uses them: gathered as the
    sharded step asks while it traces (`gathering_layers`), inside the scan's body, and
    their gradient split back there, so FSDP holds one layer gathered at a time and
    never the whole gradient; as they are otherwise."""
    shardings = _LAYER_SHARDINGS.get()
    if shardings is None or not variables.get("params"):
        return variables
    gathered, split = shardings

    @jax.custom_vjp
    def gather(params):
        return jax.lax.with_sharding_constraint(params, gathered)

    def backward(_, grads):  # the gradient split as the parameter is: a reduce-scatter
        return (grads if split is None else jax.lax.with_sharding_constraint(grads, split),)

    gather.defvjp(lambda params: (gather(params), None), backward)
    return {**variables, "params": gather(variables["params"])}


# Leaves smaller than this stay whole under the default rule: gathering a bias
# costs a collective's latency and saves nothing worth it.
MIN_SHARDED_BYTES = 16 * 1024

Rules = Sequence[tuple[str, str | None]] | Mapping[str, str | None]


def rules_table(rules: Rules | None = None) -> dict[str, str | None]:
    """`RULES` with ``rules`` (pairs or a mapping) taking precedence. A mesh axis's own
    name (``fsdp``, ``model``, as ``nn.with_partitioning`` writes them) maps to itself.

    Raises:
        UsageError: a rule maps a name to an axis that does not split parameters.
    """
    table: dict[str, str | None] = {FSDP_AXIS: FSDP_AXIS, MODEL_AXIS: MODEL_AXIS, **dict(RULES)}
    given = dict(rules.items() if isinstance(rules, Mapping) else rules or ())
    for name, axis in given.items():
        check_axis_rule(name, axis)
    table.update(given)
    return table


class _Table(dict):
    """A rules table `rules_table` already made (and checked)."""


def _axis_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else checked_sizes(mesh)


def _nbytes(leaf: Any) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    """``spec`` as one tuple of mesh axes per dimension."""
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return entries + [()] * (ndim - len(entries))


def _spec(entries: list[tuple[str, ...]]) -> PartitionSpec:
    while entries and not entries[-1]:
        entries = entries[:-1]
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def add_axis(
    spec: PartitionSpec, shape: Sequence[int], axis: str, sizes: Mapping[str, int]
) -> PartitionSpec:
    """``spec`` with ``axis`` added to the largest dimension that can take it (its size
    divisible by the product of its axes' sizes), or ``spec`` unchanged when none can,
    the axis has size 1, or the leaf already uses it."""
    entries = _entries(spec, len(shape))
    if sizes.get(axis, 1) <= 1 or any(axis in entry for entry in entries):
        return spec
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        split = math.prod(sizes[a] for a in (*entries[dim], axis))
        if shape[dim] % split == 0:
            entries[dim] = tuple(sorted((*entries[dim], axis), key=KNOWN_AXES.index))
            return _spec(entries)
    return spec


def leaf_spec(
    shape: Sequence[int],
    names: Sequence[str | None] | None,
    mesh: Mesh | Mapping[str, int],
    rules: Rules | None = None,
    *,
    nbytes: int | None = None,
) -> PartitionSpec:
    """The `PartitionSpec` of one parameter of ``shape`` with logical ``names`` (None:
    none given) on ``mesh``: the rules, then the default rule on ``fsdp``.

    ``nbytes``: the leaf's size, for the default rule's threshold (default: 4-byte
    elements). ``mesh`` may be a mapping of axis sizes (no devices needed).
    """
    sizes = _axis_sizes(mesh)
    table = rules if isinstance(rules, _Table) else rules_table(rules)
    if names is not None and STACKED in names and len(names) == len(shape):
        # Scanned layers: each step of the scan reads one layer, laid out as an
        # unscanned layer would be; the stacking axis itself is never split.
        dim = list(names).index(STACKED)
        nbytes = math.prod(shape) * 4 if nbytes is None else nbytes
        inner = leaf_spec(
            [*shape[:dim], *shape[dim + 1 :]],
            [*names[:dim], *names[dim + 1 :]],
            sizes,
            table,
            nbytes=nbytes // max(shape[dim], 1),
        )
        entries = _entries(inner, len(shape) - 1)
        return _spec([*entries[:dim], (), *entries[dim:]])
    entries: list[tuple[str, ...]] = [()] * len(shape)
    if names is not None:
        if len(names) != len(shape):
            raise UsageError(
                f"logical axis names {tuple(names)} do not match a parameter of shape "
                f"{tuple(shape)}; give one name (or None) per dimension"
            )
        used: set[str] = set()
        for dim, name in enumerate(names):
            axis = table.get(name) if name is not None else None
            if axis is None or sizes.get(axis, 1) <= 1 or axis in used:
                continue
            if shape[dim] % sizes[axis] == 0:  # else the dimension stays whole
                entries[dim] = (axis,)
                used.add(axis)
    spec = _spec(entries)
    nbytes = math.prod(shape) * 4 if nbytes is None else nbytes
    if nbytes >= MIN_SHARDED_BYTES:
        spec = add_axis(spec, shape, FSDP_AXIS, sizes)
    return spec


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def param_specs(
    params: Any, mesh: Mesh | Mapping[str, int], *, names: Any = None, rules: Rules | None = None
) -> Any:
    """Each parameter's `PartitionSpec` on ``mesh``, as `leaf_spec` gives it.

    Args:
        params: the parameters, or their shapes (``jax.ShapeDtypeStruct``).
        mesh: the mesh, or its axis sizes.
        names: logical axis names, a tree like ``params`` with a tuple (one name
            or None per dimension) or None at each leaf; `logical_names` reads them
            from a Linen model's boxed parameters. None: no names.
        rules: overrides of `RULES`.

    Examples:
        >>> params = {"kernel": jnp.zeros((784, 512)), "bias": jnp.zeros(512)}
        >>> names = {"kernel": ("embed", "mlp"), "bias": ("mlp",)}
        >>> jdp.param_specs(params, {"data": 2, "fsdp": 2, "model": 2}, names=names)
        {'bias': P('model',), 'kernel': P('fsdp', 'model')}
        >>> jdp.param_specs(params, {"fsdp": 8})  # no names: the default rule
        {'bias': P(), 'kernel': P('fsdp',)}
    """
    check_leaves(params)
    leaves, treedef = jax.tree.flatten(params)
    named = [None] * len(leaves) if names is None else names_by_leaf(treedef, names)
    table = _Table(rules_table(rules))  # validated once, not per leaf
    if rules:
        rules = dict(rules.items() if isinstance(rules, Mapping) else rules)
        check_rules_apply(rules, named, _axis_sizes(mesh))
    specs = [
        leaf_spec(leaf.shape, leaf_names, mesh, table, nbytes=_nbytes(leaf))
        for leaf, leaf_names in zip(leaves, named, strict=True)
    ]
    return jax.tree.unflatten(treedef, specs)


def logical_names(boxed: Any) -> Any:
    """``(params, names)`` from parameters that may hold Flax partitioning boxes
    (``nn.with_logical_partitioning``, ``nn.with_partitioning``): the plain
    arrays, and a tree of their logical names (None where a leaf has none).
    Names given as mesh axes (``nn.with_partitioning``) are names too: the rules
    map a mesh axis's name to itself."""
    from flax.core import meta

    def is_box(x):
        return isinstance(x, meta.AxisMetadata)

    def unbox(x):
        return x.unbox() if is_box(x) else x

    def names_of(x):
        if isinstance(x, meta.Partitioned):
            return tuple(x.names)
        return None

    params = jax.tree.map(unbox, boxed, is_leaf=is_box)
    names = jax.tree.map(names_of, boxed, is_leaf=is_box)
    return params, names


def optimizer_specs(
    optimizer: optax.GradientTransformation,
    params: Any,
    specs: Any,
    mesh: Mesh | Mapping[str, int],
    *,
    shard_optimizer: bool = False,
) -> Any:
    """The `PartitionSpec` of each leaf of ``optimizer.init(params)``: a leaf that mirrors a
    parameter takes its spec (and, with ``shard_optimizer``, ``data`` added by the
    default rule); the rest are replicated. ``params`` may be shapes."""
    sizes = _axis_sizes(mesh)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = jax.eval_shape(optimizer.init, shapes)

    def mirror(leaf, spec):
        if shard_optimizer and _nbytes(leaf) >= MIN_SHARDED_BYTES:
            return add_axis(spec, leaf.shape, DATA_AXIS, sizes)
        return spec

    try:
        return optax.tree_utils.tree_map_params(
            optimizer,
            mirror,
            state,
            specs,
            transform_non_params=lambda _: PartitionSpec(),
            is_leaf=_is_spec,
        )
    except Exception:  # an optimizer whose state optax cannot map to its parameters
        return _specs_by_shape(state, params, specs, mirror)


def _specs_by_shape(state: Any, params: Any, specs: Any, mirror) -> Any:
    """Specs for a state whose leaves optax cannot map to parameters: a leaf takes the
    spec of the parameter of its shape when that spec is unique, else stays whole."""
    by_shape: dict[tuple, set] = {}
    for leaf, spec in zip(
        jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=_is_spec), strict=True
    ):
        by_shape.setdefault(tuple(leaf.shape), set()).add(spec)

    def spec_of(leaf):
        found = by_shape.get(tuple(leaf.shape), set())
        return mirror(leaf, next(iter(found))) if len(found) == 1 else PartitionSpec()

    return jax.tree.map(spec_of, state)


def shardings(specs: Any, mesh: Mesh) -> Any:
    """A tree of `PartitionSpec` as ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def bytes_per_device(tree: Any, specs: Any, mesh: Mesh | Mapping[str, int]) -> int:
    """The bytes one device holds of ``tree`` (arrays or shapes) laid out by ``specs`` (a
    tree of `PartitionSpec`, as `param_specs` and `optimizer_specs` make) on ``mesh``."""
    sizes = _axis_sizes(mesh)
    total = 0
    for leaf, spec in zip(
        jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec), strict=True
    ):
        total += _nbytes(leaf) // math.prod(sizes[a] for e in _entries(spec, 0) for a in e)
    return total


def split_counts(specs: Any) -> dict[str, int]:
    """``{mesh axis: number of leaves split over it}``, in the mesh's axis order."""
    counts: dict[str, int] = {}
    for spec in jax.tree.leaves(specs, is_leaf=_is_spec):
        for entry in _entries(spec, len(spec)):
            for axis in entry:
                counts[axis] = counts.get(axis, 0) + 1
    return {axis: counts[axis] for axis in KNOWN_AXES if axis in counts}


def describe(specs: Any) -> str:
    """``"12 of 16 parameter leaves split (fsdp: 12, model: 8)"``, for start-up lines."""
    leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    split = sum(any(entry is not None for entry in spec) for spec in leaves)
    by_axis = ", ".join(f"{axis}: {count}" for axis, count in split_counts(specs).items())
    return f"{split} of {len(leaves)} parameter leaves split" + (f" ({by_axis})" if by_axis else "")
