"""The cpu backend: Numba kernels (kernels.py: dense and attention; moe_kernels.py) over NumPy buffers, on any x86-64 or ARM64 CPU.

Memory is host memory. Weights stay the read-only memmap views given to `to_device`, only re-viewed
as their stored bits (float16 -> uint16, bfloat16 -> int16; see kernels.py), so pages of experts
never routed to are never read. Every op writes into the buffer it is given and allocates nothing.

Threads: COLIBRI_NUM_THREADS arrives as `num_threads` (0 = every thread Numba started, by default
one per core) and sizes Numba's pool with numba.set_num_threads. That setting is per calling
thread, so it is applied again when another thread runs a step. BLAS is never called: Numba's pool
is the only one to govern.
"""
from __future__ import annotations

import os
import platform
import threading

import numpy as np

from colibri_edge.dtypes import STORAGE
from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from colibri_edge.modeldir import expert_sections
from ..base import Backend as BackendBase, Plan, Weight, plan_buffers

# stored type -> element type of the view the kernels read (the type picks the widening)
KERNEL_VIEW = {"float32": np.dtype(np.float32), "float16": np.dtype(np.uint16), "bfloat16": np.dtype(np.int16),
               "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8)}

_thread_state = threading.local()     # the thread count set on this thread, if any


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe(for_auto=False):
    """-> (ok, detail): the CPU, its cores and Numba's version, or why Numba cannot be used."""
    try:
        import numba
    except Exception as e:             # not installed, or built against another NumPy
        return False, f"numba is not importable ({type(e).__name__}: {e}); pip install numba"
    return True, f"{_cpu_name()} ({platform.machine()}), {os.cpu_count()} cores, numba {numba.__version__}"


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False          # one array type for memmapped and in-memory weights alike
    return v


class Backend(BackendBase):
    name = "cpu"
    weight_dtypes = ("float32", "float16", "bfloat16", "int8")
    OPTIONS = ("num_threads",)

    def __init__(self, num_threads=0):
        import numba
        from . import kernels, moe_kernels
        self.numba, self.k, self.m = numba, kernels, moe_kernels
        pool = numba.config.NUMBA_NUM_THREADS
        num_threads = int(num_threads or 0)
        if num_threads < 0 or num_threads > pool:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"COLIBRI_NUM_THREADS={num_threads}: Numba started {pool} threads; use 0..{pool} "
                               f"(or set NUMBA_NUM_THREADS={num_threads} before starting)")
        self.num_threads = num_threads or pool
        self.none = _readonly(np.zeros(0, np.float32))      # an absent bias or scales vector
        self.no_tally = np.zeros(0, np.int32)
        self._warm_up()

    def _warm_up(self):
        """Run every op once on tiny buffers of the types the scheduler passes, each weight type
        included: Numba compiles lazily (or loads its disk cache lazily), and this puts that time
        and memory at backend creation, never inside a request."""
        T, H, I, E, k, D, B = 2, 8, 4, 3, 2, 4, 2
        f32, i32 = np.float32, np.int32
        x, o, y, h = self.alloc((T, H)), self.alloc((T, H)), self.alloc((T * k, H)), self.alloc((T * k, I))
        ids, pos = self.alloc((T, k), i32), self.alloc((T,), i32)
        norm = self.upload(np.ones(H, f32))
        bufs = {n: self.alloc(s, d) for n, (s, d) in plan_buffers(T * k, E).items()}
        for wd in self.weight_dtypes:
            sc = np.ones(H, f32) if wd == "int8" else None
            w = self.upload(np.zeros((H, H), STORAGE[wd]), wd, scales=sc)
            ffn = self.upload_expert(np.zeros(expert_sections(H, I, wd)[1], np.uint8), H, I, wd)
            self.embed(x, w, pos)
            self.matmul(o, x, w)
            self.route(ids, self.alloc((T, k)), self.alloc((T, E)), k, "topk", True)
            plan = self.align(bufs, ids, T, E, k, self.alloc((E,), i32))
            self.grouped_ffn(y, x, [ffn] * E, plan, h)
        self.align(bufs, ids, T, E, k)
        self.embed(x, y, pos)
        self.matmul(o, x, self.upload(np.zeros((H, H), f32)), norm)
        self.rmsnorm(x, x, norm, 1e-6)
        self.add(x, x, x)
        self.add(x, x, x, gate=self.alloc((T, 1)))
        self.combine(x, y, self.alloc((T, k)), plan)
        q, kv = self.alloc((T, 2, D)), self.alloc((T, 1, D))
        self.rope(q, q, pos, 10000.0)
        K, V = self.alloc((2 * B, 1, D)), self.alloc((2 * B, 1, D))
        self.kv_write(K, V, kv, kv, pos)
        self.paged_attention(q.copy(), q, K, V, self.alloc((1, 2), i32), pos, pos, B, 0.5)

    def _use_threads(self):
        if getattr(_thread_state, "n", None) != self.num_threads:
            self.numba.set_num_threads(self.num_threads)
            _thread_state.n = self.num_threads

    def summary(self) -> str:
        return f"cpu: {probe()[1]}, {self.num_threads} threads"

    # -- memory ------------------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def to_device(self, host, dtype):
        arr = np.asarray(host)
        if arr.dtype.itemsize != KERNEL_VIEW[dtype].itemsize:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"cpu backend: {arr.dtype} data cannot hold {dtype}")
        if not arr.flags.c_contiguous:     # model tensors always are; this copies only odd inputs
            arr = np.ascontiguousarray(arr)
        return _readonly(arr.view(KERNEL_VIEW[dtype]))

    def view(self, buf, byte_offset, shape, dtype):
        dt = KERNEL_VIEW[dtype]
        n = int(np.prod(shape)) * dt.itemsize
        return _readonly(buf[byte_offset:byte_offset + n].view(dt).reshape(shape))

    def upload_into(self, dst, host):
        dst[...] = host

    def download(self, buf):
        return np.array(buf)

    def host_view(self, buf):
        return buf

    # -- dense -------------------------------------------------------------------------------
    def _scales(self, w):
        return self.none if w.scales is None else w.scales

    def embed(self, out, table, ids):
        if isinstance(table, Weight):
            self.k.embed(out, table.data, self._scales(table), ids)
        else:
            self.k.embed(out, table, self.none, ids)

    def matmul(self, out, x, w, bias=None):
        self._use_threads()
        self.k.matmul(out, x, w.data, self._scales(w), self.none if bias is None else bias.data, self.num_threads)

    def rmsnorm(self, out, x, weight, eps):
        self.k.rmsnorm(out, x, weight.data, float(eps))

    def rope(self, out, x, positions, theta):
        self.k.rope(out, x, positions, float(theta))

    def add(self, out, a, b, gate=None):
        if gate is None:
            self.k.add(out, a, b)
        else:
            self.k.gated_add(out, a, b, gate)

    # -- attention ---------------------------------------------------------------------------
    def kv_write(self, K, V, k, v, slots):
        self.k.kv_write(K, V, k, v, slots)

    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale):
        self._use_threads()
        self.k.paged_attention(out, q, K, V, block_tables, seq_index, positions, int(block_size), float(scale))

    # -- MoE ---------------------------------------------------------------------------------
    def route(self, out_ids, out_w, logits, k, mode, normalize):
        self.m.route(out_ids, out_w, logits, mode == "gated", bool(normalize))

    def align(self, bufs, ids, num_tokens, num_experts, top_k, tally=None):
        A, E = num_tokens * top_k, num_experts
        if A > bufs["order"].shape[0] or E > bufs["counts"].shape[0]:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"plan of {A} rows / {E} experts exceeds its buffers "
                               f"({bufs['order'].shape[0]} / {bufs['counts'].shape[0]})")
        order, inverse, counts = bufs["order"][:A], bufs["inverse"][:A], bufs["counts"][:E]
        offsets, active = bufs["offsets"][:E + 1], bufs["active"][:E]
        n_active = self.m.align(offsets, order, inverse, counts, active, ids.reshape(-1)[:A],
                                self.no_tally if tally is None else tally)
        return Plan(offsets, order, inverse, counts, num_tokens, top_k, active[:n_active], num_experts=E)

    def grouped_ffn(self, out, x, experts, plan, scratch):
        """Per active expert: gate/up + SwiGLU into scratch (its rows, packed [n, I]), then down into
        out's rows. Two parallel passes per expert, each reading that expert's weights once."""
        self._use_threads()
        width = scratch.shape[1]
        flat = scratch.reshape(-1)         # scratch is C-contiguous: rows start.. hold act [n, I]
        for e in plan.experts_to_run():    # align's active list, or a slot-pool wave of it
            e = int(e)
            start, n = int(plan.offsets[e]), int(plan.counts[e])
            ffn = experts[e]
            inter = ffn.gate.shape[0]
            act = flat[start * width:start * width + n * inter].reshape(n, inter)
            self.m.swiglu_gate_up(act, x, plan.order, start, plan.top_k, ffn.gate.data, ffn.up.data,
                                  self._scales(ffn.gate), self._scales(ffn.up), self.num_threads)
            self.k.matmul(out[start:start + n], act, ffn.down.data, self._scales(ffn.down), self.none,
                          self.num_threads)

    def combine(self, out, y, w, plan):
        self.m.combine(out, y, w, plan.inverse)
