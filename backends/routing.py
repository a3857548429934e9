"""Routing policy and `align`: backend-neutral, host-side NumPy (the reference for every backend).

align groups a step's (token, choice) assignments by expert with a counting sort, so each chosen
expert then runs once over a contiguous run of rows and reads its weights once.

Worked example: T=3 tokens, k=2, E=4, ids = [[2, 0], [0, 3], [2, 0]]
    flat assignments a = t*k + j:   a: 0  1  2  3  4  5
                                 expert: 2  0  0  3  2  0
    counts  = [3, 0, 2, 1]           offsets = [0, 3, 3, 5, 6]
    order   = [1, 2, 5, 0, 4, 3]     (expert 0's assignments first, stable within an expert)
    inverse = [3, 0, 1, 5, 4, 2]     (assignment a sits at sorted row inverse[a])
Expert 0 runs on rows 0..2 = tokens order//k = [0, 1, 2]; expert 1 is skipped; and so on.
"""
from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def topk_lower_id(p: np.ndarray, k: int):
    """Top-k per row, descending by value, ties to the lower expert id (stable sort of -p)."""
    order = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    return order.astype(np.int32), np.take_along_axis(p, order, axis=-1)


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def group_mask(c: np.ndarray, groups) -> np.ndarray:
    """DeepSeek / GLM group-limited routing: c [T,E] -> c with the experts outside the `keep` best of
    n groups (E/n consecutive experts each; a group scores the sum of its `top` largest c: 1 is its
    maximum (DeepSeek-V2), 2 the sum of its top two (V3, GLM)) set to -inf; ties to the lower group id."""
    n, keep, top = groups
    T, E = c.shape
    g = c.reshape(T, n, E // n)
    best = -np.sort(-g, axis=-1)[..., :top]
    score = best[..., 0].copy()
    for j in range(1, top):                     # in order: the largest first, as the kernels sum
        score += best[..., j]
    kept, _ = topk_lower_id(score, keep)
    mask = np.zeros((T, n), bool)
    np.put_along_axis(mask, kept.astype(np.int64), True, axis=-1)
    return np.where(np.repeat(mask, E // n, axis=1), c, np.float32(-np.inf)).astype(np.float32)


def sparsemixer(logits: np.ndarray, jitter: float):
    """Phi-3.5-MoE's inference router (base.Backend.sparsemixer has the math): logits [T,E] ->
    (ids [T,2] int32, weights [T,2] fp32)."""
    s = logits.astype(np.float32)
    T, E = s.shape
    thr = np.float32(2 * jitter)
    ids, ws = np.zeros((T, 2), np.int32), np.zeros((T, 2), np.float32)
    rows = np.arange(T)
    cand = s.copy()
    for j in range(2):
        i = np.argmax(cand, axis=-1)                        # the first maximum: the lower id
        m = cand[rows, i][:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            drop = (m - s) / np.maximum(np.abs(s), m) > thr
        g = np.where(drop, np.float32(-np.inf), cand)
        ws[:, j] = np.float32(1) / np.exp(g - m).sum(axis=-1, dtype=np.float32)
        ids[:, j] = i
        cand[rows, i] = -np.inf
    return ids, ws


def route(logits: np.ndarray, k: int, mode: str = "topk", normalize: bool = True, choice_bias=None,
          norm_min: float = 0.0, expert_scale=None, score: str = "softmax", groups=None, scaling: float = 1.0):
    """logits [T,E] -> (ids [T,k] int32, weights [T,k] fp32). The router always runs in fp32.
        p = softmax(logits), or sigmoid(logits) per expert (score "sigmoid": DeepSeek-V3, GLM)
        c = p + choice_bias (choice_bias [E]: the choice only, ERNIE-4.5's / DeepSeek-V3's
            e_score_correction_bias; none: p itself); with groups (n, keep, top) only the experts of
            the `keep` best groups stay in the choice (group_mask)
        ids = the k largest c, ties to the lower expert id
        w = p[ids], divided by max(sum of those p, norm_min) when normalize (norm_min: ERNIE's
              moe_norm_min floor, DeepSeek-V3's 1e-20; 0 for every other family), times scaling
              (routed_scaling_factor), then times expert_scale[ids] when given (expert_scale [E]:
              Gemma 4's per_expert_scale)
    gated: k == E, every expert with weight p."""
    p = softmax(logits.astype(np.float32)) if score == "softmax" else sigmoid(logits)
    if mode == "gated":
        T, E = p.shape
        return np.tile(np.arange(E, dtype=np.int32), (T, 1)), p.astype(np.float32)
    c = p if choice_bias is None else p + np.asarray(choice_bias, np.float32).reshape(1, -1)
    if groups is not None and groups[0] > 1:
        c = group_mask(c, groups)
    ids, _ = topk_lower_id(c, k)
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), np.float32(norm_min))
    if scaling != 1.0:
        w = w * np.float32(scaling)
    if expert_scale is not None:
        w = w * np.asarray(expert_scale, np.float32).reshape(-1)[ids]
    return ids, w.astype(np.float32)


def align(ids: np.ndarray, num_experts: int):
    """ids [T,k] -> (offsets [E+1], order [T*k], inverse [T*k]) as int32. See the module docstring."""
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.zeros(num_experts + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    order = np.argsort(flat, kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=np.int32)
    return offsets, order, inverse
