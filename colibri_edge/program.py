"""The layer program (DESIGN.md, "One layer, as the scheduler sees it"): a model as typed layers,
each a mixer plus FFN parts, with every weight's shape in a comment.

    h  = rmsnorm(x) * input_norm;   x += mixer(h, state[seq])
    h  = rmsnorm(x) * post_norm;    x += sum of the FFN parts(h)

Mixers:    Attention        GQA over a paged KV pool (optional q/k/v/o biases, q/k norms, a sliding
                            window, per-head sink logits, a rope frequency table)
FFN parts: MoE              route (optionally a router bias, a choice-only bias and a renormalisation
                            floor), align, the chosen experts' SwiGLU (or gpt-oss's clamped SwiGLU
                            with expert biases), combine
           SharedExpert     an always-on expert, optionally behind a sigmoid gate (Qwen2-MoE)
           DenseMLP         a plain SwiGLU MLP (dense layers)
Each part's `forward(r, s)` runs its ops on the backend `r.be` over the step's arena views `s`
(scheduler.StepViews) and adds its output into the residual s.x. The scheduler owns the order,
the state and the hooks; a new kind is a new class here with its weights and its forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import rope
from .backends.base import FFN, Act, Weight
from .errors import ColibriError, COLIBRI_ERR_UNAVAILABLE


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
    qk_norm: str                # "none" | "per_head" | "full"
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

    def forward(self, be, s):
        """x += wo @ attention(rope(norm(q)), rope(norm(k)), v), the new k, v written to the cache."""
        be.matmuls((s.q2, s.k2, s.v2), s.h, (self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))
        if self.qk_norm == "per_head":
            be.rmsnorm(s.q_heads, s.q_heads, self.q_norm, self.eps)
            be.rmsnorm(s.k_heads, s.k_heads, self.k_norm, self.eps)
        elif self.qk_norm == "full":
            be.rmsnorm(s.q2, s.q2, self.q_norm, self.eps)
            be.rmsnorm(s.k2, s.k2, self.k_norm, self.eps)
        be.rope(s.q, s.q, s.pos, self.rope_theta, self.inv_freq)
        be.rope(s.k, s.k, s.pos, self.rope_theta, self.inv_freq)
        be.kv_write(self.K, self.V, s.k, s.v, s.slots[self.pool])
        be.paged_attention(s.attn, s.q, self.K, self.V, s.tables[self.pool], s.seq, s.pos, self.block_size,
                           self.scale, self.window, self.sinks)
        be.matmul(s.o, s.attn2, self.wo, self.bo)
        be.add(s.x, s.x, s.o)


@dataclass
class MoE:
    """Routed experts: E experts of SwiGLU [I,H] / [H,I], k chosen per token."""
    layer: int                  # layer id
    index: int                  # among the MoE layers (its row of the expert counts)
    router: Weight              # [E, H] float32
    experts: list               # E FFNs, or None for experts that live in the slot pool
    top_k: int                  # the routing fan (E in gated mode)
    mode: str                   # "topk" | "gated"
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

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def forward(self, r, s):
        """x += sum_j w[t,j] * expert_{ids[t,j]}(h[t])"""
        be = r.be
        be.matmul(s.router, s.h, self.router, self.router_bias)
        be.route(s.ids, s.w, s.router, self.top_k, self.mode, self.normalize, self.choice_bias, self.norm_min)
        plan = be.align(r.plan_bufs, s.ids, s.T, len(self.experts), self.top_k, self.tally)
        prefetch = r.on_route(self, s) if r.hooks else None
        if r.slot_pool is None:
            be.grouped_ffn(s.y, s.h, self.experts, plan, s.scratch, self.act)
        else:
            r.slot_pool.run_layer(self, plan, s, prefetch)
        be.combine(s.x, s.y, s.w, plan)


@dataclass
class SharedExpert:
    """An always-on expert beside the routed ones: x += sigmoid(gate @ h) * ffn(h)."""
    ffn: FFN                    # gate/up [Is,H], down [H,Is]
    gate: Weight | None         # [1, H] float32, or None (ungated)
    _one: list = field(default=None, repr=False)

    def __post_init__(self):
        self._one = [self.ffn]  # grouped_ffn takes an expert list; built once, not per step

    def forward(self, r, s):
        be = r.be
        be.grouped_ffn(s.o, s.h, self._one, r.dense_plan(s), s.scratch_dense)
        if self.gate is not None:
            be.matmul(s.gate_logit, s.h, self.gate)
            be.add(s.x, s.x, s.o, gate=s.gate_logit)
        else:
            be.add(s.x, s.x, s.o)


@dataclass
class DenseMLP:
    """A plain SwiGLU MLP: x += down @ (silu(gate @ h) * (up @ h))."""
    ffn: FFN                    # gate/up [I,H], down [H,I]
    _one: list = field(default=None, repr=False)

    def __post_init__(self):
        self._one = [self.ffn]

    def forward(self, r, s):
        be = r.be
        be.grouped_ffn(s.y_dense, s.h, self._one, r.dense_plan(s), s.scratch_dense)
        be.add(s.x, s.x, s.y_dense)


@dataclass
class Layer:
    index: int
    input_norm: Weight          # [H]
    mixer: Attention
    post_norm: Weight           # [H]
    ffns: tuple                 # FFN parts, run in order, each adding into the residual


@dataclass
class Program:
    embed: Weight               # [V, H]
    layers: list
    final_norm: Weight          # [H]
    lm_head: Weight             # [V, H] (the embedding itself when tied)
    eps: float                  # rms_norm_eps

    @property
    def moe(self) -> list:
        return [p for l in self.layers for p in l.ffns if isinstance(p, MoE)]


def build(model, be, pools, resident: bool) -> Program:
    """The program of a model directory with its weights made resident on backend `be`.
    pools: the engine's paged pools (one per attention group); resident: every routed expert on the
    backend (False: the slot pool holds them)."""
    cfg = model.config

    def w(name):
        if not model.has(name):
            return None
        sc = model.raw_tensor(name + ".scales") if model.has(name + ".scales") else None
        return be.upload(model.raw_tensor(name), model.tensor_dtype(name), scales=sc, shape=model.tensor_shape(name))

    def ffn(prefix):
        return FFN(w(prefix + ".gate"), w(prefix + ".up"), w(prefix + ".down"))

    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    k = max(cfg["experts_per_layer"], 1) if cfg["router_mode"] == "gated" else cfg["top_k"]
    pool_of = {l: i for i, p in enumerate(pools) for l in p.layers}
    inv_freq, attn_factor = rope.of_config(cfg)
    act_kind = cfg.get("expert_act", "silu")
    if act_kind not in be.ffn_activations:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE,
                           f"the {cfg['model_type']} experts' activation {act_kind!r} with expert biases is not "
                           f"implemented on the {be.name} backend (it runs {', '.join(be.ffn_activations)}); "
                           "open the engine with backend='cpu' (or 'reference')")
    layers, moe_index = [], 0
    for spec in cfg["layers"]:
        i, p = spec["layer_id"], f"layers.{spec['layer_id']}."
        mixer = Attention(w(p + "attn.wq"), w(p + "attn.wk"), w(p + "attn.wv"), w(p + "attn.wo"),
                          w(p + "attn.bq"), w(p + "attn.bk"), w(p + "attn.bv"), w(p + "attn.bo"),
                          w(p + "attn.q_norm"), w(p + "attn.k_norm"), cfg["qk_norm"], cfg["rope_theta"],
                          cfg.get("attention_scale", hd ** -0.5) * attn_factor ** 2, eps, pool_of[i],
                          pools[pool_of[i]].block_size, window=pools[pool_of[i]].window, sinks=w(p + "attn.sinks"),
                          inv_freq=inv_freq)
        if spec["type"] == "dense":
            parts = (DenseMLP(ffn(p + "mlp")),)
        else:
            fm = model.layer_formats[i]
            E = spec["moe_num_experts"]
            experts = be.upload_experts((model.expert_blob(i, j) for j in range(E)), H, I, fm) if resident \
                else [None] * E
            act = None if act_kind == "silu" else \
                Act(act_kind, cfg["swiglu_alpha"], cfg["swiglu_limit"], w(p + "experts.gate_bias"),
                    w(p + "experts.up_bias"), w(p + "experts.down_bias"))
            parts = (MoE(i, moe_index, w(p + "router"), experts, k, cfg["router_mode"], cfg["norm_topk_prob"],
                         H, I, fm, w(p + "router_choice_bias"), cfg.get("router_norm_min", 0.0),
                         router_bias=w(p + "router_bias"), act=act),)
            moe_index += 1
            if spec["type"] == "moe_shared":
                parts += (SharedExpert(ffn(p + "shared"), w(p + "shared.gate_logit")),)
        layers.append(Layer(i, w(p + "input_norm"), mixer, w(p + "post_attention_norm"), parts))
    embed = w("embed_tokens")
    prog = Program(embed, layers, w("norm"), embed if cfg["tie_word_embeddings"] else w("lm_head"), eps)
    moe = prog.moe
    for a, b in zip(moe, moe[1:]):
        a.next_layer, a.next_router, a.next_choice_bias = b.layer, b.router, b.choice_bias
        a.next_router_bias = b.router_bias
    return prog
