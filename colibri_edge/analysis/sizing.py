"""What a model needs: bytes per expert, weight bytes read per decoded token, memory at a context.

Arena and per-sequence state bytes come from the declarations the engine allocates from
(arena.buffers, scheduler.layout), so `colibri inspect` states what the engine will allocate.
"""
from __future__ import annotations

from ..runtime import arena
from ..model.modeldir import ModelDir
from ..runtime.runner import layout


def kv_bytes(cfg: dict, tokens: int, block_size: int = 1, kv_dtype: str = "float32") -> int:
    """Bytes of the per-sequence state for `tokens` cached positions (K and V in kv_dtype): every
    position in the full-attention layers, at most ceil(W / B) + 1 blocks in sliding-window ones."""
    _, states = layout(cfg, 1, 1, 1, 1, block_size, kv_dtype)
    B = block_size
    return sum(p.bytes_per_token() * (min(-(-tokens // B), -(-p.window // B) + 1) * B if p.window else tokens)
               for p in states.paged)


def kv_full_bytes_per_token(cfg: dict, kv_dtype: str = "float32") -> int:
    """What each cached position costs in the full-attention layers (the window layers' cost is bounded),
    in kv_dtype (PagedPool.bytes_per_token: exact, q8_0's scales included)."""
    _, states = layout(cfg, 1, 1, 1, 1, 1, kv_dtype)
    return sum(p.bytes_per_token() for p in states.paged if not p.window)


def kv_window_bytes(cfg: dict, block_size: int, kv_dtype: str = "float32") -> int:
    """The most a sequence holds in the sliding-window layers between steps, however long it is."""
    _, states = layout(cfg, 1, 1, 1, 1, block_size, kv_dtype)
    return sum(p.bytes_per_token() * (-(-p.window // block_size) + 1) * block_size for p in states.paged if p.window)


def state_bytes_per_sequence(cfg: dict) -> int:
    """What each sequence holds in fixed-size state whatever its length (the recurrent layers' conv and
    delta-rule state: Qwen3.5's gated delta-nets), 0 without recurrent layers. Memory at a context is
    then this constant term plus kv_full_bytes_per_token x tokens."""
    _, states = layout(cfg, 1, 1, 1, 1, 1)
    return sum(p.bytes_per_seq() for p in states.fixed)


def snapshot_bytes(cfg: dict) -> int:
    """What one recurrent-state snapshot (prefix caching of recurrent layers) costs: a sequence's
    fixed-size state (state_bytes_per_sequence); 0 without recurrent layers."""
    return state_bytes_per_sequence(cfg)


def engine_memory(cfg: dict, max_seq_len: int, max_batch: int, prefill_chunk: int, kv_tokens: int,
                  block_size: int = 16, kv_dtype: str = "float32", snapshots: int | None = None) -> dict:
    """Bytes the engine allocates at start for these limits: arena and state pools (the paged ones in
    kv_dtype), exactly. snapshots: recurrent-state snapshots (Engine.open's state_snapshots; default
    max_batch, as the engine's with the prefix cache on)."""
    blocks = -(-kv_tokens // block_size)
    prefill_chunk = min(prefill_chunk, max_seq_len * max_batch)     # as Engine.open: no rows that cannot occur
    lim, states = layout(cfg, max(prefill_chunk, max_batch), max_batch, max_seq_len, blocks, block_size, kv_dtype,
                         max_batch if snapshots is None else snapshots)
    return {"arena_bytes": arena.nbytes(arena.buffers(cfg, lim)), "state_bytes": states.nbytes(),
            "kv_tokens": blocks * block_size}


def summary(model: ModelDir, context: int, max_batch: int = 1, prefill_chunk: int = 256,
            block_size: int = 16, kv_dtype: str = "float32") -> dict:
    cfg = model.config
    nbytes = {n: r["nbytes"] for n, r in model.tensors.items()}
    per_layer = {l: model.layer_blob_bytes(l) for l in model.moe_layers}
    per_expert = max(per_layer.values(), default=0)
    non_expert = sum(nbytes.values())
    experts = sum(e.weight_size for e in model.experts)
    # read per decoded token: one embedding row, every non-expert tensor but the embedding table
    # (the lm_head is the table itself when tied), and top_k experts per MoE layer
    V = cfg["vocab_size"]
    emb = nbytes["embed_tokens"] + nbytes.get("embed_tokens.scales", 0)
    per_token = non_expert - emb + emb // V
    if cfg["tie_word_embeddings"]:
        per_token += emb
    per_token += arena.fan(cfg) * sum(per_layer.values())
    mem = engine_memory(cfg, context, max_batch, prefill_chunk, context * max_batch, block_size, kv_dtype)
    return {
        "non_expert_bytes": non_expert, "expert_bytes": experts, "bytes_per_expert": per_expert,
        "bytes_per_expert_by_layer": per_layer, "formats": sorted(model.formats),
        "num_experts": len(model.experts), "bytes_per_decoded_token": per_token,
        "kv_cache_bytes": mem["state_bytes"],
        "kv_dtype": kv_dtype, "kv_bytes_per_token": kv_full_bytes_per_token(cfg, kv_dtype),
        "kv_window_bytes_per_sequence": kv_window_bytes(cfg, block_size, kv_dtype),
        "state_bytes_per_sequence": state_bytes_per_sequence(cfg),
        "snapshot_bytes": snapshot_bytes(cfg), "snapshots": max_batch if snapshot_bytes(cfg) else 0,
        "scratch_bytes": mem["arena_bytes"], "context": context, "max_batch": max_batch,
        "prefill_chunk": prefill_chunk, "block_size": block_size,
        "total_bytes": non_expert + experts + mem["state_bytes"] + mem["arena_bytes"],
    }
