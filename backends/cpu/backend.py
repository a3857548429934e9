"""The cpu backend: Numba kernels (kernels.py: dense and attention; moe_kernels.py; recurrent.py: the recurrent
mixers) over NumPy buffers, on any x86-64 or ARM64 CPU.

Memory is host memory. Weights stay the read-only memmap views given to `to_device`, only re-viewed
as their stored bits (float16 -> uint16, bfloat16 -> int16; see kernels.py), so pages of experts
never routed to are never read. Every op writes into the buffer it is given and allocates nothing.

Threads: COLIBRI_NUM_THREADS arrives as `num_threads`. 0 (the default): as many as the process has
cores (cores.available_cores: affinity mask and cgroup quota, at most the threads Numba started),
and fewer while other processes take cores (cores.Governor, re-read at a step's start every 0.25 s);
N: exactly N, always. The count sizes Numba's pool with numba.set_num_threads, which is per calling
thread, so it is applied again when another thread runs a step. BLAS is never called: Numba's pool
is the only one to govern. Inside a parallel region threads claim chunks of rows (kernels.claim),
so a descheduled or slower thread holds a region up by at most one chunk.

Threading layer and waits, chosen by measurement (2-core CI host, float16 benchmark model, decode
tok/s quiet / with a busy loop pinned to one core, 2 threads fixed): OpenMP with its default wait
(spin ~300k pauses, a whole time slice, then sleep) 44 / 18, p99 194 ms under load (the spinning
worker spends its share of the busy core, and the scheduler then favours the loop when the worker
has work); OMP_WAIT_POLICY=passive 43 / 28, p99 51 ms, but every parallel region then wakes a
sleeping thread: the 4-layer demo model's step 650-750 -> 1100 us; GOMP_SPINCOUNT=2000 (~40 us of
pauses, about the gap between two regions of a step) keeps the demo step at 680-830 us; workqueue
29 / 23 (its calling thread only waits); TBB 44 / 29 (no aarch64 wheel). With the governor on top
(cores.py), spin 2000: 53 / 34 tok/s, p99 45 ms, and 36 tok/s with a loop taking half a core. So:
OpenMP first, ~40 us of spin (GOMP_SPINCOUNT from the host's timed pause: spincount), both set
before Numba starts its threads unless the environment sets NUMBA_THREADING_LAYER(_PRIORITY),
OMP_WAIT_POLICY or GOMP_SPINCOUNT. On ARM64, libgomp's spin has no pause instruction, so 2000 is a
shorter spin (closer to passive).
"""
from __future__ import annotations

import os
import platform
import threading

import numpy as np

from colibri_edge.model.dtypes import is_block, storage_dtype, storage_shape
from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from colibri_edge.model.modeldir import expert_sections
from colibri_edge.model.quant import BLOCK, act_block
from ..base import GATE_MODES, KV_DTYPES, Backend as BackendBase, KVCache, Plan, Weight, plan_buffers
from .cores import Governor, available_cores

# stored type -> element type of the view the kernels read (the type picks the widening, or for a block
# format the decoding: a record of one block, with one field named after the format; see qir.py)
KERNEL_VIEW = {"float32": np.dtype(np.float32), "float16": np.dtype(np.uint16), "bfloat16": np.dtype(np.int16),
               "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
               **{f: np.dtype([(f, "u1", (nb,))]) for f, (_, nb) in BLOCK.items()}}

_thread_state = threading.local()     # the thread count set on this thread, if any
# rows from which a LoRA update runs on the pool (one row per thread, or a row cut in column chunks):
# every update, measured on the benchmark model (int8, batch 1: attention's one-row updates 0.62 ->
# 0.55 ms a token, an MoE layer's two rows 1.0 -> 0.8 ms)
PARALLEL_LORA_ROWS = 1
SPIN_US = 40.0                        # how long an idle thread spins before it sleeps (see above)
SPINCOUNT = 2000                      # libgomp's spins for SPIN_US where a pause is not timed (ARM64)


def spincount(pause_ns: float | None = None) -> int:
    """libgomp's GOMP_SPINCOUNT for SPIN_US of spinning on this host. libgomp counts spins, each a
    `pause` on x86-64, whose length differs by an order between cores: ~20 ns on Zen 3 (where 2000
    spins were measured as ~40 us), 10.4 ns on the AVX-512 CI host, where 2000 spins slept the pool
    between a step's LoRA regions (an MoE layer's two LoRA updates of one decode row 106 / 76 us ->
    55 / 30 us at 4000 spins; the base model's int8 decode 105 -> 110 tok/s; decode beside a busy
    loop unchanged, 56 -> 57 tok/s). So the pause is timed (spin_pause_ns) and the count follows."""
    if pause_ns is None:
        pause_ns = spin_pause_ns()
    if not pause_ns:
        return SPINCOUNT
    return int(min(max(SPIN_US * 1000.0 / pause_ns, 500), 20000))


def _bits(a):
    """A float32 or float16 array as the kernels read it (float16 as its bits, uint16: KERNEL_VIEW)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _threading_defaults():
    """OpenMP first, a short spin before sleeping (see the module docstring); the environment wins.
    Only effective before Numba starts its threads (the first parallel call in the process)."""
    import numba
    from numba.np.ufunc import parallel
    if parallel._is_initialized:
        return
    if "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ and "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(spincount())   # read by libgomp when Numba loads it


def spin_pause_ns() -> float | None:
    """The length of one `pause` on this x86-64 host in ns (the best of three runs of 20,000), or None
    elsewhere (libgomp's ARM64 spin has no pause instruction)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import time
    from .kernels import pause_loop
    pause_loop(100)
    best = None
    for _ in range(3):
        t = time.perf_counter_ns()
        pause_loop(20000)
        d = (time.perf_counter_ns() - t) / 20000
        best = d if best is None else min(best, d)
    return best


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
    weight_dtypes = ("float32", "float16", "bfloat16", "int8") + tuple(BLOCK)
    OPTIONS = ("num_threads", "int8_activations")
    kv_dtypes = KV_DTYPES

    def __init__(self, num_threads=0, int8_activations=True):
        import numba
        from . import kernels, moe_kernels, qkernels, recurrent
        self.numba, self.k, self.m, self.q, self.r = numba, kernels, moe_kernels, qkernels, recurrent
        self._lora_z = None               # the LoRA kernels' per-item scratch (grown on first use)
        self._lora_rowbuf = None          # their plan rows (lora_kernels.plan_rows)
        self._lora_starts = None
        self._lora_tiles = None
        _threading_defaults()
        pool = numba.config.NUMBA_NUM_THREADS
        num_threads = int(num_threads or 0)
        if num_threads < 0 or num_threads > pool:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"COLIBRI_NUM_THREADS={num_threads}: Numba started {pool} threads; use 0..{pool} "
                               f"(or set NUMBA_NUM_THREADS={num_threads} before starting)")
        # num_threads: the most threads a step uses; threads: what the governor lets it use now
        self.num_threads = num_threads or max(1, min(pool, available_cores()))
        self.governor = None if num_threads else Governor(self.num_threads)
        self.threads = self.num_threads
        self.thread_steps = np.zeros(self.num_threads + 1, np.int64)    # steps run at each count
        self.work = np.zeros((self.num_threads, 8), np.int64)   # the kernels' claim counters (kernels.claim)
        self.none = _readonly(np.zeros(0, np.float32))      # an absent bias or scales vector
        self._kv_warm = {"float32"}                  # the kv_dtypes the attention kernels were warmed in
        self._freqs = {}                                      # (theta, D) -> the rope table
        self.no_pre = np.zeros((0, 0), np.float32)            # no per-row gate/up addend (kernels.expert_act)
        self._silu = (self.none, self.none, np.float32(0), np.float32(0), self.no_pre)   # expert_act's SwiGLU
        self.no_tally = np.zeros(0, np.int32)
        # block formats' dequantised rows (4), or predecoded gate and up row quads (qir.PB: 2 x 4 x 704 / 256 bytes a column)
        self._qscratch = np.zeros((self.num_threads, 6, 0), np.float32)
        # block formats: activations quantised to int8 per 32 (or 256: quant.act_block), integer dots (qir.py); the
        # float32-activation path stays, int8_activations=False / COLIBRI_INT8_ACTIVATIONS=0
        self.int8_activations = bool(int8_activations)
        self._qx = (np.zeros((1, 0), np.int8), np.zeros((1, 0), np.float32), np.zeros((1, 0), np.float32))
        self._route_c = np.zeros(0, np.float32)     # route's choice and group scores [E + groups]
        self._ml = np.zeros((0, 2), np.float32)     # latent attention's running (max, sum) [T*Hq, 2]
        self._heads_warm = set()                    # the types head_matmul was warmed in
        self._delta = {}                            # (dk, dv) -> delta_rule's chunk scratch (_delta_scratch)
        self._warm_up(("float32",), common=True)

    def prepare(self, formats, max_cols, max_rows=2):
        """Compile (or load from Numba's cache) and warm the kernels of the model's formats, and size
        the block formats' scratch: the dequantised rows [threads, 4, max_cols] and the int8
        activations of max_rows rows: nothing the model will not run."""
        if any(is_block(f) for f in formats):
            self._scratch(max_cols)
            self._acts(max_cols, max_rows)
        self._warm_up(tuple(f for f in sorted(formats) if f != "float32"))


    def _scratch(self, cols):
        """The prefill scratch, at least cols wide: prepare() sizes it for a model, so this grows it only
        for ops called directly (kernel tests)."""
        t, _, c = self._qscratch.shape
        if c < cols or t < self.num_threads:
            self._qscratch = np.zeros((max(t, self.num_threads), 6, max(c, cols)), np.float32)
        return self._qscratch

    def _acts(self, cols, rows):
        """The int8 activations of rows rows (qx int8 [rows, cols], dx and xs float32 [rows, cols / 32]),
        sized by prepare(); grown here only for ops called directly."""
        r, c = self._qx[0].shape
        if c < cols or r < rows:
            r, c = max(r, rows), max(c, -(-cols // 32) * 32)
            self._qx = (np.zeros((r, c), np.int8), np.zeros((r, c // 32), np.float32),
                        np.zeros((r, c // 32), np.float32))
        return self._qx

    def _warm_up(self, formats, common=False):
        """_warm_ops on one thread. The warm-up runs on the thread that opens the engine, and the steps
        on the engine's core thread: an OpenMP region run here with 2 threads would give this thread a
        pool of its own, and with more OpenMP threads than cores libgomp stops spinning and every
        region of the core thread then waits for a sleeping worker (measured on the 2-core CI host: a
        tiny parallel region from a second thread 63 us instead of 7; int8 decode of the benchmark
        model 77 tok/s instead of 100). One thread here creates no pool."""
        threads, self.threads = self.threads, 1
        self.numba.set_num_threads(1)            # for the kernels that do not go through _use_threads
        _thread_state.n = 1
        try:
            self._warm_ops(formats, common)
        finally:
            self.threads = threads               # _use_threads sets it again on the next op of this thread

    def _warm_ops(self, formats, common=False):
        """Run every op once on tiny buffers of the types the scheduler passes, in the given weight
        formats: Numba compiles lazily (or loads its disk cache lazily), and this puts that time and
        memory at backend creation (the common ops) and model open (the model's formats), never
        inside a request."""
        T, E, k, D = 2, 3, 2, 4
        H = I = 256                       # a K-quant block wide
        f32, i32 = np.float32, np.int32
        x, o, y, h = self.alloc((T, H)), self.alloc((T, H)), self.alloc((T * k, H)), self.alloc((T * k, I))
        x5 = self.alloc((5, H))
        ids, pos = self.alloc((T, k), i32), self.alloc((T,), i32)
        ids[:] = [[0, 1], [2, 0]]            # 1 and 2 rows an expert (an odd and an even count)
        norm = self.upload(np.ones(H, f32))
        bufs = {n: self.alloc(s, d) for n, (s, d) in plan_buffers(5 * k, E).items()}
        for wd in formats:
            sc = np.ones(H, f32) if wd == "int8" else None
            raw = np.zeros(storage_shape(wd, (H, H)), storage_dtype(wd))    # zero blocks: valid in every format
            w = self.upload(raw, wd, scales=sc, shape=(H, H))
            ffn = self.upload_expert(np.zeros(expert_sections(H, I, wd)[1], np.uint8), H, I, wd)
            self.embed(x, w, pos)
            self.matmul(o, x, w)
            self.matmul(self.alloc((5, H)), x5, w)         # the prefill path of the block formats
            self.route(ids, self.alloc((T, k)), self.alloc((T, E)), k, "topk", True)
            plan = self.align(bufs, ids, T, E, k, self.alloc((E,), i32))
            self.grouped_ffn(y, x, [ffn] * E, plan, h)
            plan = self.align(bufs, self.alloc((5, k), i32), 5, E, k)
            self.grouped_ffn(self.alloc((5 * k, H)), x5, [ffn] * E, plan, self.alloc((5 * k, I)))
        if not common:
            return
        plan = self.align(bufs, ids, T, E, k)
        self.embed(x, y, pos)
        self.matmul(o, x, self.upload(np.zeros((H, H), f32)), norm)
        self.rmsnorm(x, x, norm, 1e-6)
        self.add(x, x, x)
        self.add(x, x, x, gate=self.alloc((T, 1)))
        self.combine(x, y, self.alloc((T, k)), plan)
        q = self.alloc((T, 2, D))
        self.rope(q, q, pos, 10000.0)
        self._warm_kv("float32")

    def _warm_kv(self, kv_dtype, latent=False):
        """kv_write and paged_attention (latent: latent_attention) over caches in kv_dtype, once on tiny
        buffers (as _warm_up)."""
        from ..base import kv_parts
        T, D, B = 2, 4, 2
        i32 = np.int32
        pos = self.alloc((T,), i32)
        q, kv = self.alloc((T, 2, D)), self.alloc((T, 1, D))

        def cache(n):
            return self.alloc_kv(kv_parts((2 * B, 1, n), kv_dtype), kv_dtype, warm=False)
        K, V = cache(D), cache(2 if latent else D)
        self.kv_write(K, V, kv, self.alloc((T, 1, 2)) if latent else kv, pos)
        if latent:
            self.latent_attention(q.copy(), q, self.alloc((T, 2, 2)), K, V, self.alloc((1, 2), i32), pos, pos, B, 0.5)
        else:
            self.paged_attention(q.copy(), q, K, V, self.alloc((1, 2), i32), pos, pos, B, 0.5)

    def _warm_latent(self, dtype):
        """head_matmul in weight type dtype and latent_attention (over the kv_dtypes warmed so far), once
        on tiny buffers (as _warm_up)."""
        T, G, N, K = 2, 2, 4, 4
        w = self.upload(np.zeros((G, N, K), storage_dtype(dtype)), dtype)
        x = self.alloc((T, G, K))
        self.head_matmul(self.alloc((T, G, N)), x, w)
        for kv_dtype in sorted(self._kv_warm):
            self._warm_kv(kv_dtype, latent=True)

    def _use_threads(self):
        if getattr(_thread_state, "n", None) != self.threads:
            self.numba.set_num_threads(self.threads)
            _thread_state.n = self.threads

    def begin_step(self):
        if self.governor is not None:
            self.threads = self.governor.tick()
        self.thread_steps[self.threads] += 1

    def thread_stats(self) -> dict:
        """Threads now, the most a step may use, how set, and the steps run at each count."""
        g = self.governor
        return {"threads": self.threads, "max_threads": self.num_threads,
                "mode": "fixed (num_threads)" if g is None else
                        "adaptive" if g.enabled else "adaptive, off (no /proc/stat or 1 core)",
                "others_cores": None if g is None else round(g.others, 2),
                "steps_by_threads": {n: int(c) for n, c in enumerate(self.thread_steps) if c}}

    def summary(self) -> str:
        st = self.thread_stats()
        how = "fixed" if self.governor is None else f"adaptive up to {self.num_threads}"
        if self.governor is not None and self.governor.enabled:
            how += f", other processes took {st['others_cores']:.2f} cores"
        steps = ", ".join(f"{c} at {n}" for n, c in st["steps_by_threads"].items())
        return (f"cpu: {probe()[1]}, {self.threads} threads ({how}; steps run: {steps or 'none'}; "
                f"{self.numba.threading_layer()} threading layer, "
                f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}, "
                f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}); " + self.kernel_summary())

    @staticmethod
    def kernel_summary() -> str:
        """'kernels: N compiled, M loaded from the cache (target CPU, cache folder)' in this process."""
        from numba.core import config
        from . import jitcache
        c = jitcache.counts()
        where = os.environ.get(jitcache.CACHE_ENV) or "Numba's default cache"
        from .kernels import VW
        from .qir import INT8_DOT, PREFETCH
        pf = f"prefetch {PREFETCH} B ahead" if PREFETCH else "no software prefetch"
        return (f"kernels: {c['compiled']} compiled, {c['cached']} loaded from the cache (target CPU "
                f"{config.CPU_NAME or 'host'}, {where}); float tiles {VW} lanes, int8 dots {INT8_DOT}, {pf}")

    # -- memory ------------------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def alloc_slots(self, num_slots, blob_bytes):
        from ..base import aligned_host
        return aligned_host(num_slots, blob_bytes)   # page-aligned rows: direct reads land in them

    def slot_host_view(self, slots, slot):
        return slots[slot]                 # host memory: a miss is read from storage straight into it

    def to_device(self, host, dtype):
        arr = np.asarray(host)
        if not arr.flags.c_contiguous:     # model tensors always are; this copies only odd inputs
            arr = np.ascontiguousarray(arr)
        if dtype in BLOCK:                 # bytes [N, row_bytes] -> blocks [N, K / B]
            if arr.dtype != np.uint8 or arr.shape[-1] % BLOCK[dtype][1]:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"cpu backend: {arr.dtype} {arr.shape} is not "
                                   f"rows of {dtype} blocks")
        elif arr.dtype.itemsize != KERNEL_VIEW[dtype].itemsize:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"cpu backend: {arr.dtype} data cannot hold {dtype}")
        return _readonly(arr.view(KERNEL_VIEW[dtype]))

    def view(self, buf, byte_offset, shape, dtype):
        """shape: the storage shape ([N, row_bytes] for a block format)."""
        dt = KERNEL_VIEW[dtype]
        if dtype in BLOCK:
            n = int(np.prod(shape))
            return _readonly(buf[byte_offset:byte_offset + n].reshape(shape).view(dt))
        n = int(np.prod(shape)) * dt.itemsize
        return _readonly(buf[byte_offset:byte_offset + n].view(dt).reshape(shape))

    def upload(self, host, dtype="float32", scales=None, shape=None):
        """The upload policy (base.Backend.upload). The first per-head weight [G, N, K] in a type (latent
        attention's: the only 3-D weights) warms head_matmul in that type and latent_attention, so
        they compile (or load from the cache) at model open, and only for a model that runs them."""
        w = super().upload(host, dtype, scales, shape)
        if len(w.shape) == 3 and dtype not in self._heads_warm:
            self._heads_warm.add(dtype)
            self._warm_latent(dtype)
        return w

    def alloc_kv(self, parts, kv_dtype, warm=True):
        """A paged cache tensor (base.alloc_kv), its float16 buffers (float16 values, q8_0's scales) seen
        as their bits (uint16: Numba has no float16 arrays; the kernels widen them as they read). The
        first cache of a kv_dtype warms the attention kernels in it (and latent_attention when a latent
        model's weights were uploaded), at engine open, never inside a request."""
        c = super().alloc_kv(parts, kv_dtype)
        if isinstance(c, KVCache):
            bits = lambda a: None if a is None else a.view(np.uint16) if a.dtype == np.float16 else a  # noqa: E731
            c = KVCache(c.dtype, bits(c.data), bits(c.scales))
        if warm and kv_dtype not in self._kv_warm:
            self._kv_warm.add(kv_dtype)
            self._warm_kv(kv_dtype)
            if self._heads_warm:
                self._warm_kv(kv_dtype, latent=True)
        return c

    def _kv(self, cache):
        """A cache tensor -> (values, q8_0 scales or None) as the attention kernels take them."""
        if isinstance(cache, KVCache):
            return cache.data, cache.scales
        return cache, None

    def upload_into(self, dst, host):
        dst[...] = host

    def copy_into(self, dst, src):
        dst[...] = src

    def download(self, buf):
        return np.array(buf)

    def host_view(self, buf):
        return buf

    # -- dense -------------------------------------------------------------------------------
    def _scales(self, w):
        return self.none if w.scales is None else w.scales

    def embed(self, out, table, ids):
        if not isinstance(table, Weight):
            self.k.embed(out, table, self.none, ids)
        elif table.dtype in BLOCK:
            self.q.qembed(out, table.data, ids)
        else:
            self.k.embed(out, table.data, self._scales(table), ids)

    def matmul(self, out, x, w, bias=None):
        self._use_threads()
        b = self.none if bias is None else bias.data
        if w.dtype in BLOCK:
            self._qmatmul(out, x, w.data, b)
        else:
            self.k.matmul(out, x, w.data, self._scales(w), b, self.work)

    def rmsnorm(self, out, x, weight, eps):
        self.k.rmsnorm(out, x, weight.data, float(eps))

    def pos_scale(self, out, x, positions, floor_scale, attn_scale):
        T = x.shape[0]
        self.k.pos_scale(out.reshape(T, -1), x.reshape(T, -1), positions, np.float32(floor_scale),
                         np.float32(attn_scale))

    def layernorm(self, out, x, weight, bias, eps):
        self.k.layernorm(out, x, weight.data, bias.data, float(eps))

    def rope(self, out, x, positions, theta, inv_freq=None):
        if inv_freq is None:
            key = (float(theta), x.shape[-1])
            inv_freq = self._freqs.get(key)
            if inv_freq is None:     # the reference's float32 table: 1 / theta^(2i/D)
                D = x.shape[-1]
                inv_freq = self._freqs[key] = (1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float32) / D))).astype(
                    np.float32)
        self.k.rope(out, x, positions, inv_freq)

    def add(self, out, a, b, gate=None):
        if gate is None:
            self.k.add(out, a, b)
        else:
            self.k.gated_add(out, a, b, gate)

    def scale(self, out, x, factor, cap=0.0):
        """NumPy's ufuncs in place (SIMD tanh: 0.15 ms on a 262144-wide logit row against 3.9 ms for a
        scalar Numba loop), in the reference's order, allocating nothing."""
        np.multiply(x, np.float32(factor), out=out)
        if cap > 0:
            c = np.float32(cap)
            np.divide(out, c, out=out)
            np.tanh(out, out=out)
            np.multiply(out, c, out=out)

    # -- attention ---------------------------------------------------------------------------
    def kv_write(self, K, V, k, v, slots):
        """A float32 cache as is; float16 as half bits rounded to nearest even; q8_0 as int8 values and
        a half-bit scale per group (kernels.kv_write_q8): each row quantised as it is written."""
        if not isinstance(K, KVCache):
            self.k.kv_write(K, V, k, v, slots)
            return
        for cache, x in ((K, k), (V, v)):
            if cache.scales is None:
                self.k.kv_write_half(cache.data, x, slots)
            else:
                self.k.kv_write_q8(cache.data, cache.scales, x, slots)

    def head_matmul(self, out, x, w):
        self._use_threads()
        self.k.head_matmul(out, x, w.data, self.work)

    def latent_attention(self, out, q, q_rope, C, R, block_tables, seq_index, positions, block_size, scale):
        """Parallel over (token, part of its heads): one part per token, or as many as make the parts
        reach the threads when the tokens are fewer (decode)."""
        self._use_threads()
        T, Hq = q.shape[0], q.shape[1]
        if self._ml.shape[0] < T * Hq:
            self._ml = np.zeros((T * Hq, 2), np.float32)
        self.k.latent_attention(out, q, q_rope, *self._kv(C), *self._kv(R), block_tables, seq_index, positions,
                                int(block_size), float(scale), min(Hq, -(-self.threads // T)), self._ml)

    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale, window=0,
                        sinks=None):
        self._use_threads()
        self.k.paged_attention(out, q, *self._kv(K), *self._kv(V), block_tables, seq_index, positions,
                               int(block_size), float(scale), int(window), self.none if sinks is None else sinks.data)

    # -- recurrent mixers --------------------------------------------------------------------
    def causal_conv(self, out, x, weight, state, starts, slots, positions, silu=True, bias=None):
        self._use_threads()
        self.r.causal_conv(out, x, weight.data, state, starts, slots, positions, bool(silu),
                           self.none if bias is None else bias.data)

    def ssm_scan(self, out, xbc, dt, a_neg, d_skip, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        """Token by token on every path (recurrent.ssm_scan): prefill and decode the same arithmetic."""
        self._use_threads()
        nh, P, G, N = (int(h) for h in heads)
        self.r.ssm_scan(out, xbc, dt, a_neg.data, d_skip.data, dt_bias.data, state, starts, slots, positions,
                        nh, P, G, N)

    def _delta_scratch(self, dk, dv):
        """delta_rule's chunk scratch for heads of dk x dv, one set per thread (recurrent.delta_rule:
        Q, K, W [C, dk]; U [C, dv]; A, M [C, C]; G, beta [C]; C = 16: 34 KB at dk = dv = 128):
        allocated the first time the shape is seen, then reused by every call (a decode step uses one
        [dv] row of it a thread: recurrent.delta_step's X)."""
        s = self._delta.get((dk, dv))
        if s is None:
            n, C = self.num_threads, self.r.DELTA_CHUNK
            s = self._delta[(dk, dv)] = (np.zeros((n, 3, C, dk), np.float32), np.zeros((n, C, dv), np.float32),
                                         np.zeros((n, 2, C, C), np.float32), np.zeros((n, 2, C), np.float32))
        return s

    def delta_rule(self, out, qkv, a, b, a_neg, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        """Parallel over (sequence, value head) pairs: one token by the recurrence, more in chunks of 16
        (recurrent.delta_rule), or token by token when stepwise."""
        self._use_threads()
        Hk, Hv, dk, dv = heads[:4]
        group = heads[4] if len(heads) > 4 else Hv // Hk        # value head h reads key head (h // group) % Hk
        self.r.delta_rule(out, qkv, a, b, a_neg.data, dt_bias.data, state, starts, slots, positions, int(Hk),
                          int(group), bool(stepwise), self.work, self.threads, *self._delta_scratch(int(dk), int(dv)))

    def gate_mul(self, out, x, gate, act):
        self._use_threads()
        self.r.gate_mul(out, x, gate, GATE_MODES[act])

    # -- MoE ---------------------------------------------------------------------------------
    def route(self, out_ids, out_w, logits, k, mode, normalize, choice_bias=None, norm_min=0.0, expert_scale=None,
              score="softmax", groups=None, scaling=1.0):
        groups = (1, 1, 1) if groups is None else tuple(int(g) for g in groups)
        if self._route_c.shape[0] < logits.shape[1] + groups[0]:
            self._route_c = np.zeros(logits.shape[1] + groups[0], np.float32)
        self.m.route(out_ids, out_w, logits, mode == "gated", bool(normalize),
                     self.none if choice_bias is None else choice_bias.data, np.float32(norm_min),
                     self.none if expert_scale is None else expert_scale.data, score == "sigmoid", groups,
                     np.float32(scaling), self._route_c)

    def sparsemixer(self, out_ids, out_w, logits, jitter):
        self.m.sparsemixer(out_ids, out_w, logits, np.float32(2 * jitter))

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

    ffn_activations = ("silu", "swiglu_oai", "gelu_tanh")

    def grouped_ffn(self, out, x, experts, plan, scratch, act=None, pre=None):
        """Per active expert: gate/up + SwiGLU into scratch (its rows, packed [n, I]), then down into
        out's rows. Two parallel passes per expert, each reading that expert's weights once. pre: the
        rows' gate/up addends (base.grouped_ffn), handed to the activation with the expert's rows."""
        self._use_threads()
        width = scratch.shape[1]
        flat = scratch.reshape(-1)         # scratch is C-contiguous: rows start.. hold act [n, I]
        for e in plan.experts_to_run():    # align's active list, or a slot-pool wave of it
            e = int(e)
            start, n = int(plan.offsets[e]), int(plan.counts[e])
            ffn = experts[e]
            inter = ffn.gate.shape[0]
            a = flat[start * width:start * width + n * inter].reshape(n, inter)
            ep, db = self._epilogue(act, e, self.no_pre if pre is None else pre[start:start + n])
            if ffn.gate.dtype in BLOCK and self.int8_activations and \
                    act_block(ffn.gate.dtype) == act_block(ffn.up.dtype):       # one quantised x serves both
                self.q.qswiglu_gate_up_i8(a, x, plan.order, start, plan.top_k, ffn.gate.data, ffn.up.data,
                                          self.work, *self._acts(x.shape[1], n), self._scratch(x.shape[1]), ep)
            elif ffn.gate.dtype in BLOCK:
                self.q.qswiglu_gate_up(a, x, plan.order, start, plan.top_k, ffn.gate.data, ffn.up.data,
                                       self.work, self._scratch(x.shape[1]), ep)
            else:
                self.m.swiglu_gate_up(a, x, plan.order, start, plan.top_k, ffn.gate.data, ffn.up.data,
                                      self._scales(ffn.gate), self._scales(ffn.up), self.work, ep)
            if ffn.down.dtype in BLOCK:
                self._qmatmul(out[start:start + n], a, ffn.down.data, db)
            else:
                self.k.matmul(out[start:start + n], a, ffn.down.data, self._scales(ffn.down), db, self.work)

    def _epilogue(self, act, e, pre):
        """(ep, down bias) of expert e for the kernels: ep = (gate bias, up bias, alpha, limit, pre) of
        kernels.expert_act (alpha 0: SwiGLU, empty biases; alpha -1: gelu_tanh; gpt-oss's alpha > 0;
        pre: the expert's rows' gate/up addends, or empty)."""
        if act is None:
            return (self._silu if pre is self.no_pre else (self.none, self.none, np.float32(0), np.float32(0), pre)), \
                self.none
        row = lambda w: self.none if w is None else w.data[e]          # noqa: E731
        alpha = np.float32(-1) if act.kind == "gelu_tanh" else np.float32(act.alpha)
        return (row(act.gate_bias), row(act.up_bias), alpha, np.float32(act.limit), pre), row(act.down_bias)

    def _qmatmul(self, out, x, w, bias):
        """A block-format matmul: int8 activations unless turned off, else float32 (each for every row
        count, so a row's result never depends on the others: batch invariance)."""
        T, K = x.shape
        if self.int8_activations:
            self.q.qmatmul_i8(out, x, w, bias, self.work, *self._acts(K, T), self._scratch(K))
        else:
            self.q.qmatmul(out, x, w, bias, self.work, self._scratch(K))

    def combine(self, out, y, w, plan):
        self.m.combine(out, y, w, plan.inverse)

    runs_lora = True

    def _lora_scratch(self, rows, width):
        """(z [>= max(rows, threads), TILE, >= width], tiles [>= rows + 1]): the LoRA kernels' scratch,
        grown on first use, then reused."""
        from .lora_kernels import TILE
        z, items = self._lora_z, max(rows, self.threads)
        if z is None or z.shape[0] < items or z.shape[2] < width:
            z = self._lora_z = np.zeros((max(items, 64, 0 if z is None else z.shape[0]), TILE,
                                         max(width, 32, 0 if z is None else z.shape[2])), np.float32)
            self._lora_tiles = np.zeros(z.shape[0] + 1, np.int64)
        return z, self._lora_tiles

    def _lora_run(self, serial, parallel, rows, *args):
        """A LoRA kernel (lora_kernels) over `rows` rows, on the pool (its tiles of rows each cut into
        threads / tiles column chunks, so that even a decode step's one row keeps every thread
        reading), or on the calling thread below PARALLEL_LORA_ROWS rows."""
        n = self.threads if rows >= PARALLEL_LORA_ROWS else 1
        if n > 1:
            self._use_threads()
            parallel(*args, n)
        else:
            serial(*args, 1)

    def lora_update(self, out, x, a, b_t, r0, r1):
        from . import lora_kernels as lk
        z, _ = self._lora_scratch(r1 - r0, a.shape[0])
        self._lora_run(lk.lora_update, lk.lora_update_par, r1 - r0, out, x,
                       _bits(a).reshape(1, *a.shape), _bits(b_t).reshape(1, *b_t.shape), r0, r1, z)

    def lora_rows(self, order, k, tokad, offsets, n):
        """Each adapter's plan rows, [m, 3] int64 views of one scratch grown on first use (one pass:
        lora_kernels.plan_rows)."""
        from . import lora_kernels as lk
        A = len(order)
        if self._lora_rowbuf is None or self._lora_rowbuf.shape[0] < A or self._lora_starts.shape[0] < n + 1:
            self._lora_rowbuf = np.zeros((max(A, 256), 3), np.int64)
            self._lora_starts = np.zeros(max(n + 1, 8), np.int64)
        starts = self._lora_starts[:n + 1]
        lk.plan_rows(self._lora_rowbuf, starts, order, A, k, tokad, offsets)
        return [self._lora_rowbuf[starts[i]:starts[i + 1]] for i in range(n)]

    def lora_pre(self, pre, x, rows, ag, bg, au, bu):
        from . import lora_kernels as lk
        n = rows.shape[0]
        if n:
            z, tiles = self._lora_scratch(n, 2 * ag.shape[1])
            self._lora_run(lk.lora_pre, lk.lora_pre_par, n, pre, x, rows, n, tiles, _bits(ag), _bits(bg), _bits(au),
                           _bits(bu), z)

    def lora_down(self, out, flat, rows, offsets, width, ad, bd):
        from . import lora_kernels as lk
        n = rows.shape[0]
        if n:
            z, tiles = self._lora_scratch(n, ad.shape[1])
            self._lora_run(lk.lora_down, lk.lora_down_par, n, out, flat, rows, n, tiles, offsets, width, _bits(ad),
                           _bits(bd), z)
