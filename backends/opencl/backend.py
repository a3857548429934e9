"""The OpenCL backend's ops: ARM Mali GPUs (and any OpenCL 1.2 device; PoCL on CPU and Oclgrind in CI).
Device, programs, launches, memory and queues are the runtime's (runtime.py).

Attention: paged (GQA, sliding windows, sinks) and latent (DeepSeek's MLA: one shared latent and rope
key per position, heads projected in and out by head_matmul), both through the block tables.
The MoE layer runs on the device: router logits, top-k (softmax or sigmoid scores, optionally within
the best expert groups; ties to the lower expert id), align (a
deterministic counting sort in one work-group), each chosen expert's gated FFN over its rows (SwiGLU,
gpt-oss's clamped SwiGLU or GeGLU, by an activation-kind code: moe.cl expert_act),
combine. Recurrent mixers (Qwen3.5 / Qwen3-Next's gated delta-net, recurrent.cl): the causal conv, the
gated delta rule (per value head, S in the state slot; decode by the recurrence, prefill in chunks of
DELTA_CHUNK tokens), the output gate. COLIBRI_NUM_STREAMS (`num_streams`) command queues: independent
experts of a layer go round-robin to the queues (run_parts), so results never depend on the number of queues.
"""
from __future__ import annotations

import numpy as np

from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.model.quant import act_block
from ..base import Plan, Weight
from .platforms import probe  # noqa: F401  (the registry's entry)
from .runtime import ACT8, BLOCK_DTYPES, CONV_KMAX, DELTA_CHUNK, OpenCLRuntime, ROWS_PER_ITEM, roundup


class Backend(OpenCLRuntime):

    def __init__(self, num_streams=1, disable_fp16=False, device=None, int8_activations=True):
        super().__init__(num_streams=num_streams, disable_fp16=disable_fp16, device=device,
                         int8_activations=int8_activations)
        self._qbufs = {}                 # "x" / "act" -> packed int8 activations (grown, never per step)
        self._qfill = {}                 # slot -> the marker after its latest fill on the main queue (_quantized)
        self._inv_freq = {}              # (theta, D) -> the rotary frequency table on the device
        self._tables = {}                # id(expert list) -> (experts, (offset table, base buffers))

    @staticmethod
    def _wdtype(t):
        """Storage type of a matrix: a Weight's, or float32 for a plain buffer."""
        return t.dtype if isinstance(t, Weight) else "float32"

    @staticmethod
    def _data(t):
        return t.data if isinstance(t, Weight) else t

    def _scales(self, t):
        """An int8 matrix's row scales; the dummy buffer (unread by the kernels) for every other type."""
        return t.scales if isinstance(t, Weight) and t.scales is not None else self._dummy

    # -- dense -------------------------------------------------------------------------------------
    def embed(self, out, table, ids):
        T, H = out.shape
        k = self._kernel("dense.cl", "embed", self._wdtype(table))
        g, l = self._2d(k, H, T)
        self._launch(k, g, l, out, self._data(table), self._scales(table), ids, T, H)

    # -- int8 activations (block formats): x quantised once per consumer, then integer dots -------------
    def _act8(self, wdtype):
        return self.int8_activations and wdtype in BLOCK_DTYPES

    def _quantized(self, x, ldx, T, K, slot, wdtype, row0=0, queue=None):
        """x [T, K] (row stride ldx) -> its packed int8 blocks (dense.cl quantize_act; one scale per
        quant.act_block(wdtype) activations: the weights they feed) at rows row0.. of the backend's
        buffer `slot`, and their row stride (floats). The buffer grows to the largest step
        seen (prefill), so decode steps allocate nothing."""
        ld = K // 32 * 10
        need = (row0 + T) * ld
        buf = self._qbufs.get(slot)
        if buf is None or buf.size < need:
            buf = self._qbufs[slot] = self.alloc((max(need, 2 * (0 if buf is None else buf.size)),), np.float32)
            # alloc zero-filled it on the main queue, after the side queues forked (grouped_ffn): every
            # side queue that writes this buffer from now on waits for that fill (else the fill could
            # land after its quantize and zero an expert's rows). grouped_ffn clears these per fork.
            self._qfill[slot] = self.cl.enqueue_marker(self.queue)
        if queue is not None and slot in self._qfill:
            self.cl.enqueue_barrier(queue, wait_for=[self._qfill[slot]])
        k = self._kernel("dense.cl", "quantize_act", "q8_0" + ACT8)
        g, l = self._2d(k, K // 32, T, want=32)
        view = buf[row0 * ld:]
        self._launch(k, g, l, view, ld, x, ldx, T, K, act_block(wdtype.removesuffix(ACT8)), queue=queue)
        return view, ld

    def _matmul(self, out, ldo, x, ldx, w, bias, T, K, N, queue=None, xq=None):
        """xq: x already quantised (packed, stride) for a block format with int8 activations."""
        wd = self._wdtype(w)
        if self._act8(wd):
            x, ldx = xq or self._quantized(x, ldx, T, K, "x", wd, queue=queue)
            wd += ACT8
        if T >= ROWS_PER_ITEM:
            k = self._kernel("dense.cl", "matmul4", wd)
            g, l = self._2d(k, N, -(-T // ROWS_PER_ITEM))
        else:
            k = self._kernel("dense.cl", "matmul1", wd)
            g, l = self._2d(k, N, T)
        self._launch(k, g, l, out, ldo, x, ldx, self._data(w), self._scales(w), self._dummy if bias is None else bias.data,
                     bias is not None, T, K, N, queue=queue)

    def matmul(self, out, x, w, bias=None):
        T, K = x.shape
        N = w.shape[0]
        if tuple(w.shape) != (N, K) or tuple(out.shape) != (T, N):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"matmul shapes out {out.shape}, x {x.shape}, "
                               f"w {w.shape} do not agree")
        self._matmul(out, N, x, K, w, bias, T, K, N)

    def matmuls(self, outs, x, ws, biases):
        """q, k and v (one storage type) in one launch (dense.cl matmul3); otherwise one matmul each."""
        T, K = x.shape
        if not 1 <= len(ws) <= 3 or \
                any(tuple(w.shape) != (o.shape[1], K) or o.shape[0] != T for o, w in zip(outs, ws)):
            return super().matmuls(outs, x, ws, biases)           # matmul says what is wrong
        if len({self._wdtype(w) for w in ws}) != 1:
            # mixed types (a q4_k_m file: q4_k, q8_0, q6_k): one launch each, x quantised once for all
            # (once per activation block: quant.act_block of each type)
            act8 = [self._wdtype(w) for w in ws if self._act8(self._wdtype(w))]
            xq = {act_block(d): self._quantized(x, K, T, K, f"x{act_block(d)}", d) for d in act8}
            for out, w, b in zip(outs, ws, biases):
                T_, N = out.shape
                self._matmul(out, N, x, K, w, b, T, K, N, xq=xq.get(act_block(self._wdtype(w)))
                             if self._act8(self._wdtype(w)) else None)
            return
        pad = 3 - len(ws)
        wd, ldx = self._wdtype(ws[0]), K
        if self._act8(wd):
            x, ldx = self._quantized(x, K, T, K, "x", wd)
            wd += ACT8
        outs, ws, biases = list(outs) + [self._dummy] * pad, list(ws) + [None] * pad, list(biases) + [None] * pad
        Ns = [w.shape[0] if w is not None else 0 for w in ws]
        k = self._kernel("dense.cl", "matmul3", wd)
        g, l = self._2d(k, sum(Ns), -(-T // ROWS_PER_ITEM))
        has_bias = sum(1 << j for j, b in enumerate(biases) if b is not None)
        self._launch(k, g, l, *outs, x, ldx, *[self._dummy if w is None else self._data(w) for w in ws],
                     *[self._dummy if w is None else self._scales(w) for w in ws],
                     *[self._dummy if b is None else b.data for b in biases], has_bias, *Ns, T, K)

    def rmsnorm(self, out, x, weight, eps):
        D = x.shape[-1]
        R = x.size // D
        k = self._kernel("dense.cl", "rmsnorm")
        L = self._local(k, min(256, roundup(D, 32)), pow2=True)
        self._launch(k, (R * L,), (L,), out, x, weight.data, D, float(eps), self.cl.LocalMemory(4 * L))

    def layernorm(self, out, x, weight, bias, eps):
        D = x.shape[-1]
        R = x.size // D
        k = self._kernel("dense.cl", "layernorm")
        L = self._local(k, min(256, roundup(D, 32)), pow2=True)
        self._launch(k, (R * L,), (L,), out, x, self._float32("layernorm", "the weight", weight),
                     self._float32("layernorm", "the bias", bias), D, float(eps), self.cl.LocalMemory(4 * L))

    def _freqs(self, theta, D):
        key = (float(theta), int(D))
        buf = self._inv_freq.get(key)
        if buf is None:
            # the reference's fp32 table: 1 / theta^(2i/D)
            inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float32) / D))
            buf = self._inv_freq[key] = self.to_device(inv.astype(np.float32), "float32")
        return buf

    def rope(self, out, x, positions, theta, inv_freq=None):
        T, heads, D = x.shape
        k = self._kernel("dense.cl", "rope")
        g, l = self._2d(k, D // 2, T * heads, want=32)
        if inv_freq is None:
            table = self._freqs(theta, D)
        else:                            # a model's table (YaRN): uploaded once, kept by identity
            got = self._inv_freq.get(id(inv_freq))
            if got is None or got[0] is not inv_freq:
                got = self._inv_freq[id(inv_freq)] = (inv_freq, self.to_device(np.asarray(inv_freq, np.float32),
                                                                               "float32"))
            if np.size(got[0]) != D // 2:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"rope: an inv_freq table of {np.size(got[0])} "
                                   f"frequencies for head_dim {D} (needs {D // 2})")
            table = got[1]
        self._launch(k, g, l, out, x, positions, table, T, heads, D)

    def add(self, out, a, b, gate=None):
        n = out.size
        H = out.shape[-1] if out.ndim else 1
        k = self._kernel("dense.cl", "add")
        L = self._local(k, 128)
        self._launch(k, (n,), (L,), out, a, b, self._dummy if gate is None else gate, gate is not None, n, H)

    def scale(self, out, x, factor, cap=0.0):
        n = x.size
        if out.size != n:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"scale shapes out {out.shape}, x {x.shape} do not agree")
        k = self._kernel("dense.cl", "scale")
        L = self._local(k, 128)
        self._launch(k, (n,), (L,), out, x, n, float(factor), float(cap) if cap and cap > 0 else 0.0)

    def pos_scale(self, out, x, positions, floor_scale, attn_scale):
        T = x.shape[0]
        N = x.size // max(T, 1)
        if out.size != x.size or positions.shape[0] < T:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"pos_scale shapes out {out.shape}, x {x.shape}, "
                               f"positions {positions.shape} do not agree")
        k = self._kernel("dense.cl", "pos_scale")
        g, l = self._2d(k, N, T)
        self._launch(k, g, l, out, x, positions, T, N, float(floor_scale), float(attn_scale))

    # -- attention ---------------------------------------------------------------------------------
    def kv_write(self, K, V, k, v, slots):
        T = k.shape[0]
        if tuple(k.shape[1:]) != tuple(K.shape[1:]) or tuple(v.shape[1:]) != tuple(V.shape[1:]) or v.shape[0] != T:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"kv_write: k {k.shape}, v {v.shape} do not fit the "
                               f"caches {K.shape}, {V.shape}")
        krow, vrow = K.shape[1] * K.shape[2], V.shape[1] * V.shape[2]     # differ for latent attention
        kk = self._kernel("attention.cl", "kv_write")
        g, l = self._2d(kk, max(krow, vrow), T)
        self._launch(kk, g, l, K, V, k, v, slots, T, krow, vrow)

    HEAD_DTYPES = ("float32", "float16", "bfloat16")    # dense.cl head_matmul's weight types

    def head_matmul(self, out, x, w):
        T, G, K = x.shape
        N = w.shape[1] if len(w.shape) == 3 else -1
        if tuple(w.shape) != (G, N, K) or tuple(out.shape) != (T, G, N):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"head_matmul shapes out {out.shape}, x {x.shape}, "
                               f"w {w.shape} do not agree")
        if w.dtype not in self.HEAD_DTYPES:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"head_matmul runs {', '.join(self.HEAD_DTYPES)} weights, "
                               f"not {w.dtype}")
        k = self._kernel("dense.cl", "head_matmul", w.dtype)
        mult = self._wg[k[1]][1] or 1
        l0 = self._local(k, min(64, roundup(N, mult)))
        self._launch(k, (N, G, -(-T // ROWS_PER_ITEM)), (l0, 1, 1), out, x, w.data, T, G, N, K)

    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale, window=0,
                        sinks=None):
        T, Hq, D = q.shape
        Hkv = K.shape[1]
        if K.shape[2] != D or Hkv < 1 or Hq % Hkv:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"paged_attention: q {q.shape} and a KV cache "
                               f"{K.shape} do not agree")
        k = self._kernel("attention.cl", "paged_attention")
        C = self._local(k, 64, pow2=True)
        # local memory per work-group: q and the accumulator [D] and two chunk rows [C], sized by each
        # call's own head_dim (no compile-time maximum; sliding and full layers may differ)
        while C > 1 and 8 * (D + C) > self.local_mem:
            C //= 2
        if 8 * (D + C) > self.local_mem:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"paged_attention: head_dim {D} needs {8 * (D + C)} bytes "
                               f"of local memory, the OpenCL device has {self.local_mem}")
        lm = self.cl.LocalMemory
        ldb = block_tables.shape[1]
        self._launch(k, (C * Hq, T), (C, 1), out, q, K, V, block_tables, ldb, seq_index, positions,
                     Hq, Hkv, D, block_size, float(scale), int(window), self._dummy if sinks is None else sinks.data,
                     sinks is not None, lm(4 * D), lm(4 * D), lm(4 * C), lm(4 * C))

    def latent_attention(self, out, q, q_rope, C, R, block_tables, seq_index, positions, block_size, scale):
        T, Hq, Dc = q.shape
        Dr = q_rope.shape[2]
        if C.shape[1:] != (1, Dc) or R.shape[1:] != (1, Dr) or tuple(q_rope.shape[:2]) != (T, Hq) or \
                tuple(out.shape) != (T, Hq, Dc) or C.shape[0] != R.shape[0]:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"latent_attention: q {q.shape}, q_rope {q_rope.shape}, "
                               f"out {out.shape} and the caches C {C.shape}, R {R.shape} do not agree")
        k = self._kernel("attention.cl", "latent_attention")
        L = self._local(k, 64, pow2=True)
        # local memory per work-group: q, q_rope and the accumulator [2 Dc + Dr], three chunk rows [L]
        # (scores, probabilities, slots), sized by each call's own widths (no compile-time maximum)
        rows = 4 * (2 * Dc + Dr)
        while L > 1 and rows + 12 * L > self.local_mem:
            L //= 2
        if rows + 12 * L > self.local_mem:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"latent_attention: a latent of {Dc} and a rope key of {Dr} "
                               f"need {rows + 12 * L} bytes of local memory, the OpenCL device has {self.local_mem}")
        lm = self.cl.LocalMemory
        self._launch(k, (L * Hq, T), (L, 1), out, q, q_rope, C, R, block_tables, block_tables.shape[1], seq_index,
                     positions, Hq, Dc, Dr, block_size, float(scale), lm(4 * Dc), lm(4 * Dr), lm(4 * Dc), lm(4 * L),
                     lm(4 * L), lm(4 * L))

    # -- recurrent mixers --------------------------------------------------------------------------
    def _float32(self, op, what, w):
        """A float32 Weight's (or a plain float32 buffer's) data; anything else is refused."""
        if self._wdtype(w) != "float32":
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{op}: {what} must be float32, not {self._wdtype(w)}")
        return self._data(w)

    def causal_conv(self, out, x, weight, state, starts, slots, positions, silu=True, bias=None):
        T, C = x.shape
        K = weight.shape[1] if len(weight.shape) == 2 else -1
        S = slots.shape[0]
        if tuple(weight.shape) != (C, K) or tuple(out.shape) != (T, C) or tuple(state.shape[1:]) != (K - 1, C) or \
                starts.shape[0] != S + 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"causal_conv shapes out {out.shape}, x {x.shape}, "
                               f"weight {weight.shape}, state {state.shape}, starts {starts.shape}, "
                               f"slots {slots.shape} do not agree")
        if not 1 <= K <= CONV_KMAX:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"causal_conv: a conv of {K} taps; the opencl backend "
                               f"runs 1 to {CONV_KMAX} (recurrent.cl keeps the window in registers)")
        w = self._float32("causal_conv", "the conv weight", weight)
        k = self._kernel("recurrent.cl", "causal_conv")
        g, l = self._2d(k, C, S)
        self._launch(k, g, l, out, x, w, state, starts, slots, positions, S, C, K, int(bool(silu)),
                     self._dummy if bias is None else self._float32("causal_conv", "the bias", bias), int(bias is not None))

    def ssm_scan(self, out, xbc, dt, a_neg, d_skip, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        nh, P, G, N = (int(h) for h in heads)
        T, S = xbc.shape[0], slots.shape[0]
        if min(nh, P, G, N) < 1 or nh % G or tuple(xbc.shape) != (T, nh * P + 2 * G * N) or \
                tuple(dt.shape) != (T, nh) or out.size != T * nh * P or tuple(state.shape[1:]) != (nh, P, N) or \
                starts.shape[0] != S + 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"ssm_scan: heads {heads} and the shapes out {out.shape}, "
                               f"xbc {xbc.shape}, dt {dt.shape}, state {state.shape}, starts {starts.shape}, "
                               f"slots {slots.shape} do not agree")
        vecs = [self._float32("ssm_scan", n, w) for n, w in (("a_neg", a_neg), ("d_skip", d_skip), ("dt_bias", dt_bias))]
        k = self._kernel("recurrent.cl", "ssm_scan")
        g, l = self._2d(k, nh * P, S)
        self._launch(k, g, l, out, xbc, dt, *vecs, state, starts, slots, positions, S, nh, P, G, N)

    def delta_local_bytes(self, dk, L, Cm=DELTA_CHUNK):
        """Local memory of one delta_rule work-group (recurrent.cl): q, k, W [Cm, dk], A, QK [Cm, Cm],
        the per-token G, beta and norms [4 DELTA_CHUNK], the reduction's [L] (floats)."""
        return 4 * (3 * Cm * dk + 2 * Cm * Cm + 4 * DELTA_CHUNK + L)

    def delta_rule(self, out, qkv, a, b, a_neg, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        Hk, Hv, dk, dv = (int(v) for v in heads[:4])
        # value head h reads key head (h // group) % Hk: group Hv / Hk (grouped, the default) or 1 (tiled)
        group = int(heads[4]) if len(heads) > 4 else Hv // max(Hk, 1)
        T = qkv.shape[0]
        S = slots.shape[0]
        if min(Hk, Hv, dk, dv, group) < 1 or (len(heads) == 4 and Hv % Hk) or \
                tuple(qkv.shape) != (T, 2 * Hk * dk + Hv * dv) or \
                tuple(out.shape[:1]) != (T,) or out.size != T * Hv * dv or tuple(a.shape) != (T, Hv) or \
                tuple(b.shape) != (T, Hv) or tuple(state.shape[1:]) != (Hv, dk, dv) or starts.shape[0] != S + 1 or \
                tuple(a_neg.shape) != (Hv,) or tuple(dt_bias.shape) != (Hv,):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"delta_rule: heads {heads} and the shapes out "
                               f"{out.shape}, qkv {qkv.shape}, a {a.shape}, b {b.shape}, a_neg {a_neg.shape}, "
                               f"dt_bias {dt_bias.shape}, state {state.shape}, starts {starts.shape}, "
                               f"slots {slots.shape} do not agree")
        an = self._float32("delta_rule", "a_neg", a_neg)
        dt = self._float32("delta_rule", "dt_bias", dt_bias)
        k = self._kernel("recurrent.cl", "delta_rule")
        # a work-group per (value head, sequence); its work-items own the columns of S (a power of two
        # for the norms' tree reduction: dv rounded up, within what the device runs)
        L = self._local(k, min(256, 1 << max(0, dv - 1).bit_length()), pow2=True)
        Cm = min(DELTA_CHUNK, T)           # no sequence has more tokens than the step
        need = self.delta_local_bytes(dk, L, Cm)
        if need > self.local_mem:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"delta_rule: key heads of {dk} dims need {need} bytes of "
                               f"local memory (chunks of {Cm} tokens), the OpenCL device has {self.local_mem}")
        lm = self.cl.LocalMemory
        self._launch(k, (L * Hv, S), (L, 1), out, qkv, a, b, an, dt, state, starts, slots, positions,
                     Hk, Hv, dk, dv, group, float(np.float32(dk ** -0.5)), int(bool(stepwise)),
                     lm(4 * Cm * dk), lm(4 * Cm * dk), lm(4 * Cm * dk), lm(4 * Cm * Cm), lm(4 * Cm * Cm),
                     lm(4 * 4 * DELTA_CHUNK), lm(4 * L))

    GATE_ACTS = ("sigmoid", "silu", "none")      # the kernel's mode: the index

    def gate_mul(self, out, x, gate, act):
        n = out.size
        if act not in self.GATE_ACTS:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"gate_mul: act {act!r} (silu, sigmoid or none)")
        if x.size != n or gate.size != n:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"gate_mul shapes out {out.shape}, x {x.shape}, "
                               f"gate {gate.shape} do not agree")
        k = self._kernel("recurrent.cl", "gate_mul")
        L = self._local(k, 128)
        self._launch(k, (n,), (L,), out, x, gate, n, self.GATE_ACTS.index(act))

    # -- MoE ---------------------------------------------------------------------------------------
    def route(self, out_ids, out_w, logits, k, mode, normalize, choice_bias=None, norm_min=0.0, expert_scale=None,
              score="softmax", groups=None, scaling=1.0):
        T, E = logits.shape
        if score not in ("softmax", "sigmoid"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: score {score!r} (softmax or sigmoid)")
        n, keep, top = (1, 1, 1) if groups is None or groups[0] <= 1 else map(int, groups)
        if E % n or keep < 1 or top not in (1, 2):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"route: groups {groups} for {E} experts (n groups of "
                               "E/n experts, keep >= 1, a group scored by its top 1 or 2)")
        if 4 * n > self.local_mem:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"route: {n} expert groups need {4 * n} bytes of local "
                               f"memory, the OpenCL device has {self.local_mem}")
        kk = self._kernel("moe.cl", "route")
        # local memory: each work-item's (token's) n group scores
        L = max(1, min(self._local(kk, 64), self.local_mem // (4 * n)))
        self._launch(kk, (T,), (L,), out_ids, out_w, logits, self._dummy if choice_bias is None else choice_bias.data,
                     self._dummy if expert_scale is None else expert_scale.data, T, E, k, mode == "gated",
                     bool(normalize), choice_bias is not None, float(norm_min), expert_scale is not None,
                     score == "sigmoid", n, keep, top, float(scaling), self.cl.LocalMemory(4 * L * n))

    def sparsemixer(self, out_ids, out_w, logits, jitter):
        T, E = logits.shape
        k = self._kernel("moe.cl", "sparsemixer")
        self._launch(k, (T,), (max(1, min(self._local(k, 64), T)),), out_ids, out_w, logits, T, E,
                     float(np.float32(2 * jitter)))

    def align(self, bufs, ids, num_tokens, num_experts, top_k, tally=None):
        """The plan on the device, cut into blocks of ROWS_PER_ITEM rows (moe.cl align): the grouped
        kernels launch over the bound on the block count, so nothing is read back. The counts stay
        on the device; Plan.fetch_counts copies them for the host paths that need them (the slot pool)."""
        N, E = num_tokens * top_k, num_experts
        offsets = bufs["offsets"][:E + 1]
        order, inverse = bufs["order"][:N], bufs["inverse"][:N]
        k = self._kernel("moe.cl", "align")
        L = self._local(k, min(256, roundup(E, 8)))
        lm = self.cl.LocalMemory
        self._launch(k, (L,), (L,), offsets, order, inverse, bufs["blocks"], bufs["nblocks"],
                     self._dummy if tally is None else tally, tally is not None, ids, N, E, ROWS_PER_ITEM,
                     lm(4 * E), lm(4 * E))

        def fetch():
            return np.diff(self.download(offsets))
        return Plan(offsets, order, inverse, None, num_tokens, top_k, num_experts=E, blocks=bufs["blocks"],
                    nblocks=bufs["nblocks"], block_rows=ROWS_PER_ITEM,
                    max_blocks=max(1, min(N, -(-N // ROWS_PER_ITEM) + E - 1)), fetch_counts=fetch)

    # a MoE layer's experts live in one buffer (upload_experts), found through a table of byte offsets
    PACK_ALIGN = 256                    # bytes between packed expert blobs (Mali's cache line is 64)

    def upload_experts(self, blobs, hidden, inter, fmts):
        """A layer's experts packed into as few buffers as CL_DEVICE_MAX_MEM_ALLOC_SIZE allows (one,
        for any model we know of), each blob at a multiple of PACK_ALIGN bytes; each buffer is filled
        on the host and written once (Oclgrind re-creates a buffer's shadow on every host write)."""
        from colibri_edge.model.modeldir import expert_formats, expert_sections
        for f in set(expert_formats(fmts)):
            self.check_dtype(f)
        size = expert_sections(hidden, inter, fmts)[1]
        stride = roundup(size, self.PACK_ALIGN)
        limit = min(int(self.dev.max_mem_alloc_size), 2**31)
        per = max(1, limit // stride)
        blobs = iter(blobs)
        out, group = [], []

        def flush():
            host = np.zeros(len(group) * stride, np.uint8)
            for j, b in enumerate(group):
                host[j * stride:j * stride + size] = np.asarray(b, np.uint8).reshape(-1)
            buf = self.to_device(host, "uint8")
            out.extend(self.expert_views(self.view(buf, j * stride, (size,), "uint8"), hidden, inter, fmts)
                       for j in range(len(group)))
            group.clear()
        for b in blobs:
            group.append(b)
            if len(group) == per:
                flush()
        if group:
            flush()
        return out

    def _expert_table(self, experts):
        """-> (table [E, 6] uint32 on the device, base buffers (gate, up, down, their scales)) when every
        expert's gate lies in one buffer, every up in one, every down in one (a packed layer, or a single
        FFN), cached per expert list; None otherwise (slots: the per-expert path)."""
        key = id(experts)
        ent = self._tables.get(key)
        if ent is not None and len(ent[0]) == len(experts) and all(a is b for a, b in zip(ent[0], experts)):
            return ent[1]
        if any(f is None for f in experts) or len({f.gate.dtype for f in experts} |
                                                  {f.up.dtype for f in experts}) != 1 or \
                len({f.down.dtype for f in experts}) != 1:
            return None
        bases, offs = [], []
        for m in ("gate", "up", "down"):
            ws = [getattr(f, m) for f in experts]
            b = {w.data.base_data.int_ptr for w in ws}
            sb = {w.scales.base_data.int_ptr for w in ws if w.scales is not None}
            if len(b) != 1 or len(sb) > 1:
                return None
            bases.append(ws[0].data.base_data)
            offs.append([w.data.offset for w in ws])
        for m in ("gate", "up", "down"):
            ws = [getattr(f, m) for f in experts]
            bases.append(ws[0].scales.base_data if ws[0].scales is not None else self._dummy.base_data)
            offs.append([w.scales.offset if w.scales is not None else 0 for w in ws])
        tab = np.array(offs, np.int64).T
        if tab.max() >= 2**32:
            return None
        res = (self.to_device(np.ascontiguousarray(tab, np.uint32), "uint32"), bases)
        if len(self._tables) >= 4096:
            self._tables.pop(next(iter(self._tables)))
        self._tables[key] = (tuple(experts), res)
        return res

    ffn_activations = ("silu", "swiglu_oai", "gelu_tanh")
    ACT_KINDS = {"silu": 0, "swiglu_oai": 1, "gelu_tanh": 2}     # moe.cl ACT_SILU, ACT_SWIGLU_OAI, ACT_GELU_TANH

    def grouped_ffn(self, out, x, experts, plan, scratch, act=None):
        spec = act
        T, H = x.shape
        kind = self.ACT_KINDS.get("silu" if spec is None else spec.kind)
        if kind is None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the opencl backend runs the expert activations "
                               f"{', '.join(self.ffn_activations)}, not {spec.kind!r}")
        alpha, limit = (float(spec.alpha), float(spec.limit)) if spec is not None else (0.0, 0.0)
        # has_bias: bit 0 the gate's bias, bit 1 the up projection's (either may be absent)
        gb_w, ub_w = (None, None) if spec is None else (spec.gate_bias, spec.up_bias)
        has_bias = (gb_w is not None) | (ub_w is not None) << 1
        gbias = self._dummy if gb_w is None else gb_w.data
        ubias = self._dummy if ub_w is None else ub_w.data
        dbias = spec.down_bias if spec is not None and spec.down_bias is not None else None
        topk = plan.top_k
        lda = scratch.shape[1]
        packed = self._expert_table(experts) if plan.active is None and plan.blocks is not None else None
        if packed is not None:
            # every active expert in two launches, sized by the plan's bound on its blocks
            tab, (gb, ub, db, gsb, usb, dsb) = packed
            f0 = experts[0]
            I = f0.gate.shape[0]
            if I > lda:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"scratch has {lda} columns, expert needs {I}")
            gd, dd, xin, act, ld = f0.gate.dtype, f0.down.dtype, x, scratch, lda
            if self._act8(gd):
                xin = self._quantized(x, H, T, H, "x", gd)[0]
                gd += ACT8
            k = self._kernel("moe.cl", "ffn_gate_up_grouped", gd)
            g, l = self._2d(k, I, plan.max_blocks)
            self._launch(k, g, l, scratch, lda, xin, plan.order, plan.blocks, plan.nblocks, tab, gb, ub, gsb, usb,
                         topk, H, I, gbias, ubias, has_bias, kind, alpha, limit)
            if self._act8(dd):
                act, ld = self._quantized(scratch, lda, T * topk, I, "act", dd)
                dd += ACT8
            k = self._kernel("moe.cl", "ffn_down_grouped", dd)
            g, l = self._2d(k, H, plan.max_blocks)
            self._launch(k, g, l, out, act, ld, plan.blocks, plan.nblocks, tab, db, dsb, H, I,
                         self._dummy if dbias is None else dbias.data, dbias is not None)
            return
        # per expert (experts in separate buffers: the slot pool's slots): the host sizes each launch
        if plan.counts is None:
            plan.counts = plan.fetch_counts()
        starts = np.concatenate([[0], np.cumsum(plan.counts)]).astype(np.int64)
        work = [(int(e), int(starts[e]), int(plan.counts[e])) for e in plan.experts_to_run()]
        work = [wk for wk in work if wk[2] > 0]
        if not work:
            return
        parts = min(len(self.queues), len(work))
        xin = x
        gd = experts[work[0][0]].gate.dtype
        if self._act8(gd):               # once, on the main queue: the side queues start after it
            xin = self._quantized(x, H, T, H, "x", gd)[0]
            gd += ACT8

        self._qfill.clear()              # fills queued before the fork: the side queues wait for them anyway

        def run(p, queue):
            for e, row0, n in work[p::parts]:
                ffn = experts[e]
                I = ffn.gate.shape[0]
                if I > lda:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"scratch has {lda} columns, expert needs {I}")
                k = self._kernel("moe.cl", "ffn_gate_up", gd)
                g, l = self._2d(k, I, -(-n // ROWS_PER_ITEM))
                self._launch(k, g, l, scratch, lda, xin, plan.order, row0, n, topk, ffn.gate.data,
                             self._scales(ffn.gate), ffn.up.data, self._scales(ffn.up), H, I,
                             gbias[e] if has_bias & 1 else gbias, ubias[e] if has_bias & 2 else ubias, has_bias, kind,
                             alpha, limit, queue=queue)
                # down: out[row0 + r] = down @ act[row0 + r]   (a matmul over the expert's rows; int8
                # activations: the expert's own rows of the "act" buffer, so parts never share one)
                act = scratch[row0:row0 + n]
                xq = self._quantized(act, lda, n, I, "act", ffn.down.dtype, row0=row0, queue=queue) \
                    if self._act8(ffn.down.dtype) else None
                db = None if dbias is None else Weight(dbias.data[e], "float32", (H,))
                self._matmul(out[row0:row0 + n], H, act, lda, ffn.down, db, n, I, H, queue=queue, xq=xq)

        self.run_parts(parts, run)

    def combine(self, out, y, w, plan):
        T, k = plan.num_tokens, plan.top_k
        H = out.shape[-1]
        kk = self._kernel("moe.cl", "combine")
        g, l = self._2d(kk, H, T)
        self._launch(kk, g, l, out, y, w, plan.inverse, T, k, H)
