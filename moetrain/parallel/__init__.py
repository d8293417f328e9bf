"""Process layout, expert-parallel all-to-all and the DeepSpeed engine."""
