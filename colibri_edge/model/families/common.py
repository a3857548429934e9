"""What several families share: the Family base class (every hook a family may override, with the
generic behaviour most families keep), the common tensor-name maps (Hugging Face and GGUF), the generic
config translation of a standard decoder (attention + routed experts, optionally a shared expert),
rope / YaRN helpers, the q/k row permutations and the small metadata checks.

Imports nothing from the drivers (convert.py, gguf_import.py) nor from modeldir, so that both drivers,
modeldir and every family module depend on it and on nothing else of the model package but validate
and dtypes: no import cycle.
"""
from __future__ import annotations

import re
import sys

import numpy as np

from .. import validate
from ..layerplan import all_layers
from ..validate import YARN_FIELDS
from ...errors import ColibriError, COLIBRI_ERR_INVALID_MODEL_TYPE, invalid_model


# ----------------------------------------------------------------------------------------------
# small helpers

def get(hf, *names, default=None):
    """The first of `names` the config sets (not None), else default."""
    for n in names:
        if hf.get(n) is not None:
            return hf[n]
    return default


def refuse(path, field, msg):
    raise invalid_model(path, field, f"{msg}; Colibri does not implement it and will not guess")


def eos_bos(hf: dict, gen: dict):
    eos = get(gen, "eos_token_id", default=None)
    if eos is None:
        eos = hf.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return [e for e in eos if 0 <= e < hf["vocab_size"]], get(gen, "bos_token_id", default=hf.get("bos_token_id"))


def unwrap_text(hf: dict, path: str, text_type: str) -> dict:
    """A wrapped multimodal config (text_config inside) as its text model's, model_type text_type; the
    wrapper's tie_word_embeddings wins where it says."""
    tc = hf.get("text_config")
    if not isinstance(tc, dict):
        raise invalid_model(path, "text_config", f"missing (a {hf['model_type']} checkpoint nests its text model's "
                            "config)")
    return {**tc, "model_type": text_type, "tie_word_embeddings": hf.get(
        "tie_word_embeddings", tc.get("tie_word_embeddings", False))}


def yarn(rope: dict, max_pos: int, path: str):
    """rope_parameters -> our rope_scaling (None for the default rope); other rope types refused."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        refuse(path, "rope_parameters.rope_type", f"rope type {rope_type!r}")
    rs = {k: rope[k] for k in YARN_FIELDS if rope.get(k) is not None}
    if "original_max_position_embeddings" not in rs:
        refuse(path, "rope_parameters.original_max_position_embeddings", "YaRN without its original context")
    rs.setdefault("factor", max_pos / rs["original_max_position_embeddings"])
    return rs


def rope_dim_order(D: int, r: int) -> np.ndarray:
    """The head's dims in the order that puts partial rotary's pairs (i, i + r/2), i < r/2, at the
    half-split places (i, i + D/2): new dim -> old dim. The unrotated dims fill the rest in order."""
    h, p = r // 2, (D - r) // 2
    return np.concatenate([np.arange(h), r + np.arange(p), h + np.arange(h), r + p + np.arange(D - r - p)])


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf LlamaModel.permute): inside each head of
    d rows, GGUF row 2 i + p holds Hugging Face row p d/2 + i. Works on any row content (float rows,
    rows of blocks, bias entries)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def row_permutations(cfg: dict) -> dict:
    """Colibri tensor name -> heads, for the q/k rows a source with interleaved rope pairs (cfg
    rope_pairs) holds in that layout: they are permuted to the half-split layout by unpermute (q and
    k alike, so q.k is unchanged)."""
    if cfg.get("rope_pairs") != "interleaved" or cfg.get("latent_attention"):
        return {}                   # latent attention: its rotated rows are permuted by its source map
    out = {}
    for l in all_layers(cfg):
        p = f"layers.{l['layer_id']}."
        out[p + "attn.wq"] = out[p + "attn.bq"] = cfg["num_attention_heads"]
        out[p + "attn.wk"] = out[p + "attn.bk"] = cfg["num_key_value_heads"]
    return out


def pos(m, key, v, lo=1, hi=validate.MAX_DIM):
    """A GGUF metadata value checked to be in lo..hi (None passes)."""
    if v is not None and not lo <= v <= hi:
        raise invalid_model(m.path, key, f"{v} is out of range ({lo}..{hi})")
    return v


def decoder_shape(m, arch: str) -> tuple:
    """(key prefix, getter, decoder layers, hidden, heads) of an arch whose file may append
    multi-token-prediction layers after the decoder's (nextn_predict_layers: not in the plan)."""
    a = arch + "."
    g = lambda k, kind=int, **kw: m.get(a + k, kind, **kw)            # noqa: E731
    nextn = pos(m, a + "nextn_predict_layers", g("nextn_predict_layers", required=False, default=0), 0, 64)
    L = pos(m, a + "block_count", g("block_count"), 1 + nextn, validate.MAX_LAYERS) - nextn
    H = pos(m, a + "embedding_length", g("embedding_length"))
    nh = pos(m, a + "attention.head_count", g("attention.head_count"), 1, validate.MAX_HEADS)
    return a, g, L, H, nh


def gguf_vocab(m) -> int:
    """The vocabulary size: token_embd's rows."""
    if "token_embd.weight" not in m.tensors:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    return int(m.tensor("token_embd.weight").shape[1])


def nextn_tensors(m, cfg: dict, arch: str, progress: bool) -> set:
    """The tensors of the multi-token-prediction layers a file appends after the decoder's
    (nextn_predict_layers): not run, skipped with a note."""
    nextn = m.get(arch + ".nextn_predict_layers", int, required=False, default=0)
    kept = 1 if cfg.get("mtp") else 0           # the first is the MTP head (gguf_import.gguf_mtp)
    if nextn <= kept:
        return set()
    L = cfg["num_hidden_layers"]
    mtp = [n for n in m.tensors if re.match(rf"blk\.({'|'.join(str(L + j) for j in range(kept, nextn))})\.", n)]
    if progress:
        print(f"convert: {len(mtp)} tensors of {nextn - kept} multi-token-prediction layer(s) skipped "
              "(speculative-decoding heads; " + ("only the first drafts)" if kept else "the model runs without them)"),
              file=sys.stderr)
    return set(mtp)


# ----------------------------------------------------------------------------------------------
# multi-token prediction (speculative decoding's draft head)

def mtp_count(hf: dict) -> int:
    """The multi-token-prediction layers a checkpoint stores (DeepSeek-V3 / GLM: num_nextn_predict_layers,
    after the decoder's layers; Qwen3.5 / Qwen3-Next: mtp_num_hidden_layers, under mtp.*)."""
    names = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
    tc = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    return int(get(hf, *names, default=0) or get(tc, *names, default=0) or 0)


def add_mtp(cfg: dict, hf: dict) -> dict:
    """cfg["mtp"] for a checkpoint with an MTP head: its layer a decoder layer like the last one (layer_id
    num_hidden_layers, its experts after the decoder's); prepare_mtp settles it from the tensors."""
    if mtp_count(hf) and cfg["layers"]:
        last, L = cfg["layers"][-1], cfg["num_hidden_layers"]
        moe = last["type"] != "dense"
        cfg["mtp"] = {"layers": [{"layer_id": L, "type": last["type"],
                                  "moe_expert_start": sum(l["moe_num_experts"] for l in cfg["layers"]) if moe else 0,
                                  "moe_num_experts": last["moe_num_experts"] if moe else 0}]}
    return cfg


def mtp_sources(cfg: dict, norm=None) -> dict:
    """The MTP head's tensors from DeepSeek-V3's names under model.layers.L. (families with other names
    rename theirs to these in prepare_source): x = eh_proj [enorm(embed(t)); hnorm(h)] is kept as its two
    halves e_proj = eh_proj[:, :H], h_proj = eh_proj[:, H:]; shared_head.norm -> mtp.norm. norm: a
    function applied to the three norms (zero-centred ones: + 1)."""
    s, H = f"model.layers.{cfg['num_hidden_layers']}.", cfg["hidden_size"]
    wrap = (lambda n: (n, norm)) if norm else (lambda n: n)
    return {"mtp.enorm": wrap(s + "enorm.weight"), "mtp.hnorm": wrap(s + "hnorm.weight"),
            "mtp.norm": wrap(s + "shared_head.norm.weight"),
            "mtp.e_proj": (s + "eh_proj.weight", lambda a: a[:, :H].copy()),
            "mtp.h_proj": (s + "eh_proj.weight", lambda a: a[:, H:].copy()),
            "mtp.head": s + "shared_head.head.weight", "mtp.embed": s + "embed_tokens.weight"}


def prepare_mtp(src, cfg: dict, hf: dict, progress: bool, keep: bool = True):
    """Settles cfg["mtp"] from the checkpoint (its layer's names already DeepSeek's, model.layers.L.): a
    layer with a plain MLP and no experts is dense; a head or embedding stored again is the model's own
    when equal to lm_head / embed_tokens (DeepSeek-V3 stores copies; dropped), else kept (own_head /
    own_embed); further MTP layers (only the first drafts) are dropped with a note. keep=False (convert
    --no-mtp): every MTP layer dropped with a note, the model converted without its head."""
    n = mtp_count(hf)
    if not n or not cfg.get("mtp"):
        return
    L = cfg["num_hidden_layers"]
    s = f"model.layers.{L}."
    if not any(k.startswith(s) for k in src.entries):
        del cfg["mtp"]                  # declared, not stored (transformers' DeepSeek-V3 config says 1 by default)
        return
    if not keep:
        del cfg["mtp"]
        dropped = src.rebase("", "", tuple(f"model.layers.{L + j}." for j in range(n)))
        if progress:
            print(f"convert: {dropped} tensors of {n} multi-token-prediction layer(s) skipped (--no-mtp: the "
                  "model converts without its draft head)", file=sys.stderr)
        return
    if n > 1:
        dropped = src.rebase("", "", tuple(f"model.layers.{L + j}." for j in range(1, n)))
        if progress:
            print(f"convert: {dropped} tensors of {n - 1} further multi-token-prediction layer(s) skipped (the "
                  "first drafts, chained)", file=sys.stderr)
    if s + "eh_proj.weight" not in src:
        raise invalid_model(hf.get("_path", "config.json"), "num_nextn_predict_layers",
                            f"is {n} but the checkpoint has no {s}eh_proj.weight (the MTP head's projection)")
    spec = cfg["mtp"]["layers"][0]
    if s + "mlp.gate_proj.weight" in src and not any(k.startswith(s + "mlp.experts.") or
                                                     k.startswith(s + "block_sparse_moe.") for k in src.entries):
        spec.update(type="dense", moe_expert_start=0, moe_num_experts=0)
    for own, name, main in (("own_head", "shared_head.head.weight", "lm_head.weight"),
                            ("own_embed", "embed_tokens.weight", "model.embed_tokens.weight")):
        if s + name not in src:
            continue
        if main not in src and own == "own_head" and cfg["tie_word_embeddings"]:
            main = "model.embed_tokens.weight"
        if main in src and np.array_equal(src.raw(s + name), src.raw(main)):
            src.rebase("", "", (s + name,))
        else:
            cfg["mtp"][own] = True


# ----------------------------------------------------------------------------------------------
# the family base class

class Family:
    """Everything one model family knows. A subclass sets the class attributes and overrides the hooks
    it needs; the registry (families.registry.register) indexes it by each of `model_types` and
    `gguf_archs`. The defaults are a standard decoder: attention (q/k/v/o, optional biases), a router
    and routed SwiGLU experts under `mlp.` (Qwen-style names), optional dense layers."""

    model_types: tuple = ()     # Hugging Face config.json model_type names this family converts
    gguf_archs: tuple = ()      # GGUF general.architecture names it imports
    gguf_model_type = None      # the model_type a GGUF of this arch translates through
    gguf_note = ""              # said beside the supported architectures (e.g. which GGUF arch it is)
    # the program parts the runtime builds for it (docs/families.md; runtime/program.py reads the
    # config fields that select them, not these labels)
    parts = {"mixer": "attention", "ffn": "routed experts (SwiGLU)", "router": "softmax top-k"}

    # -- config translation --------------------------------------------------------------------
    renormalise = None          # norm_topk_prob: fixed True / False, or None: the config's (default False)
    shared_gate = False         # a sigmoid gate on the shared expert
    qk_norm = "none"            # "none", "per_head", "full"
    refuses_act = True          # anything but silu refused
    head_dim_field = True       # head_dim read from the config (else hidden / heads)
    bias_default = False        # attention_bias when the config does not say
    moe_prefix = "mlp"          # the checkpoint's MoE block (model.layers.N.<moe_prefix>.gate)

    def translate(self, hf: dict, gen: dict, path: str, dtype) -> dict:
        """Hugging Face config.json (+ generation_config.json) -> Colibri config.json: the standard
        decoder, with the family's hooks for what differs."""
        mt = hf["model_type"]
        H, nh = hf["hidden_size"], hf["num_attention_heads"]
        nkv = get(hf, "num_key_value_heads", default=nh)
        L = hf["num_hidden_layers"]
        max_pos = hf.get("max_position_embeddings", 4096)

        # -- features we refuse rather than compute wrongly --
        rope = hf.get("rope_parameters") or {}
        rope_scaling = yarn(rope, max_pos, path)
        if hf.get("rope_scaling"):
            rs = hf["rope_scaling"]
            if rs.get("rope_type", rs.get("type", "default")) != "default":
                refuse(path, "rope_scaling", f"rope scaling {rs!r}")
        if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
            refuse(path, "partial_rotary_factor", "partial rotary embeddings")
        if hf.get("clip_qkv") is not None:
            refuse(path, "clip_qkv", f"clipping q/k/v to {hf['clip_qkv']}")
        if hf.get("hidden_act", "silu") != "silu" and self.refuses_act:
            refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
        sw = hf.get("sliding_window")
        layer_types = self.window_layers(hf, path, L, sw, self.uses_window(hf, sw, max_pos), max_pos)
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(field) is not None:
                refuse(path, field, "logit soft-capping")
        if hf.get("mlp_bias"):
            refuse(path, "mlp_bias", "biases in the feed-forward")
        self.check(hf, path)

        rope_theta = get(rope, "rope_theta", default=None) or get(hf, "rope_theta", default=10000.0)

        # -- layer plan --
        E, moe_inter, sparse = self.layer_plan(hf, L)
        shared_inter = self.shared_size(hf, moe_inter)
        top_k = self.top_k(hf)
        if E and not 1 <= top_k <= E:
            raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
        layers, start = [], 0
        for i in range(L):
            if sparse[i]:
                layers.append({"layer_id": i, "type": "moe_shared" if shared_inter > 0 else "moe",
                               "moe_expert_start": start, "moe_num_experts": E})
                start += E
            else:
                layers.append({"layer_id": i, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0})
        head_dim, bias, out_bias = self.attention(hf, H, nh)
        eos, bos = eos_bos(hf, gen)
        extra = self.extra(hf, path, layer_types, sw)
        if rope_scaling:
            extra["rope_scaling"] = rope_scaling
        return {
            **extra,
            "format_version": 1,
            "model_type": mt,
            "architectures": hf.get("architectures", []),
            "num_hidden_layers": L,
            "hidden_size": H,
            "intermediate_size": hf["intermediate_size"],
            "moe_intermediate_size": moe_inter,
            "num_attention_heads": nh,
            "num_key_value_heads": nkv,
            "head_dim": head_dim,
            "vocab_size": hf["vocab_size"],
            "max_position_embeddings": max_pos,
            "rope_theta": float(rope_theta),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": self.tied(hf, extra),
            "experts_per_layer": E,
            "top_k": top_k,
            "router_dtype": "float32",
            "router_mode": "topk",
            "norm_topk_prob": self.renormalise if self.renormalise is not None else
            bool(hf.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": shared_inter,
            "shared_expert_gate": shared_inter > 0 and self.shared_gate,
            "attention_bias": bool(bias),
            "attention_out_bias": bool(out_bias),
            "qk_norm": self.qk_norm,
            "eos_token_ids": eos,
            "bos_token_id": bos,
            "weight_dtype": dtype,
            "layers": layers,
        }

    def uses_window(self, hf: dict, sw, max_pos: int) -> bool:
        """Whether the config's sliding window is one (a window as long as the context is none)."""
        return sw not in (None, 0) and sw < max_pos

    def window_layers(self, hf: dict, path: str, L: int, sw, uses_window: bool, max_pos: int):
        """-> the config's layer_types (None: every layer full attention); a window refused by default."""
        if uses_window:
            refuse(path, "sliding_window", f"a sliding window of {sw} tokens, shorter than the context "
                   f"({max_pos})")
        return None

    def check(self, hf: dict, path: str):
        """The family's own refusals (after the common ones)."""

    def layer_plan(self, hf: dict, L: int) -> tuple:
        """-> (experts per MoE layer, expert width, [layer i is MoE]): Qwen's decoder_sparse_step and
        mlp_only_layers."""
        E = get(hf, "num_experts", "num_local_experts", default=0)
        moe_inter = self.moe_width(hf)
        step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        return E, moe_inter, [(i not in mlp_only) and E > 0 and (i + 1) % step == 0 for i in range(L)]

    def moe_width(self, hf: dict) -> int:
        return hf.get("moe_intermediate_size", hf["intermediate_size"])

    def shared_size(self, hf: dict, moe_inter: int) -> int:
        """The shared expert's width (0: none)."""
        return 0

    def top_k(self, hf: dict) -> int:
        return hf.get("num_experts_per_tok", 2)

    def attention(self, hf: dict, H: int, nh: int) -> tuple:
        """-> (head_dim, q/k/v biases, o bias)."""
        head_dim = get(hf, "head_dim", default=H // nh) if self.head_dim_field else H // nh
        bias = bool(hf.get("attention_bias", self.bias_default))
        return head_dim, bias, bias

    def extra(self, hf: dict, path: str, layer_types, sw) -> dict:
        """The family's optional config fields (validate.OPTIONAL)."""
        return {}

    def tied(self, hf: dict, extra: dict) -> bool:
        return bool(hf.get("tie_word_embeddings", False))

    # -- safetensors checkpoints -----------------------------------------------------------------
    def prepare_source(self, src, hf: dict, cfg: dict, progress: bool):
        """Renames / drops checkpoint tensors before the conversion (a wrapped model's text weights, towers
        and multi-token-prediction layers the engine does not run)."""

    def source_names(self, cfg: dict, src=None) -> dict:
        """Colibri tensor name -> Hugging Face tensor name, or (name, row0, row1) for rows of a fused
        tensor, or (name, fn) for a function of it (non-expert tensors). src, when given, picks between
        a checkpoint's naming variants."""
        m = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
        if cfg.get("mtp"):
            m.update(mtp_sources(cfg))
        for l in all_layers(cfg):
            i = l["layer_id"]
            p, s = f"layers.{i}.", f"model.layers.{i}."
            m[p + "input_norm"] = s + "input_layernorm.weight"
            m[p + "post_attention_norm"] = s + "post_attention_layernorm.weight"
            for x in "qkvo":
                m[p + f"attn.w{x}"] = s + f"self_attn.{x}_proj.weight"
                m[p + f"attn.b{x}"] = s + f"self_attn.{x}_proj.bias"
            m[p + "attn.q_norm"] = s + "self_attn.q_norm.weight"
            m[p + "attn.k_norm"] = s + "self_attn.k_norm.weight"
            for x in ("gate", "up", "down"):
                m[p + f"mlp.{x}"] = s + f"mlp.{x}_proj.weight"
                m[p + f"shared.{x}"] = s + f"mlp.shared_expert.{x}_proj.weight"
            m[p + "shared.gate_logit"] = s + "mlp.shared_expert_gate.weight"
            m[p + "router"] = s + f"{self.moe_prefix}.gate.weight"
            self.layer_sources(m, cfg, p, s, src)
        if src is not None and "lm_head.weight" not in src and not cfg["tie_word_embeddings"] and \
                cfg.get("folded_multipliers"):
            m["lm_head"] = "model.embed_tokens.weight"         # tied in the checkpoint, untied by folding
        return m

    def layer_sources(self, m: dict, cfg: dict, p: str, s: str, src):
        """The family's changes to a layer's names in source_names (p: ours "layers.N.", s: the
        checkpoint's "model.layers.N.")."""

    def fold_factors(self, cfg: dict) -> dict:
        """Colibri tensor name -> the factor convert() multiplies it by; the routed experts' down
        projections get factors["expert.down"]."""
        return {}

    def packed_experts(self, src, layer: int) -> bool:
        """Whether a layer's experts are stored packed (kept in their format when no --dtype is given)."""
        return False

    def fused_gate_up(self, src, cfg: dict, fused: str, j: int):
        """-> (gate, up, down) getters of expert j from a fused gate_up_proj (transformers 5's layout
        [E, 2I, H] with gate rows first, down_proj [E, H, I])."""
        I = cfg["moe_intermediate_size"]
        gu = lambda: src.float32(fused + "gate_up_proj", j)         # noqa: E731
        return (lambda: gu()[:I].copy(), lambda: gu()[I:].copy(),
                lambda: src.float32(fused + "down_proj", j)), [fused + "gate_up_proj", fused + "down_proj"]

    def expert_sources(self, src, cfg: dict, layer: int, j: int):
        """-> callables giving gate [I,H], up [I,H], down [H,I] in float32 for expert j of a layer, and
        the source names they read. Every layout a family of ours stores is tried in turn."""
        s = f"model.layers.{layer}."
        for moe in ("block_sparse_moe", "mlp", ""):
            moe = moe and moe + "."                          # "": Gemma 4's layers.N.experts
            per = s + f"{moe}experts.{j}."
            if per + "w1.weight" in src:                      # w1 gate, w3 up, w2 down (Mixtral's names)
                return (lambda: src.float32(per + "w1.weight"), lambda: src.float32(per + "w3.weight"),
                        lambda: src.float32(per + "w2.weight")), [per + n for n in ("w1.weight", "w3.weight",
                                                                                   "w2.weight")]
            if per + "gate_proj.weight" in src:
                names = [per + f"{x}_proj.weight" for x in ("gate", "up", "down")]
                return tuple((lambda n=n: src.float32(n)) for n in names), names
            if s + f"{moe}input_linear.weight" in src:          # input_linear [E, 2I, H] = [gate; up] (Granite)
                I = cfg["moe_intermediate_size"]
                gi, do = s + f"{moe}input_linear.weight", s + f"{moe}output_linear.weight"
                gu = lambda: src.float32(gi, j)                  # noqa: E731
                return (lambda: gu()[:I].copy(), lambda: gu()[I:].copy(), lambda: src.float32(do, j)), [gi, do]
            fused = s + f"{moe}experts."
            if fused + "gate_up_proj" in src:
                return self.fused_gate_up(src, cfg, fused, j)
        raise invalid_model(f"model.layers.{layer}", f"experts.{j}", "expert weights not found in the checkpoint")

    # -- GGUF files ------------------------------------------------------------------------------
    gguf_ff_required = False        # feed_forward_length must be present
    gguf_ff_exp_required = False    # expert_feed_forward_length must be present
    gguf_dense_ok = True            # leading_dense_block_count may be > 0
    gguf_norm_topk = False          # routing renormalised when the file has no expert_weights_norm
    gguf_yarn = False               # YaRN rope scaling accepted
    gguf_window = False             # a sliding window accepted
    gguf_interleaved = False        # q/k rows stored with adjacent rope pairs (un-permuted on import)
    gguf_partial_rotary = False     # rope.dimension_count < key_length accepted (the family reorders the rows)

    def gguf_config(self, m, arch: str) -> dict:
        """The Hugging Face-shaped config the {arch}.* metadata describes (translate's input, so that a
        GGUF and a safetensors checkpoint of one model give the same config)."""
        a = arch + "."
        g = lambda k, kind=int, **kw: m.get(a + k, kind, **kw)            # noqa: E731
        L = pos(m, a + "block_count", g("block_count"), 1, validate.MAX_LAYERS)
        H = pos(m, a + "embedding_length", g("embedding_length"))
        nh = pos(m, a + "attention.head_count", g("attention.head_count"), 1, validate.MAX_HEADS)
        nkv = pos(m, a + "attention.head_count_kv", g("attention.head_count_kv", required=False, default=nh), 1, nh)
        E = pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
        if E == 0:
            raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE, f"{m.path}: field '{a}expert_count': a dense {arch} "
                               "model (no experts); Colibri runs mixture-of-experts models")
        k = pos(m, a + "expert_used_count", g("expert_used_count"), 1, validate.MAX_EXPERTS)
        if k > E:
            raise invalid_model(m.path, a + "expert_used_count", f"{k} experts per token of {E}")
        ff = pos(m, a + "feed_forward_length", g("feed_forward_length", required=self.gguf_ff_required))
        ff_exp = pos(m, a + "expert_feed_forward_length",
                     g("expert_feed_forward_length", required=self.gguf_ff_exp_required, default=ff))
        dense = pos(m, a + "leading_dense_block_count", g("leading_dense_block_count", required=False, default=0),
                    0, L)
        if dense and not self.gguf_dense_ok:
            raise invalid_model(m.path, a + "leading_dense_block_count", f"{dense} dense layers in a {arch} model; "
                                "Colibri's layer plan for it has none")
        head_dim = pos(m, a + "attention.key_length", g("attention.key_length", required=False, default=H // nh))
        vdim = g("attention.value_length", required=False, default=head_dim)
        if vdim != head_dim:
            raise invalid_model(m.path, a + "attention.value_length", f"{vdim} differs from key_length {head_dim}; "
                                "Colibri's attention needs them equal")
        rot = g("rope.dimension_count", required=False, default=head_dim)
        if rot != head_dim and not (self.gguf_partial_rotary and 2 <= rot < head_dim and rot % 2 == 0):
            raise invalid_model(m.path, a + "rope.dimension_count", f"{rot} of {head_dim}: partial rotary "
                                "embeddings are not implemented")
        scaling = g("rope.scaling.type", str, required=False, default="none")
        factor = g("rope.scaling.factor", float, required=False, default=1.0)
        if scaling not in ("none", "") and factor != 1.0 and not (self.gguf_yarn and scaling == "yarn"):
            raise invalid_model(m.path, a + "rope.scaling.type", f"rope scaling {scaling!r} x{factor} is not "
                                "implemented")
        ctx = pos(m, a + "context_length", g("context_length", required=False, default=4096), 1,
                  validate.MAX_POSITIONS)
        window = g("attention.sliding_window", required=False, default=0)
        if window and window < ctx and not self.gguf_window:
            raise invalid_model(m.path, a + "attention.sliding_window", f"a window of {window} tokens, shorter "
                                f"than the context ({ctx}): sliding-window attention is not implemented")
        gating = g("expert_gating_func", required=False, default=1)
        if gating != 1:
            raise invalid_model(m.path, a + "expert_gating_func", f"{gating}: only softmax gating (1) is implemented")
        scale = g("expert_weights_scale", float, required=False, default=1.0)
        if scale != 1.0:
            raise invalid_model(m.path, a + "expert_weights_scale", f"{scale}: scaled expert weights are not "
                                "implemented")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if g(key, float, required=False):
                raise invalid_model(m.path, a + key, "logit soft-capping is not implemented")
        eps = g("attention.layer_norm_rms_epsilon", float)
        if not 0 < eps < 1:
            raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
        theta = g("rope.freq_base", float, required=False, default=10000.0)
        if not theta > 0:
            raise invalid_model(m.path, a + "rope.freq_base", f"{theta} is not positive")
        V = gguf_vocab(m)
        vocab = g("vocab_size", required=False, default=V)
        if vocab != V:
            raise invalid_model(m.path, a + "vocab_size", f"{vocab}, but token_embd.weight has {V} rows")
        hf = {"model_type": self.gguf_model_type, "architectures": [], "num_hidden_layers": L, "hidden_size": H,
              "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": head_dim, "vocab_size": V,
              "max_position_embeddings": ctx, "rope_theta": theta, "rms_norm_eps": eps, "num_experts_per_tok": k,
              "tie_word_embeddings": "output.weight" not in m.tensors,
              "norm_topk_prob": g("expert_weights_norm", bool, required=False, default=self.gguf_norm_topk)}
        if rot != head_dim:             # the first rot dims of a head rotate (half-split pairs)
            hf["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rot / head_dim}
        self.gguf_fields(m, g, hf, dict(a=a, L=L, E=E, k=k, ff=ff, ff_exp=ff_exp, dense=dense, theta=theta,
                                        scaling=scaling, factor=factor, window=window))
        return hf

    def gguf_fields(self, m, g, hf: dict, d: dict):
        """The family's fields of the Hugging Face-shaped config (d: what gguf_config read). Default:
        Qwen's experts, dense layers before leading_dense_block_count."""
        hf.update(num_experts=d["E"], moe_intermediate_size=d["ff_exp"], intermediate_size=d["ff"] or d["ff_exp"],
                  decoder_sparse_step=1, mlp_only_layers=list(range(d["dense"])),
                  attention_bias="blk.0.attn_q.bias" in m.tensors)

    def gguf_fixup(self, cfg: dict, m):
        """Adjusts the translated config to the file (what only its tensors tell)."""

    def gguf_names(self, cfg: dict) -> dict:
        """Our tensor name -> GGUF tensor name (non-expert tensors)."""
        m = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
        if cfg.get("mtp"):                      # llama.cpp's nextn tensors (eh_proj split by gguf_import)
            n = f"blk.{cfg['num_hidden_layers']}.nextn."
            m.update({"mtp.enorm": n + "enorm.weight", "mtp.hnorm": n + "hnorm.weight",
                      "mtp.norm": n + "shared_head_norm.weight", "mtp.e_proj": n + "eh_proj.weight",
                      "mtp.h_proj": n + "eh_proj.weight", "mtp.head": n + "shared_head_head.weight",
                      "mtp.embed": n + "embed_tokens.weight"})
        for layer in all_layers(cfg):
            i = layer["layer_id"]
            p, b = f"layers.{i}.", f"blk.{i}."
            m[p + "input_norm"] = b + "attn_norm.weight"
            m[p + "post_attention_norm"] = b + "ffn_norm.weight"
            for x, g in zip("qkvo", ("attn_q", "attn_k", "attn_v", "attn_output")):
                m[p + f"attn.w{x}"] = b + g + ".weight"
                m[p + f"attn.b{x}"] = b + g + ".bias"
            m[p + "attn.q_norm"] = b + "attn_q_norm.weight"
            m[p + "attn.k_norm"] = b + "attn_k_norm.weight"
            m[p + "router"] = b + "ffn_gate_inp.weight"
            m[p + "router_choice_bias"] = b + "exp_probs_b.bias"
            for x in ("gate", "up", "down"):
                m[p + f"mlp.{x}"] = b + f"ffn_{x}.weight"
                m[p + f"shared.{x}"] = b + f"ffn_{x}_shexp.weight"
            m[p + "shared.gate_logit"] = b + "ffn_gate_inp_shexp.weight"
            self.gguf_layer_names(m, cfg, p, b)
        return m

    def gguf_layer_names(self, m: dict, cfg: dict, p: str, b: str):
        """The family's changes to a layer's names in gguf_names (p: "layers.N.", b: "blk.N.")."""

    def gguf_tensor(self, tz, cfg: dict, what: str, name: str, role) -> tuple:
        """(data, format) of our tensor `what` from the file's `name` (role: (shape, role) of
        modeldir.tensor_roles): as stored, q/k rows un-permuted where the arch holds adjacent rope pairs."""
        shape, r = role
        data, fmt = tz.stored(name, shape, float32=r == "float32")
        part = what.split(".", 2)[-1]
        if self.gguf_interleaved:
            heads = {"attn.wq": cfg["num_attention_heads"], "attn.bq": cfg["num_attention_heads"],
                     "attn.wk": cfg["num_key_value_heads"], "attn.bk": cfg["num_key_value_heads"]}
            if part in heads:
                data = unpermute(data, heads[part])
        return data, fmt

    def gguf_skipped(self, m, cfg: dict, arch: str, progress: bool) -> set:
        """File tensors read outside the tensor map (or not run): not left over."""
        return set()
