"""The one exception type of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data input or on-disk state; the message names the file or key and the problem."""
