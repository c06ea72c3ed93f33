"""Hardware facts the device descriptions quote: the CPU's name, host memory, the NVIDIA driver."""

from __future__ import annotations

import functools
import os
import platform


def cpu_name() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


@functools.lru_cache(maxsize=1)
def nvidia_driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi``, or ``None`` where it can't be asked."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def host_memory() -> int | None:
    """Bytes of physical memory of this machine, if the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
