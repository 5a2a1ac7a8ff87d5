"""The training layer: the only readers of `TrainConfig`.

``config`` and ``config_checks`` (the run's typed settings and their checks),
``flags`` and ``presets`` (the command line over them), ``run`` (a config made
into devices, data, model, optimizer, state and steps; ``parts`` what it takes
and returns, ``optimizer`` the config's optimizer, ``messages`` the lines that say
what it built), ``loop`` (`fit`) and ``run_actions`` (the run's own periodic
actions).
"""

from jdp import lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    {
        "jdp.training.config": ("TrainConfig",),
        "jdp.training.flags": ("parse_flags",),
        "jdp.training.loop": ("FitResult", "fit"),
        "jdp.training.presets": ("PRESETS",),
    },
)
