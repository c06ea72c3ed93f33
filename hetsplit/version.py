"""Version: the one place hetsplit's version is set, how versions compare, what a removed name says."""

import re

__version__ = "0.1.0"


def release(version: str, parts: int = 3) -> tuple[int, ...]:
    """The leading numbers of a version string (``"2.15.0+cu130"`` → ``(2, 15, 0)``); ``()`` if it has none."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in found[0].split(".")[:parts]) if found is not None else ()


def no_attribute(module: str, name: str, removed: dict[str, str]) -> AttributeError:
    """The ``AttributeError`` of ``module.name``: for a name in ``removed``, one line naming its replacement."""
    instead = f"; it was removed: use {removed[name]}" if name in removed else ""
    return AttributeError(f"module {module!r} has no attribute {name!r}{instead}")
