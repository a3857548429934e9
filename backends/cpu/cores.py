"""The cores the cpu backend gets: how many the process may use, and how many other processes are
taking right now.

available_cores(): the CPUs in the process's affinity mask (sched_getaffinity: taskset, cpusets,
Android's foreground/background cpusets), capped by a cgroup CPU quota (cgroup v2 cpu.max, v1
cpu.cfs_quota_us / cpu.cfs_period_us: `docker --cpus`, systemd CPUQuota): a quota of 1.5 CPUs
gives 2 threads, each then throttled, rather than a thread count the quota cannot run.

Governor: with COLIBRI_NUM_THREADS unset, the thread count follows the cores other processes leave
free. Every WINDOW seconds (checked once per step, never inside one) it reads the busy time of the
affinity CPUs from /proc/stat and the process's own CPU time, so

    others = (busy(affinity CPUs) - own CPU time) / wall time          (in cores)
    threads = clamp(floor(cores - others + SLACK), 1, cores)

Our own threads sleep after a short spin (see backend.py), so a waiting thread is hardly counted
as busy. Why fewer threads rather than all of them with work claiming: a parallel region ends only
when every thread of the team has arrived, so a thread that shares its core with a busy process
costs each region that thread's wake-up latency. Measured on the 2-core CI host, float16 benchmark
model, a loop spinning on one core, 1 and 2 threads alternating in one process: 33.3 vs 31.6 tok/s
(OMP_WAIT_POLICY=passive; with the short spin, fixed 2 threads fell to 21 while the governor kept
32-34), and with a loop taking half a core 29.5 vs 27.7. SLACK = 0.35 keeps the full count while
others take under 0.35 core (the host's background) and drops a thread for a process taking half
a core. A change needs two windows in a row that agree (no flapping on one noisy reading), so it
takes effect 0.25-0.5 s after the load changes.
"""
from __future__ import annotations

import math
import os
import time

WINDOW = 0.25          # seconds between readings of /proc/stat (100 Hz ticks: 25 a CPU a window)
SLACK = 0.35           # cores others may take before a thread is dropped (see above)


def cgroup_cpu_limit(root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (quota / period), or None when unlimited or
    unknown. cgroup v2: <root>/<path>/cpu.max "max 100000" or "150000 100000"; v1: the cpu
    controller's cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us. The tightest quota on the
    way up to the root applies."""
    try:
        with open(proc_cgroup) as f:
            entries = [ln.rstrip("\n").split(":", 2) for ln in f if ln.strip()]
    except OSError:
        return None
    limits = []
    for hid, ctrls, path in entries:
        v2 = hid == "0" and ctrls == ""
        if not v2 and "cpu" not in ctrls.split(","):
            continue
        base = root if v2 else next((os.path.join(root, d) for d in (ctrls, "cpu,cpuacct", "cpu")
                                     if os.path.isdir(os.path.join(root, d))), None)
        if base is None:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            q = _read_quota(d, v2)
            if q is not None:
                limits.append(q)
    return min(limits) if limits else None


def _read_quota(d, v2):
    try:
        if v2:
            with open(os.path.join(d, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(d, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def affinity() -> set:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):          # not Linux
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by its cgroup quota (rounded up)."""
    n = len(affinity()) or 1
    q = cgroup_cpu_limit()
    if q is not None:
        n = min(n, max(1, math.ceil(q - 1e-9)))
    return n


def cpu_busy_seconds(cpus, stat="/proc/stat") -> float | None:
    """Busy seconds so far of the given CPUs (user + nice + system + irq + softirq + steal), or
    None where /proc/stat cannot be read."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        with open(stat) as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *v = line.split()
                if int(name[3:]) in cpus:
                    total += int(v[0]) + int(v[1]) + int(v[2]) + int(v[5]) + int(v[6]) + int(v[7])
    except (OSError, ValueError, IndexError):
        return None
    return total / hz


class Governor:
    """The thread count for the next steps: `max_threads` on a quiet machine, fewer while other
    processes take cores (see the module docstring). `threads` is what the kernels run on now."""

    def __init__(self, max_threads: int):
        self.max_threads = self.threads = max_threads
        self.cpus = affinity()
        self.others = 0.0                      # cores other processes took in the last window
        self._pending = max_threads
        self._last = self._sample(time.monotonic())
        self._next = time.monotonic() + WINDOW
        self.enabled = self._last is not None and max_threads > 1

    def _sample(self, now):
        busy = cpu_busy_seconds(self.cpus)
        return None if busy is None else (now, busy, time.process_time())

    def tick(self) -> int:
        """Called once per step: re-reads the load when a window has passed. -> the thread count."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now < self._next:
            return self.threads
        self._next = now + WINDOW
        cur = self._sample(now)
        if cur is None:
            return self.threads
        (t0, b0, p0), (t1, b1, p1) = self._last, cur
        self._last = cur
        wall = t1 - t0
        if wall <= 0:
            return self.threads
        self.others = max(0.0, ((b1 - b0) - (p1 - p0)) / wall)
        want = max(1, min(self.max_threads, math.floor(len(self.cpus) - self.others + SLACK)))
        if want == self._pending:
            self.threads = want
        self._pending = want
        return self.threads
