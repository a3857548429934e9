"""The CUDA backend: CuPy for memory, streams and graphs; our own kernels (backends/cuda/*.cu,
compiled by NVRTC through cupy.RawModule) for every op; cuBLAS only for prefill-sized GEMMs.

The MoE layer never leaves the device:
    route    moe_route     fp32 softmax + top-k per token (ties to the lower expert id)
    align    moe_align     counting sort of the T*k assignments by expert, cut into blocks of BM rows
    ffn      moe_gate_up_* / moe_down_*   one CTA per (block, column tile), weights read once per block
    combine  moe_combine   weighted sum back into the residual
The grouped kernels are launched with a grid sized by an upper bound on the block count, so no
host copy of the plan is needed to launch them; `Plan.counts` is copied to the host only for the
scheduler's statistics (option host_counts, on by default; off inside a captured graph).

Precision: activations, the KV cache, the router and every accumulation are fp32; fp16 and bf16
weights stay 16-bit on the device (half the bytes to stream) and our kernels widen them as they
read (bf16 never goes through cuBLAS: CuPy has no bf16 type). By
default ("fp16 compute") prefill-sized GEMMs of fp16 weights run on cuBLAS in fp16 (tensor cores,
activations rounded to fp16); disable_fp16=True (COLIBRI_DISABLE_FP16=1) computes in fp32
throughout (those GEMMs then use our tiled fp32 kernel). fp32 weights always compute in fp32.

Modes: "stream" runs each op as it is called; "graph" replays a CUDA graph captured from a step
(graph_step), launching the whole step at once. A capture that fails (for instance an op that
needs the host) falls back to stream mode for that step shape. `mode` says which ran last.

Streams: num_streams > 1 splits each grouped FFN's expert blocks over that many streams (a
fork/join of events, captured as parallel branches in graph mode).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np

from colibri_edge.dtypes import widen
from colibri_edge.errors import (ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT,
                                 COLIBRI_ERR_OUT_OF_MEMORY)
from ..base import FFN, Backend as BackendBase, Plan, Weight
from . import sources

SK_ROWS, SK_WARPS = 8, 8           # skinny tiles (colibri_gemm.cuh)
TBM, TBN = 64, 64                  # tiled tiles
SKINNY_MAX_T = 32                  # dense matmuls of up to this many rows use the skinny kernel
MAX_HEAD_DIM = 256                 # attention.cu ATT_MAX_DPL * 32
MAX_ROUTE_EXPERTS = 512            # moe.cu ROUTE_MAXJ * 32
MAX_ALIGN_EXPERTS = 1024           # moe.cu ALIGN_THREADS * ALIGN_EPT
ALIGN_THREADS = 256
_NULL = np.uint64(0)               # a null pointer argument
_i32, _f32 = np.int32, np.float32

_cp = None                          # cupy, imported by probe() / Backend()


def _cupy():
    global _cp
    if _cp is None:
        import cupy
        _cp = cupy
    return _cp


def _cdiv(a, b):
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


@dataclass
class CudaPlan(Plan):
    """Plan with everything on the device, plus the block list of the grouped kernels:
        blocks [max_blocks, 3] = (expert, first sorted row, end row); nblocks [1]: how many are used
        block_rows: BM (<= 8: the skinny kernels, else the tiled ones, BM <= 64)
        max_blocks: the launch bound, min(A, ceil(A/BM) + E - 1) for A = T*k assignments
        counts_dev [E]: the counts on the device (counts, the host copy, may be None)
        stream: the backend's stream (what a host copy of counts_dev must wait for)"""
    blocks: object = None
    nblocks: object = None
    block_rows: int = SK_ROWS
    max_blocks: int = 1
    num_experts: int = 0
    counts_dev: object = None
    stream: object = None

    def device_counts(self):
        """counts, copied from the device now if the plan kept them there."""
        if self.counts is not None:
            return self.counts
        self.stream.synchronize()
        return self.counts_dev.get(stream=self.stream)

    def experts_to_run(self):
        if self.active is None:
            return np.flatnonzero(self.device_counts())
        return super().experts_to_run()


def _op(fn):
    """Run a backend op on the backend's stream; CUDA failures become ColibriError."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        try:
            with self._s:
                return fn(self, *args, **kw)
        except ColibriError:
            raise
        except Exception as e:
            err = self._translate(e, name)
            if err is None:
                raise
            raise err from e
    return wrapper


class Backend(BackendBase):
    name = "cuda"
    weight_dtypes = ("float32", "float16", "bfloat16", "int8")

    def __init__(self, num_streams=None, disable_fp16=False, num_threads=None, host_counts=True,
                 graphs=True, use_cublas=True, device=0, **_other):
        cp = _cupy()
        ns = 1 if num_streams is None else num_streams
        if not isinstance(ns, (int, np.integer)) or isinstance(ns, bool) or not 1 <= ns <= 64:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"num_streams={num_streams!r}: must be an integer from 1 to 64")
        self.num_streams = int(ns)
        self.fp32 = bool(disable_fp16)
        self.host_counts = bool(host_counts)
        self.use_graphs = bool(graphs)
        self.use_cublas = bool(use_cublas)
        self.mode = "stream"
        self.graph_captures = 0
        self.graph_replays = 0
        self.graph_failures = {}           # key -> why its capture failed (that shape runs in stream mode)
        self._graphs = {}
        self._capturing = False
        self._capture_refs = None
        self._tables = {}
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
            self._mask = None
            self._fork = cp.cuda.Event(disable_timing=True)
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
            err = self._translate(e, "start")
            if err is None:
                raise
            raise err from e

    # -- plumbing ------------------------------------------------------------------------------
    def _translate(self, e, op):
        cp = _cupy()
        msg = f"{type(e).__name__}: {e}"
        oom = isinstance(e, cp.cuda.memory.OutOfMemoryError) or any(
            s in msg for s in ("cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"))
        if oom:
            return ColibriError(COLIBRI_ERR_OUT_OF_MEMORY,
                                f"CUDA device memory exhausted in {op} ({msg}); lower max_batch, "
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
            return ColibriError(COLIBRI_ERR_BACKEND, f"CUDA error in {op}: {msg}")
        return None

    def _to_device(self, host):
        """A new device array holding host's contents: copied on the backend's stream, in order."""
        host = np.ascontiguousarray(host)
        dev = _cupy().empty(host.shape, host.dtype)
        dev.set(host, stream=self._s)
        return dev

    def _launch(self, name, grid, block, args):
        self._k[name](grid, block, args)

    @staticmethod
    def _suffix(arr):
        """Kernel suffix of a weight array: bfloat16 is stored as uint16 (NumPy has no bf16)."""
        return {np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16",
                np.dtype(np.int8): "i8"}.get(np.dtype(arr.dtype), "f32")

    def _no_host(self, what):
        if self._capturing:
            raise ColibriError(COLIBRI_ERR_BACKEND, f"{what} needs the host and cannot be captured in a CUDA graph")

    # -- memory ------------------------------------------------------------------------------
    @_op
    def alloc(self, shape, dtype=np.float32):
        return _cupy().zeros(shape, dtype=dtype)

    @_op
    def upload(self, host, dtype="float32", scales=None):
        """Matrices keep their storage type on the device (fp32, fp16, bf16 as uint16, int8 with its
        fp32 row scales); vectors (norms, biases) are fp32."""
        cp = _cupy()
        host = np.asarray(host)
        if dtype == "int8":
            if scales is None or host.ndim != 2:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "int8 weights are matrices with row scales")
            return Weight(self._to_device(np.asarray(host, dtype=np.int8)), "int8", tuple(host.shape),
                          self._to_device(np.asarray(scales, dtype=np.float32)))
        if host.ndim >= 2 and dtype in ("float16", "bfloat16"):
            arr = np.ascontiguousarray(host, dtype=np.float16 if dtype == "float16" else np.uint16)
            name = dtype
        else:
            arr, name = np.ascontiguousarray(widen(host, dtype), dtype=np.float32), "float32"
        return Weight(self._to_device(arr), name, tuple(host.shape))

    @_op
    def upload_into(self, dst, host):
        self._no_host("upload_into")
        h = np.ascontiguousarray(np.broadcast_to(np.asarray(host, dtype=dst.dtype), dst.shape))
        if dst.flags.c_contiguous:
            dst.set(h, stream=self._s)
        else:
            dst[...] = self._to_device(h)

    @_op
    def download(self, buf):
        self._no_host("download")
        self._s.synchronize()
        return buf.get(stream=self._s)

    def host_view(self, buf):
        """Device memory is not host memory: always a synchronised copy."""
        return self.download(buf)

    @_op
    def synchronize(self):
        self._no_host("synchronize")
        self._s.synchronize()
        for s in self._aux:
            s.synchronize()

    # -- dense -------------------------------------------------------------------------------
    @_op
    def embed(self, out, table, ids):
        data = table.data if isinstance(table, Weight) else table
        T, H = out.shape
        if data.ndim != 2 or data.shape[1] != H:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"embed: table {data.shape} does not give rows of {H}")
        if data.dtype not in (np.float32, np.float16, np.uint16, np.int8):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"embed: table of {data.dtype}")
        sc = table.scales if isinstance(table, Weight) and table.scales is not None else _NULL
        self._launch("embed_" + self._suffix(data), (_cdiv(H, 256), T), (256,), (out, data, sc, ids, _i32(T), _i32(H)))

    @_op
    def matmul(self, out, x, w, bias=None):
        T, K = x.shape
        N = w.shape[0]
        W = w.data
        b = bias.data if bias is not None else _NULL
        sc = w.scales if w.scales is not None else _NULL
        suf = self._suffix(W)
        if T <= SKINNY_MAX_T:
            self._launch("matmul_skinny_" + suf, (_cdiv(N, SK_WARPS), _cdiv(T, SK_ROWS)), (256,),
                         (out, x, W, sc, b, _i32(T), _i32(N), _i32(K)))
        elif self._capturing or not self.use_cublas or suf in ("bf16", "i8") or (self.fp32 and suf == "f16"):
            self._launch("matmul_tiled_" + suf, (_cdiv(N, TBN), _cdiv(T, TBM)), (256,),
                         (out, x, W, sc, b, _i32(T), _i32(N), _i32(K)))
        else:
            self._cublas_matmul(out, x, W, b, T, N, K)

    def _cublas_matmul(self, out, x, W, b, T, N, K):
        """Prefill GEMMs: cuBLAS, fp16 (tensor cores, fp32 accumulation) for fp16 weights."""
        cp = _cupy()
        if W.dtype == np.float16:
            x16 = cp.empty((T, K), dtype=np.float16)
            self._launch("f32_to_f16", (_cdiv(T * K, 256),), (256,), (x16, x, np.int64(T * K)))
            y16 = cp.empty((T, N), dtype=np.float16)
            cp.matmul(x16, W.T, out=y16)
            self._launch("f16_to_f32_bias", (_cdiv(T * N, 256),), (256,), (out, y16, b, _i32(T), _i32(N)))
        else:
            cp.matmul(x, W.T, out=out)
            if b is not _NULL:
                self._launch("bias_add", (_cdiv(T * N, 256),), (256,), (out, b, _i32(T), _i32(N)))

    @_op
    def rmsnorm(self, out, x, weight, eps):
        R, D = x.shape
        threads = min(256, max(32, _cdiv(D, 32) * 32))
        self._launch("rmsnorm", (R,), (threads,), (out, x, weight.data, _i32(R), _i32(D), _f32(eps)))

    @_op
    def rope(self, out, x, positions, theta):
        T, heads, D = x.shape
        n = T * heads * (D // 2)
        self._launch("rope", (_cdiv(n, 256),), (256,), (out, x, positions, _i32(T), _i32(heads), _i32(D), _f32(theta)))

    @_op
    def add(self, out, a, b, gate=None):
        H = out.shape[-1]
        T = out.size // H
        self._launch("add", (_cdiv(T * H, 256),), (256,), (out, a, b, _NULL if gate is None else gate, _i32(T), _i32(H)))

    # -- attention ---------------------------------------------------------------------------
    @_op
    def alloc_kv(self, num_layers, num_slots, kv_heads, head_dim):
        cp = _cupy()
        return [(cp.zeros((num_slots, kv_heads, head_dim), np.float32),
                 cp.zeros((num_slots, kv_heads, head_dim), np.float32)) for _ in range(num_layers)]

    @_op
    def kv_write(self, cache, layer, k, v, slots):
        K, V = cache[layer]
        T = k.shape[0]
        W = K.shape[1] * K.shape[2]
        self._launch("kv_write", (_cdiv(T * W, 256),), (256,), (K, V, k, v, slots, _i32(T), _i32(W)))

    @_op
    def paged_attention(self, out, q, cache, layer, block_tables, seq_index, positions, block_size, scale):
        K, V = cache[layer]
        T, Hq, D = q.shape
        Hkv = K.shape[1]
        if D > MAX_HEAD_DIM or Hq % Hkv:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"paged_attention: head_dim {D} (max {MAX_HEAD_DIM}) / heads {Hq} over {Hkv} KV heads")
        self._launch("paged_attention", (Hq, T), (128,),
                     (out, q, K, V, block_tables, seq_index, positions, _i32(T), _i32(Hq), _i32(Hkv), _i32(D),
                      _i32(block_size), _i32(block_tables.shape[1]), _f32(scale)))

    # -- MoE ---------------------------------------------------------------------------------
    @_op
    def route(self, out_ids, out_w, logits, k, mode, normalize):
        T, E = logits.shape
        if E > MAX_ROUTE_EXPERTS:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: {E} experts (the CUDA router takes {MAX_ROUTE_EXPERTS})")
        if mode not in ("topk", "gated"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: unknown mode {mode!r}")
        gated = mode == "gated"
        if gated and k != E or not 1 <= k <= E:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: k={k} with {E} experts in mode {mode}")
        self._launch("moe_route", (_cdiv(T, 4),), (128,),
                     (out_ids, out_w, logits, _i32(T), _i32(E), _i32(k), _i32(gated), _i32(bool(normalize))))

    @_op
    def alloc_plan(self, max_assignments, num_experts):
        """Device buffers for align() of up to max_assignments = T*k rows over num_experts experts."""
        cp = _cupy()
        A, E = int(max_assignments), int(num_experts)
        if E > MAX_ALIGN_EXPERTS:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"align: {E} experts (the CUDA align takes {MAX_ALIGN_EXPERTS})")
        i32 = np.int32
        return {"A": A, "E": E, "offsets": cp.zeros(E + 1, i32), "order": cp.zeros(A, i32),
                "inverse": cp.zeros(A, i32), "counts": cp.zeros(E, i32), "blocks": cp.zeros(3 * A, i32),
                "nblocks": cp.zeros(1, i32)}

    @staticmethod
    def block_rows_for(assignments, num_experts):
        """BM of a plan: the tiled kernels when experts get >= 32 rows on average, else skinny."""
        return TBM if assignments >= 32 * max(1, min(num_experts, assignments)) else SK_ROWS

    @_op
    def align(self, plan_bufs, ids, num_tokens, num_experts, top_k, block_rows=None):
        """The plan on the device (moe_align); block_rows forces BM (tests), else block_rows_for()."""
        T, k, E = int(num_tokens), int(top_k), int(num_experts)
        A = T * k
        bufs = plan_bufs
        if bufs is None or bufs["A"] < A or bufs["E"] < E:
            bufs = self.alloc_plan(A, E)
            if self._capture_refs is not None:
                self._capture_refs.append(bufs)
        BM = int(block_rows) if block_rows else self.block_rows_for(A, E)
        if not 1 <= BM <= TBM:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"align: block_rows={BM}, must be 1..{TBM}")
        self._launch("moe_align", (1,), (ALIGN_THREADS,),
                     (bufs["offsets"], bufs["order"], bufs["inverse"], bufs["counts"], bufs["blocks"], bufs["nblocks"],
                      ids, _i32(A), _i32(E), _i32(BM)))
        counts = None
        if self.host_counts and not self._capturing:
            self._s.synchronize()
            counts = bufs["counts"][:E].get(stream=self._s)
        return CudaPlan(bufs["offsets"][:E + 1], bufs["order"][:A], bufs["inverse"][:A], counts, T, k,
                        blocks=bufs["blocks"], nblocks=bufs["nblocks"], block_rows=BM,
                        max_blocks=max(1, min(A, _cdiv(A, BM) + E - 1)), num_experts=E,
                        counts_dev=bufs["counts"][:E], stream=self._s)

    def _expert_table(self, experts):
        """Device table [6, E] of the experts' gate/up/down pointers and their int8 row-scale pointers
        (0 when unquantised), cached per expert list.
        None entries (experts not resident: the slot pool) get null pointers."""
        key = id(experts) if len(experts) > 1 else id(experts[0])
        ent = self._tables.get(key)
        if ent is not None and len(ent[0]) == len(experts) and all(a is b for a, b in zip(ent[0], experts)):
            return ent
        self._no_host("building an expert table (run one step in stream mode first)")
        real = [f for f in experts if f is not None]
        if not real:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "grouped_ffn: no expert is resident")
        f0 = real[0]
        I, H = f0.gate.data.shape
        dt = f0.gate.data.dtype
        for f in real:
            if f.gate.data.shape != (I, H) or f.up.data.shape != (I, H) or f.down.data.shape != (H, I) or \
                    not f.gate.data.dtype == f.up.data.dtype == f.down.data.dtype == dt:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "grouped_ffn: experts of one call must share "
                                   f"shapes gate/up [{I},{H}], down [{H},{I}] and one dtype")
        def ptr(a):
            return 0 if a is None else a.data.ptr
        mats = (lambda f: f.gate, lambda f: f.up, lambda f: f.down)
        ptrs = np.array([[0 if f is None else ptr(m(f).data) for f in experts] for m in mats] +
                        [[0 if f is None else ptr(m(f).scales) for f in experts] for m in mats], dtype=np.uint64)
        ent = (tuple(experts), self._to_device(ptrs), self._suffix(f0.gate.data), H, I, len(real) < len(experts))
        if len(self._tables) >= 4096:
            self._tables.pop(next(iter(self._tables)))
        self._tables[key] = ent
        return ent

    def _active_mask(self, experts, plan, partial):
        """NULL (every expert with rows runs) or a device int32 [E] mask of plan.active."""
        if plan.active is None:
            if partial:
                idle = {e for e, f in enumerate(experts) if f is None}
                busy = set(np.flatnonzero(plan.device_counts()))
                if idle & busy:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"grouped_ffn: experts {sorted(idle & busy)} "
                                       "have tokens but are not resident (pass plan.active)")
            return _NULL
        self._no_host("an active-expert mask")
        E = len(experts)
        h = np.zeros(E, np.int32)
        h[np.asarray(plan.active, dtype=np.int64)] = 1
        if any(experts[e] is None for e in np.flatnonzero(h)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "grouped_ffn: an active expert is not resident")
        if self._mask is None or self._mask.size < E:
            self._mask = _cupy().zeros(max(E, 64), np.int32)
        m = self._mask[:E]
        m.set(h, stream=self._s)
        return m

    @_op
    def grouped_ffn(self, out, x, experts, plan, scratch):
        _, tab, suf, H, I, partial = self._expert_table(experts)
        T, k = plan.num_tokens, plan.top_k
        A = T * k
        if len(experts) != plan.num_experts:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"grouped_ffn: {len(experts)} experts for a plan over {plan.num_experts}")
        if scratch.size < A * I or not scratch.flags.c_contiguous:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"grouped_ffn: scratch must hold {A}x{I} contiguous floats")
        active = self._active_mask(experts, plan, partial)
        if self._capture_refs is not None:
            self._capture_refs.append(tab)
        act = scratch.reshape(-1)[:A * I]
        kind, cols = ("skinny", SK_WARPS) if plan.block_rows <= SK_ROWS else ("tiled", TBN)
        parts = max(1, min(self.num_streams, plan.max_blocks))
        gx = _cdiv(plan.max_blocks, parts)
        gu, dn = f"moe_gate_up_{kind}_{suf}", f"moe_down_{kind}_{suf}"

        def run(p):
            self._launch(gu, (gx, _cdiv(I, cols)), (256,),
                         (act, x, plan.order, plan.blocks, plan.nblocks, tab[0], tab[1], tab[3], tab[4], active,
                          _i32(k), _i32(H), _i32(I), _i32(p), _i32(parts)))
            self._launch(dn, (gx, _cdiv(H, cols)), (256,),
                         (out, act, plan.blocks, plan.nblocks, tab[2], tab[5], active, _i32(H), _i32(I), _i32(p),
                          _i32(parts)))

        if parts == 1:
            run(0)
            return
        self._s.record(self._fork)                   # fork: every part starts after what came before
        for p in range(1, parts):
            s = self._aux[p - 1]
            s.wait_event(self._fork)
            with s:
                run(p)
            s.record(self._joins[p - 1])
        run(0)
        for p in range(1, parts):                    # join: the main stream waits for every part
            self._s.wait_event(self._joins[p - 1])

    # -- expert slots (colibri_edge.slots) ----------------------------------------------------
    @_op
    def alloc_slots(self, num_slots, blob_bytes):
        """N slots of one expert blob each, one device allocation [N, blob_bytes]. (Row starts keep the
        alignment the kernels' paired loads need: those run only for even K, when 4 (fp16) or 8
        (fp32) divides every matrix offset and blob_bytes.)"""
        return _cupy().zeros((int(num_slots), int(blob_bytes)), np.uint8)

    @_op
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

    @_op
    def slot_ffn(self, slots, slot, hidden, inter, dtype):
        """Views into the slot, laid out as colibri_edge.modeldir.expert_sections says (the kernels read
        the slot, nothing else; int8 row scales are views too)."""
        from colibri_edge.modeldir import expert_sections
        if dtype not in self.weight_dtypes:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"slot_ffn: {dtype} weights")
        dt = {"float16": np.float16, "bfloat16": np.uint16, "int8": np.int8}.get(dtype, np.float32)
        row = slots[int(slot)]
        ws = []
        for _, shape, off, soff in expert_sections(hidden, inter, dtype)[0]:
            n = shape[0] * shape[1] * np.dtype(dt).itemsize
            m = row[off:off + n].view(dt).reshape(shape)
            sc = None if soff is None else row[soff:soff + 4 * shape[0]].view(np.float32)
            ws.append(Weight(m, dtype, tuple(shape), sc))
        return FFN(*ws)

    @_op
    def combine(self, out, y, w, plan):
        T, k = plan.num_tokens, plan.top_k
        H = out.shape[1]
        self._launch("moe_combine", (_cdiv(H, 256), T), (256,), (out, y, w, plan.inverse, _i32(T), _i32(k), _i32(H)))

    # -- CUDA graphs -------------------------------------------------------------------------
    def graph_step(self, key, fn):
        """Run `fn` (a step that only launches this backend's ops on fixed buffers) through a CUDA
        graph: captured the first time `key` is seen, replayed afterwards. `key` must name
        everything the launches depend on (e.g. ("decode", T, rows)). Buffer contents may change
        between replays (token ids, positions, block tables, KV); shapes, pointers and the expert
        weights may not (call invalidate_graphs() when they do). If the capture fails the step
        runs in stream mode, now and for later calls with that key.
        Returns True when the step ran as a graph replay."""
        if self.closed:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "the CUDA backend is closed")
        g = self._graphs.get(key)
        if g is None and self.use_graphs and key not in self.graph_failures:
            g = self._capture(key, fn)
        if g is None:
            fn()
            self.mode = "stream"
            return False
        try:
            with self._s:
                g[0].launch(stream=self._s)
        except Exception as e:
            err = self._translate(e, "graph launch")
            if err is None:
                raise
            raise err from e
        self.graph_replays += 1
        self.mode = "graph"
        return True

    def _capture(self, key, fn):
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
                fn()
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

    def invalidate_graphs(self):
        """Forget every captured graph (weights moved, experts evicted, buffers reallocated)."""
        self._graphs.clear()
        self.graph_failures.clear()

    # -- misc --------------------------------------------------------------------------------
    def describe(self) -> str:
        comp = "fp32 compute" if self.fp32 else "fp16 compute (cuBLAS prefill GEMMs), fp32 accumulation"
        return (f"cuda: {self.device_name} sm_{self.cc}, {comp}, {self.num_streams} stream(s), mode={self.mode} "
                f"(graphs {'on' if self.use_graphs else 'off'}: {self.graph_captures} captured, "
                f"{self.graph_replays} replays, {len(self.graph_failures)} fell back)"
                + (f"; {self.cublas_note}" if self.cublas_note else ""))

    def close(self):
        if self.closed:
            return
        self.closed = True
        try:
            self._s.synchronize()
        except Exception:
            pass
        self._graphs.clear()
        self._tables.clear()


def graph_decode_hook(engine):
    """Route an Engine's decode steps through its backend's graph_step (transitional: this is what
    the scheduler is to do itself, see Runner.graph_decode in the CUDA backend's notes). A step
    whose entries are one token each, with last-token logits, is captured once per (tokens, rows)
    and replayed after; prefill steps run as before. No-op when the scheduler already does it or
    the backend has no graph_step. Returns the engine."""
    runner, be = engine.runner, engine.backend
    if getattr(runner, "graph_decode", False) or not hasattr(be, "graph_step") or \
            getattr(runner, "_graph_hooked", False):
        return engine
    step, forward = runner.step, runner._forward
    state = {"decode": False}

    def _forward(T, nrows):
        if state["decode"] and not runner.observers and getattr(runner, "slot_pool", None) is None and \
                getattr(runner, "trace", None) is None:
            be.graph_step(("decode", T, nrows), lambda: forward(T, nrows))
        else:
            forward(T, nrows)

    def _step(entries, all_logits=False):
        state["decode"] = not all_logits and all(len(t) == 1 for _, t in entries)
        try:
            return step(entries, all_logits)
        finally:
            state["decode"] = False

    runner._forward, runner.step, runner._graph_hooked = _forward, _step, True
    return engine
