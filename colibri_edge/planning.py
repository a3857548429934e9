"""What a model needs: bytes per expert, weight bytes read per decoded token, memory at a context."""
from __future__ import annotations

from .dtypes import itemsize
from .modeldir import ModelDir, expected_tensors, expert_blob_bytes
from .scheduler import arena_bytes


def kv_bytes(cfg: dict, tokens: int) -> int:
    """K and V in float32 for every layer."""
    return 2 * cfg["num_hidden_layers"] * tokens * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def summary(model: ModelDir, context: int, max_batch: int = 1, prefill_chunk: int = 256) -> dict:
    cfg = model.config
    tensors = expected_tensors(cfg)
    nbytes = {n: model.tensors[n]["nbytes"] for n in tensors}
    per_expert = expert_blob_bytes(cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["weight_dtype"])
    non_expert = sum(nbytes.values())
    experts = per_expert * len(model.experts)
    # read per decoded token: one embedding row, every non-expert tensor but the embedding table
    # (the lm_head is the table itself when tied), and top_k experts per MoE layer
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    per_token = non_expert - nbytes["embed_tokens"] + H * itemsize(cfg["weight_dtype"])
    if cfg["tie_word_embeddings"]:
        per_token += nbytes["embed_tokens"]
    k = cfg["experts_per_layer"] if cfg["router_mode"] == "gated" else cfg["top_k"]
    per_token += len(model.moe_layers) * k * per_expert
    kv = kv_bytes(cfg, context * max_batch)
    scratch = arena_bytes(cfg, max(prefill_chunk, max_batch), max_batch)
    return {
        "non_expert_bytes": non_expert, "expert_bytes": experts, "bytes_per_expert": per_expert,
        "num_experts": len(model.experts), "bytes_per_decoded_token": per_token,
        "kv_cache_bytes": kv, "scratch_bytes": scratch, "context": context,
        "total_bytes": non_expert + experts + kv + scratch,
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
