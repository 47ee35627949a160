"""How much host memory the machine has, and how much can be allocated now.

Read by the device identity (a CPU's "device memory"), by the probes (which size their
buffers to fit), and by the runtime and the optimizer (pinned host state).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["available_host_memory_bytes", "total_host_memory_bytes"]


def total_host_memory_bytes() -> int:
    """Physical host memory in bytes, lowered to the cgroup memory limit when one is set.

    Pinned (page-locked) host memory counts against that limit, so it is the one that
    matters for pinned master weights. Returns 0 when the platform reports neither.
    """
    physical = _sysconf_bytes("SC_PHYS_PAGES")
    limit = _cgroup_limit_bytes()
    if limit is not None and (physical == 0 or limit < physical):
        return limit
    return physical


def available_host_memory_bytes() -> int:
    """Host memory in bytes that can be allocated now without swapping (``MemAvailable``).

    Falls back to the free pages the OS reports, then to :func:`total_host_memory_bytes`.
    """
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file counts KiB
                total = total_host_memory_bytes()
                return min(available, total) if total else available
    free = _sysconf_bytes("SC_AVPHYS_PAGES")
    return free or total_host_memory_bytes()


def _sysconf_bytes(pages_name: str) -> int:
    try:
        return int(os.sysconf(pages_name)) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def _cgroup_limit_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            value = int(Path(path).read_text().strip())  # "max" (no limit) raises ValueError
            # cgroup v1 reports "no limit" as a huge page-rounded number.
            if 0 < value < 2**60:
                return value
    return None
