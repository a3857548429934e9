"""The cores the cpu backend takes (backends/cpu/cores.py): cgroup quotas and affinity masks read as
the kernel writes them, busy time from /proc/stat, the governor dropping a thread for a process
that takes a core, and the kernels' work claiming handing out every row exactly once."""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from colibri_edge.backends.cpu import cores


def _cgroup(tmp_path, v2_files=None, v1=None, path="/app/worker"):
    """A fake /sys/fs/cgroup tree and /proc/self/cgroup for a process in `path`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "cg"
    if v2_files is not None:
        (tmp_path / "self_cgroup").write_text(f"0::{path}\n")
        for rel, text in v2_files.items():
            d = root / rel.strip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "cpu.max").write_text(text)
    else:
        (tmp_path / "self_cgroup").write_text(f"4:cpu,cpuacct:{path}\n2:memory:{path}\n")
        for rel, (quota, period) in v1.items():
            d = root / "cpu,cpuacct" / rel.strip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    return str(root), str(tmp_path / "self_cgroup")


def test_cgroup_v2_quota(tmp_path):
    root, pc = _cgroup(tmp_path, {"/app/worker": "150000 100000\n", "/app": "max 100000\n"})
    assert cores.cgroup_cpu_limit(root, pc) == pytest.approx(1.5)


def test_cgroup_v2_unlimited_and_parent_tighter(tmp_path):
    root, pc = _cgroup(tmp_path, {"/app/worker": "max 100000\n"})
    assert cores.cgroup_cpu_limit(root, pc) is None
    root, pc = _cgroup(tmp_path / "b", {"/app/worker": "400000 100000\n", "/app": "50000 100000\n"})
    assert cores.cgroup_cpu_limit(root, pc) == pytest.approx(0.5)      # the tightest on the way up


def test_cgroup_v1_quota(tmp_path):
    root, pc = _cgroup(tmp_path, v1={"/app/worker": (250000, 100000), "/": (-1, 100000)})
    assert cores.cgroup_cpu_limit(root, pc) == pytest.approx(2.5)
    root, pc = _cgroup(tmp_path / "b", v1={"/app/worker": (-1, 100000)})
    assert cores.cgroup_cpu_limit(root, pc) is None


def test_cgroup_unreadable(tmp_path):
    assert cores.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None


def test_busy_seconds_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    #            user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 0 300 5000 10 0 0 0 0 0\n"
                    "cpu0 100 5 50 2000 7 1 2 3 0 0\n"
                    "cpu1 800 0 250 3000 3 4 5 6 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert cores.cpu_busy_seconds({0}, str(stat)) == pytest.approx((100 + 5 + 50 + 1 + 2 + 3) / hz)
    assert cores.cpu_busy_seconds({0, 1}, str(stat)) == pytest.approx((161 + 800 + 250 + 4 + 5 + 6) / hz)
    assert cores.cpu_busy_seconds({0}, str(tmp_path / "none")) is None


AFFINITY = textwrap.dedent("""
    import os, sys
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from colibri_edge.backends.cpu.backend import Backend
    b = Backend()
    print(b.num_threads, b.threads)
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity on this OS")
def test_threads_follow_the_affinity_mask():
    """A process limited to one CPU (taskset) gets one thread, whatever os.cpu_count() says."""
    out = subprocess.run([sys.executable, "-c", AFFINITY], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"], out.stdout + out.stderr


BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


@pytest.mark.skipif(len(cores.affinity()) < 2 or not os.path.exists("/proc/stat"),
                    reason="needs 2 CPUs and /proc/stat to have one taken by another process")
def test_governor_drops_a_thread_for_a_busy_core():
    """Another process spinning on one of our CPUs counts as ~1 core taken, and the governor then
    runs one thread fewer (after two windows that agree)."""
    cpus = sorted(cores.affinity())
    g = cores.Governor(len(cpus))
    busy = subprocess.Popen([sys.executable, "-c", BUSY, str(cpus[-1])])
    try:
        seen = []
        deadline = time.monotonic() + 12 * cores.WINDOW
        while time.monotonic() < deadline and (len(seen) < 3 or g.threads == len(cpus)):
            time.sleep(cores.WINDOW / 4)
            g.tick()
            seen.append(round(g.others, 2))
        assert g.others >= 0.6, seen
        assert g.threads <= len(cpus) - 1, (g.threads, seen)
    finally:
        busy.kill()
        busy.wait()


CLAIM = None


def _claim_kernel():
    """claim() run serially for a given order of threads' calls (a thread that never shows up, one
    that comes late): -> the rows each call got."""
    global CLAIM
    if CLAIM is None:
        from numba import njit
        from colibri_edge.backends.cpu.kernels import claim, reset_claims

        @njit
        def run(work, N, order, got):
            reset_claims(work)
            n = 0
            for c in order:
                lo, hi = claim(work, c, N)
                got[n, 0], got[n, 1], got[n, 2] = c, lo, hi
                n += 1
            return n
        CLAIM = run
    return CLAIM


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("N", [1, 5, 64, 130, 1000, 2816])
def test_claim_hands_out_every_row_once(threads, N):
    """Whatever order threads come in, including threads that never come, every row of N is
    handed out exactly once and each thread first gets its own share's chunks."""
    run = _claim_kernel()
    rng = np.random.default_rng(N * 10 + threads)
    for pattern in ("only0", "random", "last_late"):
        calls = 4 * N + 8 * threads
        if pattern == "only0":
            order = np.zeros(calls, np.int64)
        elif pattern == "random":
            order = rng.integers(0, threads, calls)
        else:
            order = np.concatenate([rng.integers(0, max(1, threads - 1), calls), np.full(8, threads - 1)])
        work = np.zeros((threads, 8), np.int64)
        got = np.zeros((len(order), 3), np.int64)
        n = run(work, N, order, got)
        cover = np.zeros(N, np.int64)
        for c, lo, hi in got[:n]:
            cover[lo:hi] += 1
        assert (cover == 1).all(), (pattern, np.flatnonzero(cover != 1)[:10])
        first = got[:n][order[:n] == 0]
        if N >= threads:
            assert first[0, 1] == 0      # thread 0's first chunk is the start of its own share
