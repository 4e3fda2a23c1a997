"""plait: one model, any device mesh."""

__version__ = "0.1.0"


def version() -> str:
    """The installed distribution's version (this checkout's, when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("plait")
    except PackageNotFoundError:  # run from a checkout without installing
        return __version__
