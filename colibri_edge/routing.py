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


def route(logits: np.ndarray, k: int, mode: str = "topk", normalize: bool = True, choice_bias=None,
          norm_min: float = 0.0, expert_scale=None):
    """logits [T,E] -> (ids [T,k] int32, weights [T,k] fp32). The router always runs in fp32.
        p = softmax(logits)
        ids = the k largest of p + choice_bias (choice_bias [E]: the choice only, ERNIE-4.5's
              e_score_correction_bias; none: p itself), ties to the lower expert id
        w = p[ids], divided by max(sum of those p, norm_min) when normalize (norm_min: ERNIE's
              moe_norm_min floor; 0 for every other family), then times expert_scale[ids] when
              given (expert_scale [E]: Gemma 4's per_expert_scale)
    gated: k == E, every expert with weight p."""
    p = softmax(logits.astype(np.float32))
    if mode == "gated":
        T, E = p.shape
        return np.tile(np.arange(E, dtype=np.int32), (T, 1)), p.astype(np.float32)
    if choice_bias is None:
        ids, w = topk_lower_id(p, k)
    else:
        ids, _ = topk_lower_id(p + np.asarray(choice_bias, np.float32).reshape(1, -1), k)
        w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), np.float32(norm_min))
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
