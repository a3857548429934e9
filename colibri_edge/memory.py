"""How much memory this process may still take: what the engine compares its allocation with at
open, before allocating anything (a request too large is COLIBRI_ERR_OUT_OF_MEMORY with the
numbers, never a MemoryError or the kernel's OOM killer).

Host memory available = the smallest of
    MemAvailable of /proc/meminfo                     what the system can give without swapping
    the cgroup's limit minus its usage              v2 memory.max / memory.current, v1 limit_in_bytes,
      plus its file page cache (reclaimable)          memory.stat file (v2), *_file (v1)
    RLIMIT_AS minus the address space in use           a ulimit -v (the fuzz campaign sets one)
"""
from __future__ import annotations

import os
import resource


def _read_int(path):
    try:
        with open(path) as f:
            s = f.read().strip()
        return None if s in ("max", "") else int(s)
    except (OSError, ValueError):
        return None


def _meminfo(key):
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room():
    """Bytes left under this process's cgroup memory limit, or None without one."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":                       # cgroup v2
            d = "/sys/fs/cgroup" + parts[2]
            lim, cur = _read_int(d + "/memory.max"), _read_int(d + "/memory.current")
            if lim is None:
                lim, cur = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
        elif "memory" in parts[1].split(","):                        # cgroup v1
            d = "/sys/fs/cgroup/memory" + parts[2]
            lim, cur = _read_int(d + "/memory.limit_in_bytes"), _read_int(d + "/memory.usage_in_bytes")
        else:
            continue
        if lim is not None and lim < (1 << 60) and cur is not None:
            return max(0, lim - cur + _cgroup_file_cache(d, v2=parts[0] == "0"))
    return None


def _cgroup_file_cache(d: str, v2: bool) -> int:
    """The cgroup's file-backed page cache (reclaimable: the kernel drops it before it refuses memory,
    as MemAvailable counts it): v2 memory.stat `file`, v1 `total_inactive_file + total_active_file`.
    Without it, a process that has just read its model files would see the limit nearly used up."""
    keys = ("file",) if v2 else ("total_inactive_file", "total_active_file")
    out = 0
    try:
        with open(d + "/memory.stat") as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k in keys:
                    out += int(v)
    except (OSError, ValueError):
        return 0
    return out


def _address_space_room():
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
    return max(0, soft - used)


def host_available() -> tuple[int, str]:
    """-> (bytes this process may still allocate, what limits it)."""
    cands = [(v, why) for v, why in ((_meminfo("MemAvailable"), "the system's available memory"),
                                     (_cgroup_room(), "the cgroup's memory limit"),
                                     (_address_space_room(), "the address-space limit (ulimit -v)"))
             if v is not None]
    if not cands:
        return 1 << 62, "no known limit"
    return min(cands)
