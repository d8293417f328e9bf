"""Optimizers behind a registry (``optim.name``) and the learning-rate schedules.

- :mod:`~moetrain.optim.registry`: :class:`OptimizerSpec` (parameter groups, the torch
  optimizer, its state's names, its bytes per parameter) and the registered optimizers.
- :mod:`~moetrain.optim.groups`: the decay rules and DeepSpeed's MoE split every optimizer uses.
- :mod:`~moetrain.optim.adamw`: AdamW, the default.
- :mod:`~moetrain.optim.schedule`: learning-rate schedules, independent of the optimizer.

DeepSpeed is imported inside the functions that need it; importing this package costs nothing
beyond the config.
"""
