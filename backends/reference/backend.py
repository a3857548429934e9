"""The NumPy reference backend: the oracle every other backend is tested against.

Clarity beats speed here: each op is the math of its docstring in base.py, in float32, with
weights widened at use (so the memmap stays lazy: an expert never routed to is never read).
"""
from __future__ import annotations

import math

import numpy as np

from colibri_edge.dtypes import WEIGHT_DTYPES, storage_dtype, widen
from colibri_edge import routing
from ..base import Backend as BackendBase, Plan, Weight


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


class Backend(BackendBase):
    name = "reference"
    weight_dtypes = WEIGHT_DTYPES

    # memory
    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def slot_host_view(self, slots, slot):
        return slots[slot]                 # host memory: a miss is read from storage straight into it

    def to_device(self, host, dtype):
        return np.asarray(host).view(_storage(dtype))

    def view(self, buf, byte_offset, shape, dtype):
        n = int(np.prod(shape)) * _storage(dtype).itemsize
        return buf[byte_offset:byte_offset + n].view(_storage(dtype)).reshape(shape)

    def upload_into(self, dst, host):
        dst[...] = host

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
        K[slots] = k
        V[slots] = v

    def paged_attention(self, out, q, K, V, block_tables, seq_index, positions, block_size, scale, window=0,
                        sinks=None):
        Hq, Hkv = q.shape[1], K.shape[1]
        group = Hq // Hkv
        for t in range(q.shape[0]):
            n = int(positions[t]) + 1
            j = np.arange(max(0, n - window) if window else 0, n)
            slots = block_tables[seq_index[t], j // block_size] * block_size + j % block_size
            k = np.repeat(K[slots], group, axis=1)       # [n, Hq, D]
            v = np.repeat(V[slots], group, axis=1)
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
            c, r = C[slots, 0], R[slots, 0]              # [n, Dc], [n, Dr]
            s = (np.einsum("hd,nd->hn", q[t], c) + np.einsum("hd,nd->hn", q_rope[t], r)) * np.float32(scale)
            out[t] = routing.softmax(s) @ c

    # MoE
    def route(self, out_ids, out_w, logits, k, mode, normalize, choice_bias=None, norm_min=0.0, expert_scale=None,
              score="softmax", groups=None, scaling=1.0):
        ids, w = routing.route(logits, k, mode, normalize, None if choice_bias is None else choice_bias.data, norm_min,
                               None if expert_scale is None else expert_scale.data, score, groups, scaling)
        out_ids[...] = ids
        out_w[...] = w

    def align(self, bufs, ids, num_tokens, num_experts, top_k, tally=None):
        offsets, order, inverse = routing.align(ids, num_experts)
        counts = np.diff(offsets)
        if tally is not None:
            tally += counts.astype(tally.dtype)
        return Plan(offsets, order, inverse, counts, num_tokens, top_k, num_experts=num_experts)

    ffn_activations = ("silu", "swiglu_oai", "gelu_tanh")

    def grouped_ffn(self, out, x, experts, plan, scratch, act=None):
        k = plan.top_k
        for e in plan.experts_to_run():
            a, b = plan.offsets[e], plan.offsets[e + 1]
            tokens = plan.order[a:b] // k
            ffn = experts[e]
            xs = x[tokens]
            g, u = np.empty((b - a, ffn.gate.shape[0]), np.float32), np.empty((b - a, ffn.up.shape[0]), np.float32)
            _rows_matmul(g, xs, _f32(ffn.gate))
            _rows_matmul(u, xs, _f32(ffn.up))
            a_ = activation(g, u, act, e)
            _rows_matmul(out[a:b], a_, _f32(ffn.down))
            if act is not None and act.down_bias is not None:
                out[a:b] += _f32(act.down_bias)[e]

    def combine(self, out, y, w, plan):
        T, k = plan.num_tokens, plan.top_k
        rows = y[plan.inverse[: T * k]].reshape(T, k, -1)
        for j in range(k):                    # in choice order, elementwise: no row depends on another
            out += w[:, j:j + 1] * rows[:, j]
