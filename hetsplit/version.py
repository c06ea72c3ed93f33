"""Version: the one place hetsplit's version is set, and what a name removed before a release says."""

__version__ = "0.1.0"


def no_attribute(module: str, name: str, removed: dict[str, str]) -> AttributeError:
    """The ``AttributeError`` of ``module.name``: for a name in ``removed``, one line naming its replacement."""
    instead = f"; it was removed: use {removed[name]}" if name in removed else ""
    return AttributeError(f"module {module!r} has no attribute {name!r}{instead}")
