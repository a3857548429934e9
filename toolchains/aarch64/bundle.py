"""Build the deployment bundle for an aarch64 board with Python 3.11 (`make bundle-aarch64`).

    python toolchains/aarch64/bundle.py [--out build/bundle-aarch64] [--model DIR] [--cpu cortex-a76]

The bundle (a folder and OUT.tar.gz beside it):
    install.sh        offline install: sh install.sh [PREFIX] (default /opt/colibri); needs python3 (3.11)
    wheels/           colibri-edge's wheel, its dependencies' aarch64 wheels (cp311, manylinux_2_17..2_28;
                      no PoCL wheel: pocl-binary-distribution is x86-64 only, the board's own OpenCL
                      driver is used through pyopencl's ICD loader) and pip's wheel (install.sh runs it)
    bin/colibri       the launcher (colibri_edge/serving/launch.py): PYTHONPATH, the Numba target CPU and the
    bin/colibri-python  kernel cache, then `colibri ARGS` or `python3 SCRIPT`
    kernel-cache/CPU/ the cpu backend's Numba kernels for --cpu and for generic, compiled by running the
                      bundle's model once under emulation (so only the formats that model uses)
    lib/libcolibri.so the C interface for aarch64 and include/colibri.h (toolchains/capi), cross-compiled
                      with Debian's aarch64-linux-gnu-gcc against the build root's Python headers
    model/            the model directory given by --model (default: none; the package's demo model)
    bundle.json       what is inside: CPUs, versions, the kernels compiled for each CPU

How: the wheels come from PyPI through the host's pip (`pip download --platform ... --only-binary`), the
requirements taken from colibri-edge's own metadata with its environment markers evaluated for
aarch64. An arm64 Debian root (emuroot.py) gets the wheels unpacked by the host's pip (fast), then
runs `bin/colibri run` once per CPU under qemu-user: a cold Numba compile takes about 2.5 minutes
emulated, the two CPUs run in parallel. Needs root (binfmt_misc, chroot) and Debian's qemu-user-static,
mmdebstrap and gcc-aarch64-linux-gnu (make -C toolchains/aarch64 setup).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import email.parser
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import emuroot  # noqa: E402

PYVER = "3.11"
PLATFORMS = ["manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_26_aarch64",
             "manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"]
EXTRAS = ("opencl", "capi")
# the environment markers of a Debian 12 aarch64 board
BOARD_ENV = {"platform_machine": "aarch64", "sys_platform": "linux", "platform_system": "Linux",
             "os_name": "posix", "python_version": PYVER, "python_full_version": PYVER + ".2",
             "implementation_name": "cpython", "platform_python_implementation": "CPython"}
BUILD_PREFIX = "/opt/colibri-build"        # where the build root has the bundle (the board uses another)

LAUNCHER = """#!/bin/sh
# Colibri Edge bundle launcher: the bundle's packages, its Numba kernel cache and target CPU
# (colibri_edge/serving/launch.py), then {what}. COLIBRI_CPU=NAME picks the kernels' CPU by hand.
PREFIX=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
export COLIBRI_BUNDLE="$PREFIX"
export PYTHONPATH="$PREFIX/site-packages${{PYTHONPATH:+:$PYTHONPATH}}"
exec "${{COLIBRI_PYTHON:-python3}}" -m colibri_edge.serving.launch {args}"$@"
"""

INSTALL = """#!/bin/sh
# Offline install of this Colibri Edge bundle on an aarch64 board with Python 3.11 (Debian 12's python3):
#   sh install.sh [PREFIX]          default PREFIX: /opt/colibri; then PREFIX/bin/colibri run
# Nothing is downloaded: pip runs from its own wheel here, with --no-index.
set -eu
HERE=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
PREFIX=${1:-/opt/colibri}
PY=${COLIBRI_PYTHON:-python3}
"$PY" -c 'import platform, sys
ok = platform.machine() == "aarch64" and sys.version_info[:2] == (3, 11)
ok or sys.exit("this bundle is for aarch64 with Python 3.11; this is %s with Python %s"
               % (platform.machine(), platform.python_version()))'
mkdir -p "$PREFIX"
PIP=$(ls "$HERE"/wheels/pip-*.whl | head -n 1)
"$PY" "$PIP/pip" install --quiet --no-index --no-cache-dir --disable-pip-version-check --root-user-action=ignore \\
    --find-links "$HERE/wheels" --target "$PREFIX/site-packages" --upgrade "colibri-edge[@EXTRAS@]"
for d in bin kernel-cache lib include model bundle.json; do
    if [ -e "$HERE/$d" ]; then rm -rf "$PREFIX/$d"; cp -R "$HERE/$d" "$PREFIX/$d"; fi
done
echo "Colibri Edge installed in $PREFIX: $PREFIX/bin/colibri run"
"""


def log(msg):
    print(f"[bundle-aarch64] {msg}", flush=True)


def pip(*args, quiet=True):
    cmd = [sys.executable, "-m", "pip", *args] + (["-q"] if quiet else [])
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS",)}
    subprocess.run(cmd, check=True, env=env)


def requirements(wheel: str) -> list[str]:
    """colibri-edge's Requires-Dist with its extras, markers evaluated for the aarch64 board."""
    from packaging.requirements import Requirement
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        r = Requirement(line)
        if r.marker is not None and not any(r.marker.evaluate({**BOARD_ENV, "extra": e}) for e in ("",) + EXTRAS):
            continue                                   # e.g. pocl-binary-distribution: x86-64 only
        r.marker = None
        out.append(str(r))
    return out


def wheels(dst: str) -> list[str]:
    """The project's wheel + its aarch64 dependencies + pip, in dst; -> the file names."""
    os.makedirs(dst, exist_ok=True)
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", dst, REPO)
    own = glob.glob(os.path.join(dst, "colibri_edge-*.whl"))[0]
    reqs = requirements(own)
    import cffi                                          # the generated C checks _cffi_backend's version
    reqs = [r for r in reqs if not r.startswith("cffi")] + [f"cffi=={cffi.__version__}"]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--only-binary=:all:", *plat, "--python-version", PYVER, "--implementation", "cp",
        "--abi", "cp" + PYVER.replace(".", ""), "--abi", "abi3", "--abi", "none", "-d", dst, *reqs)
    pip("download", "--only-binary=:all:", "--no-deps", "-d", dst, "pip")
    names = sorted(os.listdir(dst))
    bad = [n for n in names if n.endswith(".whl") and re.search(r"(x86_64|win|macosx|i686)", n)]
    if bad:
        raise SystemExit(f"not aarch64 wheels: {bad}")
    return names


def write_scripts(bundle: str, extras: str) -> None:
    os.makedirs(os.path.join(bundle, "bin"), exist_ok=True)
    for name, what, args in (("colibri", "`colibri ARGS`", ""),
                             ("colibri-python", "`python3 SCRIPT ARGS`", "--python ")):
        p = os.path.join(bundle, "bin", name)
        with open(p, "w") as f:
            f.write(LAUNCHER.format(what=what, args=args))
        os.chmod(p, 0o755)
    p = os.path.join(bundle, "install.sh")
    with open(p, "w") as f:
        f.write(INSTALL.replace("@EXTRAS@", extras))
    os.chmod(p, 0o755)


def unpack_into(root: str, wheel_dir: str) -> str:
    """The bundle's wheels unpacked into ROOT/BUILD_PREFIX/site-packages by the host's pip (no compile,
    no dependency resolution: every wheel listed is installed as is)."""
    target = os.path.join(root, BUILD_PREFIX.lstrip("/"), "site-packages")
    whls = [os.path.join(wheel_dir, n) for n in sorted(os.listdir(wheel_dir))
            if n.endswith(".whl") and not n.startswith("pip-")]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("install", "--no-deps", "--no-index", "--no-compile", "--only-binary=:all:", *plat, "--python-version", PYVER,
        "--implementation", "cp", "--target", target, *whls)
    return target


def build_kernels(root: str, cpus: list[str], model_arg: list[str]) -> dict:
    """Run the model once per CPU in the build root (in parallel); -> {cpu: kernels compiled}."""
    def one(cpu):
        t0 = time.time()
        p = emuroot.run(root, [f"{BUILD_PREFIX}/bin/colibri", "run", "--backend", "cpu", "--temperature", "0",
                               "--max-new-tokens", "4", "--stats", *model_arg],
                        env={"COLIBRI_CPU": cpu}, offline=True)
        m = re.search(r"kernels: (\d+) compiled", p.stderr)
        if not m:
            raise RuntimeError(f"no kernel count in the run's output:\n{p.stderr[-2000:]}")
        log(f"kernels for {cpu}: {m.group(1)} compiled under emulation in {time.time() - t0:.0f} s")
        return cpu, int(m.group(1))
    with concurrent.futures.ThreadPoolExecutor(len(cpus)) as ex:
        return dict(ex.map(one, cpus))


def cross_capi(root: str, bundle: str) -> str:
    """lib/libcolibri.so for aarch64 (and include/colibri.h) against the build root's Python."""
    sys.path.insert(0, os.path.join(REPO, "toolchains", "capi"))
    import build_capi
    return build_capi.build_cross(os.path.join(bundle, "lib"), sysroot=root,
                                  cc=os.environ.get("AARCH64_CC", "aarch64-linux-gnu-gcc"),
                                  include_out=os.path.join(bundle, "include"))


def memo_dir(wheel_names: list[str], model: str | None, cpus: list[str]) -> str:
    """~/.cache/colibri/aarch64/kernels/KEY: the kernel cache of the last build for this Numba, model
    layout (config and tensor list: the formats) and CPU list."""
    h = hashlib.sha256(" ".join([n for n in wheel_names if n.startswith(("numba-", "llvmlite-"))] + cpus).encode())
    for f in ("config.json", "tensors.json"):
        p = os.path.join(model or os.path.join(REPO, "colibri_edge", "default_model"), f)
        if os.path.exists(p):
            with open(p, "rb") as fh:
                h.update(fh.read())
    return os.path.join(emuroot.CACHE, "kernels", h.hexdigest()[:16])


def build(out: str, work: str, model: str | None, cpu: str, keep_root: bool = False, use_memo: bool = True) -> dict:
    t0 = time.time()
    bundle = out
    if os.path.exists(bundle):
        shutil.rmtree(bundle)
    os.makedirs(bundle)
    log("wheels: colibri-edge and its aarch64 dependencies")
    names = wheels(os.path.join(bundle, "wheels"))
    write_scripts(bundle, ",".join(EXTRAS))
    if model:
        shutil.copytree(model, os.path.join(bundle, "model"),
                        ignore=shutil.ignore_patterns("*.trace.npz", "__pycache__"))
    cpus = [cpu] + (["generic"] if cpu != "generic" else [])
    root = os.path.join(work, "build-root")
    log(f"the build root (arm64 Debian {emuroot.SUITE}): {root}")
    emuroot.make_root(root, emuroot.BUILD_PACKAGES)
    try:
        unpack_into(root, os.path.join(bundle, "wheels"))
        prefix = os.path.join(root, BUILD_PREFIX.lstrip("/"))
        for d in ("bin", "model"):
            if os.path.exists(os.path.join(bundle, d)):
                shutil.copytree(os.path.join(bundle, d), os.path.join(prefix, d))
        memo = memo_dir(names, model, cpus) if use_memo else None
        if memo and os.path.isdir(memo):
            log(f"kernel cache seeded from {memo} (a build cache: Numba recompiles every kernel whose source "
                "or dependencies changed, keyed by content)")
            shutil.copytree(memo, os.path.join(prefix, "kernel-cache"))
        model_arg = ["--model", f"{BUILD_PREFIX}/model"] if model else []
        with emuroot.mounted(root):
            compiled = build_kernels(root, cpus, model_arg)
        shutil.copytree(os.path.join(prefix, "kernel-cache"), os.path.join(bundle, "kernel-cache"))
        if memo:
            shutil.rmtree(memo, ignore_errors=True)
            shutil.copytree(os.path.join(prefix, "kernel-cache"), memo)
        log("libcolibri.so for aarch64 (cross-compiled)")
        cross_capi(root, bundle)
    finally:
        if not keep_root:
            emuroot.remove_root(root)
    import numba
    info = {"format": 1, "platform": "aarch64", "python": PYVER,
            "colibri_edge": next(n for n in names if n.startswith("colibri_edge-")).split("-")[1],
            "numba": next(n for n in names if n.startswith("numba-")).split("-")[1], "host_numba": numba.__version__,
            "cpus": cpus, "kernels_compiled": compiled, "model": os.path.basename(os.path.abspath(model)) if model
            else "the package's demo model", "wheels": [n for n in names if n.endswith(".whl")],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(os.path.join(bundle, "bundle.json"), "w") as f:
        json.dump(info, f, indent=1)
    tgz = bundle.rstrip("/") + ".tar.gz"
    with tarfile.open(tgz, "w:gz", compresslevel=1) as t:     # the wheels are compressed already
        t.add(bundle, arcname=os.path.basename(bundle.rstrip("/")))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(bundle) for f in fs)
    info.update(path=bundle, tarball=tgz, bytes=size, tarball_bytes=os.path.getsize(tgz),
                seconds=round(time.time() - t0, 1))
    log(f"{bundle}: {size / 2**20:.0f} MiB ({tgz}: {info['tarball_bytes'] / 2**20:.0f} MiB) "
        f"in {info['seconds']:.0f} s; kernels {compiled}")
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "build", "bundle-aarch64"))
    ap.add_argument("--work", default=os.path.join(REPO, "build", "aarch64"), help="where the build root goes")
    ap.add_argument("--model", default=None, help="a model directory to ship (default: the package's demo model)")
    ap.add_argument("--no-memo", action="store_true", help="compile every kernel under emulation (no build cache)")
    ap.add_argument("--cpu", default="cortex-a76",
                    help="the board's CPU as LLVM names it (cortex-a76: RK3588; cortex-a55, cortex-a72, "
                         "neoverse-n1, ...); kernels for generic come too")
    a = ap.parse_args(argv)
    why = emuroot.need_root()
    if why:
        raise SystemExit(f"bundle-aarch64: {why}")
    with emuroot.binfmt():
        build(os.path.abspath(a.out), os.path.abspath(a.work), a.model, a.cpu, use_memo=not a.no_memo)


if __name__ == "__main__":
    main()
