"""The OpenCL runtime: platforms and devices, programs, launches, memory, queues, error translation.
The ops (backend.py) sit on top of it; nothing here knows what a layer is.

Kernels live in the .cl files beside this module (OpenCL C 1.2, built with -cl-std=CL1.2):
    common.cl     macros shared by all (buffer+offset arguments, half loads, dot products)
    dense.cl      embed, matmul1/matmul4 (GEMV / 4-token blocks), head_matmul (per-head GEMV, float types),
                  rmsnorm, rope, add, scale, zero
    attention.cl  kv_write, paged_attention, latent_attention
    moe.cl        route, align, ffn_gate_up (+ _grouped, ffn_down_grouped; activation by kind), combine
    recurrent.cl  causal_conv, delta_rule (the gated delta rule: recurrence for decode, chunked for prefill),
                  gate_mul
dense.cl and moe.cl are built per weight type (float32; WF16=1: half read with vload_half; WBF16=1:
bfloat16 widened in-register; WI8=1: int8 widened, each row's float32 scale applied to its sum;
WQ8_0=1 ... WQ6_K=1, WMXFP4=1, WQ2_K=1, WQ3_K=1, WIQ4_NL=1, WIQ4_XS=1, WTQ1_0=1, WTQ2_0=1, WNVFP4=1, and the
lattice i-quants WIQ2_XXS=1 ... WIQ1_M=1: ggml's blocks decoded in registers chunk by chunk of 32 weights, the
lattice grids from __constant tables written from quant.iq_grid ahead of the source, lattice_tables), and, for
half weights on a device that reports cl_khr_fp16 (unless COLIBRI_DISABLE_FP16 / `disable_fp16`), with
COLIBRI_HALF_MATH=1: half products, float accumulation.
Constants the host and the kernels share are defined once, in DEFINES, and passed to every build.

Buffers are pyopencl.array.Array; leading-dimension slices and reshapes are views, and every kernel
takes (buffer, element offset) pairs so any view can be passed.
"""
from __future__ import annotations

import collections
import functools
import os

import numpy as np

from colibri_edge.errors import (ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT,
                                 COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE)
from ..base import Backend as BackendBase
from .platforms import INSTALL_HINT, _all_devices, _cl, _is_gpu_like, format_platforms

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))
KERNEL_FILES = ("dense.cl", "attention.cl", "moe.cl", "recurrent.cl")
WEIGHT_PROGRAMS = ("dense.cl", "moe.cl")        # built once per weight type
CL_STD = "-cl-std=CL1.2"
ROWS_PER_ITEM = 4                               # tokens per work-item of matmul4 / ffn_gate_up
DELTA_CHUNK = 16                                # tokens per chunk of delta_rule's chunked form (prefill)
CONV_KMAX = 8                                   # the most taps causal_conv runs (a window in registers)
DEFINES = f"-DROWS_PER_ITEM={ROWS_PER_ITEM} -DDELTA_CHUNK={DELTA_CHUNK} -DCONV_KMAX={CONV_KMAX}"
BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q4_k", "q5_k", "q6_k",   # quant.BLOCK's
                "q2_k", "q3_k", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "nvfp4",
                "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
# the lattice i-quants: format -> (its grid, quant.iq_grid's name; whether it reads KSIGNS)
LATTICE = {"iq2_xxs": ("iq2xxs", True), "iq2_xs": ("iq2xs", True), "iq2_s": ("iq2s", False),
           "iq3_xxs": ("iq3xxs", True), "iq3_s": ("iq3s", False), "iq1_s": ("iq1s", False), "iq1_m": ("iq1s", False)}
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "int8") + BLOCK_DTYPES
_HOST = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8, "uint8": np.uint8,
         "uint32": np.uint32, **{f: np.uint8 for f in BLOCK_DTYPES}}   # block formats: bytes [N, row_bytes]

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


# -- sources and build options ---------------------------------------------------------------------
def _read(name):
    with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
        return f.read()


def _guard(formats):
    return " || ".join(f"(defined(W{f.upper()}) && W{f.upper()})" for f in formats)


@functools.lru_cache(maxsize=None)
def lattice_tables() -> str:
    """The lattice formats' tables as OpenCL C, written from the data (quant.iq_grid, quant.KSIGNS; never
    copied into a .cl file): IQ_GRID, a grid's rows packed little-endian (8 values: ulong, 4: uint; the
    first value the lowest byte, so as_char8 / as_char4 unpack them on a little-endian device), and
    IQ_KSIGNS, each under the switches of the formats that read it, so a program holds only its own
    grid (the largest, iq1s's, 16 KiB of the 64 KiB of __constant memory OpenCL 1.2 guarantees)."""
    from colibri_edge.model.quant import KSIGNS, iq_grid
    out = ["/* the lattice i-quants' tables: written by runtime.py lattice_tables from quant.iq_grid and "
           "quant.KSIGNS */"]
    for grid in dict.fromkeys(g for g, _ in LATTICE.values()):
        rows = iq_grid(grid)
        w = rows.shape[1]
        vals = [int.from_bytes(bytes(int(v) & 255 for v in r), "little") for r in rows]
        ty, suf, digits = ("ulong", "UL", 16) if w == 8 else ("uint", "U", 8)
        body = ",\n".join(", ".join(f"0x{v:0{digits}x}{suf}" for v in vals[i:i + 8]) for i in range(0, len(vals), 8))
        out += [f"#if {_guard([f for f, (g, _) in LATTICE.items() if g == grid])}",
                f"#define IQ_GRID_ROWS {len(vals)}", f"__constant {ty} IQ_GRID[{len(vals)}] = {{\n{body}}};", "#endif"]
    ks = ",\n".join(", ".join(str(int(v)) for v in KSIGNS[i:i + 16]) for i in range(0, len(KSIGNS), 16))
    out += [f"#if {_guard([f for f, (_, k) in LATTICE.items() if k])}",
            f"__constant uchar IQ_KSIGNS[{len(KSIGNS)}] = {{\n{ks}}};", "#endif"]
    return "\n".join(out) + "\n"


def kernel_source(name):
    """The text actually built for `name`: common.cl then the file (so a change to common.cl can
    never hit a stale cached binary, and the offline check builds the very same text); the weight
    programs begin with the lattice formats' tables (lattice_tables), each under its formats' switches."""
    head = lattice_tables() + '#line 1 "common.cl"\n' if name in WEIGHT_PROGRAMS else ""
    return head + _read("common.cl") + f'\n#line 1 "{name}"\n' + _read(name)


ACT8 = "+a8"                                    # a block format's program with int8 activations: "q4_0+a8"


def idot_kind(extensions: str) -> int:
    """COLIBRI_IDOT for a device: 1 cl_khr_integer_dot_product, 2 cl_arm_integer_dot_product_int8, 0 neither
    (the portable definition)."""
    ext = extensions.split()
    return 1 if "cl_khr_integer_dot_product" in ext else 2 if "cl_arm_integer_dot_product_int8" in ext else 0


def weight_options(dtype: str, half_math: bool = False, idot: int = 0) -> str:
    """Build options of the weight programs (dense.cl, moe.cl) for matrices stored as `dtype` (a block
    format + ACT8: with int8 activations, dotted by the COLIBRI_IDOT kind `idot`)."""
    if dtype.endswith(ACT8):
        opts = f"{weight_options(dtype[:-len(ACT8)])} -DWACT8=1 -DCOLIBRI_IDOT={int(idot)}"
        # cl_khr_integer_dot_product's builtins are declared by its OpenCL 3.0 feature macro
        return opts.replace(CL_STD, "-cl-std=CL3.0") if idot == 1 else opts
    if dtype == "float16":
        return f"{CL_STD} {DEFINES} -DWF16=1 -DCOLIBRI_HALF_MATH={int(bool(half_math))}"
    if dtype == "bfloat16":
        return f"{CL_STD} {DEFINES} -DWBF16=1"
    if dtype == "int8":
        return f"{CL_STD} {DEFINES} -DWI8=1"
    if dtype in BLOCK_DTYPES:
        return f"{CL_STD} {DEFINES} -DW{dtype.upper()}=1"
    return f"{CL_STD} {DEFINES} -DWF16=0"


def build_variants(fp16_device: bool, disable_fp16: bool = False, idot: int = 0):
    """-> [(file, options)] the backend builds: every file, the weight programs per weight type (block
    formats also with int8 activations)."""
    out = []
    for f in KERNEL_FILES:
        if f in WEIGHT_PROGRAMS:
            out += [(f, weight_options(d, fp16_device and not disable_fp16, idot))
                    for d in WEIGHT_DTYPES + tuple(b + ACT8 for b in BLOCK_DTYPES)]
        else:
            out.append((f, f"{CL_STD} {DEFINES}"))
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
            try:
                prg = cl.Program(self.ctx, kernel_source(name)).build(options=options.split())
            except cl.Error as e:
                hint = ""
                if "unknown target CPU" in str(e):
                    hint = (" -- this OpenCL compiler's LLVM does not know this CPU (pip's PoCL 3.0 is LLVM 14: "
                            "no AMD Zen 4/5); install a newer PoCL (Debian's `pocl-opencl-icd`) or pick another "
                            "device with Engine.open(device=...) (`colibri backends` lists them)")
                raise ColibriError(COLIBRI_ERR_BACKEND, f"building {name} ({options}) for {self.dev.name.strip()} "
                                   f"failed: {e}{hint}") from None
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
    if gpus:
        return gpus[0]
    # CPU devices only (PoCL, for testing): the first whose compiler builds a kernel. pip's PoCL 3.0
    # (LLVM 14) fails on CPUs newer than its LLVM (AMD Zen 4/5: "unknown target CPU 'generic'") while
    # Debian's PoCL beside it works; the failing one is still picked when none builds (its error says why)
    for _, d in devs:
        if _compiles(cl, d):
            return d
    return devs[0][1]


def _compiles(cl, dev) -> bool:
    key = ("compiles", dev.int_ptr)
    if key not in _SHARED:
        try:
            cl.Program(cl.Context([dev]), "__kernel void k(__global float *x) { x[0] = 1.0f; }").build()
            _SHARED[key] = True
        except cl.Error:
            _SHARED[key] = False
    return _SHARED[key]


def _pow2_floor(n):
    return 1 << (max(1, int(n)).bit_length() - 1)


def roundup(n, m):
    return -(-n // m) * m


class OpenCLRuntime(BackendBase):
    """Device, queues, programs and launches; memory as pyopencl arrays."""
    name = "opencl"
    weight_dtypes = WEIGHT_DTYPES
    mixed_gate_up = False      # the fused gate/up kernels are compiled for one weight format
    OPTIONS = ("num_streams", "disable_fp16", "device", "int8_activations")

    def __init__(self, num_streams=1, disable_fp16=False, device=None, int8_activations=True):
        cl = self.cl = _cl()
        import pyopencl.array as cla
        self.cla = cla
        if not isinstance(num_streams, (int, np.integer)) or isinstance(num_streams, bool) or num_streams < 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"num_streams={num_streams!r}: expected a positive integer")
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
            self.queues = [cl.CommandQueue(self.ctx, dev) for _ in range(int(num_streams))]
        except cl.Error as e:
            raise _error(cl, e, "creating command queues") from None
        self.queue = self.queues[0]
        self.fp16_device = "cl_khr_fp16" in dev.extensions.split()
        self.half_math = self.fp16_device and not disable_fp16
        # block formats with int8 activations (llama.cpp's arithmetic, as the cpu backend's default):
        # integer dots, by the device's extension where it has one
        self.int8_activations = bool(int8_activations)
        self.idot = idot_kind(dev.extensions)
        self.max_wg = int(dev.max_work_group_size)
        self.local_mem = int(dev.local_mem_size)         # bytes of local memory per work-group
        self._kernels, self._wg = {}, {}
        for name, opts in build_variants(self.fp16_device, disable_fp16):
            if name not in WEIGHT_PROGRAMS:     # the weight programs: per format, in prepare() or when first used
                self.shared.program(cl, name, opts)
        # what a step costs the host: kernel launches, blocking device->host reads (downloads and
        # queue drains) and host->device writes, counted per step between begin_step calls
        self.counts = {"launches": 0, "reads": 0, "writes": 0}
        self._step_counts = collections.deque(maxlen=1024)
        self._mark = None
        self._dummy = self.alloc((1,), np.float32)       # bound to an absent optional argument

    copies_weights = True
    # the slot pool's device copies from the compute thread only: Oclgrind 21.10 crashes (SIGSEGV) on a
    # copy enqueued from another thread while kernels are enqueued (PoCL takes it; the spec allows it)
    slot_loads_in_parallel = False

    def prepare(self, formats, max_cols, max_rows=2):
        """Build the weight programs of the model's formats (and float32's: activations as matrices),
        nothing else: 27 weight types (and the int8-activation variants) x 2 programs would cost seconds
        of PoCL builds at every open."""
        for f in {"float32", *formats}:
            for v in (f, f + ACT8) if f in BLOCK_DTYPES and self.int8_activations else (f,):
                opts = weight_options(v, self.half_math, self.idot)
                for name in WEIGHT_PROGRAMS:
                    self.shared.program(self.cl, name, opts)

    def memory_available(self):
        """The device's global memory (OpenCL has no query for what is free); on a CPU device (PoCL)
        also no more than the host can give."""
        room = int(self.dev.global_mem_size)
        what = f"the OpenCL device's global memory ({int(self.dev.global_mem_size) / 2**30:.1f} GiB)"
        if self.dev.type & self.cl.device_type.CPU:
            from colibri_edge.memory import host_available
            host, why = host_available()
            if host < room:
                return host, why
        return room, what

    @classmethod
    def list_devices(cls):
        return format_platforms().splitlines()

    def begin_step(self):
        now = tuple(self.counts.values())
        if self._mark is not None:
            self._step_counts.append(tuple(a - b for a, b in zip(now, self._mark)))
        self._mark = now

    def step_counts(self) -> dict | None:
        """The median step's launches, reads and writes over the steps run so far (a `colibri run` is
        mostly decode steps), and the steps counted; None before two steps."""
        if not self._step_counts:
            return None
        a = np.array(self._step_counts)
        med = np.median(a, axis=0)
        return {**{k: float(v) for k, v in zip(self.counts, med)}, "steps": len(a),
                "max_launches": int(a[:, 0].max())}

    def summary(self):
        c = self.step_counts()
        per = "" if c is None else (f"; a step (median of {c['steps']}): {c['launches']:.0f} kernel launches, "
                                    f"{c['reads']:.0f} device->host reads, {c['writes']:.0f} host->device writes")
        act = ("int8 activations for block formats (" + ("portable int8 dot", "cl_khr_integer_dot_product",
                                                         "cl_arm_integer_dot_product_int8")[self.idot] + ")"
               if self.int8_activations else "float32 activations")
        return (f"opencl: {self.dev.name.strip()} ({self.dev.platform.name.strip()}, {self.dev.version.strip()}), "
                f"{len(self.queues)} queue(s), fp16 math {'on' if self.half_math else 'off'}, {act}" + per)

    def translate_error(self, e, where):
        return _error(self.cl, e, where) if isinstance(e, self.cl.Error) else None

    # -- kernels -----------------------------------------------------------------------------------
    def _kernel(self, file, name, wdtype="float32"):
        key = (file, name, wdtype)
        k = self._kernels.get(key)
        if k is None:
            opts = weight_options(wdtype, self.half_math, self.idot) if file in WEIGHT_PROGRAMS else f"{CL_STD} {DEFINES}"
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
        gsize = tuple(roundup(g, l) for g, l in zip(gsize, lsize))
        self.counts["launches"] += 1
        try:
            k(queue or self.queue, gsize, lsize, *self._args(args))
        except self.cl.Error as e:
            raise _error(self.cl, e, f"kernel {key[1]} ({key[0]})") from None

    def _2d(self, kernel_key, n0, n1, want=64):
        """A 2-D launch (n0, n1) with work-groups (l0, 1); l0 no larger than n0 needs (rounded up
        to the preferred multiple), so small rows do not launch idle work-items."""
        mult = self._wg[kernel_key[1]][1] or 1
        l0 = self._local(kernel_key, min(want, roundup(n0, mult)))
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

    def to_device(self, host, dtype):
        host = np.ascontiguousarray(host).view(_HOST[dtype])
        try:
            return self.cla.to_device(self.queue, host)
        except self.cl.Error as e:
            raise _error(self.cl, e, f"alloc/upload of {host.shape} {host.dtype}") from None

    def view(self, buf, byte_offset, shape, dtype):
        return self.cla.Array(self.queue, shape, _HOST[dtype], data=buf.base_data, offset=buf.offset + byte_offset)

    def upload_into(self, dst, host):
        self.counts["writes"] += 1
        host = np.ascontiguousarray(host, dtype=dst.dtype).reshape(dst.shape)
        try:
            dst.set(host, queue=self.queue)
        except self.cl.Error as e:
            raise _error(self.cl, e, "upload_into") from None

    def download(self, buf):
        self.counts["reads"] += 1
        try:
            return buf.get(queue=self.queue)
        except self.cl.Error as e:
            raise _error(self.cl, e, "download (an earlier kernel may have failed)") from None

    def synchronize(self):
        self.counts["reads"] += 1
        try:
            for q in self.queues:
                q.finish()
        except self.cl.Error as e:
            raise _error(self.cl, e, "synchronize (an earlier kernel failed)") from None

    # -- queues ------------------------------------------------------------------------------------
    def _fork(self, n):
        side = self.queues[1:1 + n]
        if side:                # the side queues wait for everything already on the main queue
            ev = self.cl.enqueue_marker(self.queue)
            for q in side:
                self.cl.enqueue_barrier(q, wait_for=[ev])
        return side

    def _join(self, side):      # the main queue waits for every side queue
        self.cl.enqueue_barrier(self.queue, wait_for=[self.cl.enqueue_marker(q) for q in side])

    # -- expert slots ------------------------------------------------------------------------------
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

    def close(self):
        try:
            self.synchronize()
        except ColibriError:
            pass
