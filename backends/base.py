"""The backend protocol: everything the neutral core asks of a backend, declared in this one place.

A backend owns memory and the numeric kernels; the core owns the layer program, routing policy,
`align`'s definition, the per-sequence state and the arena (colibri_edge.runtime.program / .state / .arena).
Every kernel writes into an output buffer it is given (output first). Buffers are the backend's own
array type (NumPy for cpu/reference, CuPy, pyopencl.array); leading-dimension slices `buf[:T]` and
reshapes of contiguous buffers are views. Shapes below use
    T tokens in the step, H hidden, D head_dim, Hq/Hkv query/KV heads, E experts, k top_k, V vocab.

Required -- abstract here; there is no per-op fallback, so the suite proves each backend whole:
    memory     alloc, to_device, view, upload_into, download
    dense      embed, matmul, rmsnorm, rope, add, scale
    attention  kv_write, paged_attention, latent_attention, head_matmul
    recurrent  causal_conv, delta_rule, gate_mul
    MoE        route, align, grouped_ffn, combine
Optional -- each has its default below, and the core never probes a backend with hasattr:
    OPTIONS                         the Engine.open options it takes                 ()
    kv_dtypes                       the KV cache types (Engine.open kv_dtype) its     ("float32",)
                                    kv_write and attention ops take
    alloc_kv(parts, kv_dtype)       one layer's paged cache tensor (KVCache below)    alloc each part
    host_view(buf)                  host access to a small buffer (logits)          a download
    copy_into(dst, src)             buffer to buffer of one shape (state snapshots)  download + upload_into
    synchronize()                   wait for queued work                            nothing to wait for
    begin_step()                    once before each step (cpu: re-read free cores)  nothing
    graph_step(key, fn, *args)      capture a decode step once, replay it after     run fn
    memory_available(), copies_weights   what Engine.open may allocate; device copies   host memory / False
    prepare(formats, max_cols, max_rows)  warm the model's formats' kernels, size scratch  nothing
    list_devices()                  device/platform lines for `colibri backends`    none
    alloc_slots/load_slot/slot_ffn  expert slot pool storage                        one [N, blob] buffer
    alloc_staging(nbytes)           host buffer a slot miss is read into            ordinary host memory
    slot_loads_in_parallel          load_slot from I/O threads while kernels run    False (compute thread)
    upload_experts(blobs, ...)      a MoE layer's experts made resident             upload_expert each
    matmuls(outs, x, ws, biases)    projections of one x (q, k, v)                  matmul each
    _fork(n)/_join(side)            side queues for independent experts             no side queues
    op_scope()/translate_error(e)   the context ops run in; library errors -> codes  none / re-raise
    summary(), describe(), close()
Written once here for every backend: the upload policy (vectors become float32, matrices keep
their storage type), expert-blob views (one uploaded blob or a slot, cut into gate|up|down),
fork/join of parts over side queues (run_parts) and error translation (`guarded`).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import numpy as np

from colibri_edge.model.dtypes import QUANTIZED, widen
from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.knobs import KV_DTYPES

# gate_mul's activations, as the kernels number them (out = x * act(gate))
GATE_MODES = {"sigmoid": 0, "silu": 1, "none": 2}


# -- the paged KV cache's storage types (Engine.open kv_dtype, COLIBRI_KV_DTYPE) ------------------------
KV_GROUP = 32           # q8_0: values per scale, as ggml's block_q8_0


def kv_group(n: int) -> int:
    """q8_0's values per scale in a cache row of n values (one position's head row): 32 when n is a
    multiple of 32 (ggml's blocks), else the whole row (one scale per head row)."""
    return KV_GROUP if n % KV_GROUP == 0 else n


def check_kv_dtype(kv_dtype) -> str:
    """kv_dtype when it is one of KV_DTYPES, else COLIBRI_ERR_INVALID_ARGUMENT listing them."""
    if kv_dtype not in KV_DTYPES:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"kv_dtype={kv_dtype!r:.40}: expected one of "
                           f"{', '.join(KV_DTYPES)}")
    return kv_dtype


def kv_parts(shape, kv_dtype: str) -> dict:
    """The buffers of one layer's paged cache tensor of logical shape [rows, heads, n] (rows: block
    slots; a row of n values per head and position) in kv_dtype: name -> (shape, NumPy dtype).
        float32  data float32 [rows, heads, n]
        float16  data float16 [rows, heads, n]                      (IEEE half, round to nearest even)
        q8_0     data int8 [rows, heads, n], scales float16 [rows, heads, n / g], g = kv_group(n):
                 each group of g consecutive values of a head row is g int8 q and one scale d, llama.cpp's
                 block_q8_0: d = max|x| / 127 stored as float16, q = round(x / d) half away from zero (by
                 the stored d, clamped to +-127: every value within d/2 of what reads back, x = q * d).
                 A row of n values costs n + 2 n / g bytes."""
    shape = tuple(int(x) for x in shape)
    check_kv_dtype(kv_dtype)
    if kv_dtype == "float32":
        return {"data": (shape, np.dtype(np.float32))}
    if kv_dtype == "float16":
        return {"data": (shape, np.dtype(np.float16))}
    n = shape[-1]
    return {"data": (shape, np.dtype(np.int8)), "scales": ((*shape[:-1], n // kv_group(n)), np.dtype(np.float16))}


def kv_row_bytes(n: int, kv_dtype: str) -> int:
    """Bytes a cache row of n values takes in kv_dtype (kv_parts): 4n, 2n, or n + 2 n / kv_group(n)."""
    return sum(int(np.prod(s[1:])) * d.itemsize for s, d in kv_parts((1, n), kv_dtype).values())



PAGE = 4096          # O_DIRECT's alignment of buffer address, file offset and length (the expert blobs are
                     # 4096-aligned in colibri_weights.bin: model/modeldir.py)


def aligned_host(rows: int, row_bytes: int) -> np.ndarray:
    """[rows, row_bytes rounded up to PAGE] uint8 zeros, each row PAGE-aligned: host expert slots that a
    direct read (whole pages) lands in without a bounce buffer."""
    row_bytes = -(-row_bytes // PAGE) * PAGE
    raw = np.zeros(rows * row_bytes + PAGE, np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + rows * row_bytes].reshape(rows, row_bytes)

@dataclass
class KVCache:
    """One layer's paged cache tensor (K, V, latent attention's C or R) in a kv_dtype other than
    float32 (a float32 cache is a plain float32 buffer [rows, heads, n], on every backend): its
    buffers of kv_parts, as the backend's kernels read them (cpu: half bits as uint16). kv_write
    quantises on write; paged_attention and latent_attention dequantise each row as they read it."""
    dtype: str                  # "float16" | "q8_0"
    data: object                # [rows, heads, n]: float16 (or its bits) | int8
    scales: object = None       # q8_0: [rows, heads, n / g] float16 (or its bits); None for float16

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def group(self) -> int:
        """Values per scale (q8_0), the row's n for float16."""
        n = self.data.shape[-1]
        return n if self.scales is None else n // self.scales.shape[-1]


@dataclass
class Weight:
    """A weight matrix/vector resident on the backend. `data` is in storage dtype (`dtype` is one of
    colibri_edge.model.dtypes.WEIGHT_DTYPES); shape is the logical [out, in] for matrices (a block format's
    data is its bytes, [out, row_bytes], or the backend's view of them). int8 weights carry float32
    `scales` [out]: w = data * scales[:, None]."""
    data: object
    dtype: str
    shape: tuple
    scales: object = None


@dataclass
class FFN:
    """One SwiGLU feed-forward: a routed expert, a shared expert or a dense MLP.
        gate [I,H], up [I,H], down [H,I]    y = down @ (silu(gate @ x) * (up @ x))"""
    gate: Weight
    up: Weight
    down: Weight


@dataclass
class Act:
    """An FFN's activation when it is not plain SwiGLU, and the experts' biases (gpt-oss):
        g = gate @ x + gate_bias[e],  u = up @ x + up_bias[e]
        swiglu_oai:  a = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),  g' = min(g, limit)
        gelu_tanh:   a = gelu_tanh(g) * u,  gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
                     (GeGLU, Gemma's gelu_pytorch_tanh; alpha and limit unused)
        y = down @ a + down_bias[e]
    gate_bias, up_bias [E, I], down_bias [E, H]: float32 Weights (each may be None)."""
    kind: str                   # "swiglu_oai" | "gelu_tanh"
    alpha: float = 0.0
    limit: float = 0.0
    gate_bias: Weight | None = None
    up_bias: Weight | None = None
    down_bias: Weight | None = None


@dataclass
class Plan:
    """Tokens grouped by expert (see colibri_edge.backends.routing.align for a worked example).
        offsets [E+1]  rows of expert e are sorted positions offsets[e] .. offsets[e+1]-1
        order   [T*k]  sorted position -> assignment a = t*k + j (token t's j-th choice)
        inverse [T*k]  assignment a -> sorted position
        counts  host copy of offsets' differences, or None where they stay on the device
                (`fetch_counts` then copies them, for the host paths that need them)
        active  host ids of the experts grouped_ffn runs (ascending), or None for every expert
                with tokens; the slot pool runs a layer in waves by narrowing it
        blocks [max_blocks, 3], nblocks [1]: the rows cut into blocks of at most block_rows, each
                one expert (expert, first row, end row): what the GPU grouped kernels launch over
    """
    offsets: object
    order: object
    inverse: object
    counts: object
    num_tokens: int
    top_k: int
    active: object = None
    blocks: object = None
    nblocks: object = None
    block_rows: int = 0
    max_blocks: int = 0
    num_experts: int = 0
    fetch_counts: object = None

    def experts_to_run(self):
        if self.active is not None:
            return self.active
        if self.counts is None:
            self.counts = self.fetch_counts()
        return np.flatnonzero(self.counts)


def plan_buffers(max_assignments: int, num_experts: int) -> dict:
    """The buffers one align fills, as name -> (shape, dtype): declared here so the arena allocates
    them once for the largest step. blocks holds at most min(A, ceil(A/BM) + E - 1) <= A + E rows."""
    A, E = int(max_assignments), int(num_experts)
    i32 = np.int32
    return {"offsets": ((E + 1,), i32), "order": ((A,), i32), "inverse": ((A,), i32), "counts": ((E,), i32),
            "active": ((E,), i32), "blocks": ((A + E, 3), i32), "nblocks": ((1,), i32)}


def guarded(fn):
    """An op of a GPU backend: runs inside self.op_scope(); an exception of the device library
    becomes a ColibriError through self.translate_error (anything it does not recognise propagates)."""
    where = fn.__name__

    @functools.wraps(fn)
    def op(self, *args, **kw):
        try:
            with self.op_scope():
                return fn(self, *args, **kw)
        except ColibriError:
            raise
        except Exception as e:
            err = self.translate_error(e, where)
            if err is None:
                raise
            raise err from e
    return op


class Backend:
    name = "abstract"
    weight_dtypes: tuple = ()
    kv_dtypes: tuple = ("float32",)   # KV cache types (kv_parts) kv_write and the attention ops take
    OPTIONS: tuple = ()           # Engine.open options this backend takes (num_threads, num_streams, ...)
    # optional: whether an FFN's gate and up projections may be stored in different formats (a GGUF
    # file's choice); a backend whose fused gate/up kernel is built for one format says False, and
    # Engine.open refuses such a model there (COLIBRI_ERR_UNAVAILABLE) instead of misreading it
    mixed_gate_up: bool = True

    # -- memory (required) -------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        """A zero-filled buffer, allocated once (arena, per-sequence state, slots)."""
        raise NotImplementedError

    def alloc_kv(self, parts: dict, kv_dtype: str):
        """Optional: one layer's paged cache tensor, its buffers as the pool declares them (kv_parts:
        name -> (shape, dtype)), kv_dtype one of self.kv_dtypes: the float32 buffer for float32, else a
        KVCache. Default: alloc each part; a backend may view them as its kernels read them."""
        bufs = {name: self.alloc(shape, dtype) for name, (shape, dtype) in parts.items()}
        return bufs["data"] if kv_dtype == "float32" else KVCache(kv_dtype, bufs["data"], bufs.get("scales"))

    def to_device(self, host: np.ndarray, dtype: str):
        """Weights resident on the backend, in their storage type: a copy on a device, the memmap's
        own read-only pages on host backends (never a copy there). dtype names the stored elements:
        a weight type of dtypes.STORAGE, or "uint8" for a whole expert blob."""
        raise NotImplementedError

    def view(self, buf, byte_offset: int, shape, dtype: str):
        """A view of `shape` elements of `dtype` (storage name, as to_device) starting byte_offset
        bytes into the contiguous uint8 buffer buf (an uploaded expert blob or a slot)."""
        raise NotImplementedError

    def upload_into(self, dst, host: np.ndarray):
        """Copy a small host array (step inputs, a slot's blob) into an existing buffer."""
        raise NotImplementedError

    def download(self, buf) -> np.ndarray:
        raise NotImplementedError

    # -- memory (optional) -------------------------------------------------------------------
    def host_view(self, buf) -> np.ndarray:
        """Read-only host access to a small buffer (logits). Host-memory backends return the buffer
        itself (no copy: the decode loop stays allocation-free); a device copies it."""
        return self.download(buf)

    def copy_into(self, dst, src):
        """Copy buffer src into dst (same shape and dtype; leading-index views of allocated buffers):
        recurrent-state snapshots. Default: through the host."""
        self.upload_into(dst, np.ascontiguousarray(self.download(src)))

    def synchronize(self):
        """Wait until everything queued has run (devices with queues)."""

    # -- the upload policy, written once --------------------------------------------------------
    def upload(self, host: np.ndarray, dtype: str = "float32", scales=None, shape=None) -> Weight:
        """Make a host tensor resident. Vectors (norms, biases) become float32 on every backend, so
        only matrices need typed kernels; matrices keep their storage type (a block format's bytes
        [N, row_bytes] with `shape` its logical [N, K]), and int8 ones carry their float32 row scales."""
        self.check_dtype(dtype)
        host = np.asarray(host)
        shape = tuple(host.shape if shape is None else shape)
        if host.ndim <= 1:
            return Weight(self.to_device(np.ascontiguousarray(widen(host, dtype), np.float32), "float32"),
                          "float32", shape)
        if (scales is not None) != (dtype in QUANTIZED):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{self.name}: {dtype} matrices "
                               f"{'need' if dtype in QUANTIZED else 'take no'} row scales")
        sc = None if scales is None else self.to_device(np.ascontiguousarray(scales, np.float32), "float32")
        return Weight(self.to_device(np.ascontiguousarray(host), dtype), dtype, shape, sc)

    def check_dtype(self, dtype: str):
        if dtype not in self.weight_dtypes:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the {self.name} backend runs "
                               f"{', '.join(self.weight_dtypes)} weights, not {dtype}")

    def upload_expert(self, blob: np.ndarray, hidden: int, inter: int, fmts) -> FFN:
        """One expert's contiguous blob (uint8) -> an FFN resident on the backend: the blob travels as
        one unit (one buffer, one copy on a device) and gate, up, down are views into it. fmts: one
        format, or (gate, up, down)."""
        from colibri_edge.model.modeldir import expert_formats
        for f in set(expert_formats(fmts)):
            self.check_dtype(f)
        return self.expert_views(self.to_device(np.asarray(blob, np.uint8), "uint8"), hidden, inter, fmts)

    def upload_experts(self, blobs, hidden: int, inter: int, fmts) -> list:
        """Optional: one MoE layer's expert blobs (an iterable, read one at a time) -> their FFNs.
        Default: upload_expert each. A device may pack the layer into one buffer so that one launch
        can reach every expert (OpenCL 1.2 has no pointer tables)."""
        return [self.upload_expert(b, hidden, inter, fmts) for b in blobs]

    def expert_views(self, buf, hidden: int, inter: int, fmts) -> FFN:
        """gate [I,H], up [I,H], down [H,I] (and int8 row scales) as views into one expert's blob,
        laid out as colibri_edge.model.modeldir.expert_sections says."""
        from colibri_edge.model.dtypes import storage_shape
        from colibri_edge.model.modeldir import expert_sections
        ws = []
        for _, shape, fmt, off, soff in expert_sections(hidden, inter, fmts)[0]:
            sc = None if soff is None else self.view(buf, soff, (shape[0],), "float32")
            ws.append(Weight(self.view(buf, off, storage_shape(fmt, shape), fmt), fmt, tuple(shape), sc))
        return FFN(*ws)

    # -- expert slots (colibri_edge.runtime.slots) ---------------------------------------------------
    def alloc_slots(self, num_slots: int, blob_bytes: int):
        """N expert slots of one blob each, allocated once: [N, blob_bytes] uint8."""
        return self.alloc((num_slots, blob_bytes), np.uint8)

    def slot_host_view(self, slots, slot: int):
        """Optional: a writable host uint8 view of one slot, so that a miss is read from storage straight
        into it; None (the default) when the slots are device memory: the pool reads into a host
        staging buffer and calls load_slot."""
        return None

    def alloc_staging(self, nbytes: int) -> np.ndarray:
        """Optional: a host uint8 buffer a slot miss is read into before load_slot copies it to the
        device (one per reading thread, allocated once). A GPU backend gives page-locked memory, which
        its DMA engine copies from directly (pageable memory goes through the driver's own bounce
        buffer, one more copy). Default: ordinary host memory."""
        return np.zeros(int(nbytes), np.uint8)

    def load_slot(self, slots, slot: int, blob: np.ndarray):
        """Copy one expert's blob (from the memmap) into a slot. May run on a prefetch thread: a GPU
        backend must order it with the kernels (e.g. a blocking write on the in-order main queue,
        or an event the next kernel waits on), never let a kernel read a half-written slot."""
        self.upload_into(slots[slot], np.asarray(blob, np.uint8).reshape(-1))

    def slot_ffn(self, slots, slot: int, hidden: int, inter: int, fmts) -> FFN:
        """The FFN whose weights are views into a slot (holding an expert of formats fmts): kernels
        read the slot, nothing else."""
        return self.expert_views(slots[slot], hidden, inter, fmts)

    # -- dense (required) --------------------------------------------------------------------
    def embed(self, out, table, ids):
        """out[T,H] = table[ids[T]]  (table: Weight [V,H] or a float32 buffer [N,H])."""
        raise NotImplementedError

    def matmul(self, out, x, w: Weight, bias=None):
        """out[T,N] = x[T,K] @ w[N,K]^T (+ bias[N]); a GEMV when T == 1."""
        raise NotImplementedError

    def matmuls(self, outs, x, ws, biases):
        """Optional: out_j = x @ w_j^T (+ b_j) for several projections of one x (attention's q, k, v).
        Default: one matmul each; a device may run them as one launch."""
        for out, w, b in zip(outs, ws, biases):
            self.matmul(out, x, w, b)

    def rmsnorm(self, out, x, weight: Weight, eps: float):
        """out[R,D] = x / sqrt(mean(x^2, -1) + eps) * weight[D]   (rows R may be T*heads; may alias)."""
        raise NotImplementedError

    def layernorm(self, out, x, weight: Weight, bias: Weight, eps: float):
        """out[r] = (x[r] - mean(x[r])) / sqrt(var(x[r]) + eps) * weight + bias, the biased variance
        (torch.nn.LayerNorm; Phi-3.5-MoE's norms). x, out [R, D] float32 (may alias); weight, bias float32
        Weights [D]."""
        raise NotImplementedError

    def rope(self, out, x, positions, theta: float, inv_freq=None):
        """Rotary embedding on x[T,heads,D] at positions[T], rotate-half convention:
        out[..., i] = x_i cos(p f_i) - x_{i+D/2} sin(p f_i),  f_i = theta^(-2i/D), i < D/2
        out[..., i+D/2] = x_{i+D/2} cos(p f_i) + x_i sin(p f_i).
        inv_freq: a host float32 [D/2] table of f_i replacing theta's (YaRN: colibri_edge.runtime.rope), the
        same array object at every call (a device backend keeps its copy by identity)."""
        raise NotImplementedError

    def add(self, out, a, b, gate=None):
        """out = a + b, or out = a + sigmoid(gate[T,1]) * b (Qwen2-MoE's gated shared expert)."""
        raise NotImplementedError

    def scale(self, out, x, factor: float, cap: float = 0.0):
        """out = factor * x, or with cap > 0 the soft-capped out = cap * tanh(factor * x / cap)
        (Gemma's embedding scale and per-layer scalar; its final logit soft-capping). x, out [R, N]
        contiguous float32, may alias; factor 0 with a finite x zeroes out."""
        raise NotImplementedError

    def pos_scale(self, out, x, positions, floor_scale: float, attn_scale: float):
        """Llama 4's attention temperature on the queries of its no-rope layers, per token t in fp32:
            out[t] = x[t] * (log1p(floor((positions[t] + 1) / floor_scale)) * attn_scale + 1)
        x, out [T, ...] contiguous float32 (may alias), positions [T] int32."""
        raise NotImplementedError

    # -- attention (required) ----------------------------------------------------------------
    def kv_write(self, K, V, k, v, slots):
        """K[slots[t]] = k[t]; V[slots[t]] = v[t].  K, V: one layer's cache [num_slots, Hkv, D];
        k, v: [T,Hkv,D]; slot = block * B + offset in the block (colibri_edge.runtime.state). K and V may
        differ in their last dimension (latent attention: the latent [.., 1, Dc] and the rope key
        [.., 1, Dr] of every position). A cache in another kv_dtype (a KVCache, on backends whose
        kv_dtypes list it) stores each row quantised as kv_parts says; every attention op below reads
        its rows dequantised (x = q * d), one row at a time, never a dequantised copy of the cache."""
        raise NotImplementedError

    def head_matmul(self, out, x, w: Weight):
        """Per-head projections (latent attention's absorbed up-projections):
            out[t, g, n] = sum_k x[t, g, k] * w[g, n, k]
        out [T,G,N], x [T,G,K] contiguous float32; w a Weight of shape (G, N, K) in float32, float16
        or bfloat16 (every head's [N, K] matrix contiguous, row-major)."""
        raise NotImplementedError

    def latent_attention(self, out, q, q_rope, C, R, block_tables, seq_index, positions, block_size, scale):
        """Multi-head latent attention in the latent space (DeepSeek-V2's MLA, absorbed): every head
        attends to one shared cache row per position, the latent c (the keys' and the values'
        compressed form) and the rope key r.
            s_j = scale * (q[t,h] . C[slot(j)] + q_rope[t,h] . R[slot(j)]),  j = 0..p
            out[t,h] = sum_j softmax(s)_j C[slot(j)]                          (fp32)
        q, out [T,Hq,Dc]; q_rope [T,Hq,Dr]; C [num_slots,1,Dc], R [num_slots,1,Dr] (one layer's cache,
        written by kv_write); token t of sequence s = seq_index[t] at position p = positions[t],
        slot(j) = block_tables[s, j // B] * B + j % B, as paged_attention."""
        raise NotImplementedError

    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale,
                        window: int = 0, sinks=None):
        """Causal attention through block tables.
        q, out [T,Hq,D]; token t of sequence s = seq_index[t] at position p = positions[t] attends to
        that sequence's positions lo..p, lo = max(0, p - window + 1) (window 0: lo = 0; window < 0:
        chunked attention, Llama 4's, in chunks of C = -window: lo = p - p mod C), slot(j) =
        block_tables[s, j // B] * B + j % B (entries below lo // B may be freed: never read);
        query head h reads KV head h // (Hq/Hkv).  out = softmax(q K^T * scale) V (fp32).
        sinks: a float32 Weight [Hq] of per-head logits that join every softmax's denominator and
        nothing else (gpt-oss):  out = sum_j e^{s_j} V_j / (e^{sink_h} + sum_j e^{s_j})."""
        raise NotImplementedError

    # -- recurrent mixers (required) ---------------------------------------------------------
    # A step's tokens are grouped by sequence: entry s owns tokens starts[s] .. starts[s+1]-1, at
    # consecutive positions, and a fixed-size state slot slots[s] (colibri_edge.runtime.state.FixedPool). A
    # sequence whose first token in the step is at position 0 starts from a zero state and never reads
    # its slot (a slot needs no clearing when it is handed out); the state left in the slot after the
    # step is the one after the sequence's last token, so prefill chunks and decode steps continue it.
    def causal_conv(self, out, x, weight, state, starts, slots, positions, silu=True, bias=None):
        """Depthwise causal conv1d + SiLU over each sequence, its last K-1 inputs carried in the state:
            out[t, c] = silu(sum_{i<K} weight[c, i] * u(p - K + 1 + i, c) + bias[c]),  p = positions[t]
        (silu False: no activation, LFM2's short convolution; bias a float32 Weight [C], Mamba-2's, or
        None: 0).
        u(q, c) is the input at position q of t's sequence: x[t - (p - q), c] for the step's tokens
        (q >= p0, the position of the sequence's first token in the step); before them the state,
        state[slot, K - 1 - (p0 - q), c] for p0 - K + 1 <= q < p0 when p0 > 0 (it holds 0 where q < 0:
        the first step wrote them), 0 when p0 = 0 (the slot is not read). Afterwards state[slot, i, c] =
        u(pl - K + 2 + i, c), i < K - 1 (pl: the sequence's last position): the K-1 inputs ending there.
        x, out [T, C] float32 (distinct buffers); weight a float32 Weight [C, K]; state [num_slots, K-1, C];
        starts [S+1], slots [S], positions [T] int32 (S sequences in the step: len(slots))."""
        raise NotImplementedError

    def delta_rule(self, out, qkv, a, b, a_neg, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        """The gated delta rule (Qwen3.5 / Qwen3-Next linear attention) over each sequence, its
        recurrent state S [Hv, dk, dv] carried in the state slot. heads = (Hk, Hv, dk, dv, group): value
        head h reads key head (h // group) % Hk (group Hv / Hk: the checkpoint's grouped order, where
        consecutive value heads share a key head; 1: llama.cpp's tiled order). Per token t and value
        head h, in fp32:
            q = l2(qkv[t, q part, head]) / sqrt(dk),  k = l2(qkv[t, k part, head]),  v = qkv[t, v part, h]
            l2(x) = x / sqrt(sum(x^2) + 1e-6)
            beta = sigmoid(b[t, h]),  g = a_neg[h] * softplus(a[t, h] + dt_bias[h])   (softplus(y) = y past 20)
            S = e^g S;  S += k (beta (v - S^T k))^T;  out[t, h] = S^T q
        qkv [T, 2*Hk*dk + Hv*dv] (q heads | k heads | v heads, each head's dims contiguous); a, b [T, Hv];
        a_neg (= -exp(A_log)), dt_bias float32 Weights [Hv]; out [T, Hv*dv]; state [num_slots, Hv, dk, dv].
        S starts at 0 for a sequence whose step starts at position 0, else at state[slot]; the final S
        is written back. A backend may run a sequence's tokens in chunks of C (the chunked form: the
        intra-chunk work as C x C and C x dk products, S carried between chunks) instead of one at a
        time: the same function (the reference runs both: reference.delta_rule_recurrent). stepwise: every
        sequence runs its tokens one at a time, as decode runs one (a verification of drafted tokens, so
        its outputs and state are decode's bit for bit where decode is batch invariant)."""
        raise NotImplementedError

    def ssm_scan(self, out, xbc, dt, a_neg, d_skip, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        """Mamba-2's selective state space (SSD) over each sequence, its state S [nh, P, N] carried in the
        state slot. heads = (nh, P, G, N): nh heads of P dims, G groups of B and C (head h reads group
        h // (nh / G)), a state of N per head dim. Per token t and head h, in fp32:
            x = xbc[t, h P .. h P + P],  B = xbc[t, nh P + g N ..],  C = xbc[t, nh P + G N + g N ..]  (g: h's group)
            dt = softplus(dt[t, h] + dt_bias[h])     (softplus(y) = y past 20)
            S = e^(dt a_neg[h]) S + dt x B^T;   out[t, h P + p] = sum_n S[p, n] C[n] + d_skip[h] x[p]
        xbc [T, nh P + 2 G N] (the conv's output: x | B | C); dt [T, nh]; a_neg (= -exp(A_log)), d_skip,
        dt_bias float32 Weights [nh]; out [T, nh P]; state [num_slots, nh, P, N]. S starts at 0 for a
        sequence whose step starts at position 0. A backend may run a sequence in chunks (the SSD chunked
        form: reference.ssm_chunked) instead of token by token: the same function; stepwise: token by
        token (a verification of drafted tokens, as decode runs)."""
        raise NotImplementedError

    def gate_mul(self, out, x, gate, act: str):
        """out = x * act(gate), elementwise over [R, N] contiguous float32 (may alias x): act "silu"
        (the gated RMSNorm's output gate), "sigmoid" (Qwen3.5's attention output gate) or "none"
        (out = x * gate: LFM2's short-convolution gates)."""
        raise NotImplementedError

    # -- MoE (required) ----------------------------------------------------------------------
    def route(self, out_ids, out_w, logits, k: int, mode: str, normalize: bool, choice_bias=None,
              norm_min: float = 0.0, expert_scale=None, score: str = "softmax", groups=None,
              scaling: float = 1.0):
        """logits [T,E] (fp32) -> out_ids [T,k] int32, out_w [T,k] fp32.
        topk: p = softmax(logits) (score "sigmoid": p = 1 / (1 + e^-logits), per expert);
        c = p + choice_bias [E] (a float32 weight, when given: the choice only);
        groups = (n, keep, top) (DeepSeek / GLM group-limited routing, n groups of E/n consecutive
        experts): a group scores the sum of its `top` largest c (1: its maximum), the `keep` best
        groups stay (ties to the lower group id) and the others' experts are out of the choice;
        the k largest c among what stays, ties to the lower expert id; w = their p, divided by
        max(their sum, norm_min) if normalize, times `scaling` (routed_scaling_factor), then times
        expert_scale[id] (a float32 Weight [E], Gemma 4's per_expert_scale) when given.
        gated: k == E, every expert with weight p (softmax). (Model validation guarantees mode, k
        <= keep * E/n and top <= E/n; colibri_edge.backends.routing.route is the reference.)"""
        raise NotImplementedError

    def sparsemixer(self, out_ids, out_w, logits, jitter: float):
        """Phi-3.5-MoE's router at inference (transformers' sparsemixer with training off; arXiv 2409.12136):
        logits s [T,E] fp32 (E >= 2) -> out_ids [T,2] int32, out_w [T,2] fp32, per token in fp32:
            i1 = argmax s (ties to the lower id), m1 = s[i1]
            w1 = 1 / sum_{e kept} exp(s_e - m1)        e kept: not (m1 - s_e) / max(|s_e|, m1) > 2 jitter
            i2 = argmax of s without i1, m2 = s[i2]
            w2 = 1 / sum_{e != i1 kept} exp(s_e - m2)  e kept: not (m2 - s_e) / max(|s_e|, m2) > 2 jitter
        i.e. each weight is its expert's softmax over the experts within a relative 2 jitter of it (a NaN
        ratio, 0 / 0, keeps its expert, as torch's comparison does); the weights are not renormalised.
        colibri_edge.backends.routing.sparsemixer is the reference."""
        raise NotImplementedError

    def align(self, bufs: dict, ids, num_tokens: int, num_experts: int, top_k: int, tally=None) -> Plan:
        """Group the step's assignments by expert (counting sort; colibri_edge.backends.routing.align) into
        the arena's plan buffers `bufs` (plan_buffers()). tally: an int32 [E] buffer that counts the
        tokens routed to each expert, on the device (so graph replays count too), or None."""
        raise NotImplementedError

    def grouped_ffn(self, out, x, experts, plan: Plan, scratch, act: Act | None = None, pre=None):
        """For each expert e in plan.experts_to_run(): out[sorted rows of e] = experts[e](x[its tokens]).
        out [T*k,H] in plan order, x [T,H]; scratch [T*k, I] for the gate/up activations (expert e's rows
        packed [n, I] from scratch's flat offset offsets[e] * scratch.shape[1]).
        Each chosen expert's weights are read once per step, however many tokens chose it.
        act: another activation with expert biases (Act), only when its kind is in ffn_activations.
        pre: optional (backends with grouped_ffn_pre), float32 [T*k, 2I] in plan order, added to each
        row's gate (columns :I) and up (I:) before the activation (run-time LoRA: runtime/lora.py)."""
        raise NotImplementedError

    def combine(self, out, y, w, plan: Plan):
        """out[t] += sum_j w[t,j] * y[inverse[t*k+j]]   (the residual add is fused)."""
        raise NotImplementedError

    # -- LoRA (optional) ---------------------------------------------------------------------
    runs_lora = False              # True: the lora_* ops run on this backend's buffers and grouped_ffn takes
                                   # pre (run-time adapters, runtime/lora.py); False: adapters are merged
                                   # at conversion instead

    def lora_update(self, out, x, a, b_t, r0: int, r1: int):
        """Optional (runs_lora): a LoRA update of rows r0 .. r1-1,
            out[t] += (a @ x[t]) @ b_t,   a [r, in], b_t [r, out] float32 (the scale folded into b_t)
        each row on its own, so that a row's result never depends on the rows beside it (the batch
        invariance the request core relies on). Default: NumPy, on host buffers."""
        out[r0:r1] += (x[r0:r1] @ a.T) @ b_t

    def lora_rows(self, order, k, tokad, offsets, n: int) -> list:
        """Optional (runs_lora): the plan rows of each of a step's n adapters, for lora_pre / lora_down:
        adapter i's rows are the plan rows p whose token t = order[p] // k has tokad[t] == i (-1: no
        adapter), each with its token and its expert e (the one whose rows offsets[e] .. offsets[e+1]-1
        hold p), in plan order. What an entry holds is the backend's own. Default: (p, t, e) arrays."""
        order, tokad = np.asarray(order), np.asarray(tokad)
        out = []
        for i in range(n):
            p = np.flatnonzero(tokad[order // k] == i)
            out.append((p, order[p] // k, np.searchsorted(np.asarray(offsets), p, side="right") - 1))
        return out

    def lora_pre(self, pre, x, rows, ag, bg, au, bu):
        """Optional (runs_lora): the gate/up LoRA addends of grouped_ffn's rows (pre, plan order) for an
        adapter's rows (lora_rows: plan row p of token t and expert e):
            pre[p, :I] += (ag[e] @ x[t]) @ bg[e],   pre[p, I:] += (au[e] @ x[t]) @ bu[e]
        ag, au [E, r, H] and bg, bu [E, r, I] float32, the scale folded into bg / bu; au may be empty
        [0, r, 0]: up uses ag (one A for both, as PEFT's fused gate_up has). Each row on its own.
        Default: NumPy."""
        I = bg.shape[2]
        for p, t, e in zip(*rows):
            pre[p, :I] += (ag[e] @ x[t]) @ bg[e]
            pre[p, I:] += ((au[e] if au.shape[0] else ag[e]) @ x[t]) @ bu[e]

    def lora_down(self, out, flat, rows, offsets, width, ad, bd):
        """Optional (runs_lora): the down projection's LoRA update of an adapter's rows (as lora_pre),
            out[p] += (ad[e] @ a) @ bd[e]
        a: the row's activation in grouped_ffn's scratch, flat (expert e's rows packed [n, I] from
        offsets[e] * width); ad [E, r, I], bd [E, r, H] float32. Each row on its own. Default: NumPy."""
        I = ad.shape[2]
        for p, _, e in zip(*rows):
            o = offsets[e] * width + (p - offsets[e]) * I
            out[p] += (ad[e] @ flat[o:o + I]) @ bd[e]

    # -- optional capabilities ---------------------------------------------------------------
    ffn_activations = ("silu",)    # the expert activations grouped_ffn runs (Act kinds beyond SwiGLU)
    copies_weights = False         # True: weights are copied into the backend's memory (a device), so
                                   # they count against memory_available; host backends map them
    slot_loads_in_parallel = False  # True: load_slot may run on several of the slot pool's I/O threads
                                   # while the compute thread enqueues kernels; False: the pool reads a
                                   # device backend's demand misses and copies them on the compute thread
                                   # (a host backend's slots take the reads directly: no load_slot)

    def prepare(self, formats: set, max_cols: int, max_rows: int = 2):
        """Called once a model is known, before its weights are uploaded: the weight formats it uses,
        its widest matrix row and the most rows (tokens) a step passes. A backend compiles and warms only those kernels and sizes its own
        scratch here (nothing it will not run is compiled). Default: nothing to do."""

    def memory_available(self) -> tuple:
        """-> (bytes the engine may still allocate on this backend, what limits it): compared with
        what Engine.open needs before anything is allocated. Host backends: colibri_edge.memory."""
        from colibri_edge.memory import host_available
        return host_available()

    def begin_step(self):
        """Called once before each step's first op, never inside a step (the cpu backend re-reads
        the cores other processes leave free here). Default: nothing to do."""

    def graph_step(self, key, fn, *args) -> bool:
        """Run fn(*args), a step that only launches this backend's ops on fixed buffers. A backend
        with graph capture (CUDA) captures it the first time `key` is seen and replays it after;
        `key` names everything the launches depend on. -> True when it ran as a replay."""
        fn(*args)
        return False

    @classmethod
    def list_devices(cls) -> list:
        """Lines describing the devices and platforms this backend sees (`colibri backends`)."""
        return []

    def run_parts(self, parts: int, run):
        """run(p, queue) for p < parts: part 0 on the main queue, the others on side queues that
        start after everything queued so far and are joined back before anything queued later, so
        results never depend on the number of parts."""
        side = self._fork(parts - 1) if parts > 1 else []
        for p, q in enumerate(side, 1):
            run(p, q)
        run(0, None)
        if side:
            self._join(side)

    def _fork(self, n: int) -> list:
        """n side queues that wait for everything queued on the main queue (a backend with queues)."""
        return []

    def _join(self, side: list):
        """The main queue waits for everything queued on the side queues."""

    def op_scope(self):
        """The context a guarded op runs in (e.g. the backend's CUDA stream)."""
        return contextlib.nullcontext()

    def translate_error(self, e: Exception, where: str):
        """A device library's exception -> ColibriError with its code, or None if not the library's."""
        return None

    not_applicable: dict = {}     # knob -> where its value came from: environment or defaults that
                                  # do not apply to this backend (set by the Engine; listed by describe)

    def summary(self) -> str:
        """One line: the device and how the backend is set up."""
        return self.name

    def describe(self) -> str:
        s = self.summary()
        if self.not_applicable:
            s += "; not applicable here: " + ", ".join(f"{k} ({v})" for k, v in self.not_applicable.items())
        return s

    def close(self):
        pass
