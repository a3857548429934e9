"""The arena (DESIGN.md, "Memory"): every activation and scratch buffer of the largest step,
declared once as name -> (shape, dtype) from the engine's limits. The scheduler allocates exactly
this declaration at start (the decode loop allocates nothing) and `colibri inspect` sizes memory
from it, so the two cannot drift apart.

    R rows (tokens) in a step = max(prefill_chunk, max_batch), S sequences = max_batch,
    k = the routing fan (top_k, or every expert in gated mode), E experts per MoE layer,
    M = the MoE layers, P = the paged state pools, W = block-table width (ceil(max_seq_len / B)).

The step's inputs (token ids, positions, which sequence each token is, the rows whose logits are
wanted, and per paged pool the cache slot of each token and each sequence's block table) are one
int32 buffer, `inputs`, filled on the host and uploaded once per step; `input_layout` gives each
input's place in it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backends.base import plan_buffers
from ..model.layerplan import geometries, mtp_layers


@dataclass(frozen=True)
class Limits:
    rows: int           # R
    max_batch: int      # S
    table_width: int    # W
    paged_pools: int    # P
    fixed_pools: int = 0    # F: fixed-size state pools (recurrent layers)
    mtp: bool = False       # the MTP head runs (drafting): its hidden rows and their source rows


def fan(cfg: dict) -> int:
    return max(cfg["experts_per_layer"], 1) if cfg["router_mode"] == "gated" else cfg["top_k"]


def input_layout(lim: Limits) -> dict:
    """name -> (offset, shape) of the step inputs inside the int32 `inputs` buffer."""
    R, S, W = lim.rows, lim.max_batch, lim.table_width
    parts = [("tok", (R,)), ("pos", (R,)), ("seq", (R,)), ("rows", (R,))]
    for p in range(lim.paged_pools):
        parts += [(f"slots{p}", (R,)), (f"tables{p}", (S, W))]
    if lim.fixed_pools:                         # each sequence's tokens starts[s]..starts[s+1]-1, its slots
        parts += [("starts", (S + 1,))] + [(f"fslots{p}", (S,)) for p in range(lim.fixed_pools)]
    if lim.mtp:                                 # the MTP head's step: which mtp_h row each token reads
        parts += [("hrows", (R,))]
    out, off = {}, 0
    for name, shape in parts:
        out[name] = (off, shape)
        off += math.prod(shape)
    return out


def buffers(cfg: dict, lim: Limits) -> dict:
    """name -> (shape, dtype) of every arena buffer (step inputs included)."""
    R = lim.rows
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    geo = geometries(cfg)                               # (Hq, Hkv, D) of each attention geometry
    QW, KW = max([nh * hd for nh, _, hd in geo], default=1), max([nkv * hd for _, nkv, hd in geo], default=1)
    E, k = max(cfg["experts_per_layer"], 1), fan(cfg)
    specs = cfg["layers"] + (mtp_layers(cfg) if lim.mtp else [])
    M = sum(1 for l in specs if l["type"] != "dense")
    types = {l["type"] for l in specs}                  # the widest FFN the plan runs (sizes it does not use
    inter = max([cfg["intermediate_size"]] * bool(types & {"dense", "moe_dense"}) + [cfg["moe_intermediate_size"]] * (M > 0) +
                [cfg["shared_expert_intermediate_size"]] * ("moe_shared" in types) + [1])   # are never allocated)
    f32, i32 = np.float32, np.int32
    spec = {
        "x": ((R, H), f32), "h": ((R, H), f32), "o": ((R, H), f32),               # residual, normed, branch out
        "q": ((R, QW), f32), "k": ((R, KW), f32), "v": ((R, KW), f32), "attn": ((R, QW), f32),  # [T, heads, D]
                                                                                # views per geometry
        "router": ((R, E), f32), "ids": ((R, k), i32), "w": ((R, k), f32),      # routing
        "gate_logit": ((R, 1), f32),                                            # shared expert's gate
        "y": ((R * k, H), f32), "scratch": ((R * k, inter), f32),               # expert outputs, gate/up act
        "zeros": ((R, 1), i32),                                                 # ids of the 1-expert plan
        "pred_router": ((R, E), f32), "pred_ids": ((R, k), i32), "pred_w": ((R, k), f32),   # prefetch, traces
        "sel": ((R, H), f32), "logits": ((R, V), f32),
        "expert_counts": ((max(M, 1), E), i32),                                 # tokens routed, on the device
        "inputs": ((sum(math.prod(s) for _, s in input_layout(lim).values()),), i32),
    }
    if lim.mtp:                                                                 # the model's final-normed rows
        spec["mtp_h"] = ((R, H), f32)                                           # (every token), the head's input
    if cfg.get("attention_output_gate"):
        spec["attn_gate"] = ((R, QW), f32)                                      # sigmoid gate of attention's output
    lin = cfg.get("linear_attention")
    if lin and lim.fixed_pools:                                                 # gated delta-net (rows only: the
        Hk, Hv, dk, dv = (lin[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
        C = 2 * Hk * dk + Hv * dv                                               # state is the fixed pool's)
        for name, width in (("qkv", C), ("conv", C), ("z", Hv * dv), ("a", Hv), ("b", Hv), ("core", Hv * dv)):
            spec[f"lin.{name}"] = ((R, width), f32)
    if cfg.get("router_input_scale"):                                           # Llama 4: the routed outputs
        spec["ones"] = ((R, 1), f32)                                            # combined with weight 1
    if cfg.get("short_conv") and lim.fixed_pools:                               # LFM2's short convolutions:
        for name in ("b", "c", "x", "conv"):                                    # in_proj's thirds, the conv's
            spec[f"sc.{name}"] = ((R, H), f32)                                  # output (state: the fixed pool)
    mb = cfg.get("mamba")
    if mb and lim.fixed_pools:                                                  # Mamba-2 (rows only: the state
        nh, P, G, N = (mb[k] for k in ("num_heads", "head_dim", "n_groups", "state_size"))   # is the fixed pool's)
        for name, width in (("z", nh * P), ("xbc", nh * P + 2 * G * N), ("conv", nh * P + 2 * G * N),
                            ("dt", nh), ("y", nh * P)):
            spec[f"ssm.{name}"] = ((R, width), f32)
    la = cfg.get("latent_attention")
    if la:                                                                      # latent attention (rows only:
        nh, r, dr = cfg["num_attention_heads"], la["kv_lora_rank"], la["qk_rope_head_dim"]   # nothing here grows
        for name, width in (("qa", max(la["q_lora_rank"], 1)), ("q_nope", nh * la["qk_nope_head_dim"]),  # with the
                            ("q_rope", nh * dr), ("c", r), ("r", dr), ("q_lat", nh * r), ("o_lat", nh * r),   # cache)
                            ("o_v", nh * la["v_head_dim"])):
            spec[f"mla.{name}"] = ((R, width), f32)
    for name, sd in plan_buffers(R * k, E).items():                             # align's plan, MoE layers
        spec[f"plan.{name}"] = sd
    for name, sd in plan_buffers(R, 1).items():                                 # ... and dense MLPs
        spec[f"dense_plan.{name}"] = sd
    return spec


def nbytes(spec: dict) -> int:
    return sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in spec.values())
