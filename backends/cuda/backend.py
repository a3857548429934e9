"""The CUDA backend's ops: our own kernels (backends/cuda/*.cu, see sources.py) for every op, cuBLAS
only for prefill-sized GEMMs. Device, memory, streams and graphs are the runtime's (runtime.py).

The MoE layer never leaves the device:
    route    moe_route     fp32 softmax or sigmoid + top-k per token (ties to the lower expert id), group-
                           limited (DeepSeek / GLM) when asked, renormalised, times the routed scaling
                           factor and the experts' scales (Gemma 4) when given
    align    moe_align     counting sort of the T*k assignments by expert, cut into blocks of BM rows;
                           adds the step's counts into the engine's per-expert tally
    ffn      moe_gate_up_* / moe_down_*   one CTA per (block, column tile), weights read once per block;
                           the activation (SwiGLU, gpt-oss's, GeGLU) is a kind code of the MODE 1 epilogue
    combine  moe_combine   weighted sum back into the residual
The grouped kernels are launched with a grid sized by an upper bound on the block count, so no
host copy of the plan is needed to launch them; the counts stay on the device (Plan.fetch_counts
copies them for the host paths that need them: the slot pool).

The recurrent mixers (recurrent.cu, Qwen3.5 / Qwen3-Next gated delta-net) keep each sequence's state in its
slot: causal_conv a thread per (sequence, channel) over its tokens, the last K-1 inputs in registers;
delta_rule a CTA per (sequence, value head), a thread per value column of S [dk, dv], the token by token
recurrence for a decode token and the chunked form (chunks of 16, as the reference) for a prefill; gate_mul
elementwise. None of them needs the host: decode steps capture.

Precision: activations, the KV cache, the router and every accumulation are fp32; fp16 and bf16
weights stay 16-bit on the device (half the bytes to stream) and our kernels widen them as they
read (bf16 never goes through cuBLAS: CuPy has no bf16 type). By default ("fp16 compute")
prefill-sized GEMMs of fp16 weights run on cuBLAS in fp16 (tensor cores, activations rounded to
fp16); disable_fp16=True (COLIBRI_DISABLE_FP16=1) computes in fp32 throughout (those GEMMs then use
our tiled fp32 kernel). fp32 weights always compute in fp32.

Streams: num_streams > 1 splits each grouped FFN's expert blocks over that many streams (run_parts:
a fork/join of events, captured as parallel branches in graph mode).
"""
from __future__ import annotations

import numpy as np

from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from ..base import GATE_MODES, Plan, Weight, guarded
from . import sources
from .runtime import CudaRuntime, _cupy, cdiv, probe  # noqa: F401  (probe: the registry's entry)

SK_ROWS, SK_WARPS = sources.DEFINES["SK_ROWS"], sources.DEFINES["SK_WARPS"]
TBM, TBN = sources.DEFINES["TBM"], sources.DEFINES["TBN"]
ALIGN_THREADS = sources.DEFINES["ALIGN_THREADS"]
LAT_WARPS = sources.DEFINES["LAT_WARPS"]
SKINNY_MAX_T = 32                  # dense matmuls of up to this many rows use the skinny kernel
CONV_THREADS = 128                 # causal_conv: channels per CTA (a thread per channel and sequence)
_NULL = np.uint64(0)               # a null pointer argument
_i32, _f32 = np.int32, np.float32


def _storage(buf_or_weight) -> str:
    return buf_or_weight.dtype if isinstance(buf_or_weight, Weight) else "float32"


class Backend(CudaRuntime):

    def __init__(self, num_streams=1, disable_fp16=False, cuda_graphs=True, device=0, use_cublas=True):
        super().__init__(num_streams=num_streams, disable_fp16=disable_fp16, cuda_graphs=cuda_graphs,
                         device=device, use_cublas=use_cublas)
        self._tables = {}
        self._freq_tables = {}           # id(inv_freq) -> (the host table, its device copy)
        self._mask = None

    # -- dense -------------------------------------------------------------------------------
    @guarded
    def embed(self, out, table, ids):
        data = table.data if isinstance(table, Weight) else table
        T, H = out.shape
        shape = tuple(table.shape) if isinstance(table, Weight) else data.shape
        if data.ndim != 2 or len(shape) != 2 or shape[1] != H:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"embed: table {data.shape} does not give rows of {H}")
        sc = table.scales if isinstance(table, Weight) and table.scales is not None else _NULL
        self._launch(sources.EMBED[_storage(table)], (cdiv(H, 256), T), (256,), (out, data, sc, ids, _i32(T), _i32(H)))

    @guarded
    def matmul(self, out, x, w, bias=None):
        T, K = x.shape
        N = w.shape[0]
        W = w.data
        b = bias.data if bias is not None else _NULL
        sc = w.scales if w.scales is not None else _NULL
        if T <= SKINNY_MAX_T:
            self._launch(sources.MATMUL_SKINNY[w.dtype], (cdiv(N, SK_WARPS), cdiv(T, SK_ROWS)), (256,),
                         (out, x, W, sc, b, _i32(T), _i32(N), _i32(K)))
        elif self._capturing or not self.use_cublas or w.dtype not in ("float32", "float16") or \
                (self.fp32 and w.dtype == "float16"):
            self._launch(sources.MATMUL_TILED[w.dtype], (cdiv(N, TBN), cdiv(T, TBM)), (256,),
                         (out, x, W, sc, b, _i32(T), _i32(N), _i32(K)))
        else:
            self._cublas_matmul(out, x, W, b, T, N, K)

    def _cublas_matmul(self, out, x, W, b, T, N, K):
        """Prefill GEMMs: cuBLAS, fp16 (tensor cores, fp32 accumulation) for fp16 weights."""
        cp = _cupy()
        if W.dtype == np.float16:
            x16 = cp.empty((T, K), dtype=np.float16)
            self._launch("f32_to_f16", (cdiv(T * K, 256),), (256,), (x16, x, np.int64(T * K)))
            y16 = cp.empty((T, N), dtype=np.float16)
            cp.matmul(x16, W.T, out=y16)
            self._launch("f16_to_f32_bias", (cdiv(T * N, 256),), (256,), (out, y16, b, _i32(T), _i32(N)))
        else:
            cp.matmul(x, W.T, out=out)
            if b is not _NULL:
                self._launch("bias_add", (cdiv(T * N, 256),), (256,), (out, b, _i32(T), _i32(N)))

    @guarded
    def head_matmul(self, out, x, w):
        T, G, K = x.shape
        N = w.shape[1] if len(w.shape) == 3 else 0
        kernel = sources.HEAD_MATMUL.get(w.dtype)
        if kernel is None or len(w.shape) != 3 or tuple(w.shape) != (G, N, K) or out.shape != (T, G, N) or \
                not (x.flags.c_contiguous and out.flags.c_contiguous):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"head_matmul: x {x.shape} -> out {out.shape} through a "
                               f"{w.dtype} weight {tuple(w.shape)} (needs contiguous [T,G,K] -> [T,G,N] and a float32, "
                               "float16 or bfloat16 [G,N,K])")
        self._launch(kernel, (cdiv(N, SK_WARPS), cdiv(T, SK_ROWS), G), (256,),
                     (out, x, w.data, _i32(T), _i32(G), _i32(N), _i32(K)))

    @guarded
    def rmsnorm(self, out, x, weight, eps):
        R, D = x.shape
        threads = min(256, max(32, cdiv(D, 32) * 32))
        self._launch("rmsnorm", (R,), (threads,), (out, x, weight.data, _i32(R), _i32(D), _f32(eps)))

    @guarded
    def layernorm(self, out, x, weight, bias, eps):
        R, D = x.shape
        threads = min(256, max(32, cdiv(D, 32) * 32))
        self._launch("layernorm", (R,), (threads,), (out, x, weight.data, bias.data, _i32(R), _i32(D), _f32(eps)))

    @guarded
    def rope(self, out, x, positions, theta, inv_freq=None):
        T, heads, D = x.shape
        n = T * heads * (D // 2)
        table = _NULL
        if inv_freq is not None:         # a model's table (YaRN, partial rotary): uploaded once, kept by identity,
            got = self._freq_tables.get(id(inv_freq))     # one per table (Gemma 4: one per head_dim)
            if got is None or got[0] is not inv_freq:
                got = self._freq_tables[id(inv_freq)] = (inv_freq, self.to_device(np.asarray(inv_freq, np.float32),
                                                                                  "float32"))
            table = got[1]
            if table.size < D // 2:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"rope: an inv_freq table of {table.size} for "
                                   f"head_dim {D} (needs {D // 2})")
        self._launch("rope", (cdiv(n, 256),), (256,),
                     (out, x, positions, _i32(T), _i32(heads), _i32(D), _f32(theta), table))

    @guarded
    def add(self, out, a, b, gate=None):
        H = out.shape[-1]
        T = out.size // H
        self._launch("add", (cdiv(T * H, 256),), (256,), (out, a, b, _NULL if gate is None else gate, _i32(T), _i32(H)))

    @guarded
    def scale(self, out, x, factor, cap=0.0):
        n = x.size
        if out.size != n or not (x.flags.c_contiguous and out.flags.c_contiguous):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"scale: out {out.shape} and x {x.shape} must be "
                               "contiguous buffers of one size")
        if n:
            self._launch("scale", (cdiv(n, 256),), (256,), (out, x, np.int64(n), _f32(factor), _f32(cap)))

    @guarded
    def pos_scale(self, out, x, positions, floor_scale, attn_scale):
        T = x.shape[0]
        N = x.size // max(T, 1)
        if out.size != x.size or not (x.flags.c_contiguous and out.flags.c_contiguous) or T > 65535:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"pos_scale: out {out.shape} and x {x.shape} must be "
                               "contiguous buffers of one size, at most 65535 rows")
        if T and N:
            self._launch("pos_scale", (cdiv(N, 256), T), (256,), (out, x, positions, _i32(N), _f32(floor_scale),
                                                                  _f32(attn_scale)))

    # -- attention ---------------------------------------------------------------------------
    @guarded
    def kv_write(self, K, V, k, v, slots):
        T = k.shape[0]
        WK, WV = K.shape[1] * K.shape[2], V.shape[1] * V.shape[2]      # latent attention: Dc and Dr
        if k.size != T * WK or v.size != T * WV or V.shape[0] != K.shape[0]:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"kv_write: k {k.shape} / v {v.shape} do not match "
                               f"the cache's [slots, Hkv, D] = {K.shape} / {V.shape}")
        self._launch("kv_write", (cdiv(T * max(WK, WV), 256),), (256,),
                     (K, V, k, v, slots, _i32(T), _i32(WK), _i32(WV)))

    @guarded
    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale, window=0,
                        sinks=None):
        T, Hq, D = q.shape
        Hkv = K.shape[1]
        if D > sources.MAX_HEAD_DIM or Hq % Hkv or K.shape[2] != D or V.shape != K.shape:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"paged_attention: head_dim {D} (max "
                               f"{sources.MAX_HEAD_DIM}) / heads {Hq} over {Hkv} KV heads, cache {K.shape}")
        self._launch("paged_attention", (Hq, T), (128,),
                     (out, q, K, V, block_tables, seq_index, positions, _i32(T), _i32(Hq), _i32(Hkv), _i32(D),
                      _i32(block_size), _i32(block_tables.shape[1]), _f32(scale), _i32(window),
                      _NULL if sinks is None else sinks.data))

    @guarded
    def latent_attention(self, out, q, q_rope, C, R, block_tables, seq_index, positions, block_size, scale):
        T, Hq, Dc = q.shape
        Dr = q_rope.shape[2]
        if Dc > sources.MAX_LATENT_DIM or Dr > sources.MAX_LATENT_ROPE or q_rope.shape[:2] != (T, Hq) or \
                out.shape != q.shape or C.shape[1:] != (1, Dc) or R.shape[1:] != (1, Dr) or R.shape[0] != C.shape[0]:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"latent_attention: q {q.shape} (latent width max "
                               f"{sources.MAX_LATENT_DIM}) / q_rope {q_rope.shape} (max {sources.MAX_LATENT_ROPE}) / "
                               f"out {out.shape} against the caches C {C.shape} and R {R.shape} ([slots, 1, Dc], "
                               "[slots, 1, Dr])")
        self._launch("latent_attention", (Hq, T), (32 * LAT_WARPS,),
                     (out, q, q_rope, C, R, block_tables, seq_index, positions, _i32(Hq), _i32(Dc), _i32(Dr),
                      _i32(block_size), _i32(block_tables.shape[1]), _f32(scale)))

    # -- recurrent mixers (recurrent.cu) -------------------------------------------------------
    delta_chunk = sources.DEFINES["DELTA_CHUNK"]     # tokens per chunk of delta_rule's prefill form

    @guarded
    def causal_conv(self, out, x, weight, state, starts, slots, positions, silu=True, bias=None):
        T, C = x.shape
        K = weight.shape[1] if isinstance(weight, Weight) and len(weight.shape) == 2 else 0
        S = slots.shape[0]
        if not isinstance(weight, Weight) or weight.dtype != "float32" or tuple(weight.shape) != (C, K) or \
                not 1 <= K <= sources.CONV_MAX_K or out.shape != (T, C) or state.ndim != 3 or \
                state.shape[1:] != (K - 1, C) or starts.shape[0] < S + 1 or positions.shape[0] < T or \
                not all(a.flags.c_contiguous for a in (out, x, weight.data, state)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"causal_conv: x {x.shape} -> out {out.shape} through a "
                               f"{getattr(weight, 'dtype', type(weight).__name__)} weight "
                               f"{tuple(getattr(weight, 'shape', ()))}, state {state.shape}, {S} sequences (needs "
                               f"contiguous [T,C] buffers, a float32 [C,K] weight with K <= {sources.CONV_MAX_K}, a "
                               "[slots,K-1,C] state, starts [S+1], positions [T])")
        if T and S:
            self._launch("causal_conv", (cdiv(C, CONV_THREADS), S), (CONV_THREADS,),
                         (out, x, weight.data, state, starts, slots, positions, _i32(C), _i32(K), _i32(bool(silu)),
                          _NULL if bias is None else bias.data))

    @guarded
    def ssm_scan(self, out, xbc, dt, a_neg, d_skip, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        nh, P, G, N = (int(h) for h in heads)
        T, S = xbc.shape[0], slots.shape[0]
        vecs = (a_neg, d_skip, dt_bias)
        if min(nh, P, G, N) < 1 or nh % G or xbc.shape != (T, nh * P + 2 * G * N) or dt.shape != (T, nh) or \
                out.size != T * nh * P or state.ndim != 4 or state.shape[1:] != (nh, P, N) or S > 65535 or \
                starts.shape[0] < S + 1 or any(_storage(w) != "float32" or w.data.size != nh for w in vecs) or \
                not all(a.flags.c_contiguous for a in (out, xbc, dt, state)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"ssm_scan: heads (nh, P, G, N) = {tuple(heads)}, xbc "
                               f"{xbc.shape}, dt {dt.shape}, out {out.shape}, state {state.shape}, {S} sequences (needs "
                               "contiguous xbc [T, nh P + 2 G N], dt [T, nh], state [slots, nh, P, N], float32 "
                               "a_neg, d_skip, dt_bias [nh], G dividing nh, at most 65535 sequences)")
        if T and S:
            self._launch("ssm_scan", (cdiv(nh * P, 128), S), (128,),
                         (out, xbc, dt, *(w.data for w in vecs), state, starts, slots, positions, _i32(nh), _i32(P),
                          _i32(G), _i32(N)))

    @guarded
    def delta_rule(self, out, qkv, a, b, a_neg, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        Hk, Hv, dk, dv = (int(h) for h in heads[:4])
        group = int(heads[4]) if len(heads) > 4 else Hv // max(Hk, 1)   # value head h reads key head (h//group) % Hk
        T, S = qkv.shape[0], slots.shape[0]
        vecs = (a_neg, dt_bias)
        if not (1 <= dk <= sources.DELTA_MAX_DK and 1 <= dv <= sources.DELTA_MAX_DV and Hk >= 1 and Hv % Hk == 0 and
                group >= 1) or \
                qkv.shape != (T, 2 * Hk * dk + Hv * dv) or out.shape != (T, Hv * dv) or a.shape != (T, Hv) or \
                b.shape != (T, Hv) or state.ndim != 4 or state.shape[1:] != (Hv, dk, dv) or S > 65535 or \
                starts.shape[0] < S + 1 or positions.shape[0] < T or \
                any(_storage(w) != "float32" or (w.data if isinstance(w, Weight) else w).size != Hv for w in vecs) or \
                not all(x.flags.c_contiguous for x in (out, qkv, a, b, state)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"delta_rule: heads (Hk, Hv, dk, dv) = {tuple(heads)} "
                               f"(dk <= {sources.DELTA_MAX_DK}, dv <= {sources.DELTA_MAX_DV}, Hk dividing Hv), qkv "
                               f"{qkv.shape}, out {out.shape}, a {a.shape}, b {b.shape}, state {state.shape}, {S} "
                               "sequences (needs contiguous qkv [T, 2 Hk dk + Hv dv], out [T, Hv dv], a, b [T, Hv], "
                               "state [slots, Hv, dk, dv], float32 a_neg, dt_bias [Hv], at most 65535 sequences)")
        if T and S:
            self._launch("delta_rule", (Hv, S), (cdiv(dv, 32) * 32,),
                         (out, qkv, a, b, *(w.data if isinstance(w, Weight) else w for w in vecs), state, starts,
                          slots, positions, _i32(Hk), _i32(Hv), _i32(dk), _i32(dv), _i32(group), _f32(dk ** -0.5),
                          _i32(bool(stepwise))))

    @guarded
    def gate_mul(self, out, x, gate, act):
        n = x.size
        if act not in GATE_MODES or out.size != n or gate.size != n or \
                not all(a.flags.c_contiguous for a in (out, x, gate)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"gate_mul: act {act!r} (silu, sigmoid or none) over out "
                               f"{out.shape}, x {x.shape}, gate {gate.shape} (contiguous buffers of one size)")
        if n:
            self._launch("gate_mul", (cdiv(n, 256),), (256,), (out, x, gate, np.int64(n), _i32(GATE_MODES[act])))

    # -- MoE ---------------------------------------------------------------------------------
    @guarded
    def route(self, out_ids, out_w, logits, k, mode, normalize, choice_bias=None, norm_min=0.0, expert_scale=None,
              score="softmax", groups=None, scaling=1.0):
        T, E = logits.shape
        if E > sources.MAX_ROUTE_EXPERTS:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"route: {E} experts (the CUDA router takes {sources.MAX_ROUTE_EXPERTS})")
        if score not in ("softmax", "sigmoid"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: score {score!r} (softmax or sigmoid)")
        n, keep, top = (int(g) for g in groups) if groups is not None and groups[0] > 1 else (1, 1, 1)
        if n > 1 and (E % n or not 1 <= keep <= n or top not in (1, 2) or top > E // n or
                      (mode != "gated" and k > keep * (E // n))):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: groups {tuple(groups)} for {E} experts, top-{k} "
                               "(n groups must divide E, keep <= n, top 1 or 2 and <= E/n, k <= keep * E/n)")
        self._launch("moe_route", (cdiv(T, 4),), (128,),
                     (out_ids, out_w, logits, _NULL if choice_bias is None else choice_bias.data, _i32(T), _i32(E),
                      _i32(k), _i32(mode == "gated"), _i32(bool(normalize)), np.float32(norm_min),
                      _NULL if expert_scale is None else expert_scale.data, _i32(score == "sigmoid"), _i32(n),
                      _i32(keep), _i32(top), _f32(scaling)))

    @guarded
    def sparsemixer(self, out_ids, out_w, logits, jitter):
        T, E = logits.shape
        if T:
            self._launch("moe_sparsemixer", (cdiv(T, 128),), (128,), (out_ids, out_w, logits, _i32(T), _i32(E),
                                                                        _f32(2 * jitter)))

    @staticmethod
    def block_rows_for(assignments, num_experts):
        """BM of a plan: the tiled kernels when experts get >= 32 rows on average, else skinny."""
        return TBM if assignments >= 32 * max(1, min(num_experts, assignments)) else SK_ROWS

    @guarded
    def align(self, bufs, ids, num_tokens, num_experts, top_k, tally=None, block_rows=None):
        """The plan on the device (moe_align); block_rows forces BM (tests), else block_rows_for()."""
        T, k, E = int(num_tokens), int(top_k), int(num_experts)
        A = T * k
        if E > sources.MAX_ALIGN_EXPERTS:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"align: {E} experts (the CUDA align takes {sources.MAX_ALIGN_EXPERTS})")
        BM = int(block_rows) if block_rows else self.block_rows_for(A, E)
        if not 1 <= BM <= TBM:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"align: block_rows={BM}, must be 1..{TBM}")
        self._launch("moe_align", (1,), (ALIGN_THREADS,),
                     (bufs["offsets"], bufs["order"], bufs["inverse"], bufs["counts"], bufs["blocks"], bufs["nblocks"],
                      _NULL if tally is None else tally, ids, _i32(A), _i32(E), _i32(BM)))
        counts_dev, stream = bufs["counts"][:E], self._s

        def fetch():
            stream.synchronize()
            return counts_dev.get(stream=stream)
        return Plan(bufs["offsets"][:E + 1], bufs["order"][:A], bufs["inverse"][:A], None, T, k,
                    blocks=bufs["blocks"], nblocks=bufs["nblocks"], block_rows=BM,
                    max_blocks=max(1, min(A, cdiv(A, BM) + E - 1)), num_experts=E, fetch_counts=fetch)

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
        I, H = f0.gate.shape
        for f in real:
            if f.gate.shape != (I, H) or f.up.shape != (I, H) or f.down.shape != (H, I) or \
                    not f.gate.dtype == f.up.dtype == f0.gate.dtype or f.down.dtype != f0.down.dtype:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "grouped_ffn: experts of one call must share "
                                   f"shapes gate/up [{I},{H}], down [{H},{I}], one gate/up dtype and one down "
                                   "dtype (a q4_k_m layer: q4_k gate/up, q6_k down)")

        def ptr(a):
            return 0 if a is None else a.data.ptr
        mats = (lambda f: f.gate, lambda f: f.up, lambda f: f.down)
        ptrs = np.array([[0 if f is None else ptr(m(f).data) for f in experts] for m in mats] +
                        [[0 if f is None else ptr(m(f).scales) for f in experts] for m in mats], dtype=np.uint64)
        ent = (tuple(experts), self.to_device(ptrs, "uint64"), (f0.gate.dtype, f0.down.dtype), H, I,
               len(real) < len(experts))
        if len(self._tables) >= 4096:
            self._tables.pop(next(iter(self._tables)))
        self._tables[key] = ent
        return ent

    def _active_mask(self, experts, plan, partial):
        """NULL (every expert with rows runs) or a device int32 [E] mask of plan.active."""
        if plan.active is None:
            if partial:
                idle = {e for e, f in enumerate(experts) if f is None}
                busy = set(np.flatnonzero(plan.fetch_counts()))
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

    ffn_activations = tuple(sources.ACT_KINDS)      # silu, swiglu_oai, gelu_tanh: expert_act's kind codes

    @guarded
    def grouped_ffn(self, out, x, experts, plan, scratch, act=None):
        spec = act
        kind = sources.ACT_KINDS["silu"] if spec is None else sources.ACT_KINDS.get(spec.kind)
        if kind is None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"grouped_ffn: activation {spec.kind!r} (the CUDA "
                               f"backend runs {', '.join(self.ffn_activations)})")
        _, tab, wd, H, I, partial = self._expert_table(experts)
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
        skinny = plan.block_rows <= SK_ROWS
        kernels = sources.MOE_SKINNY if skinny else sources.MOE_TILED
        gu, dn = kernels[wd[0]][0], kernels[wd[1]][1]
        cols = SK_WARPS if skinny else TBN
        parts = max(1, min(self.num_streams, plan.max_blocks))
        gx = cdiv(plan.max_blocks, parts)

        def b(w):
            return _NULL if spec is None or w is None else w.data
        epi = (b(spec and spec.gate_bias), b(spec and spec.up_bias), _i32(kind), _f32(spec.alpha if spec else 0.0),
               _f32(spec.limit if spec else 0.0))

        def run(p, stream):
            with self.on(stream):
                self._launch(gu, (gx, cdiv(I, cols)), (256,),
                             (act, x, plan.order, plan.blocks, plan.nblocks, tab[0], tab[1], tab[3], tab[4], active,
                              _i32(k), _i32(H), _i32(I), _i32(p), _i32(parts), *epi))
                self._launch(dn, (gx, cdiv(H, cols)), (256,),
                             (out, act, plan.blocks, plan.nblocks, tab[2], tab[5], active, _i32(H), _i32(I), _i32(p),
                              _i32(parts), b(spec and spec.down_bias)))
        self.run_parts(parts, run)

    @guarded
    def combine(self, out, y, w, plan):
        T, k = plan.num_tokens, plan.top_k
        H = out.shape[1]
        self._launch("moe_combine", (cdiv(H, 256), T), (256,), (out, y, w, plan.inverse, _i32(T), _i32(k), _i32(H)))

    def close(self):
        super().close()
        self._tables.clear()
