"""Store: profiles and plans as versioned JSON files, written atomically, found by device set."""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import sys
import threading
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from . import files
from .devices import DeviceLike, canonical_name, local_gpus
from .files import ProfileFileError, read_json, write_json

_ENV_PROFILE_DIR = "HETSPLIT_PROFILE_DIR"


def profile_dir(directory: str | Path | None = None) -> Path:
    """Where profiles are stored and looked up: ``directory``, else ``$HETSPLIT_PROFILE_DIR``, else ``./profiles``."""
    if directory is not None:
        return Path(directory)
    env = os.environ.get(_ENV_PROFILE_DIR)
    return Path(env) if env else Path.cwd() / "profiles"


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
    publish = lambda tmp, _path: _publish_new(tmp, folder, base)
    return write_json(folder / f"{base}.json", "profile", profile.to_dict(), publish=publish)


def _publish_new(tmp: Path, folder: Path, base: str) -> Path:
    """Give the finished file ``tmp`` a name no other file has: ``base.json``, else ``base-2.json``, ...

    A hard link fails if the name exists, so two runs saving in the same second never share a
    name, and readers never see a partial file; without links, the name is reserved with ``O_EXCL``.
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


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A profile file of the store as last read: its path, its state on disk, its document."""

    path: Path
    stamp: tuple[int, ...]  # device, inode, size, modification time: a changed file is read again
    doc: dict[str, Any]


# {path: (stamp, _Stored or the reason it is skipped)}: a lookup stats every file and
# reads only those changed since the last one; a skipped file is warned about once.
_CACHE: dict[str, tuple[tuple[int, ...], _Stored | str]] = {}
_CACHE_LOCK = threading.Lock()


def find_profiles(
    devices: Sequence[DeviceLike] | None = None,
    directory: str | Path | None = None,
    *,
    host: str | None = None,
    fingerprint: str | None = None,
) -> list[Path]:
    """Profile files in the profile directory (:func:`profile_dir`), newest first: readable ones of this schema.

    Kept: those covering all ``devices`` (by name), measured on ``host`` (default: this
    machine; ``"*"``: any), of the model with ``fingerprint`` (default: any). Only regular
    ``*.json`` files of at most :data:`~hetsplit.files.MAX_FILE_BYTES` are read, a link only
    inside the directory; anything else is skipped with one warning the first time.
    """
    return [s.path for s in _stored_profiles(devices, directory, host=host, fingerprint=fingerprint)]


def _stored_profiles(
    devices: Sequence[DeviceLike] | None = None,
    directory: str | Path | None = None,
    *,
    host: str | None = None,
    fingerprint: str | None = None,
) -> list[_Stored]:
    """:func:`find_profiles` with each file's document, read once per change of the file."""
    root = profile_dir(directory)
    try:
        listing = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:  # no directory (yet), or not one
        return []
    want = {canonical_name(d) for d in devices} if devices is not None else set()
    host = platform.node() if host is None else host
    gpus = local_gpus() if want else {}
    real_root = os.path.realpath(root)
    found: list[tuple[str, float, _Stored]] = []
    skipped: list[str] = []
    for entry in listing:
        if not entry.name.endswith(".json") or entry.name.startswith("."):
            continue
        item, fresh = _load_entry(Path(entry.path), entry, real_root)
        if isinstance(item, str):
            if fresh:
                skipped.append(item)
            continue
        doc = item.doc
        try:
            names = {_local_name(d.get("info", {}), gpus) for d in doc.get("devices", [])}
        except (AttributeError, TypeError, ValueError) as e:
            _remember(item.path, item.stamp, f"{item.path}: damaged profile ({e})")
            skipped.append(f"{item.path}: damaged profile ({e})")
            continue
        model = doc.get("model")
        if fingerprint is not None and not (isinstance(model, dict) and model.get("fingerprint") == fingerprint):
            continue
        if want <= names and (host == "*" or doc.get("host") == host):
            found.append((str(doc.get("created", "")), item.stamp[-1], item))
    if skipped:
        _warn_skipped(skipped)
    with _CACHE_LOCK:  # forget files no longer there
        for key in [k for k in _CACHE if os.path.dirname(k) == str(root) and not os.path.lexists(k)]:
            del _CACHE[key]
    found.sort(key=lambda item: item[:2], reverse=True)
    return [item for _, _, item in found]


def _load_entry(path: Path, entry: os.DirEntry[str], real_root: str) -> tuple[_Stored | str, bool]:
    """The stored profile at ``path``, or why it is skipped; and whether that is news (not cached)."""
    try:
        info = entry.stat(follow_symlinks=True)
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror})", False  # a dangling link: nothing to warn again and again
    stamp = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    with _CACHE_LOCK:
        cached = _CACHE.get(str(path))
    if cached is not None and cached[0] == stamp:
        return cached[1], False
    result: _Stored | str
    if entry.is_symlink() and os.path.dirname(os.path.realpath(path)) != real_root:
        result = f"{path}: a link to {os.path.realpath(path)}, outside the profile directory; not followed"
    else:
        try:
            files._check_regular(path, info)
            result = _Stored(path, stamp, read_json(path, "profile"))
        except ProfileFileError as e:
            result = str(e)
    _remember(path, stamp, result)
    return result, True


def _remember(path: Path, stamp: tuple[int, ...], result: _Stored | str) -> None:
    with _CACHE_LOCK:
        _CACHE[str(path)] = (stamp, result)


def _warn_skipped(reasons: list[str]) -> None:
    shown = "; ".join(reasons[:5]) + (f"; and {len(reasons) - 5} more" if len(reasons) > 5 else "")
    noun = "a stored profile" if len(reasons) == 1 else f"{len(reasons)} stored profiles"
    warn_at_caller(f"hetsplit: skipping {noun}: {shown}")


def _skip_damaged(item: _Stored, reason: str) -> None:
    """Mark a stored profile damaged inside (found when it is loaded): skipped with a warning, once."""
    with _CACHE_LOCK:
        cached = _CACHE.get(str(item.path))
        fresh = cached is None or not isinstance(cached[1], str) or cached[0] != item.stamp
        _CACHE[str(item.path)] = (item.stamp, reason)
    if fresh:
        _warn_skipped([reason])


_PACKAGE = os.path.dirname(os.path.abspath(__file__))

# The variable that silences hetsplit's lines about a split (every integration's report,
# hd.plan's, HeteroDataParallel's), as quiet=True does.
QUIET_ENV = "HETSPLIT_QUIET"


def is_quiet(quiet: bool) -> bool:
    """``quiet``, or ``$HETSPLIT_QUIET`` set to anything but empty, ``0``, ``false``, ``no`` or ``off``."""
    flag = os.environ.get(QUIET_ENV, "").strip().lower()
    return bool(quiet) or flag not in ("", "0", "false", "no", "off")


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` reported at the first line outside hetsplit and torch: the user's call.

    torch's frames are skipped too: ``dp(x)`` reaches hetsplit through ``nn.Module.__call__``,
    whose line the user never wrote.
    """
    torch = sys.modules.get("torch")
    torch_file = None if torch is None else torch.__file__
    skip = (_PACKAGE + os.sep,) + ((os.path.dirname(torch_file) + os.sep,) if torch_file is not None else ())
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=skip)
        return
    level = 1
    frame: types.FrameType | None = sys._getframe(0)  # None past the outermost frame
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def _local_name(info: dict[str, Any], gpus: dict[str, str]) -> Any:
    """A stored device's name on this machine: its GPU's current index when the UUID is here."""
    name = gpus.get(info.get("uuid") or "") if info.get("kind") == "cuda" else None
    if name is None:
        return info.get("name")
    return f"{name}@{info.get('speed', 1.0):g}" if info.get("emulated") else name
