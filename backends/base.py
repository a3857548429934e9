"""The backend interface: what the neutral scheduler asks of every backend.

A backend owns memory and the numeric kernels. Every kernel writes into an output buffer it is
given (output first). Buffers are the backend's own array type (NumPy for cpu/reference, CuPy,
pyopencl.array); leading-dimension slices `buf[:T]` are views. Shapes below use
    T tokens in the step, H hidden, D head_dim, Hq/Hkv query/KV heads, E experts, k top_k, V vocab.
There is no per-op fallback: a backend implements all of it, so the suite proves it whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Weight:
    """A weight matrix/vector resident on the backend. `data` is in storage dtype
    (`dtype` is "float32", "float16", "bfloat16" or "int8"); shape is [out, in] for matrices.
    int8 weights carry float32 `scales` [out]: w = data * scales[:, None]."""
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
class Plan:
    """Tokens grouped by expert (see colibri_edge.routing.align for a worked example).
        offsets [E+1]  rows of expert e are sorted positions offsets[e] .. offsets[e+1]-1
        order   [T*k]  sorted position -> assignment a = t*k + j (token t's j-th choice)
        inverse [T*k]  assignment a -> sorted position
        counts  host copy of offsets' differences, so the host can skip idle experts
        active  host ids of the experts grouped_ffn runs (ascending), or None for every expert
                with tokens; the slot pool runs a layer in waves by narrowing it
    """
    offsets: object
    order: object
    inverse: object
    counts: np.ndarray
    num_tokens: int
    top_k: int
    active: object = None

    def experts_to_run(self):
        return self.active if self.active is not None else np.flatnonzero(self.counts)


class Backend:
    name = "abstract"
    weight_dtypes: tuple = ()

    # -- memory ------------------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32):
        """A zero-filled buffer, allocated once (arena, KV cache)."""
        raise NotImplementedError

    def upload(self, host: np.ndarray, dtype: str = "float32", scales=None) -> Weight:
        """Make host weights (storage dtype) resident. CPU backends keep the memmap view.
        scales: float32 [rows] for int8 weights (only backends declaring int8 receive them)."""
        raise NotImplementedError

    def upload_into(self, dst, host: np.ndarray):
        """Copy a small host array (token ids, positions, slots) into an arena buffer."""
        raise NotImplementedError

    def download(self, buf) -> np.ndarray:
        raise NotImplementedError

    def host_view(self, buf) -> np.ndarray:
        """Read-only host access to a small buffer (logits): no copy when the buffer already is host
        memory, which keeps the decode loop allocation-free on CPU backends."""
        return buf if isinstance(buf, np.ndarray) else self.download(buf)

    def synchronize(self):
        pass

    # -- dense -------------------------------------------------------------------------------
    def embed(self, out, table, ids):
        """out[T,H] = table[ids[T]]  (table: Weight [V,H] or a float32 buffer [N,H])."""
        raise NotImplementedError

    def matmul(self, out, x, w: Weight, bias=None):
        """out[T,N] = x[T,K] @ w[N,K]^T (+ bias[N]); a GEMV when T == 1."""
        raise NotImplementedError

    def rmsnorm(self, out, x, weight: Weight, eps: float):
        """out[R,D] = x / sqrt(mean(x^2, -1) + eps) * weight[D]   (rows R may be T*heads)."""
        raise NotImplementedError

    def rope(self, out, x, positions, theta: float):
        """Rotary embedding on x[T,heads,D] at positions[T], rotate-half convention:
        out[..., i] = x_i cos(p f_i) - x_{i+D/2} sin(p f_i),  f_i = theta^(-2i/D), i < D/2
        out[..., i+D/2] = x_{i+D/2} cos(p f_i) + x_i sin(p f_i)."""
        raise NotImplementedError

    def add(self, out, a, b, gate=None):
        """out = a + b, or out = a + sigmoid(gate[T,1]) * b (Qwen2-MoE's gated shared expert)."""
        raise NotImplementedError

    # -- attention ---------------------------------------------------------------------------
    def alloc_kv(self, num_layers, num_slots, kv_heads, head_dim):
        """The paged KV cache: per layer, K and V of [num_slots, Hkv, D] (slot = block*B + offset)."""
        raise NotImplementedError

    def kv_write(self, cache, layer, k, v, slots):
        """cache[layer].K[slots[t]] = k[t]; same for V. k, v: [T,Hkv,D]."""
        raise NotImplementedError

    def paged_attention(self, out, q, cache, layer, block_tables, seq_index, positions, block_size, scale):
        """Causal attention through block tables.
        q, out [T,Hq,D]; token t of sequence s = seq_index[t] at position p = positions[t] attends to
        that sequence's positions 0..p, slot(j) = block_tables[s, j // B] * B + j % B;
        query head h reads KV head h // (Hq/Hkv).  out = softmax(q K^T * scale) V (fp32)."""
        raise NotImplementedError

    # -- MoE ---------------------------------------------------------------------------------
    def route(self, out_ids, out_w, logits, k: int, mode: str, normalize: bool):
        """logits [T,E] (fp32) -> out_ids [T,k] int32, out_w [T,k] fp32.
        topk: p = softmax(logits); the k largest p, ties to the lower expert id; renormalise if asked.
        gated: k == E, every expert with weight p."""
        raise NotImplementedError

    def align(self, plan_bufs, ids, num_tokens: int, num_experts: int, top_k: int) -> Plan:
        """Group the step's assignments by expert (counting sort; colibri_edge.routing.align)."""
        raise NotImplementedError

    def upload_expert(self, blob: np.ndarray, hidden: int, inter: int, dtype: str) -> FFN:
        """One expert's contiguous blob (uint8) -> an FFN resident on the backend."""
        from colibri_edge.modeldir import split_expert_blob_scaled
        return FFN(*(self.upload(m, dtype) if sc is None else self.upload(m, dtype, scales=sc)
                     for m, sc in split_expert_blob_scaled(blob, hidden, inter, dtype)))

    # -- expert slots (colibri_edge.slots): defaults for backends whose memory is host memory --
    def alloc_slots(self, num_slots: int, blob_bytes: int):
        """N expert slots of one blob each, allocated once."""
        return np.zeros((num_slots, blob_bytes), np.uint8)

    def load_slot(self, slots, slot: int, blob: np.ndarray):
        """Copy one expert's blob (from the memmap) into a slot. May run on a prefetch thread: a GPU
        backend must order it with the kernels (e.g. a blocking write on the in-order main queue,
        or an event the next kernel waits on), never let a kernel read a half-written slot."""
        slots[slot] = blob

    def slot_ffn(self, slots, slot: int, hidden: int, inter: int, dtype: str) -> FFN:
        """The FFN whose weights are views into a slot: kernels read the slot, nothing else."""
        return self.upload_expert(slots[slot], hidden, inter, dtype)

    def grouped_ffn(self, out, x, experts, plan: Plan, scratch):
        """For each expert e in plan.experts_to_run(): out[sorted rows of e] = experts[e](x[its tokens]).
        out [T*k,H] in plan order, x [T,H]; scratch [T*k, 2*I] for gate/up activations.
        Each chosen expert's weights are read once per step, however many tokens chose it."""
        raise NotImplementedError

    def combine(self, out, y, w, plan: Plan):
        """out[t] += sum_j w[t,j] * y[inverse[t*k+j]]   (the residual add is fused)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def close(self):
        pass
