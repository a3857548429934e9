"""The OpenCL backend: ARM Mali GPUs (and any OpenCL 1.2 device; PoCL on CPU and Oclgrind in CI).

Kernels live in the .cl files beside this module (OpenCL C 1.2, built with -cl-std=CL1.2):
    common.cl     macros shared by all (buffer+offset arguments, half loads, dot products)
    dense.cl      embed, matmul1/matmul4 (GEMV / 4-token blocks), rmsnorm, rope, add
    attention.cl  kv_write, paged_attention
    moe.cl        route, align, ffn_gate_up, combine
dense.cl and moe.cl are built per weight type (float32; WF16=1: half read with vload_half; WBF16=1:
bfloat16 widened in-register), and, for half weights on a device that reports cl_khr_fp16 (unless COLIBRI_DISABLE_FP16 /
`disable_fp16`), with COLIBRI_HALF_MATH=1: half products, float accumulation.

Buffers are pyopencl.array.Array; leading-dimension slices and reshapes are views, and every kernel
takes (buffer, element offset) pairs so any view can be passed. The MoE layer runs on the device:
router logits, top-k (ties to the lower expert id), align (a deterministic counting sort in one
work-group), each chosen expert's SwiGLU over its rows, combine. COLIBRI_NUM_STREAMS
(`num_streams`) command queues: independent experts of a layer go round-robin to the queues, joined
back into the main queue with markers, so results never depend on the number of queues.
"""
from __future__ import annotations

import os

import numpy as np

from colibri_edge.errors import (ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT,
                                 COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE)
from ..base import Backend as BackendBase, FFN, Plan, Weight

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))
KERNEL_FILES = ("dense.cl", "attention.cl", "moe.cl")
WEIGHT_PROGRAMS = ("dense.cl", "moe.cl")        # built once per weight type
CL_STD = "-cl-std=CL1.2"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")

INSTALL_HINT = ("no OpenCL platform found: install an ICD, e.g. `pip install pocl-binary-distribution` "
                "(PoCL on the CPU, for testing), Debian's `pocl-opencl-icd`, or the board vendor's Mali "
                "driver (libmali with its /etc/OpenCL/vendors/*.icd)")


# -- probing ---------------------------------------------------------------------------------------
def _cl():
    try:
        import pyopencl as cl
        return cl
    except ImportError as e:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"pyopencl is not installed ({e}); "
                           "`pip install 'colibri-edge[opencl]'` (pyopencl + pocl-binary-distribution)") from None


def _platforms(cl):
    try:
        return cl.get_platforms()
    except cl.Error:          # PLATFORM_NOT_FOUND_KHR from the ICD loader when no ICD is installed
        return []


def _is_gpu_like(dev, cl):
    """GPU or accelerator, never a CPU device (PoCL's): what backend='auto' may pick."""
    t = dev.type
    return bool(t & (cl.device_type.GPU | cl.device_type.ACCELERATOR)) and not (t & cl.device_type.CPU)


def _all_devices(cl):
    out = []
    for p in _platforms(cl):
        try:
            out += [(p, d) for d in p.get_devices()]
        except cl.Error:      # a platform with no devices
            pass
    return out


def probe(for_auto=False):
    """-> (ok, detail). for_auto: only GPU/accelerator devices count (never a CPU device)."""
    try:
        cl = _cl()
    except ColibriError as e:
        return False, e.message
    devs = _all_devices(cl)
    if not devs:
        return False, INSTALL_HINT
    usable = [(p, d) for p, d in devs if _is_gpu_like(d, cl)] if for_auto else devs
    if not usable:
        names = ", ".join(f"{d.name.strip()} ({cl.device_type.to_string(d.type)})" for _, d in devs)
        return False, (f"no OpenCL GPU or accelerator device (found only: {names}); auto never picks a CPU "
                       "device, ask for backend='opencl' explicitly to use it")
    return True, "; ".join(f"{p.name.strip()}: {d.name.strip()}" for p, d in usable)


def describe_platforms():
    """Every OpenCL platform and device, for `colibri backends`. -> list of dicts, one per device:
    platform, platform_version, device, device_version, type, compute_units, global_mem_bytes,
    max_work_group_size, fp16 (cl_khr_fp16 reported). Empty when pyopencl or an ICD is missing."""
    try:
        cl = _cl()
    except ColibriError:
        return []
    out = []
    for p, d in _all_devices(cl):
        out.append({
            "platform": p.name.strip(),
            "platform_version": p.version.strip(),
            "device": d.name.strip(),
            "device_version": d.version.strip(),
            "type": cl.device_type.to_string(d.type),
            "compute_units": int(d.max_compute_units),
            "global_mem_bytes": int(d.global_mem_size),
            "max_work_group_size": int(d.max_work_group_size),
            "fp16": "cl_khr_fp16" in d.extensions.split(),
        })
    return out


def format_platforms(rows=None) -> str:
    """describe_platforms() as text lines."""
    rows = describe_platforms() if rows is None else rows
    if not rows:
        return INSTALL_HINT
    return "\n".join(f"{r['platform']} ({r['platform_version']}): {r['device']} [{r['type']}], "
                     f"{r['device_version']}, {r['compute_units']} CUs, "
                     f"{r['global_mem_bytes'] / 2**30:.1f} GiB, fp16 {'yes' if r['fp16'] else 'no'}"
                     for r in rows)


# -- errors ----------------------------------------------------------------------------------------
def _error(cl, e, where):
    """An OpenCL exception -> ColibriError naming the OpenCL status and where it happened."""
    def field(obj, name):
        v = getattr(obj, name, None)
        try:
            return v() if callable(v) else v
        except Exception:
            return None
    rec = e.args[0] if e.args and not isinstance(e.args[0], str) else None
    code = field(e, "code")
    if not isinstance(code, int):
        code = field(rec, "code")
    try:
        name = cl.status_code.to_string(code, "<unknown %d>") if isinstance(code, int) else type(e).__name__
    except Exception:
        name = str(code)
    routine = field(e, "routine") or field(rec, "routine") or ""
    oom = name in ("MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_RESOURCES", "OUT_OF_HOST_MEMORY", "INVALID_BUFFER_SIZE")
    msg = f"OpenCL error CL_{name} ({code}) in {where}" + (f" [{routine}]" if routine else "")
    if oom and where.startswith("alloc"):
        return ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, msg + ": device memory exhausted; use a smaller "
                            "kv_cache_tokens / prefill_chunk or a smaller model")
    return ColibriError(COLIBRI_ERR_BACKEND, msg)


def _read(name):
    with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
        return f.read()


def kernel_source(name):
    """The text actually built for `name`: common.cl then the file (so a change to common.cl can
    never hit a stale cached binary, and the offline check builds the very same text)."""
    return _read("common.cl") + f'\n#line 1 "{name}"\n' + _read(name)


def weight_options(dtype: str, half_math: bool = False) -> str:
    """Build options of the weight programs (dense.cl, moe.cl) for matrices stored as `dtype`."""
    if dtype == "float16":
        return f"{CL_STD} -DWF16=1 -DCOLIBRI_HALF_MATH={int(bool(half_math))}"
    if dtype == "bfloat16":
        return f"{CL_STD} -DWBF16=1"
    return f"{CL_STD} -DWF16=0"


def build_variants(fp16_device: bool, disable_fp16: bool = False):
    """-> [(file, options)] the backend builds: every file, the weight programs per weight type."""
    out = []
    for f in KERNEL_FILES:
        if f in WEIGHT_PROGRAMS:
            out += [(f, weight_options(d, fp16_device and not disable_fp16)) for d in WEIGHT_DTYPES]
        else:
            out.append((f, CL_STD))
    return out


# -- shared per-process state: one context and one set of built programs per device ------------------
_SHARED = {}


class _Device:
    def __init__(self, cl, dev):
        self.dev = dev
        self.ctx = cl.Context([dev])
        self.programs = {}

    def program(self, cl, name, options):
        key = (name, options)
        prg = self.programs.get(key)
        if prg is None:
            src = kernel_source(name)
            try:
                prg = cl.Program(self.ctx, src).build(options=options.split())
            except cl.Error as e:
                log = ""
                try:
                    log = prg.get_build_info(self.dev, cl.program_build_info.LOG) if prg else ""
                except Exception:
                    pass
                raise ColibriError(COLIBRI_ERR_BACKEND, f"building {name} ({options}) for {self.dev.name.strip()} "
                                   f"failed: {e}{log}") from None
            self.programs[key] = prg
        return prg


def _pick_device(cl, device=None):
    devs = _all_devices(cl)
    if not devs:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, INSTALL_HINT)
    if device is not None:
        if isinstance(device, int) or str(device).isdigit():
            i = int(device)
            if not 0 <= i < len(devs):
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"OpenCL device index {i} out of range "
                                   f"(0..{len(devs) - 1})")
            return devs[i][1]
        for p, d in devs:
            if str(device).lower() in f"{p.name} {d.name}".lower():
                return d
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"no OpenCL device matches {device!r}")
    gpus = [d for _, d in devs if _is_gpu_like(d, cl)]
    return (gpus or [devs[0][1]])[0]


def _pow2_floor(n):
    return 1 << (max(1, int(n)).bit_length() - 1)


def _roundup(n, m):
    return -(-n // m) * m


class Backend(BackendBase):
    name = "opencl"
    weight_dtypes = WEIGHT_DTYPES

    def __init__(self, num_streams=1, disable_fp16=False, device=None, **options):
        cl = self.cl = _cl()
        import pyopencl.array as cla
        self.cla = cla
        try:
            ok = int(num_streams) >= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"num_streams={num_streams!r}: expected a positive integer")
        num_streams = int(num_streams)
        self.options = dict(options, num_streams=num_streams, disable_fp16=bool(disable_fp16))
        dev = _pick_device(cl, device)
        key = dev.int_ptr
        if key not in _SHARED:
            try:
                _SHARED[key] = _Device(cl, dev)
            except cl.Error as e:
                raise _error(cl, e, "creating the OpenCL context") from None
        self.shared = sh = _SHARED[key]
        self.dev, self.ctx = dev, sh.ctx
        try:
            self.queues = [cl.CommandQueue(self.ctx, dev) for _ in range(num_streams)]
        except cl.Error as e:
            raise _error(cl, e, "creating command queues") from None
        self.queue = self.queues[0]
        self.fp16_device = "cl_khr_fp16" in dev.extensions.split()
        self.half_math = self.fp16_device and not disable_fp16
        self.max_wg = int(dev.max_work_group_size)
        self._kernels = {}
        self._wg = {}
        self._inv_freq = {}
        self._dummy_f = self.alloc((1,), np.float32)
        for name, opts in build_variants(self.fp16_device, disable_fp16):
            self.shared.program(cl, name, opts)

    # -- kernels -----------------------------------------------------------------------------------
    def _kernel(self, file, name, wdtype="float32"):
        key = (file, name, wdtype)
        k = self._kernels.get(key)
        if k is None:
            opts = weight_options(wdtype, self.half_math) if file in WEIGHT_PROGRAMS else CL_STD
            prg = self.shared.program(self.cl, file, opts)
            k = self._kernels[key] = self.cl.Kernel(prg, name)   # per backend: set_arg is not thread safe
            kmax = k.get_work_group_info(self.cl.kernel_work_group_info.WORK_GROUP_SIZE, self.dev)
            mult = k.get_work_group_info(self.cl.kernel_work_group_info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE,
                                         self.dev)
            self._wg[key] = (int(kmax), int(mult))
        return k, key

    def _local(self, kernel_key, want, pow2=False):
        """A work-group size from what the device reports for this kernel: <= its maximum, a
        multiple of its preferred multiple when possible, a power of two for tree reductions."""
        kmax, mult = self._wg[kernel_key[1]]
        n = max(1, min(want, kmax))
        if pow2:
            return _pow2_floor(n)
        if mult and n >= mult:
            n -= n % mult
        return n

    def _args(self, args):
        out = []
        for a in args:
            if isinstance(a, Weight):
                a = a.data
            if isinstance(a, self.cla.Array):
                off = a.offset // a.dtype.itemsize
                if off > 2**31 - 1:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "buffer view offset beyond 2^31 elements")
                out += [a.base_data, np.int32(off)]
            elif isinstance(a, (bool, int, np.integer)):
                out.append(np.int32(a))
            elif isinstance(a, (float, np.floating)):
                out.append(np.float32(a))
            else:
                out.append(a)           # LocalMemory
        return out

    def _launch(self, kernel_key, gsize, lsize, *args, queue=None):
        k, key = kernel_key
        if any(g == 0 for g in gsize):
            return
        gsize = tuple(_roundup(g, l) for g, l in zip(gsize, lsize))
        try:
            k(queue or self.queue, gsize, lsize, *self._args(args))
        except self.cl.Error as e:
            raise _error(self.cl, e, f"kernel {key[1]} ({key[0]})") from None

    def _2d(self, kernel_key, n0, n1, want=64):
        """A 2-D launch (n0, n1) with work-groups (l0, 1); l0 no larger than n0 needs (rounded up
        to the preferred multiple), so small rows do not launch idle work-items."""
        mult = self._wg[kernel_key[1]][1] or 1
        l0 = self._local(kernel_key, min(want, _roundup(n0, mult)))
        return (n0, n1), (l0, 1)

    # -- memory ------------------------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        dtype = np.dtype(dtype)
        try:
            buf = self.cla.empty(self.queue, shape, dtype)
        except self.cl.Error as e:
            raise _error(self.cl, e, f"alloc of {shape} {dtype.name}") from None
        if dtype.itemsize == 4:
            k = self._kernel("dense.cl", "zero")
            self._launch(k, (buf.size,), (self._local(k, 256),), buf, buf.size)
        elif buf.size:
            self.upload_into(buf, np.zeros(shape, dtype))
        return buf

    def _to_device(self, host):
        try:
            return self.cla.to_device(self.queue, np.ascontiguousarray(host))
        except self.cl.Error as e:
            raise _error(self.cl, e, f"alloc/upload of {host.shape} {host.dtype}") from None

    _HOST = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}

    def upload(self, host, dtype="float32"):
        host = np.asarray(host)
        if dtype not in self.weight_dtypes:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the opencl backend runs {', '.join(self.weight_dtypes)} "
                               f"weights, not {dtype}")
        if host.ndim <= 1:
            # vectors (norms, biases) are tiny: keep them fp32 so only matrices need typed kernels
            from colibri_edge.dtypes import widen
            return Weight(self._to_device(np.asarray(widen(host, dtype), np.float32)), "float32", tuple(host.shape))
        host = host.astype(self._HOST[dtype], copy=False)
        return Weight(self._to_device(host), dtype, tuple(host.shape))

    def upload_expert(self, blob, hidden, inter, dtype):
        """The expert's blob goes to the device as one unit (one buffer, one copy); gate, up and
        down are views into it."""
        from colibri_edge.modeldir import split_expert_blob
        if dtype not in self.weight_dtypes:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the opencl backend runs {', '.join(self.weight_dtypes)} "
                               f"weights, not {dtype}")
        g, u, d = split_expert_blob(blob, hidden, inter, dtype)
        n = g.size + u.size + d.size
        flat = self._to_device(np.asarray(blob).view(g.dtype)[:n])
        a, b = g.size, g.size + u.size
        return FFN(Weight(flat[:a].reshape(g.shape), dtype, g.shape),
                   Weight(flat[a:b].reshape(u.shape), dtype, u.shape),
                   Weight(flat[b:n].reshape(d.shape), dtype, d.shape))

    def upload_into(self, dst, host):
        host = np.ascontiguousarray(host, dtype=dst.dtype).reshape(dst.shape)
        try:
            dst.set(host, queue=self.queue)
        except self.cl.Error as e:
            raise _error(self.cl, e, "upload_into") from None

    def download(self, buf):
        if isinstance(buf, Weight):
            buf = buf.data
        try:
            return buf.get(queue=self.queue)
        except self.cl.Error as e:
            raise _error(self.cl, e, "download (an earlier kernel may have failed)") from None

    def synchronize(self):
        try:
            for q in self.queues:
                q.finish()
        except self.cl.Error as e:
            raise _error(self.cl, e, "synchronize (an earlier kernel failed)") from None

    # -- dense -------------------------------------------------------------------------------------
    @staticmethod
    def _wdtype(t):
        """Storage type of a matrix: a Weight's, or float32 for a plain buffer."""
        return t.dtype if isinstance(t, Weight) else "float32"

    def embed(self, out, table, ids):
        T, H = out.shape
        k = self._kernel("dense.cl", "embed", self._wdtype(table))
        g, l = self._2d(k, H, T)
        self._launch(k, g, l, out, table, ids, T, H)

    def _matmul(self, out, ldo, x, ldx, w, bias, T, K, N, queue=None):
        wd = self._wdtype(w)
        if T >= 4:
            k = self._kernel("dense.cl", "matmul4", wd)
            g, l = self._2d(k, N, -(-T // 4))
        else:
            k = self._kernel("dense.cl", "matmul1", wd)
            g, l = self._2d(k, N, T)
        self._launch(k, g, l, out, ldo, x, ldx, w, self._dummy_f if bias is None else bias,
                     bias is not None, T, K, N, queue=queue)

    def matmul(self, out, x, w, bias=None):
        T, K = x.shape
        N = w.shape[0]
        if tuple(w.shape) != (N, K) or tuple(out.shape) != (T, N):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"matmul shapes out {out.shape}, x {x.shape}, "
                               f"w {w.shape} do not agree")
        self._matmul(out, N, x, K, w, bias, T, K, N)

    def rmsnorm(self, out, x, weight, eps):
        D = x.shape[-1]
        R = x.size // D
        k = self._kernel("dense.cl", "rmsnorm")
        L = self._local(k, min(256, _roundup(D, 32)), pow2=True)
        self._launch(k, (R * L,), (L,), out, x, weight, D, float(eps), self.cl.LocalMemory(4 * L))

    def _freqs(self, theta, D):
        key = (float(theta), int(D))
        buf = self._inv_freq.get(key)
        if buf is None:
            # the reference's fp32 table: 1 / theta^(2i/D)
            inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float32) / D))
            buf = self._inv_freq[key] = self._to_device(inv.astype(np.float32))
        return buf

    def rope(self, out, x, positions, theta):
        T, heads, D = x.shape
        k = self._kernel("dense.cl", "rope")
        g, l = self._2d(k, D // 2, T * heads, want=32)
        self._launch(k, g, l, out, x, positions, self._freqs(theta, D), T, heads, D)

    def add(self, out, a, b, gate=None):
        n = out.size
        H = out.shape[-1] if out.ndim else 1
        k = self._kernel("dense.cl", "add")
        L = self._local(k, 128)
        self._launch(k, (n,), (L,), out, a, b, self._dummy_f if gate is None else gate, gate is not None, n, H)

    # -- attention ---------------------------------------------------------------------------------
    def alloc_kv(self, num_layers, num_slots, kv_heads, head_dim):
        return [(self.alloc((num_slots, kv_heads, head_dim)), self.alloc((num_slots, kv_heads, head_dim)))
                for _ in range(num_layers)]

    def kv_write(self, cache, layer, k, v, slots):
        K, V = cache[layer]
        T = k.shape[0]
        row = K.shape[1] * K.shape[2]
        kk = self._kernel("attention.cl", "kv_write")
        g, l = self._2d(kk, row, T)
        self._launch(kk, g, l, K, V, k, v, slots, T, row)

    def paged_attention(self, out, q, cache, layer, block_tables, seq_index, positions, block_size, scale):
        K, V = cache[layer]
        T, Hq, D = q.shape
        Hkv = K.shape[1]
        k = self._kernel("attention.cl", "paged_attention")
        C = self._local(k, 64, pow2=True)
        lm = self.cl.LocalMemory
        ldb = block_tables.shape[1]
        self._launch(k, (C * Hq, T), (C, 1), out, q, K, V, block_tables, ldb, seq_index, positions,
                     Hq, Hkv, D, block_size, float(scale), lm(4 * D), lm(4 * D), lm(4 * C), lm(4 * C))

    # -- MoE ---------------------------------------------------------------------------------------
    def route(self, out_ids, out_w, logits, k, mode, normalize):
        T, E = logits.shape
        if mode not in ("topk", "gated"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"router_mode {mode!r}: expected topk or gated")
        if mode == "gated" and k != E:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"gated routing runs every expert: k={k} != E={E}")
        kk = self._kernel("moe.cl", "route")
        L = self._local(kk, 64)
        self._launch(kk, (T,), (L,), out_ids, out_w, logits, T, E, k, mode == "gated", bool(normalize))

    def alloc_plan(self, max_assignments, E):
        """Device buffers for align: offsets [E+1], order and inverse [max_assignments]."""
        return {"offsets": self.alloc((E + 1,), np.int32), "order": self.alloc((max_assignments,), np.int32),
                "inverse": self.alloc((max_assignments,), np.int32), "E": E, "N": max_assignments}

    def align(self, plan_bufs, ids, num_tokens, num_experts, top_k):
        N, E = num_tokens * top_k, num_experts
        if plan_bufs is None or plan_bufs["N"] < N or plan_bufs["E"] < E:
            plan_bufs = self.alloc_plan(N, E)
        offsets = plan_bufs["offsets"][:E + 1]
        order, inverse = plan_bufs["order"][:N], plan_bufs["inverse"][:N]
        k = self._kernel("moe.cl", "align")
        L = self._local(k, min(256, _roundup(E, 8)))
        self._launch(k, (L,), (L,), offsets, order, inverse, ids, N, E, self.cl.LocalMemory(4 * E))
        # Host round trip (E+1 ints): grouped_ffn launches one kernel pair per expert that has
        # tokens, sized by its row count, so the host needs the counts to skip idle experts and
        # size the launches (and the scheduler counts routed tokens per expert from them).
        host_offsets = self.download(offsets)
        return Plan(offsets, order, inverse, np.diff(host_offsets), num_tokens, top_k)

    def grouped_ffn(self, out, x, experts, plan, scratch):
        T, H = x.shape
        topk = plan.top_k
        lda = scratch.shape[1]
        starts = np.concatenate([[0], np.cumsum(plan.counts)]).astype(np.int64)
        work = [(int(e), int(starts[e]), int(plan.counts[e])) for e in plan.experts_to_run()]
        work = [wk for wk in work if wk[2] > 0]
        if not work:
            return
        queues = self.queues[:min(len(self.queues), len(work))]
        if len(queues) > 1:     # fork: the side queues wait for everything already on the main queue
            ev = self.cl.enqueue_marker(self.queue)
            for q in queues[1:]:
                self.cl.enqueue_barrier(q, wait_for=[ev])
        for i, (e, row0, n) in enumerate(work):
            ffn = experts[e]
            q = queues[i % len(queues)]
            I = ffn.gate.shape[0]
            if I > lda:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"scratch has {lda} columns, expert needs {I}")
            k = self._kernel("moe.cl", "ffn_gate_up", self._wdtype(ffn.gate))
            g, l = self._2d(k, I, -(-n // 4))
            self._launch(k, g, l, scratch, lda, x, plan.order, row0, n, topk, ffn.gate, ffn.up, H, I, queue=q)
            # down: out[row0 + r] = down @ act[row0 + r]   (a matmul over the expert's rows)
            self._matmul(out[row0:row0 + n], H, scratch[row0:row0 + n], lda, ffn.down, None, n, I, H, queue=q)
        if len(queues) > 1:     # join: the main queue waits for every side queue
            marks = [self.cl.enqueue_marker(q) for q in queues[1:]]
            self.cl.enqueue_barrier(self.queue, wait_for=marks)

    # -- expert slots (colibri_edge.slots) ---------------------------------------------------------
    def alloc_slots(self, num_slots, blob_bytes):
        """N expert slots of one blob each: N device buffers of blob_bytes (uint8), allocated once.
        One buffer per slot rather than one [N, blob_bytes] buffer: a slot load is then a whole-buffer
        write at offset 0 (Oclgrind 21.10's uninitialized-value checker re-creates a buffer's shadow
        on every host write, so a write at an offset would poison the rest of a shared buffer), no
        element offset can pass 2^31, and no single allocation has to fit CL_DEVICE_MAX_MEM_ALLOC_SIZE."""
        slots = []
        for _ in range(num_slots):
            try:
                slots.append(self.cla.empty(self.queue, (blob_bytes,), np.uint8))
            except self.cl.Error as e:
                raise _error(self.cl, e, f"alloc of {num_slots} expert slots of {blob_bytes} bytes") from None
        return slots

    def load_slot(self, slots, slot, blob):
        """Copy an expert's blob into a slot. Enqueued on the main (in-order) queue, so it lands after
        every kernel already enqueued (which may still read the slot's previous expert) and before
        every later one; blocking, so the prefetch thread returns only once the bytes are there."""
        dst = slots[slot]
        host = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1)
        if host.size != dst.size:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"expert blob of {host.size} bytes for slots of {dst.size}")
        try:
            self.cl.enqueue_copy(self.queue, dst.base_data, host, is_blocking=True)
        except self.cl.Error as e:
            raise _error(self.cl, e, f"load_slot {slot}") from None

    def slot_ffn(self, slots, slot, hidden, inter, dtype):
        """gate [I,H], up [I,H], down [H,I] as views into the slot: the kernels read the slot only."""
        from colibri_edge.dtypes import storage_dtype
        if dtype not in self.weight_dtypes:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the opencl backend runs {', '.join(self.weight_dtypes)} "
                               f"weights, not {dtype}")
        dt = storage_dtype(dtype)
        buf = slots[slot].base_data
        n = hidden * inter * dt.itemsize
        return FFN(*(Weight(self.cla.Array(self.queue, shape, dt, data=buf, offset=j * n), dtype, shape)
                     for j, shape in enumerate([(inter, hidden), (inter, hidden), (hidden, inter)])))

    def combine(self, out, y, w, plan):
        T, k = plan.num_tokens, plan.top_k
        H = out.shape[-1]
        kk = self._kernel("moe.cl", "combine")
        g, l = self._2d(kk, H, T)
        self._launch(kk, g, l, out, y, w, plan.inverse, T, k, H)

    def describe(self):
        return (f"opencl: {self.dev.name.strip()} ({self.dev.platform.name.strip()}, {self.dev.version.strip()}), "
                f"{len(self.queues)} queue(s), fp16 math {'on' if self.half_math else 'off'}")

    def close(self):
        try:
            self.synchronize()
        except ColibriError:
            pass
