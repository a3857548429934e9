"""The NumPy reference backend: the oracle every other backend is tested against.

Clarity beats speed here: each op is the math of its docstring in base.py, in float32, with
weights widened at use (so the memmap stays lazy: an expert never routed to is never read).
"""
from __future__ import annotations

import math

import numpy as np

from colibri_edge.model.dtypes import WEIGHT_DTYPES, storage_dtype, widen
from colibri_edge.backends import routing
from ..base import KV_DTYPES, Backend as BackendBase, KVCache, Plan, Weight


def probe(for_auto=False):
    return True, "NumPy " + np.__version__


def _f32(w):
    return widen(w.data, w.dtype, w.scales) if isinstance(w, Weight) else w


def _rows_matmul(out, x, w):
    """out[t] = w @ x[t], one GEMV per row: a row's result never depends on the rows sharing the call
    (BLAS picks GEMV or GEMM, with different summation orders, by the row count), so the reference
    is batch-invariant bit for bit (request core, issue 19)."""
    for t in range(x.shape[0]):
        np.matmul(w, x[t], out=out[t])


def _storage(dtype):
    return np.dtype(np.uint8) if dtype == "uint8" else storage_dtype(dtype)


def swiglu_oai(g, u, act, e):
    """gpt-oss's clamped SwiGLU of expert e (base.Act): (clamp(u + bu) + 1) * g' sigmoid(alpha g'),
    g' = min(g + bg, limit), u clamped to [-limit, limit]."""
    if act.gate_bias is not None:
        g = g + _f32(act.gate_bias)[e]
    if act.up_bias is not None:
        u = u + _f32(act.up_bias)[e]
    lim, alpha = np.float32(act.limit), np.float32(act.alpha)
    g = np.minimum(g, lim)
    u = np.clip(u, -lim, lim)
    return (u + np.float32(1)) * (g / (np.float32(1) + np.exp(-alpha * g)))


def gelu_tanh(g):
    """Gemma's gelu_pytorch_tanh: g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), float32."""
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * g * (np.float32(1) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))


def activation(g, u, act, e):
    """The FFN's activation of expert e (base.Act): SwiGLU when act is None."""
    if act is None:
        return g / (np.float32(1) + np.exp(-g)) * u              # SwiGLU: silu(gate) * up
    if act.kind == "gelu_tanh":
        if act.gate_bias is not None:
            g = g + _f32(act.gate_bias)[e]
        if act.up_bias is not None:
            u = u + _f32(act.up_bias)[e]
        return gelu_tanh(g) * u
    return swiglu_oai(g, u, act, e)


def quantize_q8_0(x, group: int):
    """q8_0 (llama.cpp's block_q8_0 layout) of rows x [..., n] in groups of `group` consecutive values:
    d = max|x| / 127 (float32) stored as float16 d', q = round(x / d') half away from zero, clamped to
    [-127, 127] (0 where d' is 0); -> (q int8 [..., n], d' float16 [..., n / group]). Dividing by the stored
    d' (llama.cpp's quantize_row_q8_0_ref divides by d before rounding it) keeps every value within half a
    step of what reads back, also where d' is a float16 subnormal (max|x| below 127 * 2^-14). A non-finite
    value makes its group's q 0 and its d' non-finite, so the group reads back non-finite, never as a
    number."""
    x = np.asarray(x, np.float32)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    d = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float16)
    dr = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(dr != 0, np.float32(1) / dr, np.float32(0)).astype(np.float32)
        v = g * inv[..., None]
    v = np.where(np.isfinite(v), v, np.float32(0))
    q = np.copysign(np.minimum(np.floor(np.abs(v).astype(np.float64) + 0.5), 127), v).astype(np.int8)
    return q.reshape(x.shape), d


def kv_store(cache, slots, x):
    """cache[slots] = x [T, heads, n]: a float32 buffer as is, a KVCache in its kv_dtype (base.kv_parts)."""
    if not isinstance(cache, KVCache):
        cache[slots] = x
    elif cache.dtype == "float16":
        with np.errstate(over="ignore"):            # past float16's range: inf, as the cast rounds it
            cache.data[slots] = x.astype(np.float16)
    else:
        cache.data[slots], cache.scales[slots] = quantize_q8_0(x, cache.group)


def kv_rows(cache, slots):
    """The rows cache[slots] [n, heads, D] in float32: only those rows, dequantised (x = q * d)."""
    if not isinstance(cache, KVCache):
        return cache[slots]
    if cache.dtype == "float16":
        return cache.data[slots].astype(np.float32)
    q, d = cache.data[slots], cache.scales[slots].astype(np.float32)
    g = cache.group
    with np.errstate(invalid="ignore"):             # a non-finite d: 0 * inf reads back NaN, as it should
        return (q.reshape(*q.shape[:-1], -1, g).astype(np.float32) * d[..., None]).reshape(q.shape)


DELTA_CHUNK = 16        # tokens per chunk of the chunked delta rule (the reference's prefill form)


def softplus(y):
    """torch's softplus (beta 1, threshold 20): log(1 + e^y), y itself past 20."""
    return np.where(y > 20, y, np.log1p(np.exp(np.minimum(y, 20)))).astype(np.float32)


def delta_inputs(qkv, a, b, a_neg, dt_bias, heads):
    """One sequence's tokens [n] -> q, k [n, Hv, dk] (l2-normed, q / sqrt(dk), key heads repeated to
    the value heads), v [n, Hv, dv], g (log decay) and beta [n, Hv]: base.delta_rule's per-token terms."""
    Hk, Hv, dk, dv = heads[:4]
    group = heads[4] if len(heads) > 4 else Hv // Hk
    n = qkv.shape[0]
    q = qkv[:, :Hk * dk].reshape(n, Hk, dk)
    k = qkv[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk)
    v = qkv[:, 2 * Hk * dk:].reshape(n, Hv, dv)

    def l2(y):
        return y / np.sqrt((y * y).sum(-1, keepdims=True) + np.float32(1e-6))
    kh = (np.arange(Hv) // group) % Hk                  # the key head each value head reads
    q = l2(q)[:, kh] * np.float32(dk ** -0.5)
    k = l2(k)[:, kh]
    beta = np.float32(1) / (np.float32(1) + np.exp(-b))
    g = _f32(a_neg)[None, :] * softplus(a + _f32(dt_bias)[None, :])
    return q.astype(np.float32), k.astype(np.float32), v, g.astype(np.float32), beta.astype(np.float32)


def delta_rule_recurrent(q, k, v, g, beta, S):
    """The token-by-token recurrence (the oracle of the chunked form): S [Hv, dk, dv] is updated in
    place; returns out [n, Hv, dv].  S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q."""
    out = np.empty(v.shape, np.float32)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out


def ssm_inputs(xbc, dt, a_neg, dt_bias, heads):
    """Mamba-2's per-token inputs (base.ssm_scan): x [T, nh, P], B and C [T, nh, N] (each head its group's),
    dt = softplus(dt + dt_bias) [T, nh], the log decay dt * a_neg [T, nh]."""
    nh, P, G, N = heads
    T, di = xbc.shape[0], nh * P
    x = xbc[:, :di].reshape(T, nh, P)
    B = np.repeat(xbc[:, di:di + G * N].reshape(T, G, N), nh // G, axis=1)
    C = np.repeat(xbc[:, di + G * N:di + 2 * G * N].reshape(T, G, N), nh // G, axis=1)
    d = softplus(dt + _f32(dt_bias)[None, :])
    return x, B, C, d, (d * _f32(a_neg)[None, :]).astype(np.float32)


def ssm_recurrent(x, B, C, d, la, D, S):
    """Token by token: S = e^la S + d x B^T; y = S C + D x.  S [nh, P, N] in place."""
    y = np.empty(x.shape, np.float32)
    for t in range(x.shape[0]):
        S *= np.exp(la[t])[:, None, None]
        S += (d[t][:, None, None] * B[t][:, None, :]) * x[t][:, :, None]
        y[t] = np.einsum("hpn,hn->hp", S, C[t]) + D[:, None] * x[t]
    return y


def ssm_chunked(x, B, C, d, la, D, S, chunk=DELTA_CHUNK):
    """The chunked (SSD) form, as transformers' mamba2_chunk_scan: within a chunk, with A the cumulative
    log decay (A_l = la_0 + .. + la_l) and L[l, s] = e^(A_l - A_s) (s <= l),
        y_l = sum_{s<=l} L[l, s] (C_l . B_s) d_s x_s + e^(A_l) S C_l + D x_l
        S   = e^(A_last) S + sum_s e^(A_last - A_s) d_s x_s B_s^T
    S [nh, P, N] in place; the last chunk may be shorter (no padding)."""
    n = x.shape[0]
    y = np.empty(x.shape, np.float32)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        c = c1 - c0
        A = np.cumsum(la[c0:c1], axis=0).T                                    # [nh, c]
        low = np.tril(np.ones((c, c), bool))
        L = np.where(low, np.exp(np.where(low, A[:, :, None] - A[:, None, :], 0)), 0).astype(np.float32)
        xd = (x[c0:c1] * d[c0:c1][..., None]).transpose(1, 0, 2)             # [nh, c, P]
        Bh, Ch = B[c0:c1].transpose(1, 0, 2), C[c0:c1].transpose(1, 0, 2)    # [nh, c, N]
        M = (Ch @ Bh.transpose(0, 2, 1)) * L                                  # [nh, c, c]
        yc = M @ xd + np.exp(A)[..., None] * (Ch @ S.transpose(0, 2, 1))      # [nh, c, P]
        y[c0:c1] = yc.transpose(1, 0, 2) + D[None, :, None] * x[c0:c1]
        last = A[:, -1]
        S *= np.exp(last)[:, None, None]
        S += (xd * np.exp(last[:, None] - A)[..., None]).transpose(0, 2, 1) @ Bh
    return y


def delta_rule_chunked(q, k, v, g, beta, S, chunk=DELTA_CHUNK):
    """The chunked form (DeltaNet's WY / UT transform, as transformers' torch_chunk_gated_delta_rule):
    within a chunk of c tokens, with G the cumulative log decay and D[i, j] = e^(G_i - G_j) (i >= j),
        A = strictly_lower((beta k) k^T * D)                         [c, c]
        U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k e^G)        (forward substitution)
        v' = U - W S;  out = (q e^G) S + lower(q k^T * D) v'
        S  = e^(G_last) S + (k e^(G_last - G))^T v'
    every token's update folded into c x c and c x dk products; S [Hv, dk, dv] in place; the last
    chunk may be shorter (no padding)."""
    n = q.shape[0]
    out = np.empty(v.shape, np.float32)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        qh, kh, vh = (x[c0:c1].transpose(1, 0, 2) for x in (q, k, v))        # [Hv, c, d]
        G = np.cumsum(g[c0:c1], axis=0).T                                      # [Hv, c]
        bh = beta[c0:c1].T
        c = c1 - c0
        low = np.tril(np.ones((c, c), bool))
        D = np.where(low, np.exp(np.where(low, G[:, :, None] - G[:, None, :], 0)), 0).astype(np.float32)
        kb = kh * bh[..., None]
        A = np.where(np.tril(np.ones((c, c), bool), -1), (kb @ kh.transpose(0, 2, 1)) * D, 0)
        U, W = vh * bh[..., None], kb * np.exp(G)[..., None]
        for i in range(1, c):                  # (I + A) X = R, row by row
            U[:, i] -= np.einsum("hj,hjd->hd", A[:, i, :i], U[:, :i])
            W[:, i] -= np.einsum("hj,hjd->hd", A[:, i, :i], W[:, :i])
        vn = U - W @ S                                                         # [Hv, c, dv]
        o = (qh * np.exp(G)[..., None]) @ S + ((qh @ kh.transpose(0, 2, 1)) * D) @ vn
        out[c0:c1] = o.transpose(1, 0, 2)
        last = G[:, -1]
        S *= np.exp(last)[:, None, None]
        S += (kh * np.exp(last[:, None] - G)[..., None]).transpose(0, 2, 1) @ vn
    return out


class Backend(BackendBase):
    name = "reference"
    runs_lora = True               # base.Backend.lora_update's NumPy default
    weight_dtypes = WEIGHT_DTYPES
    kv_dtypes = KV_DTYPES

    # memory
    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def alloc_slots(self, num_slots, blob_bytes):
        from ..base import aligned_host
        return aligned_host(num_slots, blob_bytes)   # page-aligned rows: direct reads land in them

    def slot_host_view(self, slots, slot):
        return slots[slot]                 # host memory: a miss is read from storage straight into it

    def to_device(self, host, dtype):
        return np.asarray(host).view(_storage(dtype))

    def view(self, buf, byte_offset, shape, dtype):
        n = int(np.prod(shape)) * _storage(dtype).itemsize
        return buf[byte_offset:byte_offset + n].view(_storage(dtype)).reshape(shape)

    def upload_into(self, dst, host):
        dst[...] = host

    def copy_into(self, dst, src):
        dst[...] = src

    def download(self, buf):
        return np.array(buf)

    def host_view(self, buf):
        return buf

    # dense
    def embed(self, out, table, ids):
        if isinstance(table, Weight):
            out[...] = widen(table.data[ids], table.dtype, None if table.scales is None else table.scales[ids])
        else:
            out[...] = table[ids]

    def matmul(self, out, x, w, bias=None):
        _rows_matmul(out, x, _f32(w))
        if bias is not None:
            out += _f32(bias)

    def rmsnorm(self, out, x, weight, eps):
        var = np.mean(x * x, axis=-1, keepdims=True)
        out[...] = x / np.sqrt(var + np.float32(eps)) * _f32(weight)

    def pos_scale(self, out, x, positions, floor_scale, attn_scale):
        p = positions.astype(np.float32)
        f = np.log1p(np.floor((p + np.float32(1)) / np.float32(floor_scale))) * np.float32(attn_scale) + np.float32(1)
        out[...] = x * f.astype(np.float32).reshape((-1,) + (1,) * (x.ndim - 1))

    def layernorm(self, out, x, weight, bias, eps):
        mean = np.mean(x, axis=-1, keepdims=True)
        c = x - mean
        var = np.mean(c * c, axis=-1, keepdims=True)
        out[...] = c / np.sqrt(var + np.float32(eps)) * _f32(weight) + _f32(bias)

    def rope(self, out, x, positions, theta, inv_freq=None):
        D = x.shape[-1]
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float32) / D))
        ang = positions.astype(np.float32)[:, None] * inv_freq[None, :].astype(np.float32)   # [T, D/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : D // 2].copy(), x[..., D // 2:].copy()
        out[..., : D // 2] = x1 * cos - x2 * sin
        out[..., D // 2:] = x2 * cos + x1 * sin

    def add(self, out, a, b, gate=None):
        if gate is None:
            out[...] = a + b
        else:
            out[...] = a + b / (1.0 + np.exp(-gate))

    def scale(self, out, x, factor, cap=0.0):
        if cap > 0:
            out[...] = np.float32(cap) * np.tanh(x * np.float32(factor) / np.float32(cap))
        else:
            out[...] = x * np.float32(factor)

    # attention
    def kv_write(self, K, V, k, v, slots):
        kv_store(K, slots, k)
        kv_store(V, slots, v)

    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale, window=0,
                        sinks=None):
        Hq, Hkv = q.shape[1], K.shape[1]
        group = Hq // Hkv
        for t in range(q.shape[0]):
            n = int(positions[t]) + 1
            j = np.arange(max(0, n - window) if window > 0 else (n - 1) - (n - 1) % -window if window < 0 else 0, n)
            slots = block_tables[seq_index[t], j // block_size] * block_size + j % block_size
            k = np.repeat(kv_rows(K, slots), group, axis=1)       # [n, Hq, D]
            v = np.repeat(kv_rows(V, slots), group, axis=1)
            s = np.einsum("hd,nhd->hn", q[t], k) * np.float32(scale)
            if sinks is not None:                        # the sink joins the softmax, then is dropped
                s = np.concatenate([s, _f32(sinks)[:, None]], axis=1)
            p = routing.softmax(s)[:, :len(j)]
            out[t] = np.einsum("hn,nhd->hd", p, v)

    def head_matmul(self, out, x, w):
        wf = _f32(w).reshape(w.shape)                    # [G, N, K]
        for g in range(wf.shape[0]):
            _rows_matmul(out[:, g], x[:, g], wf[g])

    def latent_attention(self, out, q, q_rope, C, R, block_tables, seq_index, positions, block_size, scale):
        for t in range(q.shape[0]):
            j = np.arange(int(positions[t]) + 1)
            slots = block_tables[seq_index[t], j // block_size] * block_size + j % block_size
            c, r = kv_rows(C, slots)[:, 0], kv_rows(R, slots)[:, 0]      # [n, Dc], [n, Dr]
            s = (np.einsum("hd,nd->hn", q[t], c) + np.einsum("hd,nd->hn", q_rope[t], r)) * np.float32(scale)
            out[t] = routing.softmax(s) @ c

    # recurrent mixers
    def causal_conv(self, out, x, weight, state, starts, slots, positions, silu=True, bias=None):
        w = _f32(weight)                                   # [C, K]
        bv = np.zeros(w.shape[0], np.float32) if bias is None else _f32(bias)
        K = w.shape[1]
        for s in range(len(slots)):
            a, b = int(starts[s]), int(starts[s + 1])
            if b <= a:
                continue
            prev = np.zeros((K - 1, x.shape[1]), np.float32) if positions[a] == 0 else state[slots[s]].copy()
            u = np.concatenate([prev, x[a:b]])             # positions p0-K+1 .. pl
            for j in range(b - a):
                y = np.einsum("ic,ci->c", u[j:j + K], w) + bv
                out[a + j] = y / (np.float32(1) + np.exp(-y)) if silu else y
            state[slots[s]] = u[u.shape[0] - (K - 1):]

    delta_chunk = DELTA_CHUNK

    def delta_rule(self, out, qkv, a, b, a_neg, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        Hk, Hv, dk, dv = heads[:4]
        for s in range(len(slots)):
            r0, r1 = int(starts[s]), int(starts[s + 1])
            if r1 <= r0:
                continue
            S = np.zeros((Hv, dk, dv), np.float32) if positions[r0] == 0 else state[slots[s]].copy()
            q, k, v, g, beta = delta_inputs(qkv[r0:r1], a[r0:r1], b[r0:r1], a_neg, dt_bias, heads)
            o = delta_rule_recurrent(q, k, v, g, beta, S) if r1 - r0 == 1 or stepwise else \
                delta_rule_chunked(q, k, v, g, beta, S, self.delta_chunk)
            out[r0:r1] = o.reshape(r1 - r0, Hv * dv)
            state[slots[s]] = S

    def ssm_scan(self, out, xbc, dt, a_neg, d_skip, dt_bias, state, starts, slots, positions, heads, stepwise=False):
        nh, P = heads[0], heads[1]
        for s in range(len(slots)):
            r0, r1 = int(starts[s]), int(starts[s + 1])
            if r1 <= r0:
                continue
            S = np.zeros(state.shape[1:], np.float32) if positions[r0] == 0 else state[slots[s]].copy()
            x, B, C, d, la = ssm_inputs(xbc[r0:r1], dt[r0:r1], a_neg, dt_bias, heads)
            y = ssm_recurrent(x, B, C, d, la, _f32(d_skip), S) if r1 - r0 == 1 or stepwise else \
                ssm_chunked(x, B, C, d, la, _f32(d_skip), S, self.delta_chunk)
            out[r0:r1] = y.reshape(r1 - r0, nh * P)
            state[slots[s]] = S

    def gate_mul(self, out, x, gate, act):
        if act == "silu":
            out[...] = x * (gate / (np.float32(1) + np.exp(-gate)))
        elif act == "none":
            out[...] = x * gate
        else:
            out[...] = x / (np.float32(1) + np.exp(-gate))

    # MoE
    def route(self, out_ids, out_w, logits, k, mode, normalize, choice_bias=None, norm_min=0.0, expert_scale=None,
              score="softmax", groups=None, scaling=1.0):
        ids, w = routing.route(logits, k, mode, normalize, None if choice_bias is None else choice_bias.data, norm_min,
                               None if expert_scale is None else expert_scale.data, score, groups, scaling)
        out_ids[...] = ids
        out_w[...] = w

    def sparsemixer(self, out_ids, out_w, logits, jitter):
        ids, w = routing.sparsemixer(logits, jitter)
        out_ids[...] = ids
        out_w[...] = w

    def align(self, bufs, ids, num_tokens, num_experts, top_k, tally=None):
        offsets, order, inverse = routing.align(ids, num_experts)
        counts = np.diff(offsets)
        if tally is not None:
            tally += counts.astype(tally.dtype)
        return Plan(offsets, order, inverse, counts, num_tokens, top_k, num_experts=num_experts)

    ffn_activations = ("silu", "swiglu_oai", "gelu_tanh")

    def grouped_ffn(self, out, x, experts, plan, scratch, act=None, pre=None):
        k = plan.top_k
        for e in plan.experts_to_run():
            a = plan.offsets[e]
            b = a + plan.counts[e] if plan.counts is not None else plan.offsets[e + 1]   # counts may narrow it
            tokens = plan.order[a:b] // k
            ffn = experts[e]
            xs = x[tokens]
            g, u = np.empty((b - a, ffn.gate.shape[0]), np.float32), np.empty((b - a, ffn.up.shape[0]), np.float32)
            _rows_matmul(g, xs, _f32(ffn.gate))
            _rows_matmul(u, xs, _f32(ffn.up))
            if pre is not None:                   # a LoRA update of gate and up (base.grouped_ffn)
                g += pre[a:b, :g.shape[1]]
                u += pre[a:b, g.shape[1]:]
            a_ = activation(g, u, act, e)
            if scratch is not None:               # the activations kept as base.grouped_ffn lays them out
                width = scratch.shape[1]
                scratch.reshape(-1)[a * width:a * width + a_.size] = a_.reshape(-1)
            _rows_matmul(out[a:b], a_, _f32(ffn.down))
            if act is not None and act.down_bias is not None:
                out[a:b] += _f32(act.down_bias)[e]

    def combine(self, out, y, w, plan):
        T, k = plan.num_tokens, plan.top_k
        rows = y[plan.inverse[: T * k]].reshape(T, k, -1)
        for j in range(k):                    # in choice order, elementwise: no row depends on another
            out += w[:, j:j + 1] * rows[:, j]
