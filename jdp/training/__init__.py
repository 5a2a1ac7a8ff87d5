"""The training layer: the only readers of `TrainConfig`.

``config`` and ``config_checks`` (the run's typed settings and their checks),
``flags`` and ``presets`` (the command line over them), ``run`` (a config made
into devices, data, model, optimizer, state and steps; ``parts`` what it takes
and returns, ``optimizer`` the config's optimizer, ``messages`` the lines that say
what it built), ``loop`` (`fit`) and ``run_actions`` (the run's own periodic
actions).
"""

from jdp.training.config import TrainConfig as TrainConfig
from jdp.training.flags import parse_flags as parse_flags
from jdp.training.loop import FitResult as FitResult
from jdp.training.loop import fit as fit
from jdp.training.presets import PRESETS as PRESETS
