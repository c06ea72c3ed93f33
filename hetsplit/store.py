"""Store: profiles and plans as versioned JSON files, written atomically, found by device set."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from .devices import DeviceLike, canonical_name, local_gpus

__all__ = [
    "SCHEMA_VERSION",
    "ENV_PROFILE_DIR",
    "ProfileFileError",
    "profile_dir",
    "write_json",
    "read_json",
    "check_writable",
    "save_profile",
    "find_profiles",
    "warn_at_caller",
]

SCHEMA_VERSION = 1
ENV_PROFILE_DIR = "HETSPLIT_PROFILE_DIR"


class ProfileFileError(ValueError):
    """A profile or plan file is missing, damaged, or of another schema version."""


def profile_dir(directory: str | Path | None = None) -> Path:
    """Where profiles are stored and looked up.

    Lookup order: the ``directory`` argument (``--profile-dir`` on the CLI), then the
    ``HETSPLIT_PROFILE_DIR`` environment variable, then ``./profiles`` in the current
    working directory.
    """
    if directory is not None:
        return Path(directory)
    env = os.environ.get(ENV_PROFILE_DIR)
    return Path(env) if env else Path.cwd() / "profiles"


def write_json(path: str | Path, kind: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` with a schema header to ``path`` atomically.

    The JSON goes to a temporary file in the same directory, is flushed to disk, then
    renamed over ``path``: an interrupted write leaves the old file (or none), never a
    half-written one.

    Args:
        path: Target file; parent directories are created.
        kind: What the file holds (``"profile"``, ``"plan"``, ``"bench"``).
        payload: JSON-ready data.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, kind, payload)
    try:
        os.replace(tmp, path)
    except BaseException:
        # Ctrl-C or a full disk: drop the temporary file, leave the target untouched.
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_temp(path: Path, kind: str, payload: dict[str, Any]) -> Path:
    """The document, complete and on disk, in a hidden temporary file beside ``path``."""
    doc = {"schema": "hetsplit", "kind": kind, "schema_version": SCHEMA_VERSION, **payload}
    text = json.dumps(doc, indent=1, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; a profile is shared data, so follow the umask like open() does.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(path: str | Path, *, directory: bool = False) -> Path:
    """Raise now, before any work, if ``path`` (a file, or with ``directory`` a folder) cannot be written.

    Raises:
        ProfileFileError: Naming the path and what is wrong.
    """
    path = Path(path)
    folder = path if directory else path.parent
    if not directory and path.is_dir():
        raise ProfileFileError(f"{path} is a directory; give a file name, e.g. {path / 'profile.json'}")
    if folder.exists() and not folder.is_dir():
        raise ProfileFileError(f"{folder} is not a directory; choose another place to write")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:  # a real write: permission bits say nothing for root, or on /proc and read-only mounts
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        what = f"{folder}" if directory else f"{folder} (for {path.name})"
        raise ProfileFileError(
            f"cannot write to {what}: {e.strerror} (creating a file in {existing}); choose another place"
        ) from None
    return path


def read_json(path: str | Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """Read a file written by :func:`write_json`, checking its kind and schema version.

    Raises:
        ProfileFileError: If the file is missing, not valid JSON, not a hetsplit file of
            this ``kind``, or of another schema version; the message names the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileFileError(f"{path}: no such file; run 'hetsplit profile' to make one") from None
    except UnicodeDecodeError as e:
        raise ProfileFileError(f"{path}: not a text file ({e.reason} at byte {e.start}); not a hetsplit file") from e
    except OSError as e:
        raise ProfileFileError(f"{path}: cannot read it ({e.strerror})") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileFileError(
            f"{path}: damaged file, not valid JSON ({e.msg} at line {e.lineno}); re-create it"
        ) from e
    except ValueError as e:  # e.g. an integer of thousands of digits
        raise ProfileFileError(f"{path}: damaged file, not a hetsplit file ({str(e)[:80]})") from e
    except RecursionError as e:  # absurdly nested JSON: no file of ours looks like that
        raise ProfileFileError(f"{path}: damaged file, nested too deeply to be a hetsplit file") from e
    if not isinstance(doc, dict) or doc.get("schema") != "hetsplit":
        raise ProfileFileError(f"{path}: not a hetsplit file")
    kinds = (kind,) if isinstance(kind, str) else kind
    if doc.get("kind") not in kinds:
        wanted = " or ".join(repr(k) for k in kinds)
        raise ProfileFileError(f"{path}: holds a {doc.get('kind')!r}, expected a {wanted}")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileFileError(
            f"{path}: schema version {version!r}, but this hetsplit reads version {SCHEMA_VERSION}; "
            "re-create it with 'hetsplit profile'"
        )
    return doc


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "x"


class _Saveable(Protocol):
    model: dict[str, Any]
    host: str
    created: str

    @property
    def devices(self) -> list[str]: ...

    def to_dict(self) -> dict[str, Any]: ...


def save_profile(profile: _Saveable, path: str | Path | None = None, *, directory: str | Path | None = None) -> Path:
    """Write ``profile`` as JSON (see :meth:`hetsplit.Profile.save`)."""
    if path is not None:
        return write_json(path, "profile", profile.to_dict())
    model = profile.model.get("name", "model")
    stamp = re.sub(r"[^0-9]", "", profile.created)[:14]
    base = f"{_slug(profile.host)}_{_slug(model)}_{_slug('+'.join(profile.devices))}_{stamp}"[:200]
    folder = profile_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(folder / f"{base}.json", "profile", profile.to_dict())
    try:
        return _publish_new(tmp, folder, base)
    finally:
        tmp.unlink(missing_ok=True)  # Ctrl-C or an error: nothing left behind


def _publish_new(tmp: Path, folder: Path, base: str) -> Path:
    """Give the finished file ``tmp`` a name no other file has: ``base.json``, else ``base-2.json``, ...

    A hard link fails if the name exists, so two runs saving in the same second never
    share a name and never overwrite each other, and readers never see a partial file.
    Where links are not supported, the name is reserved with ``O_EXCL`` and replaced.
    """
    for k in range(1, 10_000):
        path = folder / (f"{base}.json" if k == 1 else f"{base}-{k}.json")
        try:
            os.link(tmp, path)
            return path
        except FileExistsError:
            continue
        except OSError:  # no hard links on this file system
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            except FileExistsError:
                continue
            try:
                os.replace(tmp, path)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            return path
    raise ProfileFileError(f"{folder}: no free file name for {base}; clean the profile directory")


def find_profiles(
    devices: Sequence[DeviceLike] | None = None,
    directory: str | Path | None = None,
    *,
    host: str | None = None,
) -> list[Path]:
    """Profile files in the profile directory, newest first.

    Args:
        devices: If given, keep only profiles that cover all these devices (by name,
            including the emulation suffix).
        directory: Where to look (see :func:`profile_dir`).
        host: Keep only profiles measured on this host (default: this machine; ``"*"``: any).

    Returns:
        Paths of readable profiles of the current schema; damaged files are skipped.
    """
    root = profile_dir(directory)
    if not root.is_dir():
        return []
    want = {canonical_name(d) for d in devices} if devices is not None else set()
    host = platform.node() if host is None else host
    gpus = local_gpus() if want else {}
    found: list[tuple[str, Path]] = []
    for path in root.glob("*.json"):
        try:
            doc = read_json(path, "profile")
            names = {_local_name(d.get("info", {}), gpus) for d in doc.get("devices", [])}
        except ProfileFileError as e:
            warn_at_caller(f"hetsplit: skipping a stored profile: {e}")
            continue
        except (AttributeError, TypeError, ValueError) as e:
            warn_at_caller(f"hetsplit: skipping a stored profile: {path}: damaged profile ({e})")
            continue
        if want <= names and (host == "*" or doc.get("host") == host):
            found.append((str(doc.get("created", "")), _mtime(path), path))
    found.sort(key=lambda item: item[:2], reverse=True)
    return [p for _, _, p in found]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed since it was read
        return 0.0


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` reported at the first line outside hetsplit: the user's call.

    Python 3.12+ skips hetsplit's frames itself (``skip_file_prefixes``); before that the
    ``stacklevel`` is counted by walking the stack.
    """
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=(_PACKAGE + os.sep,))
        return
    level, frame = 1, sys._getframe(0)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def _local_name(info: dict[str, Any], gpus: dict[str, str]) -> Any:
    """A stored device's name on this machine: its GPU's current index when the UUID is here."""
    name = gpus.get(info.get("uuid") or "") if info.get("kind") == "cuda" else None
    if name is None:
        return info.get("name")
    return f"{name}@{info.get('speed', 1.0):g}" if info.get("emulated") else name
