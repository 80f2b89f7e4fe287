"""Loggers of apex.transformer: children of the ``apex`` logger, so one call sets their level."""

from __future__ import annotations

import logging
import os


def get_transformer_logger(name: str) -> logging.Logger:
    """The logger named after ``name`` without a file extension (pass ``__name__``)."""
    return logging.getLogger(os.path.splitext(name)[0])


def set_logging_level(verbosity: int | str) -> None:
    """Set the level of apex's root logger (``logging.getLogger("apex")``), hence of every apex logger."""
    logging.getLogger("apex").setLevel(verbosity)
