"""The ARM64 bundle's launcher (toolchains/aarch64): its bin/colibri and bin/colibri-python run this.

    PREFIX/bin/colibri ARGS...            = colibri ARGS... with the bundle's environment
    PREFIX/bin/colibri-python SCRIPT ...  = python3 SCRIPT ... with the bundle's environment

A bundle carries the cpu backend's kernels compiled by Numba for one named CPU (e.g. cortex-a76, the
RK3588's big core) and for 'generic' (any ARMv8-A), each in PREFIX/kernel-cache/<cpu>/. Before Numba
is imported, setup() picks the target: COLIBRI_CPU if set; else the CPU LLVM detects on this host
(llvmlite: e.g. cortex-a76) when the bundle has kernels for it; else 'generic'. It sets
NUMBA_CPU_NAME to it and NUMBA_CPU_FEATURES to '' (the CPU's own feature set: what the cache was
built with; Numba's default adds the host's detected features, which differ between a board and the
emulator and would miss the cache), and COLIBRI_KERNEL_CACHE to that folder (backends/cpu/jitcache.py
keys it by source hash, not by install path). A name the user set in NUMBA_CPU_NAME is kept.
PREFIX/model, if the bundle has one, becomes the default model (COLIBRI_DEFAULT_MODEL).
"""
from __future__ import annotations

import json
import os
import sys


def bundle_info(prefix: str) -> dict:
    try:
        with open(os.path.join(prefix, "bundle.json")) as f:
            return json.load(f)
    except OSError:
        return {}


def pick_cpu(prefix: str) -> tuple[str, str]:
    """-> (cpu name, why) for the kernels in PREFIX/kernel-cache."""
    have = sorted(d for d in os.listdir(os.path.join(prefix, "kernel-cache"))
                  if os.path.isdir(os.path.join(prefix, "kernel-cache", d))) \
        if os.path.isdir(os.path.join(prefix, "kernel-cache")) else []
    want = os.environ.get("COLIBRI_CPU")
    if want:
        return want, "COLIBRI_CPU" + ("" if want in have else f" (the bundle has no kernels for it: {have})")
    import llvmlite.binding as ll                   # llvmlite only: Numba must not be imported yet
    host = ll.get_host_cpu_name()
    if host in have:
        return host, f"this host's CPU ({host}) has the bundle's kernels"
    return "generic", f"this host's CPU is {host!r}; the bundle's kernels are for {have}: using generic"


def setup(prefix: str) -> str:
    """Set the environment for PREFIX's bundle (before Numba is imported); -> the why line."""
    if "numba" in sys.modules:
        return "numba was imported before the bundle's launcher: its kernel cache is not used"
    model = os.path.join(prefix, "model")
    if os.path.exists(os.path.join(model, "config.json")):
        os.environ.setdefault("COLIBRI_DEFAULT_MODEL", model)
    if os.environ.get("NUMBA_CPU_NAME"):
        cpu, why = os.environ["NUMBA_CPU_NAME"], "NUMBA_CPU_NAME"
    else:
        cpu, why = pick_cpu(prefix)
        os.environ["NUMBA_CPU_NAME"] = cpu
        os.environ["NUMBA_CPU_FEATURES"] = ""
    os.environ.setdefault("COLIBRI_KERNEL_CACHE", os.path.join(prefix, "kernel-cache", cpu))
    return f"kernels for {cpu}: {why}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prefix = os.environ.get("COLIBRI_BUNDLE") or os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0])))
    why = setup(prefix)
    if os.environ.get("COLIBRI_LAUNCH_VERBOSE"):
        print(f"[colibri] bundle {prefix}: {why}", file=sys.stderr)
    if argv[:1] == ["--python"]:
        import runpy
        if len(argv) < 2:
            print("usage: colibri-python SCRIPT [ARGS...]", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")
        return 0
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
