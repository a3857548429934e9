"""A fake CuPy that runs Colibri's CUDA backend on the CPU, for checking it where there is no GPU.

Put toolchains/cuda/emu first on PYTHONPATH and `import cupy` gets this module. It implements only
what backends/cuda/backend.py uses, as strictly as the real one or more:
  * device arrays are NumPy arrays (a subclass) in 256-byte aligned host memory with guard bytes
    on both sides, checked after every kernel: a kernel writing out of bounds fails the launch;
    cupy.empty is filled with NaN / 0x7f7f7f7f so reading what was never written shows up;
  * RawModule compiles the .cu text with g++ and toolchains/cuda/emu/emu.h (fibers for threads);
    a kernel call checks the argument count and that every scalar is a NumPy scalar of the C
    type (CuPy passes a Python float as a double: always a bug), every pointer a device array;
    grid and block limits are CUDA's (a zero dimension is cudaErrorInvalidConfiguration);
  * streams run eagerly; a capturing stream records launches into a Graph that replays them, and
    anything a capture cannot hold (host copies, allocations, cuBLAS, synchronize) raises
    cudaErrorStreamCaptureUnsupported; a stream forked into a capture must be joined back.
Not emulated: concurrency between streams, timing, memory limits, the NVRTC front end (the
toolchain check compiles every .cu with the real NVRTC and nvcc).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import types
import weakref

import numpy as np

__version__ = "0.0-colibri-emu"
EMU_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU_HEADER = os.path.join(EMU_DIR, "emu.h")

float16, float32, float64, int32, int64, uint64, uint8, uint16 = (np.float16, np.float32, np.float64, np.int32,
                                                                 np.int64, np.uint64, np.uint8, np.uint16)


# -- errors ---------------------------------------------------------------------------------------
class CUDARuntimeError(RuntimeError):
    pass


class CUDADriverError(RuntimeError):
    pass


class CompileException(Exception):
    pass


class OutOfMemoryError(MemoryError):
    pass


def _unsupported_in_capture(what):
    s = _current_stream()
    if s.capture is not None:
        raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: operation not permitted when stream is "
                               f"capturing ({what})")


# -- device memory --------------------------------------------------------------------------------
GUARD = 256
_live = []            # weakrefs to (raw buffer) with their data extent, for guard checks
_GUARD_BYTE = 0xA5
_GUARD_BYTES = bytes([_GUARD_BYTE]) * GUARD


class _MemPtr:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(np.ndarray):
    """A device array: host memory, but only the backend's kernels and explicit copies touch it."""

    @property
    def data(self):
        return _MemPtr(self.__array_interface__["data"][0])

    def get(self, stream=None, order="C", out=None, blocking=True):
        _unsupported_in_capture("device to host copy")
        return np.array(self.view(np.ndarray), copy=True, order=order)

    def set(self, arr, stream=None):
        _unsupported_in_capture("host to device copy")
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        np.copyto(self.view(np.ndarray), arr)

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        for x in inputs + tuple(kw.get("out", ())):
            if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
                raise TypeError(f"Unsupported type {type(x)} (a host array mixed with device arrays)")
        _unsupported_in_capture(f"elementwise {ufunc.__name__}")
        base = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs)
        if "out" in kw:
            kw["out"] = tuple(x.view(np.ndarray) for x in kw["out"])
        r = getattr(ufunc, method)(*base, **kw)
        return r.view(ndarray) if isinstance(r, np.ndarray) else r

    def __repr__(self):
        return "cupy(emu)." + np.ndarray.__repr__(self.view(np.ndarray))


def _alloc(shape, dtype, fill=None):
    _unsupported_in_capture("allocation")
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n > _props()["totalGlobalMem"]:
        raise OutOfMemoryError(f"Out of memory allocating {n:,} bytes (emulated device of "
                               f"{_props()['totalGlobalMem']:,} bytes)")
    raw = np.empty(n + 2 * GUARD + 256, np.uint8)
    start = (-raw.ctypes.data) % 256 + GUARD
    raw[:] = _GUARD_BYTE
    buf = raw[start:start + n]
    arr = buf.view(dtype).reshape(shape).view(ndarray)
    if fill is not None:
        arr.view(np.ndarray)[...] = fill
    _live.append((weakref.ref(raw), start, n))
    if len(_live) > 4 * _check_guards.size_hint:
        _live[:] = [e for e in _live if e[0]() is not None]
        _check_guards.size_hint = max(64, len(_live))
    return arr


def _check_guards(kernel):
    """Every live buffer's guard bytes intact after a launch. Compared as bytes (a copy of 2 x 256 bytes and a
    memcmp: ~0.35 us a buffer, against ~2.7 us for NumPy's != and any(); this check was two thirds of the
    emulator suite's time)."""
    for ref, start, n in _live:
        raw = ref()
        if raw is None:
            continue
        if raw[start - GUARD:start].tobytes() != _GUARD_BYTES or raw[start + n:start + n + GUARD].tobytes() != \
                _GUARD_BYTES:
            raise CUDARuntimeError(f"cudaErrorIllegalAddress: kernel {kernel} wrote outside a device buffer "
                                   f"of {n} bytes (guard bytes changed)")


_check_guards.size_hint = 64


def zeros(shape, dtype=float):
    return _alloc(shape, dtype, 0)


def empty(shape, dtype=float):
    dt = np.dtype(dtype)
    return _alloc(shape, dt, np.nan if dt.kind == "f" else (0x7F7F7F7F if dt.kind in "iu" and dt.itemsize >= 4 else 0x7F))


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    if isinstance(a, ndarray):
        _unsupported_in_capture("astype")
        out = _alloc(a.shape, dtype)
        out.view(np.ndarray)[...] = a.view(np.ndarray)
        return out
    h = np.asarray(a, dtype=dtype)
    out = _alloc(h.shape, h.dtype)
    out.view(np.ndarray)[...] = h
    return out


def asnumpy(a):
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def matmul(a, b, out=None):
    """cuBLAS GEMM (not capturable): fp32 accumulation, result in the inputs' dtype."""
    if not isinstance(a, ndarray) or not isinstance(b, ndarray):
        raise TypeError("cupy.matmul takes device arrays")
    _unsupported_in_capture("cuBLAS")
    if a.dtype != b.dtype:
        raise TypeError(f"emulated matmul needs one dtype, got {a.dtype} and {b.dtype}")
    r = np.matmul(a.view(np.ndarray).astype(np.float32), b.view(np.ndarray).astype(np.float32)).astype(a.dtype)
    if out is None:
        out = _alloc(r.shape, r.dtype)
    elif out.dtype != r.dtype or out.shape != r.shape:
        raise ValueError(f"matmul out {out.dtype}{out.shape} for a result {r.dtype}{r.shape}")
    out.view(np.ndarray)[...] = r
    return out


# -- streams, events, graphs -----------------------------------------------------------------------
_tls = threading.local()


class _Capture:
    def __init__(self, origin):
        self.origin = origin
        self.launches = []
        self.members = {origin}


class Stream:
    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.capture = None
        self.launch_seq = 0
        self.ptr = id(self)

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()

    def use(self):
        _stack()[0] = self
        return self

    def synchronize(self):
        if self.capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: synchronize on a capturing stream")

    def record(self, event=None):
        event = event or Event()
        event.stream, event.capture, event.seq = self, self.capture, self.launch_seq
        return event

    def wait_event(self, event):
        cap = event.capture
        if cap is not None:
            if self.capture is None:          # fork: this stream joins the capture
                self.capture = cap
                cap.members.add(self)
            if self is cap.origin and event.stream is not cap.origin:
                event.stream.joined_seq = event.seq

    def begin_capture(self, mode=None):
        if self.capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: stream is already capturing")
        self.capture = _Capture(self)

    def is_capturing(self):
        return self.capture is not None

    def end_capture(self):
        cap = self.capture
        if cap is None or cap.origin is not self:
            raise CUDARuntimeError("cudaErrorIllegalState: end_capture on a stream that did not begin one")
        bad = [s for s in cap.members if s is not self and getattr(s, "joined_seq", -1) < s.launch_seq]
        for s in cap.members:
            s.capture = None
        if bad:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnjoined: a forked stream did not join back")
        return Graph(cap.launches)


Stream.null = Stream()


def _stack():
    st = getattr(_tls, "stack", None)
    if st is None:
        st = _tls.stack = [Stream.null]
    return st


def _current_stream():
    return _stack()[-1]


def get_current_stream():
    return _current_stream()


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.stream, self.capture, self.seq = None, None, 0

    def synchronize(self):
        pass


class Graph:
    def __init__(self, launches):
        self.launches = list(launches)

    def launch(self, stream=None):
        s = stream or _current_stream()
        if s.capture is not None:
            raise CUDARuntimeError("emulator: launching a graph inside a capture is not emulated")
        for kern, grid, block, cargs in self.launches:
            kern._run(grid, block, cargs)

    def upload(self, stream=None):
        pass


# -- kernels --------------------------------------------------------------------------------------
_CTYPES = {"int": ctypes.c_int32, "unsigned int": ctypes.c_uint32, "unsigned": ctypes.c_uint32,
           "float": ctypes.c_float, "double": ctypes.c_double, "long long": ctypes.c_int64,
           "unsigned long long": ctypes.c_uint64, "u64": ctypes.c_uint64, "size_t": ctypes.c_uint64,
           "bool": ctypes.c_bool}
_NP_FOR = {"int": np.int32, "unsigned int": np.uint32, "unsigned": np.uint32, "float": np.float32,
           "double": np.float64, "long long": np.int64, "unsigned long long": np.uint64, "u64": np.uint64,
           "size_t": np.uint64, "bool": np.bool_}
_SIG = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_CACHE = os.environ.get("COLIBRI_EMU_CACHE") or os.path.join(tempfile.gettempdir(), f"colibri-cuda-emu-{os.getuid()}")
_compile_lock = threading.Lock()
# half <-> float in F16C instructions where the host has them (libgcc's software conversion was 4% of a
# float16 model's emulated run); both round to nearest even, so results are the same bits
try:
    with open("/proc/cpuinfo") as _f:
        F16C = ("-mf16c",) if " f16c" in _f.read() else ()
except OSError:
    F16C = ()


def _parse_params(text):
    params = []
    for p in [p.strip() for p in text.split(",") if p.strip()]:
        m = re.match(r"(.*?)(\w+)\s*$", p, re.S)
        typ = " ".join(m.group(1).replace("__restrict__", "").split())
        if "*" in typ:
            params.append(("ptr", typ))
        else:
            base = " ".join(w for w in typ.split() if w != "const")
            if base not in _CTYPES:
                raise CompileException(f"emulator: kernel parameter type {typ!r} is not handled")
            params.append(("val", base))
    return params


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=None):
        if code is None:
            raise CompileException("emulator: RawModule needs code= (no cubin loading)")
        self.code, self.options = code, tuple(options)
        self._lib, self._sigs, self._fns = None, None, {}

    def _build(self):
        if self._lib is not None:
            return
        with open(EMU_HEADER, "rb") as f:
            hdr = f.read()
        key = hashlib.sha256(hdr + self.code.encode() + repr(self.options + F16C).encode()).hexdigest()[:24]
        d = os.path.join(_CACHE, key)
        so = os.path.join(d, "module.so")
        with _compile_lock:
            os.makedirs(d, exist_ok=True)
            src = os.path.join(d, f"kernels.{os.getpid()}.cu")    # per process: test workers share the cache
            with open(src, "w") as f:
                f.write(self.code)
            defines = [o for o in self.options if o.startswith("-D")]   # NVRTC's -D options, as given
            pre = subprocess.run(["g++", "-std=c++17", "-E", "-x", "c++", "-DEMU_KEEP_GLOBAL", *defines, "-include",
                                  EMU_HEADER, src], capture_output=True, text=True)
            if pre.returncode:
                raise CompileException(pre.stderr)
            sigs = {m.group(1): _parse_params(m.group(2)) for m in _SIG.finditer(pre.stdout)}
            if not os.path.exists(so):
                wrappers = ["\n// ---- emulator launch wrappers"]
                for name, params in sigs.items():
                    call = ", ".join(f"*({t}*)args[{i}]" if k == "ptr" else f"*({t}*)args[{i}]"
                                     for i, (k, t) in enumerate(params))
                    wrappers.append(
                        f'extern "C" int emu_launch_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                        f'unsigned by, unsigned bz, void** args) {{\n'
                        f'  std::function<void()> fn = [&]() {{ {name}({call}); }};\n'
                        f'  return emu::run_grid(gx, gy, gz, bx, by, bz, fn, "{name}");\n}}')
                full = os.path.join(d, f"module.{os.getpid()}.cpp")
                with open(full, "w") as f:
                    f.write(self.code + "\n".join(wrappers) + "\n")
                tmp = so + f".{os.getpid()}.tmp"
                cc = subprocess.run(["g++", "-std=c++17", "-O2", "-g", *F16C, "-fPIC", "-shared", "-fno-strict-aliasing",
                                     "-Wno-unknown-pragmas", *defines, "-include", EMU_HEADER, "-o", tmp, full],
                                    capture_output=True, text=True)
                if cc.returncode:
                    raise CompileException(cc.stderr)
                os.replace(tmp, so)
        self._sigs = sigs
        self._lib = ctypes.CDLL(so)

    def get_function(self, name):
        self._build()
        if name not in self._sigs:
            raise CUDADriverError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name}")
        if name not in self._fns:
            fn = getattr(self._lib, f"emu_launch_{name}")
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.POINTER(ctypes.c_void_p)]
            err = self._lib.emu_last_error
            err.restype = ctypes.c_char_p
            self._fns[name] = RawKernel(name, self._sigs[name], fn, err)
        return self._fns[name]


def _dims(d, what):
    d = tuple(int(v) for v in (d if isinstance(d, tuple) else (d,)))
    if not 1 <= len(d) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions")
    return d + (1,) * (3 - len(d))


class RawKernel:
    def __init__(self, name, params, fn, last_error):
        self.name, self.params, self.fn, self.last_error = name, params, fn, last_error

    def __call__(self, grid, block, args, shared_mem=0):
        g, b = _dims(grid, "grid"), _dims(block, "block")
        if min(g) < 1 or min(b) < 1 or b[0] * b[1] * b[2] > 1024 or g[1] > 65535 or g[2] > 65535 or \
                g[0] > 2 ** 31 - 1 or b[2] > 64:
            raise CUDARuntimeError(f"cudaErrorInvalidConfiguration: {self.name} grid {g} block {b}")
        if shared_mem:
            raise CUDARuntimeError("emulator: dynamic shared memory is not emulated")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        cargs = []
        for i, (a, (kind, typ)) in enumerate(zip(args, self.params)):
            if kind == "ptr":
                if isinstance(a, ndarray):
                    cargs.append(ctypes.c_void_p(a.__array_interface__["data"][0]))
                elif isinstance(a, np.uint64) or (isinstance(a, np.integer) and a.dtype.itemsize == 8):
                    cargs.append(ctypes.c_void_p(int(a)))
                else:
                    raise TypeError(f"{self.name} argument {i} ({typ}): a device array, got {type(a).__name__}")
            else:
                want = _NP_FOR[typ]
                if not isinstance(a, np.generic) or a.dtype != np.dtype(want):
                    raise TypeError(f"{self.name} argument {i} ({typ}): needs numpy.{np.dtype(want).name}, got "
                                    f"{type(a).__name__} {getattr(a, 'dtype', '')} (CuPy would pass Python ints as "
                                    "int64 and floats as double)")
                cargs.append(_CTYPES[typ](a.item()))
        s = _current_stream()
        if s.capture is not None:
            s.launch_seq += 1
            s.capture.launches.append((self, g, b, cargs))
            return
        s.launch_seq += 1
        self._run(g, b, cargs)

    def _run(self, g, b, cargs):
        argv = (ctypes.c_void_p * max(1, len(cargs)))(*[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p)
                                                         for c in cargs])
        rc = self.fn(g[0], g[1], g[2], b[0], b[1], b[2], argv)
        if rc:
            raise CUDARuntimeError(f"cudaErrorLaunchFailure (emulator): {self.last_error().decode()}")
        _check_guards(self.name)


# -- the cupy.cuda namespace ------------------------------------------------------------------------
class Device:
    def __init__(self, device=0):
        if int(device) != 0:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self.id = 0
        self.compute_capability = "90"

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *e):
        pass


def _props(i=0):
    return {"name": b"Colibri CUDA emulator (CPU)", "major": 9, "minor": 0, "totalGlobalMem": 8 << 30,
            "multiProcessorCount": 1}


def _mod(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def _mem_info():
    """(free, total) as cudaMemGetInfo: the emulated device's size less the live device arrays."""
    total = _props()["totalGlobalMem"]
    return max(0, total - sum(n for ref, _, n in _live if ref() is not None)), total


class PinnedMemoryPointer(bytearray):
    """cupy.cuda.alloc_pinned_memory's result: page-locked host memory (here plain host memory that
    numpy.frombuffer reads as on the real one: a bytearray, for Python 3.11's buffer protocol)."""

    def __init__(self, size):
        super().__init__(int(size))
        self.size = int(size)


def alloc_pinned_memory(size):
    return PinnedMemoryPointer(size)


runtime = _mod("cupy.cuda.runtime", getDeviceCount=lambda: 1, getDeviceProperties=_props, memGetInfo=_mem_info,
               CUDARuntimeError=CUDARuntimeError, streamCaptureModeRelaxed=2)
driver = _mod("cupy.cuda.driver", CUDADriverError=CUDADriverError)
compiler = _mod("cupy.cuda.compiler", CompileException=CompileException)
nvrtc = _mod("cupy.cuda.nvrtc", getVersion=lambda: (12, 9))
memory = _mod("cupy.cuda.memory", OutOfMemoryError=OutOfMemoryError)
device = _mod("cupy.cuda.device", get_cublas_handle=lambda: 1)     # "cuBLAS" is matmul() below
cuda = _mod("cupy.cuda", runtime=runtime, driver=driver, compiler=compiler, nvrtc=nvrtc, memory=memory, device=device,
            Stream=Stream, Event=Event, Graph=Graph, Device=Device, get_current_stream=get_current_stream,
            is_available=lambda: True, alloc_pinned_memory=alloc_pinned_memory,
            PinnedMemoryPointer=PinnedMemoryPointer)
EMULATED = True
