"""Version: the one place hetsplit's version is set."""

__all__ = ["__version__"]

__version__ = "0.1.0"
