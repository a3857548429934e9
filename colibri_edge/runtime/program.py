"""The layer program (DESIGN.md, "One layer, as the scheduler sees it"): a model as typed layers,
each a mixer plus FFN parts, with every weight's shape in a comment.

    h  = rmsnorm(x) * input_norm;   x += mixer(h, state[seq])
    h  = rmsnorm(x) * post_norm;    x += sum of the FFN parts(h)
    x *= scalar                                               (Gemma 4; 1 elsewhere)

Mixers:    Attention        GQA over a paged KV pool (optional q/k/v/o biases, q/k/v norms, a sliding
                            window, per-head sink logits, a rope frequency table, its own head geometry,
                            an output norm)
           LatentAttention  multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over a paged
                            cache of latents and rope keys, computed in the latent space
           GatedDeltaNet    Qwen3.5 / Qwen3-Next linear attention, a fixed-size state per sequence
           ShortConv        LFM2's gated short convolution, its last K-1 inputs per sequence
           Mamba2           Granite 4.0-H's selective state space: the conv's last inputs and S [nh, P, N] per sequence
FFN parts: MoE              route (optionally a router bias, a choice-only bias, a renormalisation
                            floor, per-expert scales, normed inputs), align, the chosen experts' SwiGLU
                            (or gpt-oss's clamped SwiGLU with expert biases, or GeGLU), combine
           SharedExpert     an always-on expert, optionally behind a sigmoid gate (Qwen2-MoE)
           DenseMLP         a plain SwiGLU (or GeGLU) MLP (dense layers)
           ParallelFFN      Gemma 4: a dense GeGLU MLP and the experts side by side, sandwich-normed
Each part's `forward(c, s)` runs its ops on the backend `c.be` over the step's arena views `s`
(runner.StepViews) and adds its output into the residual s.x; `c` is the FFNContext below, the few
things of the step runner an FFN part may use. The runner owns the order, the state and the hooks; a
new kind is a new class here with its weights and its forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import rope
from ..backends.base import FFN, Act, Weight
from ..errors import ColibriError, COLIBRI_ERR_UNAVAILABLE
from ..model.layerplan import geometry, mtp_layers


def lora(s, out, x, w: Weight):
    """out += the LoRA updates of x for the step's requests whose adapter changes w (runtime/lora.py;
    s.lora is None in a step without adapters)."""
    if s.lora is not None:
        s.lora.linear(out, x, w)


def grouped(be, s, out, x, experts, plan, scratch, act=None, dense=False):
    """be.grouped_ffn, or with adapters in the step runtime/lora.py's split of it: the rows of requests
    whose adapter changes these experts run gate/up, the update, the activation, down and its update."""
    if s.lora is None or not s.lora.ffn(be, out, x, experts, plan, scratch, act, dense):
        be.grouped_ffn(out, x, experts, plan, scratch, act)


@dataclass
class Attention:
    """GQA over a paged KV cache. Hq query heads, Hkv KV heads, head_dim D, hidden H."""
    wq: Weight                  # [Hq*D, H]
    wk: Weight                  # [Hkv*D, H]
    wv: Weight                  # [Hkv*D, H]
    wo: Weight                  # [H, Hq*D]
    bq: Weight | None           # [Hq*D]   (attention_bias)
    bk: Weight | None           # [Hkv*D]
    bv: Weight | None           # [Hkv*D]
    bo: Weight | None           # [H]      (attention_out_bias)
    q_norm: Weight | None       # [D] per head, or [Hq*D] over the whole projection
    k_norm: Weight | None       # [D] per head, or [Hkv*D]
    qk_norm: str                # "none" | "per_head" | "full" | "per_head_after_rope" (Hunyuan: rope, then norm)
    rope_theta: float
    scale: float                # softmax scale, D^-0.5
    eps: float                  # of the q/k norms
    pool: int                   # index of its paged pool (block tables, slots)
    block_size: int
    K: object = None            # this layer's cache [blocks*B, Hkv, D], the pool's storage
    V: object = None
    window: int = 0             # attends to the last `window` positions only (0: all)
    sinks: Weight | None = None  # [Hq] float32 sink logits (gpt-oss)
    inv_freq: np.ndarray | None = None  # [D/2] host float32 rope frequencies (None: theta's)
    geo: tuple = ()             # (Hq, Hkv, D): which of the step's views (StepViews.geo) it runs in
    v_norm: Weight | None = None  # [D] ones: v RMS-normed per head without a weight (Gemma 4)
    out_norm: Weight | None = None  # [H]: the output normed before the residual add (sandwich norms)
    wq_gate: Weight | None = None   # [Hq*D, H]: the output times sigmoid(wq_gate @ h) before wo (Qwen3.5)
    rotate: bool = True         # False: no rope (Llama 4's no-rope layers)
    temperature: tuple | None = None   # (floor_scale, attn_scale): q times log1p(floor((p+1)/floor_scale))
                                       # * attn_scale + 1 (Llama 4's no-rope layers)

    def bind(self, storage: dict, layer: int):
        self.K, self.V = storage[(self.pool, layer, "k")], storage[(self.pool, layer, "v")]

    def forward(self, be, s):
        """x += [out_norm] wo @ attention(rope(norm(q)), rope(norm(k)), [v_norm] v), the new k, v
        written to the cache. Keys reused as values (Gemma 4's k_eq_v) are wv = wk, one Weight."""
        g = s.geo[self.geo]
        be.matmuls((g.q2, g.k2, g.v2), s.h, (self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))
        if self.wq_gate is not None:
            be.matmul(g.gate2, s.h, self.wq_gate)
        if s.lora is not None:
            for out, w in ((g.q2, self.wq), (g.k2, self.wk), (g.v2, self.wv), (g.gate2, self.wq_gate)):
                if w is not None:
                    s.lora.linear(out, s.h, w)
        if self.qk_norm == "per_head":
            be.rmsnorm(g.q_heads, g.q_heads, self.q_norm, self.eps)
            be.rmsnorm(g.k_heads, g.k_heads, self.k_norm, self.eps)
        elif self.qk_norm == "full":
            be.rmsnorm(g.q2, g.q2, self.q_norm, self.eps)
            be.rmsnorm(g.k2, g.k2, self.k_norm, self.eps)
        if self.v_norm is not None:
            be.rmsnorm(g.v_heads, g.v_heads, self.v_norm, self.eps)
        if self.rotate:
            be.rope(g.q, g.q, s.pos, self.rope_theta, self.inv_freq)
            be.rope(g.k, g.k, s.pos, self.rope_theta, self.inv_freq)
        if self.qk_norm in ("per_head_after_rope", "l2_after_rope"):   # a rotation keeps the pairs' norm, not
            be.rmsnorm(g.q_heads, g.q_heads, self.q_norm, self.eps)     # the weights' (l2: weights of 1)
            be.rmsnorm(g.k_heads, g.k_heads, self.k_norm, self.eps)
        if self.temperature is not None:
            be.pos_scale(g.q, g.q, s.pos, *self.temperature)
        be.kv_write(self.K, self.V, g.k, g.v, s.slots[self.pool])
        be.paged_attention(g.attn, g.q, self.K, self.V, s.tables[self.pool], s.seq, s.pos, self.block_size,
                           self.scale, self.window, self.sinks)
        if self.wq_gate is not None:
            be.gate_mul(g.attn2, g.attn2, g.gate2, "sigmoid")
        be.matmul(s.o, g.attn2, self.wo, self.bo)
        lora(s, s.o, g.attn2, self.wo)
        if self.out_norm is not None:
            be.rmsnorm(s.o, s.o, self.out_norm, self.eps)
        be.add(s.x, s.x, s.o)


@dataclass
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2's MLA), absorbed: Hq heads, the latent of width r
    (kv_lora_rank), query/key heads of dn unrotated (qk_nope_head_dim) + dr rotated (qk_rope_head_dim)
    dims, values of dv (v_head_dim). The cache holds per position and layer only c = norm(wkv_a @ h)
    [r] and the rotated key k_r = rope(wk_rope @ h) [dr], shared by every head. Head h's key and value
    would be k[h] = [wk_b[h]^T c | k_r] and v[h] = wv_b[h] c; instead of expanding them for every
    cached position at every step, the up-projections move to the query and output sides:
        q_lat[h] = wk_b[h] @ q_nope[h]                      [r]   (q_nope[h] . k_nope[h] = q_lat[h] . c)
        s_j[h]   = scale (q_lat[h] . c_j + q_rope[h] . k_r,j)
        o[h]     = wv_b[h] @ sum_j softmax(s[h])_j c_j         [dv]  (values are linear in c)
        x       += wo @ [o[0] .. o[Hq-1]]
    so a step reads (r + dr) values per cached position, for all heads at once. Prefill runs the
    same path (exact in fp32; the expanded form would save FLOPs there, not bytes)."""
    wq_a: Weight | None         # [rq, H]   the query's low-rank input (q_lora_rank), or None
    q_a_norm: Weight | None     # [rq]
    wq: Weight                  # [Hq*dn, rq or H]
    wq_rope: Weight             # [Hq*dr, rq or H]   (half-split rope layout)
    wkv_a: Weight               # [r, H]
    kv_a_norm: Weight           # [r]
    wk_rope: Weight             # [dr, H]
    wk_b: Weight                # [Hq, r, dn]
    wv_b: Weight                # [Hq, dv, r]
    wo: Weight                  # [H, Hq*dv]
    heads: int
    rope_theta: float
    inv_freq: np.ndarray | None  # [dr/2] host float32 (YaRN's), or None
    rope_gain: float            # YaRN's attention factor squared, on q_rope (only the rotated part carries it)
    scale: float                # (dn + dr)^-0.5, times YaRN's mscale^2
    eps: float                  # of the latents' norms
    pool: int
    block_size: int
    C: object = None            # this layer's cache [blocks*B, 1, r] (the pool's "c")
    R: object = None            # [blocks*B, 1, dr] (the pool's "r")

    def forward(self, be, s):
        m = s.mla
        qin = s.h
        if self.wq_a is not None:
            be.matmul(m.qa, s.h, self.wq_a)
            lora(s, m.qa, s.h, self.wq_a)
            be.rmsnorm(m.qa, m.qa, self.q_a_norm, self.eps)
            qin = m.qa
        be.matmuls((m.q_nope, m.q_rope), qin, (self.wq, self.wq_rope), (None, None))
        be.matmuls((m.c, m.r), s.h, (self.wkv_a, self.wk_rope), (None, None))
        if s.lora is not None:
            for out, x, w in ((m.q_nope, qin, self.wq), (m.q_rope, qin, self.wq_rope), (m.c, s.h, self.wkv_a),
                              (m.r, s.h, self.wk_rope)):
                s.lora.linear(out, x, w)
        be.rmsnorm(m.c, m.c, self.kv_a_norm, self.eps)
        be.rope(m.q_rope3, m.q_rope3, s.pos, self.rope_theta, self.inv_freq)
        be.rope(m.r3, m.r3, s.pos, self.rope_theta, self.inv_freq)
        if self.rope_gain != 1.0:
            be.scale(m.q_rope, m.q_rope, self.rope_gain)
        be.kv_write(self.C, self.R, m.c3, m.r3, s.slots[self.pool])
        be.head_matmul(m.q_lat, m.q_nope3, self.wk_b)
        be.latent_attention(m.o_lat, m.q_lat, m.q_rope3, self.C, self.R, s.tables[self.pool], s.seq, s.pos,
                            self.block_size, self.scale)
        be.head_matmul(m.o_v3, m.o_lat, self.wv_b)
        be.matmul(s.o, m.o_v, self.wo)
        lora(s, s.o, m.o_v, self.wo)
        be.add(s.x, s.x, s.o)

    def bind(self, storage: dict, layer: int):
        self.C, self.R = storage[(self.pool, layer, "c")], storage[(self.pool, layer, "r")]


@dataclass
class GatedDeltaNet:
    """Gated delta-net linear attention (Qwen3.5 / Qwen3-Next): Hk key heads and Hv value heads of dk / dv
    dims, a fixed-size state per sequence (the recurrent pool's slot: the conv's last K-1 inputs and the
    delta rule's S [Hv, dk, dv]) instead of a KV cache:
        qkv = conv_silu(wqkv @ h)                                 q | k | v, a depthwise causal conv of K taps
        S   = e^g S + k (beta (v - S^T k))^T,  o = S^T q         per value head (base.delta_rule: q, k l2-normed,
              g = a_neg softplus(wa @ h + dt_bias), beta = sigmoid(wb @ h))   key heads repeated)
        x  += wo @ (rmsnorm(o) * norm * silu(wz @ h))           the gated RMSNorm, per value head"""
    wqkv: Weight                # [2*Hk*dk + Hv*dv, H]
    conv: Weight                # [2*Hk*dk + Hv*dv, K] float32
    wz: Weight                  # [Hv*dv, H]
    wa: Weight                  # [Hv, H] float32
    wb: Weight                  # [Hv, H] float32
    a_neg: Weight               # [Hv]  -exp(A_log)
    dt_bias: Weight             # [Hv]
    norm: Weight                # [dv]
    wo: Weight                  # [H, Hv*dv]
    heads: tuple                # (Hk, Hv, dk, dv, group): value head h reads key head (h // group) % Hk
    eps: float
    pool: int                   # the recurrent pool's index among the engine's pools (its storage)
    fixed: int                  # ... and among the fixed pools (the step's slots)
    conv_state: object = None   # [slots, K-1, C]
    ssm_state: object = None    # [slots, Hv, dk, dv]

    def bind(self, storage: dict, layer: int):
        self.conv_state, self.ssm_state = storage[(self.pool, layer, "conv")], storage[(self.pool, layer, "ssm")]

    def forward(self, be, s):
        L, slots = s.lin, s.fslots[self.fixed]
        be.matmuls((L.qkv, L.z), s.h, (self.wqkv, self.wz), (None, None))
        be.matmuls((L.a, L.b), s.h, (self.wa, self.wb), (None, None))
        if s.lora is not None:
            for out, w in ((L.qkv, self.wqkv), (L.z, self.wz), (L.a, self.wa), (L.b, self.wb)):
                s.lora.linear(out, s.h, w)
        be.causal_conv(L.conv, L.qkv, self.conv, self.conv_state, s.starts, slots, s.pos)
        be.delta_rule(L.core, L.conv, L.a, L.b, self.a_neg, self.dt_bias, self.ssm_state, s.starts, slots, s.pos,
                      self.heads, s.stepwise)
        be.rmsnorm(L.core_heads, L.core_heads, self.norm, self.eps)
        be.gate_mul(L.core_heads, L.core_heads, L.z_heads, "silu")
        be.matmul(s.o, L.core, self.wo)
        lora(s, s.o, L.core, self.wo)
        be.add(s.x, s.x, s.o)


@dataclass
class ShortConv:
    """LFM2's gated short convolution (Liquid's LFM2 / LFM2-MoE "conv" layers): a depthwise causal conv of
    K taps over the H channels between two multiplicative gates, no activation; its state per sequence is
    the conv's last K-1 inputs (the recurrent pool's slot):
        b | c | x = in_proj @ h                     (converted as three [H, H] matrices)
        x += wo @ (c * conv(b * x))                 conv(u)[t] = sum_{i<K} w[:, i] u[t - K + 1 + i]"""
    wb: Weight                  # [H, H]
    wc: Weight                  # [H, H]
    wx: Weight                  # [H, H]
    conv: Weight                # [H, K] float32
    wo: Weight                  # [H, H]
    pool: int                   # the recurrent pool's index among the engine's pools (its storage)
    fixed: int                  # ... and among the fixed pools (the step's slots)
    conv_state: object = None   # [slots, K-1, H]

    def bind(self, storage: dict, layer: int):
        self.conv_state = storage[(self.pool, layer, "conv")]

    def forward(self, be, s):
        v, slots = s.sc, s.fslots[self.fixed]
        be.matmuls((v.b, v.c, v.x), s.h, (self.wb, self.wc, self.wx), (None, None, None))
        if s.lora is not None:
            for out, w in ((v.b, self.wb), (v.c, self.wc), (v.x, self.wx)):
                s.lora.linear(out, s.h, w)
        be.gate_mul(v.b, v.b, v.x, "none")                      # b * x
        be.causal_conv(v.conv, v.b, self.conv, self.conv_state, s.starts, slots, s.pos, silu=False)
        be.gate_mul(v.conv, v.conv, v.c, "none")                # c * conv(b * x)
        be.matmul(s.o, v.conv, self.wo)
        lora(s, s.o, v.conv, self.wo)
        be.add(s.x, s.x, s.o)


@dataclass
class Mamba2:
    """Mamba-2's selective state space (Granite 4.0-H's "mamba" layers; modeling_granitemoehybrid's
    GraniteMoeHybridMambaLayer), nh heads of P dims, B and C of N in one group; its state per sequence is
    the conv's last K-1 inputs and S [nh, P, N] (the recurrent pool's slot):
        z | xbc | dt = in_proj @ h                            (converted as three matrices)
        x | B | C = silu(conv(xbc) + conv_bias)               a depthwise causal conv of K taps
        S = e^(d a_neg) S + d x B^T,  y = S C + skip x        per head, d = softplus(dt + dt_bias) (base.ssm_scan)
        x += wo @ (rmsnorm(y * silu(z)) * norm)               the gate before the norm (norm_before_gate False)"""
    wz: Weight                  # [nh*P, H]
    wxbc: Weight                # [nh*P + 2*G*N, H]
    wdt: Weight                 # [nh, H] float32
    conv: Weight                # [nh*P + 2*G*N, K] float32
    conv_bias: Weight           # [nh*P + 2*G*N]
    a_neg: Weight               # [nh]  -exp(A_log)
    d_skip: Weight              # [nh]  D
    dt_bias: Weight             # [nh]
    norm: Weight                # [nh*P]
    wo: Weight                  # [H, nh*P]
    heads: tuple                # (nh, P, G, N)
    eps: float
    pool: int                   # the recurrent pool's index among the engine's pools (its storage)
    fixed: int                  # ... and among the fixed pools (the step's slots)
    conv_state: object = None   # [slots, K-1, nh*P + 2*G*N]
    ssm_state: object = None    # [slots, nh, P, N]

    def bind(self, storage: dict, layer: int):
        self.conv_state, self.ssm_state = storage[(self.pool, layer, "conv")], storage[(self.pool, layer, "ssm")]

    def forward(self, be, s):
        v, slots = s.ssm, s.fslots[self.fixed]
        be.matmuls((v.z, v.xbc, v.dt), s.h, (self.wz, self.wxbc, self.wdt), (None, None, None))
        if s.lora is not None:
            for out, w in ((v.z, self.wz), (v.xbc, self.wxbc), (v.dt, self.wdt)):
                s.lora.linear(out, s.h, w)
        be.causal_conv(v.conv, v.xbc, self.conv, self.conv_state, s.starts, slots, s.pos, silu=True,
                       bias=self.conv_bias)
        be.ssm_scan(v.y, v.conv, v.dt, self.a_neg, self.d_skip, self.dt_bias, self.ssm_state, s.starts, slots,
                    s.pos, self.heads, s.stepwise)
        be.gate_mul(v.y, v.y, v.z, "silu")
        be.rmsnorm(v.y, v.y, self.norm, self.eps)
        be.matmul(s.o, v.y, self.wo)
        lora(s, s.o, v.y, self.wo)
        be.add(s.x, s.x, s.o)


@dataclass
class FFNContext:
    """What an FFN part's forward may use of the step runner (built once by runner.Runner):
    be           the backend
    plan_bufs    the arena's plan buffers, which align fills for a routed layer
    dense_plan   dense_plan(s): the cached plan sending every token of the step to expert 0 (shared
                 experts and dense MLPs run through grouped_ffn with it)
    slot_pool    the expert slot pool (slots.SlotPool), or None when every expert is resident
    hooks        the runner's RoutingHook list (the same list object: hooks added later are seen)
    on_route     on_route(moe, s): shows every hook this layer's routing; returns the prefetch
                 prediction when a hook asked for one"""
    be: object
    plan_bufs: dict
    dense_plan: Callable
    slot_pool: object
    hooks: list
    on_route: Callable


@dataclass
class MoE:
    """Routed experts: E experts of SwiGLU [I,H] / [H,I], k chosen per token."""
    layer: int                  # layer id
    index: int                  # among the MoE layers (its row of the expert counts)
    router: Weight              # [E, H] float32
    experts: list               # E FFNs, or None for experts that live in the slot pool
    top_k: int                  # the routing fan (E in gated mode)
    mode: str                   # "topk" | "gated" | "sparsemixer" (top-2)
    normalize: bool             # renormalise the chosen k weights
    hidden: int
    inter: int
    formats: tuple              # the experts' (gate, up, down) weight formats
    choice_bias: Weight | None = None   # [E] float32 added to p for the choice only (ERNIE-4.5)
    norm_min: float = 0.0       # floor of the renormalisation's denominator (ERNIE's moe_norm_min)
    tally: object = None        # int32 [E] on the backend: tokens routed to each expert
    next_layer: int = -1        # the next MoE layer (prefetch prediction), -1 for the last
    next_router: Weight | None = None
    next_choice_bias: Weight | None = None
    router_bias: Weight | None = None   # [E] float32 added to the router logits (gpt-oss)
    act: Act | None = None      # the experts' activation and biases when not plain SwiGLU
    next_router_bias: Weight | None = None
    expert_scale: Weight | None = None  # [E] float32 on the chosen weights (Gemma 4's per_expert_scale)
    norms: tuple | None = None  # Gemma 4: (router_norm, experts_norm, out_norm) [H] each, eps (below)
    eps: float = 0.0
    score: str = "softmax"      # "sigmoid": p = sigmoid(logits) per expert (DeepSeek-V3, GLM)
    groups: tuple | None = None  # (n_group, topk_group, group_top): group-limited top-k (DeepSeek, GLM)
    scaling: float = 1.0        # routed_scaling_factor on the routed weights
    jitter: float = 0.0         # sparsemixer's router_jitter (mode "sparsemixer": Phi-3.5-MoE)
    scale_input: bool = False   # the experts see h * w (top-1), their outputs summed with weight 1 (Llama 4)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def route(self, be, ids, w, logits, choice_bias):
        """ids, w of a step's router logits (the prefetch prediction reads the next layer's with its bias)."""
        if self.mode == "sparsemixer":
            be.sparsemixer(ids, w, logits, self.jitter)
        else:
            be.route(ids, w, logits, self.top_k, self.mode, self.normalize, choice_bias, self.norm_min,
                     self.expert_scale, self.score, self.groups, self.scaling)

    def forward(self, c: FFNContext, s):
        """x += sum_j w[t,j] * expert_{ids[t,j]}(h[t]); with norms (Gemma 4, inside ParallelFFN):
        h = out_norm(sum_j w[t,j] expert_{ids[t,j]}(experts_norm(x))), routed on router_norm(x)."""
        be = c.be
        if self.norms is not None:
            be.rmsnorm(s.h, s.x, self.norms[0], self.eps)
        be.matmul(s.router, s.h, self.router, self.router_bias)
        lora(s, s.router, s.h, self.router)
        self.route(be, s.ids, s.w, s.router, self.choice_bias)
        plan = be.align(c.plan_bufs, s.ids, s.T, len(self.experts), self.top_k, self.tally)
        prefetch = c.on_route(self, s) if c.hooks else None
        if self.norms is not None:
            be.rmsnorm(s.h, s.x, self.norms[1], self.eps)
        if self.scale_input:                    # h = w * h, the top-1 weight on the experts' input: o = 0 + w h
            be.scale(s.o, s.o, 0.0)             # through the one-expert plan, copied back (the slot pool reads h)
            be.combine(s.o, s.h, s.w, c.dense_plan(s))
            be.scale(s.h, s.o, 1.0)
        if c.slot_pool is None:
            grouped(be, s, s.y, s.h, self.experts, plan, s.scratch, self.act)
        else:
            c.slot_pool.run_layer(self, plan, s, prefetch)
        if self.norms is None:
            be.combine(s.x, s.y, s.ones if self.scale_input else s.w, plan)
        else:                                   # h is free once the experts have read it
            be.scale(s.h, s.h, 0.0)
            be.combine(s.h, s.y, s.w, plan)
            be.rmsnorm(s.h, s.h, self.norms[2], self.eps)


@dataclass
class SharedExpert:
    """An always-on expert beside the routed ones: x += sigmoid(gate @ h) * ffn(h)."""
    ffn: FFN                    # gate/up [Is,H], down [H,Is]
    gate: Weight | None         # [1, H] float32, or None (ungated)
    _one: list = field(default=None, repr=False)

    def __post_init__(self):
        self._one = [self.ffn]  # grouped_ffn takes an expert list; built once, not per step

    def forward(self, c: FFNContext, s):
        be = c.be
        grouped(be, s, s.o, s.h, self._one, c.dense_plan(s), s.scratch_dense, dense=True)
        if self.gate is not None:
            be.matmul(s.gate_logit, s.h, self.gate)
            lora(s, s.gate_logit, s.h, self.gate)
            be.add(s.x, s.x, s.o, gate=s.gate_logit)
        else:
            be.add(s.x, s.x, s.o)


@dataclass
class DenseMLP:
    """A plain SwiGLU MLP: x += down @ (silu(gate @ h) * (up @ h)) (or GeGLU, act)."""
    ffn: FFN                    # gate/up [I,H], down [H,I]
    act: Act | None = None
    _one: list = field(default=None, repr=False)

    def __post_init__(self):
        self._one = [self.ffn]

    def forward(self, c: FFNContext, s):
        be = c.be
        grouped(be, s, s.y_dense, s.h, self._one, c.dense_plan(s), s.scratch_dense, self.act, dense=True)
        be.add(s.x, s.x, s.y_dense)


@dataclass
class ParallelFFN:
    """Gemma 4's FFN stage, sandwich-normed: a dense GeGLU MLP on h = pre_norm(x) (the layer's
    post_norm) and, when the layer has experts, the routed experts beside it on the same residual:
        m = mlp_out_norm(mlp(h));  e = the MoE part's normed output (MoE.norms)
        x += out_norm(m + e)
    Without experts (a dense Gemma layer) m = mlp(h)."""
    mlp: FFN                    # gate/up [I,H], down [H,I]
    act: Act | None             # GeGLU (None: SwiGLU)
    out_norm: Weight            # [H]
    eps: float
    moe: MoE | None = None
    mlp_out_norm: Weight | None = None  # [H], with experts
    _one: list = field(default=None, repr=False)

    def __post_init__(self):
        self._one = [self.mlp]

    def forward(self, c: FFNContext, s):
        be = c.be
        grouped(be, s, s.y_dense, s.h, self._one, c.dense_plan(s), s.scratch_dense, self.act, dense=True)
        if self.moe is None:
            be.rmsnorm(s.o, s.y_dense, self.out_norm, self.eps)
        else:
            be.rmsnorm(s.o, s.y_dense, self.mlp_out_norm, self.eps)
            self.moe.forward(c, s)              # its output in s.h
            be.add(s.o, s.o, s.h)
            be.rmsnorm(s.o, s.o, self.out_norm, self.eps)
        be.add(s.x, s.x, s.o)


@dataclass
class Layer:
    index: int
    input_norm: Weight          # [H]
    mixer: object               # Attention | LatentAttention | GatedDeltaNet | ShortConv | Mamba2
    post_norm: Weight           # [H]
    ffns: tuple                 # FFN parts, run in order, each adding into the residual
    scalar: float = 1.0         # x *= scalar after the layer (Gemma 4's layer_scalar)
    input_norm_bias: Weight | None = None   # [H]: the norms are LayerNorms with these biases (Phi-3.5-MoE)
    post_norm_bias: Weight | None = None    # [H]


@dataclass
class MTPHead:
    """A multi-token-prediction head (DeepSeek-V3 report, section 2.2; Qwen3.5's mtp.*; llama.cpp's nextn):
    from the model's final-normed hidden h_i at position i and the next token t_{i+1}, the logits of
    t_{i+2}:
        x   = e_proj @ rmsnorm(embed[t_{i+1}]) * enorm + h_proj @ rmsnorm(h_i) * hnorm   (= eh_proj [e; h])
        x   = layer(x)                          (a decoder layer at position i, its KV beside the model's)
        h'  = rmsnorm(x) * norm;   logits = head @ h'
    Chained drafts feed h' back as the next position's h (llama.cpp's chaining)."""
    enorm: Weight               # [H]
    hnorm: Weight               # [H]
    e_proj: Weight              # [H, H]  eh_proj's columns over the embedding
    h_proj: Weight              # [H, H]  ... over the hidden state
    layer: object               # Layer (layer_id num_hidden_layers)
    norm: Weight                # [H]  shared_head.norm
    head: Weight                # [V, H] the model's lm_head unless the head has its own
    embed: Weight               # [V, H] the model's embeddings unless the head has its own


@dataclass
class Program:
    embed: Weight               # [V, H]
    layers: list
    final_norm: Weight          # [H]
    lm_head: Weight             # [V, H] (the embedding itself when tied)
    eps: float                  # rms_norm_eps
    embed_scale: float = 1.0    # x = embed_scale * embed[tok] (Gemma: sqrt(H))
    softcap: float = 0.0        # logits = cap tanh(logits / cap) (Gemma's final_logit_softcapping; 0: none)
    named: dict = field(default_factory=dict)   # model tensor name -> its Weight (run-time adapters find theirs)
    mtp: MTPHead | None = None  # the multi-token-prediction head, when built
    ffn_lists: dict = field(default_factory=dict)   # "layers.N.experts" / ".shared" / ".mlp" -> the FFN list
                                                    # grouped_ffn takes (routed experts; a shared or dense MLP)
    final_norm_bias: Weight | None = None   # [H]: the final norm a LayerNorm (Phi-3.5-MoE)
    lm_head_bias: Weight | None = None      # [V]

    @property
    def moe(self) -> list:
        return [m for l in self.layers for p in l.ffns
                for m in ((p,) if isinstance(p, MoE) else (p.moe,) if isinstance(p, ParallelFFN) and p.moe else ())]


def norm(be, out, x, weight: Weight, bias: Weight | None, eps: float):
    """out = rmsnorm(x) * weight, or with a bias LayerNorm(x) * weight + bias (norm_type "layernorm")."""
    if bias is None:
        be.rmsnorm(out, x, weight, eps)
    else:
        be.layernorm(out, x, weight, bias, eps)


def build(model, be, pools, resident: bool, fixed_pools=(), mtp: bool = False, max_seq_len: int = 0) -> Program:
    """The program of a model directory with its weights made resident on backend `be`.
    pools: the engine's paged pools (one per attention group); resident: every routed expert on the
    backend (False: the slot pool holds them); fixed_pools: its fixed-size state pools (recurrent
    layers), after the paged ones in the engine's pool order; max_seq_len: the engine's context
    (longrope runs its long factors past the original context)."""
    cfg = model.config

    named = {}

    def w(name):
        if not model.has(name):
            return None
        if name not in named:
            sc = model.raw_tensor(name + ".scales") if model.has(name + ".scales") else None
            named[name] = be.upload(model.raw_tensor(name), model.tensor_dtype(name), scales=sc,
                                    shape=model.tensor_shape(name))
        return named[name]

    def ffn(prefix):
        return FFN(w(prefix + ".gate"), w(prefix + ".up"), w(prefix + ".down"))

    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    eps = cfg["rms_norm_eps"]
    k = max(cfg["experts_per_layer"], 1) if cfg["router_mode"] == "gated" else cfg["top_k"]
    pool_of = {l: i for i, p in enumerate(pools) for l in p.layers}
    act_kind, ffn_kind = cfg.get("expert_act", "silu"), cfg.get("ffn_act", "silu")
    for kind in {act_kind, ffn_kind}:
        if kind not in be.ffn_activations:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE,
                               f"the {cfg['model_type']} FFN activation {kind!r} is not implemented on the {be.name} "
                               f"backend (it runs {', '.join(be.ffn_activations)}); open the engine with "
                               "backend='cpu' (or 'reference')")
    sandwich = cfg.get("norm_layout") == "sandwich"
    ffn_act = None if ffn_kind == "silu" else Act(ffn_kind)
    tables, ones = {}, {}

    def rope_of(spec, hd):
        """The layer's rope: (theta, table or None): YaRN's, or proportional rope's (the first
        rope_partial of the D/2 frequencies theta^(-2i/D), the rest 0: those dims do not rotate)."""
        theta = spec.get("rope_theta", cfg["rope_theta"])
        key = (theta, hd, spec.get("rope_partial"))
        if key not in tables:                   # one array per kind: device backends keep copies by identity
            if cfg.get("rope_dim") and cfg["rope_dim"] < hd:
                # partial rotary (Qwen3.5): the first rope_dim dims rotate at theta^(-2i/rope_dim); the
                # converter moved them to the pairs (i, i + D/2), i < rope_dim/2; the other pairs stay put
                f = np.zeros(hd // 2, np.float32)
                r = cfg["rope_dim"]
                f[:r // 2] = 1.0 / (theta ** (np.arange(0, r, 2, dtype=np.float64) / r))
                tables[key] = (f, 1.0)
            elif spec.get("rope_partial") is not None:
                f, _ = rope.inv_freq(theta, hd)
                f[int(spec["rope_partial"] * hd // 2):] = 0.0
                tables[key] = (f, 1.0)
            elif cfg.get("rope_scaling"):
                rs = cfg["rope_scaling"]
                tables[key] = rope.inv_freq(theta, hd, rs, long=max_seq_len > rs.get("original_max_position_embeddings",
                                                                                   max_seq_len))
            else:
                tables[key] = (None, 1.0)
        return theta, *tables[key]

    def ones_of(n):
        if n not in ones:
            ones[n] = be.upload(np.ones(n, np.float32))
        return ones[n]

    la = cfg.get("latent_attention")
    if la:          # softmax scale: 1/sqrt(dn + dr), times YaRN's mscale(factor, mscale_all_dim)^2
        latent_scale = (la["qk_nope_head_dim"] + la["qk_rope_head_dim"]) ** -0.5 * rope.mscale_all_dim(
            cfg.get("rope_scaling")) ** 2
    lin = cfg.get("linear_attention")
    lin_layers = set(fixed_pools[0].layers) if lin and fixed_pools else set()
    conv_layers = set(fixed_pools[0].layers) if cfg.get("short_conv") and fixed_pools else set()
    mamba = cfg.get("mamba")
    mamba_layers = set(fixed_pools[0].layers) if mamba and fixed_pools else set()
    lin_heads = tuple(lin[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")) \
        if lin else ()
    if lin:       # value head h reads key head (h // group) % Hk: grouped (HF) group = Hv / Hk, tiled (GGUF) 1
        lin_heads += (1 if lin.get("value_head_order") == "tiled" else lin_heads[1] // lin_heads[0],)
    groups = cfg.get("router_groups")
    groups = (groups["n_group"], groups["topk_group"], groups["group_top"]) if groups else None
    def make_layer(spec, moe_index):
        """The Layer of a layer spec, and the next MoE index."""
        i, p = spec["layer_id"], f"layers.{spec['layer_id']}."
        nh, nkv, hd = geometry(cfg, spec)
        theta, inv_freq, attn_factor = rope_of(spec, hd)
        if conv_layers and i in conv_layers:
            mixer = ShortConv(w(p + "conv.wb"), w(p + "conv.wc"), w(p + "conv.wx"), w(p + "conv.w"), w(p + "conv.wo"),
                              len(pools), 0)
        elif mamba_layers and i in mamba_layers:
            mixer = Mamba2(*(w(p + "ssm." + n) for n in ("wz", "wxbc", "wdt", "conv", "conv_bias", "a_neg", "d",
                                                          "dt_bias", "norm", "wo")),
                           tuple(mamba[k] for k in ("num_heads", "head_dim", "n_groups", "state_size")),
                           mamba.get("norm_eps", eps),
                           len(pools), 0)
        elif lin_layers and i in lin_layers:
            mixer = GatedDeltaNet(w(p + "lin.wqkv"), w(p + "lin.conv"), w(p + "lin.wz"), w(p + "lin.wa"),
                                  w(p + "lin.wb"), w(p + "lin.a_neg"), w(p + "lin.dt_bias"), w(p + "lin.norm"),
                                  w(p + "lin.wo"), lin_heads, eps, len(pools), 0)
        elif la:
            mixer = LatentAttention(w(p + "mla.wq_a"), w(p + "mla.q_a_norm"), w(p + "mla.wq"), w(p + "mla.wq_rope"),
                                    w(p + "mla.wkv_a"), w(p + "mla.kv_a_norm"), w(p + "mla.wk_rope"),
                                    w(p + "mla.wk_b"), w(p + "mla.wv_b"), w(p + "attn.wo"), nh, theta, inv_freq,
                                    attn_factor ** 2, latent_scale, la["norm_eps"], pool_of[i],
                                    pools[pool_of[i]].block_size)
        else:
            wk = w(p + "attn.wk")
            nope = bool(spec.get("nope"))
            qkn = "none" if nope else cfg["qk_norm"]
            qn, kn = (ones_of(hd), ones_of(hd)) if qkn == "l2_after_rope" else (w(p + "attn.q_norm"), w(p + "attn.k_norm"))
            at = cfg.get("attn_temperature")
            chunked = (cfg.get("layer_types") or [""] * (i + 1))[i:i + 1] == ["chunked_attention"]
            mixer = Attention(w(p + "attn.wq"), wk, wk if spec.get("k_eq_v") else w(p + "attn.wv"), w(p + "attn.wo"),
                              w(p + "attn.bq"), w(p + "attn.bk"),
                              w(p + "attn.bk") if spec.get("k_eq_v") else w(p + "attn.bv"), w(p + "attn.bo"),
                              qn, kn, qkn, theta,
                              cfg.get("attention_scale", hd ** -0.5) * attn_factor ** 2, eps, pool_of[i],
                              pools[pool_of[i]].block_size,
                              window=-cfg["attention_chunk"] if chunked else pools[pool_of[i]].window,
                              sinks=w(p + "attn.sinks"),
                              inv_freq=inv_freq, geo=(nh, nkv, hd), v_norm=ones_of(hd) if cfg.get("v_norm") else None,
                              out_norm=w(p + "attn.out_norm"), wq_gate=w(p + "attn.wq_gate"), rotate=not nope,
                              temperature=(float(at["floor_scale"]), float(at["attn_scale"])) if nope and at else None)
        moe = None
        if spec["type"] != "dense":
            fm = model.layer_formats[i]
            E = spec["moe_num_experts"]
            experts = be.upload_experts((model.expert_blob(i, j) for j in range(E)), H, I, fm) if resident \
                else [None] * E
            act = None if act_kind == "silu" else \
                Act(act_kind, cfg.get("swiglu_alpha", 0.0), cfg.get("swiglu_limit", 0.0), w(p + "experts.gate_bias"),
                    w(p + "experts.up_bias"), w(p + "experts.down_bias"))
            norms = (w(p + "router_norm"), w(p + "experts_norm"), w(p + "experts_out_norm")) \
                if spec["type"] == "moe_dense" else None
            moe = MoE(i, moe_index, w(p + "router"), experts, k, cfg["router_mode"], cfg["norm_topk_prob"],
                      H, I, fm, w(p + "router_choice_bias"), cfg.get("router_norm_min", 0.0),
                      router_bias=w(p + "router_bias"), act=act, expert_scale=w(p + "expert_scale"), norms=norms,
                      eps=eps, score=cfg.get("router_score", "softmax"), groups=groups,
                      scaling=float(cfg.get("routed_scaling_factor", 1.0)), jitter=float(cfg.get("router_jitter", 0.0)),
                      scale_input=bool(cfg.get("router_input_scale")))
            moe_index += 1
        if sandwich:
            parts = (ParallelFFN(ffn(p + "mlp"), ffn_act, w(p + "ffn_out_norm"), eps, moe,
                                 w(p + "mlp.out_norm")),)
        elif spec["type"] == "dense":
            parts = (DenseMLP(ffn(p + "mlp"), ffn_act),)
        else:
            parts = (moe,)
            if spec["type"] == "moe_shared":
                shared = SharedExpert(ffn(p + "shared"), w(p + "shared.gate_logit"))
                # with router_input_scale the experts overwrite h: the shared expert reads it first
                parts = (shared, moe) if cfg.get("router_input_scale") else parts + (shared,)
        scalar = float(np.asarray(model.raw_tensor(p + "scalar"), np.float32).reshape(-1)[0]) \
            if model.has(p + "scalar") else 1.0
        return Layer(i, w(p + "input_norm"), mixer, w(p + "post_attention_norm"), parts, scalar,
                     w(p + "input_norm_bias"), w(p + "post_attention_norm_bias")), moe_index
    layers, moe_index = [], 0
    for spec in cfg["layers"]:
        layer, moe_index = make_layer(spec, moe_index)
        layers.append(layer)
    embed = w("embed_tokens")
    prog = Program(embed, layers, w("norm"), embed if cfg["tie_word_embeddings"] else w("lm_head"), eps,
                   float(cfg.get("embed_scale", 1.0)), float(cfg.get("final_logit_softcap", 0.0)), named,
                   final_norm_bias=w("norm_bias"), lm_head_bias=w("lm_head_bias"))
    for layer in layers:
        p = f"layers.{layer.index}."
        for part in layer.ffns:
            if isinstance(part, SharedExpert):
                prog.ffn_lists[p + "shared"] = part._one
            elif isinstance(part, (DenseMLP, ParallelFFN)):
                prog.ffn_lists[p + "mlp"] = part._one
            m = part if isinstance(part, MoE) else getattr(part, "moe", None)
            if m is not None:
                prog.ffn_lists[p + "experts"] = m.experts
    if mtp and cfg.get("mtp"):
        layer, _ = make_layer(mtp_layers(cfg)[0], moe_index)
        own = cfg["mtp"]
        prog.mtp = MTPHead(w("mtp.enorm"), w("mtp.hnorm"), w("mtp.e_proj"), w("mtp.h_proj"), layer, w("mtp.norm"),
                           w("mtp.head") if own.get("own_head") else prog.lm_head,
                           w("mtp.embed") if own.get("own_embed") else embed)
    moe = prog.moe
    for a, b in zip(moe, moe[1:]):
        a.next_layer, a.next_router, a.next_choice_bias = b.layer, b.router, b.choice_bias
        a.next_router_bias = b.router_bias
    return prog
