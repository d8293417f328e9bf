"""The training loop, optimiser and schedules, checkpoints, training metrics."""
