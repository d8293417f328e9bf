"""Checkpoints: the on-disk format and everything that reads or writes it.

- :mod:`~moetrain.checkpoint.format`: file names, DeepSpeed key patterns, the trainer-state
  schema, the commit manifest (the only place they are spelled).
- :mod:`~moetrain.fileio`: atomic writes and fsync (used by data/ and convert/ too).
- :mod:`~moetrain.checkpoint.catalog`: the checkpoints of a run directory, retention.
- :mod:`~moetrain.checkpoint.checkpointer`: save / resume during training, on every rank (the
  run's stateful objects: engine, progress, schedule, loss scaler, data position, RNG).
- :mod:`~moetrain.checkpoint.rank_files`: the files one rank writes in a save (fsynced,
  measured, errors kept).
- :mod:`~moetrain.checkpoint.reshard`: optimizer state re-partitioned for another layout.
- :mod:`~moetrain.checkpoint.read`: a checkpoint into a single-device model.
- :mod:`~moetrain.checkpoint.write`: a checkpoint from streamed weights (import, upcycling).

Modules are imported on demand; importing this package costs nothing.
"""
