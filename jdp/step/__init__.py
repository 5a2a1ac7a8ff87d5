"""Train and eval steps compiled over a mesh, with the ``jit`` or the ``pmap`` backend.

`jdp.replica` says what one replica computes; this package states, once, how it
is compiled: shardings, donation, the backends and the bound on calls in flight
(`CompiledStep`). Both backends run the same per-replica function and take and
return the same state and batch.

One module per way of compiling: `contract` (what every way keeps),
`data_parallel`, `sharded` layouts, the `pmap` backend and DiLoCo's `groups` (each
device's maths in `group_maths`); `builders` chooses among them, by the mesh and
the state's `jdp.state.Placement`. `adopt` compiles a train step of your own,
written for ``pmap``, and `axes` checks the axis names a step reduces over.
"""

from jdp.step.adopt import data_parallel_step as data_parallel_step
from jdp.step.builders import evaluate as evaluate
from jdp.step.builders import make_eval_step as make_eval_step
from jdp.step.builders import make_train_step as make_train_step
from jdp.step.contract import BACKENDS as BACKENDS
from jdp.step.contract import Backend as Backend
from jdp.step.contract import CompiledStep as CompiledStep
from jdp.step.groups import SyncStep as SyncStep
from jdp.step.groups import make_sync_step as make_sync_step
