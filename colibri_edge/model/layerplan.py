"""The layer plan as the runtime reads it from a validated config.json: each layer's attention
geometry and mixer kind (validate.py holds the schema; this, what a checked config means)."""
from __future__ import annotations


def geometry(cfg: dict, layer: dict) -> tuple:
    """(query heads, KV heads, head_dim) of a layer's attention."""
    return cfg["num_attention_heads"], layer.get("num_key_value_heads", cfg["num_key_value_heads"]), \
        layer.get("head_dim", cfg["head_dim"])


RECURRENT_TYPES = ("linear_attention", "short_conv", "mamba")


def mixer_type(cfg: dict, layer: dict) -> str:
    """A layer's layer_types entry: "full_attention" where the config has none (and for the MTP head's
    layer, past layer_types), "sliding_attention", or a recurrent mixer: "linear_attention" (gated
    delta-net), "short_conv" (LFM2's gated short convolution) or "mamba" (Granite 4.0-H's Mamba-2)."""
    types = cfg.get("layer_types")
    return types[layer["layer_id"]] if types and layer["layer_id"] < len(types) else "full_attention"


def is_linear(cfg: dict, layer: dict) -> bool:
    """Whether a layer's mixer is a recurrent one (a fixed-size state per sequence, no KV cache: a gated
    delta-net, a short convolution or a Mamba-2 mixer)."""
    return mixer_type(cfg, layer) in RECURRENT_TYPES


def mtp_layers(cfg: dict) -> list:
    """The multi-token-prediction head's layer specs (config "mtp"; [] when the model has none)."""
    return list(cfg.get("mtp", {}).get("layers", []))


def all_layers(cfg: dict) -> list:
    """The decoder's layers, then the MTP head's: every layer whose weights the directory holds."""
    return list(cfg["layers"]) + mtp_layers(cfg)


def geometries(cfg: dict) -> set:
    """Every attention geometry (Hq, Hkv, D) the layer plan has (Gemma 4: two; latent attention: none;
    recurrent layers have none)."""
    if cfg.get("latent_attention"):
        return set()
    return {geometry(cfg, l) for l in cfg["layers"] if not is_linear(cfg, l)}
