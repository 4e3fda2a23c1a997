"""plait: one model, any device mesh."""

__version__ = "0.1.0"
