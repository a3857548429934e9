"""An emulated arm64 Debian root on an x86-64 host: how the ARM64 bundle is built and checked.

- Debian's qemu-user-static (7.2) runs aarch64 binaries through binfmt_misc. binfmt() mounts
  binfmt_misc if needed and registers qemu-aarch64-static with the F flag (the kernel opens the
  interpreter once, so it works inside a chroot without a copy of qemu there), then restores what it
  found: our entry removed, the status flag and the mount as they were -- also when the body fails.
- make_root() extracts an arm64 Debian bookworm root made by `mmdebstrap --variant=extract` from
  Debian's repositories (a few seconds; the tarball is kept in ~/.cache/colibri/aarch64, keyed by its
  package list). mounted() binds /proc, /sys and /dev into it (pyopencl's ICD loader and PoCL need
  them) and unmounts them on the way out.
- run() runs a command in the root with a clean environment (env -i: nothing of the host's PIP_* or
  PYTHON* leaks in), optionally with no network (`unshare --net`: an offline install is proven).

Needs root (mount, chroot, binfmt_misc). The host packages: qemu-user-static, mmdebstrap.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess

BINFMT = "/proc/sys/fs/binfmt_misc"
ENTRY = "colibri-aarch64"
QEMU = "/usr/bin/qemu-aarch64-static"
# the ELF header of an aarch64 executable (e_machine 0xb7), as Debian's qemu-user-static registers it
MAGIC = r"\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
MASK = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# what a board's Debian 12 image has for us: a shell, coreutils and tar, Python 3.11, the C++ and OpenMP runtimes Numba's wheels
# link, the OpenCL ICD loader with PoCL (the stand-in for a Mali driver), libpython for libcolibri.so
BOARD_PACKAGES = ["dash", "coreutils", "tar", "gzip", "python3", "libstdc++6", "libgomp1", "ocl-icd-libopencl1", "pocl-opencl-icd", "libpython3.11"]
# the build root also has the Python headers, for cross-compiling libcolibri.so against them
BUILD_PACKAGES = BOARD_PACKAGES + ["libpython3.11-dev"]
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "colibri", "aarch64")


def need_root() -> str | None:
    """None when this process can build and run an emulated root, else why not."""
    if os.geteuid() != 0:
        return "needs root (binfmt_misc, mount, chroot)"
    missing = [t for t in (QEMU, shutil.which("mmdebstrap") or "/usr/bin/mmdebstrap") if not os.path.exists(t)]
    if missing:
        return f"missing {missing}: apt-get install qemu-user-static mmdebstrap (make -C toolchains/aarch64 setup)"
    return None


@contextlib.contextmanager
def binfmt():
    """aarch64 executables run through qemu-aarch64-static while inside; the state is restored after."""
    mounted_here = False
    if not os.path.exists(os.path.join(BINFMT, "register")):
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", BINFMT], check=True)
        mounted_here = True
    status = os.path.join(BINFMT, "status")
    with open(status) as f:
        was_enabled = f.read().strip() == "enabled"
    entry = os.path.join(BINFMT, ENTRY)
    try:
        if os.path.exists(entry):                   # left by a run that was killed: ours to replace
            with open(entry, "w") as f:
                f.write("-1")
        with open(os.path.join(BINFMT, "register"), "w") as f:
            f.write(f":{ENTRY}:M::{MAGIC}:{MASK}:{QEMU}:F")
        if not was_enabled:
            with open(status, "w") as f:
                f.write("1")
        yield
    finally:
        if os.path.exists(entry):
            with open(entry, "w") as f:
                f.write("-1")
        if not was_enabled:
            with open(status, "w") as f:
                f.write("0")
        if mounted_here:
            subprocess.run(["umount", BINFMT], check=False)


def root_tarball(packages: list[str]) -> str:
    """An arm64 Debian root as a tarball (made once per package list, then kept)."""
    key = hashlib.sha256(" ".join([SUITE, MIRROR] + sorted(packages)).encode()).hexdigest()[:16]
    path = os.path.join(CACHE, f"root-{SUITE}-arm64-{key}.tar")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        tmp = path[:-len(".tar")] + ".part.tar"           # mmdebstrap picks the format by the extension
        subprocess.run(["mmdebstrap", "--quiet", "--variant=extract", "--architectures=arm64",
                        "--include=" + ",".join(packages), SUITE, tmp, MIRROR], check=True)
        os.replace(tmp, path)
    return path


def make_root(path: str, packages: list[str]) -> str:
    """A fresh arm64 root at path (whatever was there is removed)."""
    remove_root(path)
    os.makedirs(path)
    subprocess.run(["tar", "-xf", root_tarball(packages), "-C", path], check=True)   # owners, modes as made
    for d in ("proc", "sys", "dev", "tmp", "root", "opt"):
        os.makedirs(os.path.join(path, d), exist_ok=True)
    return path


def _mounts_under(path: str) -> list[str]:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return [p for p in points if p == real or p.startswith(real + "/")]


def remove_root(path: str) -> None:
    for p in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], check=False)
    if os.path.exists(path):
        shutil.rmtree(path)


@contextlib.contextmanager
def mounted(root: str):
    """/proc, /sys and /dev inside the root while inside; unmounted after, also on failure."""
    done = []
    try:
        subprocess.run(["mount", "-t", "proc", "proc", os.path.join(root, "proc")], check=True)
        done.append("proc")
        for d in ("sys", "dev"):
            subprocess.run(["mount", "--bind", "/" + d, os.path.join(root, d)], check=True)
            done.append(d)
        yield root
    finally:
        for d in reversed(done):
            if subprocess.run(["umount", os.path.join(root, d)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", os.path.join(root, d)], check=False)


def run(root: str, argv: list[str], env: dict | None = None, offline: bool = False, timeout: float = 900,
        check: bool = True) -> subprocess.CompletedProcess:
    """argv inside the root (clean environment; no network when offline); output captured as text."""
    full = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    full.update(env or {})
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    cmd = ["env", "-i"] + [f"{k}={v}" for k, v in full.items()] + [chroot, root] + list(argv)
    if offline:
        cmd = ["unshare", "--net"] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise RuntimeError(f"in the arm64 root: {' '.join(argv)} exited {p.returncode}\n"
                           f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p
