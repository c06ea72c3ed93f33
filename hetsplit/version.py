"""Version: the one place hetsplit's version is set."""

__version__ = "0.1.0"
