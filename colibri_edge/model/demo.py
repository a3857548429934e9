"""The embedded default model used by `colibri run` without --model and by `make demo`.

If the trained demo model is shipped (colibri_edge/default_model/), it is used. Otherwise a small
deterministic random MoE model with a byte-level tokenizer is built once into a cache folder: it
exercises the whole engine but prints noise, and `colibri run` says so.
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from .families.mixtral import Mixtral
from .modeldir import ModelWriter, expected_tensors

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "default_model")
RANDOM_VERSION = 1


def ensure_default_model():
    """-> (path, note for the user). COLIBRI_DEFAULT_MODEL (an ARM64 bundle's model) comes first."""
    chosen = os.environ.get("COLIBRI_DEFAULT_MODEL")
    if chosen and os.path.exists(os.path.join(chosen, "config.json")):
        return chosen, f"COLIBRI_DEFAULT_MODEL={chosen}"
    if os.path.exists(os.path.join(SHIPPED, "config.json")):
        return SHIPPED, "the trained demo model shipped with Colibri"
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    path = os.path.join(cache, "colibri-edge", f"default-random-v{RANDOM_VERSION}")
    if not os.path.exists(os.path.join(path, "config.json")):
        # built aside and renamed into place, so that processes starting together (test workers,
        # two CLI runs) never read a half-written model; the first rename wins
        part = f"{path}.part-{os.getpid()}"
        shutil.rmtree(part, ignore_errors=True)
        build_random_model(part)
        try:
            os.rename(part, path)
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
            if not os.path.exists(os.path.join(path, "config.json")):
                raise
    return path, ("a small deterministic model with random weights: its text is noise until the trained "
                  "demo model is shipped")


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with the 256 byte symbols and no merges (tokenizers library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def build_random_model(path: str, seed: int = 0):
    tok = byte_level_tokenizer()
    V = tok.get_vocab_size()
    H, L, E, K, I = 64, 2, 8, 2, 96
    cfg = {
        "format_version": 1, "model_type": Mixtral.model_types[0], "num_hidden_layers": L, "hidden_size": H,
        "intermediate_size": I, "moe_intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": V, "max_position_embeddings": 1024, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "experts_per_layer": E, "top_k": K,
        "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": True,
        "shared_expert_intermediate_size": 0, "shared_expert_gate": False, "attention_bias": False,
        "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": [V - 1], "bos_token_id": None,
        "weight_dtype": "float32",
        "layers": [{"layer_id": i, "type": "moe", "moe_expert_start": i * E, "moe_num_experts": E} for i in range(L)],
    }
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    w = ModelWriter(path, cfg)
    for name, (shape, dtype) in expected_tensors(cfg).items():
        if len(shape) == 1:
            arr = np.ones(shape, np.float32)
        else:
            arr = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        w.add_tensor(name, arr, dtype)
    for layer in range(L):
        for j in range(E):
            g, u = (rng.standard_normal((I, H)) / np.sqrt(H)).astype(np.float32), \
                   (rng.standard_normal((I, H)) / np.sqrt(H)).astype(np.float32)
            d = (rng.standard_normal((H, I)) / np.sqrt(I)).astype(np.float32)
            w.add_expert(layer, j, g, u, d, "float32")
    w.finish()
    tok.save(os.path.join(path, "tokenizer.json"))
    return path
