"""Conversion between moetrain checkpoints and Hugging Face models."""
