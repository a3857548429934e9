"""The CUDA runtime: device, memory, kernel modules and launches, streams, CUDA graphs and error
translation, over CuPy. The ops (backend.py) sit on top of it; nothing here knows what a layer is.

Kernels are our .cu files (sources.py), compiled by NVRTC through cupy.RawModule at start, never
inside a graph capture. Every op runs on the backend's own non-blocking stream (op_scope).

Graphs: graph_step(key, fn) captures a step (fn launching this backend's ops on fixed buffers)
the first time `key` is seen and replays it after; a capture that fails (an op that needs the
host) leaves that key in stream mode. `cuda_graphs=False` (COLIBRI_CUDA_GRAPHS=0) runs every step
on streams. `mode` says which ran last.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from colibri_edge.errors import (ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT,
                                 COLIBRI_ERR_OUT_OF_MEMORY)
from ..base import Backend as BackendBase, guarded
from . import sources

_cp = None                          # cupy, imported by probe() / the backend
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8,
            "uint8": np.uint8, "uint64": np.uint64,      # uint64: the ops' device pointer tables
            **{f: np.uint8 for f in sources.BLOCK_FORMATS}}   # block formats: their bytes [N, row_bytes]


def _cupy():
    global _cp
    if _cp is None:
        import cupy
        _cp = cupy
    return _cp


def cdiv(a, b):
    return -(-a // b)


def probe(for_auto=False):
    """-> (ok, detail). Imports CuPy only here; no GPU, driver or NVRTC -> (False, why)."""
    try:
        cp = _cupy()
    except Exception as e:   # ImportError, or a CuPy whose CUDA libraries are missing
        return False, (f"CuPy is not importable ({type(e).__name__}: {e}); install it with "
                       "pip install 'colibri-edge[cuda]' (cupy-cuda12x)")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no usable NVIDIA GPU or driver ({e})"
    if n < 1:
        return False, "no NVIDIA GPU found"
    try:
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        cc = int(props["major"]) * 10 + int(props["minor"])
        mem = props["totalGlobalMem"] / 2 ** 30
    except Exception as e:
        return False, f"cannot query GPU 0 ({e})"
    if cc < 70:
        return False, f"{name} is sm_{cc}; the CUDA backend needs sm_70 or newer"
    try:
        nv = cp.cuda.nvrtc.getVersion()
    except Exception as e:
        return False, (f"NVRTC, the run-time compiler CuPy uses, is missing ({e}); "
                       "pip install nvidia-cuda-nvrtc-cu12 (or the CUDA toolkit)")
    more = f" (+{n - 1} more)" if n > 1 else ""
    return True, f"{name} sm_{cc} {mem:.0f} GiB{more}, CuPy {cp.__version__}, NVRTC {nv[0]}.{nv[1]}"


class CudaRuntime(BackendBase):
    name = "cuda"
    weight_dtypes = ("float32", "float16", "bfloat16", "int8") + sources.BLOCK_FORMATS
    mixed_gate_up = False      # the fused gate/up kernels are compiled for one weight format
    OPTIONS = ("num_streams", "disable_fp16", "cuda_graphs", "device")

    def __init__(self, num_streams=1, disable_fp16=False, cuda_graphs=True, device=0, use_cublas=True):
        cp = _cupy()
        ns = num_streams
        if not isinstance(ns, (int, np.integer)) or isinstance(ns, bool) or not 1 <= ns <= 64:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"num_streams={num_streams!r}: must be an integer from 1 to 64")
        self.num_streams = int(ns)
        self.fp32 = bool(disable_fp16)
        self.use_graphs = bool(cuda_graphs)
        self.use_cublas = bool(use_cublas)          # tests turn it off to reach the tiled kernels
        self.mode = "stream"
        self.graph_captures = self.graph_replays = 0
        self.graph_failures = {}           # key -> why its capture failed (that shape runs in stream mode)
        self._graphs = {}
        self._capturing = False
        self._capture_refs = None
        self.closed = False
        try:
            self.device = cp.cuda.Device(int(device))
            self.device.use()
            props = cp.cuda.runtime.getDeviceProperties(int(device))
            nm = props["name"]
            self.device_name = nm.decode() if isinstance(nm, bytes) else str(nm)
            self.cc = int(props["major"]) * 10 + int(props["minor"])
            self._s = cp.cuda.Stream(non_blocking=True)
            self._aux = [cp.cuda.Stream(non_blocking=True) for _ in range(self.num_streams - 1)]
            self._up = cp.cuda.Stream(non_blocking=True)      # expert slot loads (any thread)
            self._load_lock = threading.Lock()
            self._fork_ev = cp.cuda.Event(disable_timing=True)
            self._joins = [cp.cuda.Event(disable_timing=True) for _ in self._aux]
            self.cublas_note = ""
            if self.use_cublas:     # prefill GEMMs fall back to our tiled kernel where cuBLAS is missing
                try:
                    cp.cuda.device.get_cublas_handle()        # loads libcublas, makes the handle
                except Exception as e:
                    self.use_cublas, self.cublas_note = False, f"cuBLAS unavailable ({type(e).__name__}: {e})"
            self._k = {}
            for fname, names in sources.KERNELS.items():
                mod = cp.RawModule(code=sources.load_source(fname), options=sources.NVRTC_OPTIONS)
                for kn in names:       # compile and load now: never inside a graph capture
                    self._k[kn] = mod.get_function(kn)
        except ColibriError:
            raise
        except Exception as e:
            err = self.translate_error(e, "start")
            if err is None:
                raise
            raise err from e

    # -- plumbing ------------------------------------------------------------------------------
    def op_scope(self):
        return self._s

    def translate_error(self, e, where):
        cp = _cupy()
        msg = f"{type(e).__name__}: {e}"
        oom = isinstance(e, cp.cuda.memory.OutOfMemoryError) or any(
            s in msg for s in ("cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"))
        if oom:
            return ColibriError(COLIBRI_ERR_OUT_OF_MEMORY,
                                f"CUDA device memory exhausted in {where} ({msg}); lower max_batch, "
                                "kv_cache_tokens or prefill_chunk, or use a smaller model")
        cuda_errors = (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError,
                       cp.cuda.compiler.CompileException)
        nvrtc_err = getattr(cp.cuda.nvrtc, "NVRTCError", None)
        if nvrtc_err is not None:
            cuda_errors += (nvrtc_err,)
        try:                        # touching cupy.cuda.cublas loads the library: it may be absent
            lib = getattr(cp.cuda.cublas, "CUBLASError", None) if self.use_cublas else None
        except Exception:
            lib = None
        if lib is not None:
            cuda_errors += (lib,)
        if isinstance(e, cuda_errors) or type(e).__module__.startswith(("cupy", "cupy_backends")):
            return ColibriError(COLIBRI_ERR_BACKEND, f"CUDA error in {where}: {msg}")
        return None

    def _launch(self, name, grid, block, args):
        self._k[name](grid, block, args)

    def _no_host(self, what):
        if self._capturing:
            raise ColibriError(COLIBRI_ERR_BACKEND, f"{what} needs the host and cannot be captured in a CUDA graph")

    copies_weights = True
    slot_loads_in_parallel = True   # load_slot: the upload stream, under its own lock, after the main stream

    def memory_available(self):
        try:
            free, total = _cupy().cuda.runtime.memGetInfo()
        except Exception:
            return 1 << 62, "no known limit"
        return int(free), f"the GPU's free memory ({total / 2**30:.1f} GiB in all)"

    def summary(self) -> str:
        comp = "fp32 compute" if self.fp32 else "fp16 compute (cuBLAS prefill GEMMs), fp32 accumulation"
        return (f"cuda: {self.device_name} sm_{self.cc}, {comp}, {self.num_streams} stream(s), mode={self.mode} "
                f"(graphs {'on' if self.use_graphs else 'off'}: {self.graph_captures} captured, "
                f"{self.graph_replays} replays, {len(self.graph_failures)} fell back)"
                + (f"; {self.cublas_note}" if self.cublas_note else ""))

    # -- memory ------------------------------------------------------------------------------
    @guarded
    def alloc(self, shape, dtype=np.float32):
        return _cupy().zeros(shape, dtype=dtype)

    @guarded
    def to_device(self, host, dtype):
        """A new device array holding host's contents (bfloat16 as uint16): copied on the backend's
        stream, in order."""
        host = np.ascontiguousarray(host).view(_STORAGE[dtype])
        dev = _cupy().empty(host.shape, host.dtype)
        dev.set(host, stream=self._s)
        return dev

    def view(self, buf, byte_offset, shape, dtype):
        dt = np.dtype(_STORAGE[dtype])
        n = int(np.prod(shape)) * dt.itemsize
        return buf[byte_offset:byte_offset + n].view(dt).reshape(shape)

    @guarded
    def upload_into(self, dst, host):
        self._no_host("upload_into")
        h = np.ascontiguousarray(np.broadcast_to(np.asarray(host, dtype=dst.dtype), dst.shape))
        if dst.flags.c_contiguous:
            dst.set(h, stream=self._s)
        else:
            tmp = _cupy().empty(h.shape, h.dtype)
            tmp.set(h, stream=self._s)
            dst[...] = tmp

    @guarded
    def download(self, buf):
        self._no_host("download")
        self._s.synchronize()
        return buf.get(stream=self._s)

    @guarded
    def synchronize(self):
        self._no_host("synchronize")
        self._s.synchronize()
        for s in self._aux:
            s.synchronize()

    # -- streams -----------------------------------------------------------------------------
    def _fork(self, n):
        side = self._aux[:n]
        if side:                                     # fork: every side stream starts after what came before
            self._s.record(self._fork_ev)
            for s in side:
                s.wait_event(self._fork_ev)
        return side

    def _join(self, side):                           # join: the main stream waits for every side stream
        for s, ev in zip(side, self._joins):
            s.record(ev)
            self._s.wait_event(ev)

    @staticmethod
    def on(stream):
        """The context that launches on `stream` (None: the backend's main stream, already current)."""
        return contextlib.nullcontext() if stream is None else stream

    # -- expert slots ------------------------------------------------------------------------
    def alloc_staging(self, nbytes):
        """Page-locked host memory (cudaHostAlloc through CuPy) for slot misses: the copy to the slot is
        a DMA straight from it on the upload stream, while the main stream computes."""
        mem = _cupy().cuda.alloc_pinned_memory(int(nbytes))
        return np.frombuffer(mem, np.uint8, int(nbytes))

    @guarded
    def load_slot(self, slots, slot, blob):
        """Copy a blob into a slot on the upload stream, after the work queued so far (which may
        still read the expert this slot held); returns once the copy has landed. Any thread."""
        self._no_host("load_slot")
        host = np.ascontiguousarray(blob).reshape(-1).view(np.uint8)
        with self._load_lock, self.device:                # the prefetch thread: this device, upload stream
            done = self._s.record()
            self._up.wait_event(done)
            slots[int(slot), :host.size].set(host, stream=self._up)
            self._up.synchronize()

    # -- CUDA graphs -------------------------------------------------------------------------
    def graph_step(self, key, fn, *args):
        """fn(*args) through a CUDA graph: captured the first time `key` is seen, replayed after.
        `key` must name everything the launches depend on (e.g. ("decode", T, rows)). Buffer
        contents may change between replays (token ids, positions, block tables, KV); shapes,
        pointers and the expert weights may not. If the capture fails the step runs in stream mode,
        now and for later calls with that key. -> True when the step ran as a graph replay."""
        if self.closed:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "the CUDA backend is closed")
        g = self._graphs.get(key)
        if g is None and self.use_graphs and key not in self.graph_failures:
            g = self._capture(key, fn, args)
        if g is None:
            fn(*args)
            self.mode = "stream"
            return False
        try:
            with self._s:
                g[0].launch(stream=self._s)
        except Exception as e:
            err = self.translate_error(e, "graph launch")
            if err is None:
                raise
            raise err from e
        self.graph_replays += 1
        self.mode = "graph"
        return True

    def _capture(self, key, fn, args):
        s = self._s
        refs = []
        graph, why = None, None
        with s:
            try:
                s.begin_capture()
            except Exception as e:
                self.graph_failures[key] = f"begin_capture: {type(e).__name__}: {e}"
                return None
            self._capturing, self._capture_refs = True, refs
            try:
                fn(*args)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            finally:
                self._capturing, self._capture_refs = False, None
                try:
                    graph = s.end_capture()
                except Exception as e:
                    why = why or f"end_capture: {type(e).__name__}: {e}"
                    graph = None
        if why is not None or graph is None:
            self.graph_failures[key] = why or "no graph"
            return None
        self.graph_captures += 1
        self._graphs[key] = (graph, refs)
        return self._graphs[key]

    def close(self):
        if self.closed:
            return
        self.closed = True
        try:
            self._s.synchronize()
        except Exception:
            pass
        self._graphs.clear()
