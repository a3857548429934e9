"""Compile every CUDA kernel file with NVRTC 12 -- the compiler CuPy runs at start -- exactly as the
backend does (same inlined source text, same options), for the architectures we ship for. Needs
no GPU: NVRTC is a library (pip wheel nvidia-cuda-nvrtc-cu12, the `cuda` extra), called here
through ctypes.

    python toolchains/cuda/nvrtc_check.py [--arch sm_80 --arch sm_87 ...] [--lib path/libnvrtc.so.12]

For each .cu: a PTX build (compute_80) whose entries must include every kernel the backend looks
up, then a cubin per sm_XX. Any error, and any warning, fails (exit 1) with NVRTC's log.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import glob
import importlib.util
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_ARCHS = ("sm_80", "sm_87", "sm_90")


def load_sources():
    """backends/cuda/sources.py, without importing the package (no numpy, no CuPy)."""
    path = os.path.join(ROOT, "backends", "cuda", "sources.py")
    spec = importlib.util.spec_from_file_location("colibri_cuda_sources", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def find_nvrtc(explicit=None):
    """Path of libnvrtc (major 12 preferred): --lib, $COLIBRI_NVRTC_LIB, the pip wheel, the system."""
    cands = [explicit, os.environ.get("COLIBRI_NVRTC_LIB")]
    try:
        import nvidia.cuda_nvrtc as w       # the nvidia-cuda-nvrtc-cu12 wheel
        for d in list(getattr(w, "__path__", [])):
            cands += sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so.12*")))
            cands += sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for p in sys.path:
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12")))
    for p in sys.path:                  # CUDA 13 wheels: nvidia/cu13/lib
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "cu1*", "lib", "libnvrtc.so.1*")))
    cands += ["libnvrtc.so.12", "libnvrtc.so", _cupy_nvrtc]
    errors = []
    for c in cands:
        if callable(c):
            c = c()
        if not c or "builtins" in os.path.basename(c) or ".alt." in os.path.basename(c):
            continue
        try:
            return ctypes.CDLL(c), c
        except OSError as e:
            errors.append(f"{c}: {e}")
    raise FileNotFoundError("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, or set COLIBRI_NVRTC_LIB); "
                            "tried " + "; ".join(errors[-4:]))


def _cupy_nvrtc():
    """The libnvrtc CuPy itself loads (found in this process's mappings), or None."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnvrtc" in os.path.basename(path) and "builtins" not in path:
                    return path
    except Exception:
        return None
    return None


class NVRTC:
    def __init__(self, lib):
        self.lib = lib
        c_p, c_sz = ctypes.c_void_p, ctypes.c_size_t
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(c_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcCompileProgram.argtypes = [c_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [c_p, ctypes.POINTER(c_sz)]
        lib.nvrtcGetProgramLog.argtypes = [c_p, ctypes.c_char_p]
        lib.nvrtcGetPTXSize.argtypes = [c_p, ctypes.POINTER(c_sz)]
        lib.nvrtcGetPTX.argtypes = [c_p, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [c_p, ctypes.POINTER(c_sz)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(c_p)]

    def version(self):
        a, b = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
        return a.value, b.value

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source: str, name: str, options):
        """-> (ok, log, ptx or None, cubin bytes count)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            n = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace").strip()
            if rc != 0:
                return False, log or self.lib.nvrtcGetErrorString(rc).decode(), None, 0
            ptx, cubin = None, 0
            if any(o.endswith("compute_80") or "=compute_" in o for o in options):
                self.lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
                pbuf = ctypes.create_string_buffer(n.value)
                self.lib.nvrtcGetPTX(prog, pbuf)
                ptx = pbuf.value.decode()
            else:
                self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
                cubin = n.value
            return True, log, ptx, cubin
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def check(archs=DEFAULT_ARCHS, lib=None, verbose=True, files=None):
    """Compile everything; -> list of failure messages (empty: all good)."""
    src = load_sources()
    handle, path = find_nvrtc(lib)
    nv = NVRTC(handle)
    major, minor = nv.version()
    if verbose:
        print(f"NVRTC {major}.{minor} ({path}); options {' '.join(src.NVRTC_OPTIONS)}")
    failures = []
    jobs = [(fname, arch) for fname in (files or src.kernel_files()) for arch in ("compute_80",) + tuple(archs)]

    def compile_one(job):
        fname, arch = job
        t0 = time.perf_counter()
        opts = tuple(src.NVRTC_OPTIONS) + (f"--gpu-architecture={arch}",)
        return nv.compile(src.load_source(fname), fname, opts), time.perf_counter() - t0

    # one program per thread (NVRTC is thread-safe across programs; ctypes drops the GIL in the call):
    # the moe.cu builds take ~50 s each, so the cores share them; results are reported in job order
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(compile_one, jobs))
    for (fname, arch), ((ok, log, ptx, cubin), secs) in zip(jobs, results):
        what = f"{fname} [{arch}]"
        if not ok:
            failures.append(f"{what}: NVRTC error\n{log}")
        elif log:
            failures.append(f"{what}: NVRTC warnings (kept at zero)\n{log}")
        elif ptx is not None:
            entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
            missing = [k for k in src.KERNELS[fname] if k not in entries]
            if missing:
                failures.append(f"{what}: kernels the backend looks up are missing: {', '.join(missing)}")
        elif cubin <= 0:
            failures.append(f"{what}: empty cubin")
        if verbose:
            status = "ok" if not failures or not failures[-1].startswith(what) else "FAILED"
            print(f"  {what:28s} {status} ({secs:.1f}s)", flush=True)
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="sm_XX to build a cubin for (default: sm_80 sm_87 sm_90)")
    ap.add_argument("--lib", help="path of libnvrtc.so")
    a = ap.parse_args(argv)
    try:
        failures = check(tuple(a.arch) if a.arch else DEFAULT_ARCHS, a.lib)
    except FileNotFoundError as e:
        print(f"nvrtc check: {e}", file=sys.stderr)
        return 1
    for f in failures:
        print(f, file=sys.stderr)
    print("nvrtc check:", "FAILED" if failures else "every kernel compiles")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
