"""Files: hetsplit's JSON files on disk, written atomically and read only when they are plain files of a sane size."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
# The largest file read as a profile, plan or bench result. A profile of the most devices
# a plan takes (10,000) is a few MiB; anything far larger is not ours, and parsing it
# would cost several times its size in memory.
MAX_FILE_BYTES = 32 * 2**20


class ProfileFileError(ValueError):
    """A profile or plan file is missing, damaged, or of another schema version."""


def write_json(
    path: str | Path, kind: str, payload: dict[str, Any], *, publish: Callable[[Path, Path], Path] | None = None
) -> Path:
    """Write ``payload`` with a schema header to ``path`` (parents created) atomically; return the path.

    Written to a temporary file beside it, flushed, then renamed: an interrupted write leaves
    the old file (or none), never a half-written one. ``kind`` is what it holds (``"profile"``);
    ``publish(tmp, path)``, if given, names the finished file instead of the rename.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(path, e) from e
    tmp = _write_temp(path, kind, payload)
    try:
        if publish is not None:
            return publish(tmp, path)
        os.replace(tmp, path)
        return path
    except OSError as e:
        raise _write_error(path, e) from e
    finally:
        tmp.unlink(missing_ok=True)  # Ctrl-C or a full disk: no temporary file left, the target untouched


def _write_temp(path: Path, kind: str, payload: dict[str, Any]) -> Path:
    """The document, complete and on disk, in a hidden temporary file beside ``path``."""
    doc = {"schema": "hetsplit", "kind": kind, "schema_version": SCHEMA_VERSION, **payload}
    text = json.dumps(doc, indent=1, allow_nan=False)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _write_error(path, e) from e
    try:
        # mkstemp makes the file 0600; a profile is shared data, so follow the umask like open() does.
        os.chmod(tmp, 0o666 & ~umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _write_error(path, e) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _write_error(path: Path, error: OSError) -> ProfileFileError:
    """A failed write as one line naming the file (a full disk said only "[Errno 28]")."""
    reason = error.strerror or str(error)
    return ProfileFileError(f"cannot write {path}: {reason}; free some space or choose another place to write")


def umask() -> int:
    """The process umask, read without changing it.

    ``os.umask`` can only be read by setting it: another thread creating a file in that moment
    would get mode 0666, and two at once could leave the umask at 0. Linux reports it in
    ``/proc/self/status``; elsewhere a lock keeps our own readers from racing each other.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)  # the strictest value while it is briefly set, not 0
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def check_writable(path: str | Path, *, directory: bool = False) -> Path:
    """Raise now, before any work, if ``path`` (a file, or with ``directory`` a folder) cannot be written."""
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
        ProfileFileError: If the file is missing, damaged, not of this ``kind``, or of another
            schema version; the message names the file.
    """
    path = Path(path)
    text = _read_text(path)
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
    if isinstance(version, bool) or not isinstance(version, int):  # '1' is no version 1: an edited file
        raise ProfileFileError(
            f"{path}: damaged file: schema_version {version!r} is not a whole number (this hetsplit writes "
            f"{SCHEMA_VERSION}); re-create it with 'hetsplit profile'"
        )
    if version > SCHEMA_VERSION:  # written by a newer hetsplit: the file is fine, this hetsplit is old
        writer = doc.get("hetsplit")
        by = f" (written by hetsplit {writer})" if isinstance(writer, str) and len(writer) < 40 else ""
        raise ProfileFileError(
            f"{path}: schema version {version}{by} is newer than this hetsplit reads ({SCHEMA_VERSION}); "
            "upgrade hetsplit (pip install -U hetsplit)"
        )
    if version != SCHEMA_VERSION:
        raise ProfileFileError(
            f"{path}: schema version {version!r}, but this hetsplit reads version {SCHEMA_VERSION}; "
            "re-create it with 'hetsplit profile'"
        )
    return doc


def _read_text(path: Path) -> str:
    """The text of ``path`` if it is a regular file of at most :data:`MAX_FILE_BYTES`.

    Checked on the open descriptor (opened without blocking), so a FIFO (which would wait
    forever), ``/dev/zero`` (endless) or a file swapped in since it was listed is never read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ProfileFileError(f"{path}: no such file; run 'hetsplit profile' to make one") from None
    except OSError as e:
        raise ProfileFileError(f"{path}: cannot read it ({e.strerror})") from e
    try:
        info = os.fstat(fd)
        _check_regular(path, info)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ProfileFileError(f"{path}: cannot read it ({e.strerror})") from e
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # it grew since fstat
        _check_regular(path, info, size=len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileFileError(f"{path}: not a text file ({e.reason} at byte {e.start}); not a hetsplit file") from e


def _check_regular(path: Path, info: os.stat_result, size: int | None = None) -> None:
    """Raise unless ``info`` is that of a regular file of a size a hetsplit file can have."""
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        what = (
            "a directory" if stat.S_ISDIR(mode)
            else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file"
        )  # fmt: skip
        raise ProfileFileError(f"{path}: {what}, not a hetsplit file; give a JSON file written by hetsplit")
    size = info.st_size if size is None else size
    if size > MAX_FILE_BYTES:
        raise ProfileFileError(
            f"{path}: {size:,} bytes, larger than any hetsplit file (at most {MAX_FILE_BYTES:,}); not a hetsplit file"
        )
