"""Choosing the next token from logits: greedy at temperature 0, else temperature / top-k / top-p."""
from __future__ import annotations

import numpy as np

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT


def check_params(temperature, top_p, top_k):
    if temperature < 0:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"temperature={temperature}: must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"top_p={top_p}: must be in (0, 1]")
    if top_k < 0:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"top_k={top_k}: must be >= 0 (0 disables it)")


def sample(logits: np.ndarray, temperature: float, top_p: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))         # ties to the lower id, like torch.argmax
    z = logits.astype(np.float64) / temperature
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(csum, top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.size, p=p))
