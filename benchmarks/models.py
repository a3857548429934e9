"""The benchmark model, built once and cached under benchmarks/cache/ (git-ignored).

    hf/             Hugging Face checkpoint (save_pretrained, float32), random weights std 1/sqrt(fan_in)
    colibri-<dt>/   `colibri convert --dtype <dt>` of it, for every weight type the converter knows
    model-<q>.gguf  the same weights for llama.cpp (f32, f16, q8_0), written with the `gguf` library
    model-llq-<q>.gguf  model-f32.gguf quantised by llama.cpp's own quantiser (llama_model_quantize:
                    Q4_0, Q4_K_M, Q8_0, Q3_K_M, IQ4_XS, its default per-tensor mix, no importance matrix)
    colibri-gguf-<q>/   `colibri convert model-llq-<q>.gguf`: Colibri on the very file llama.cpp runs
    prompts.json    the prompts every engine runs (token ids)

A directory is reused only when its stamp (`.bench-stamp.json`) matches the spec it was built from.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "cache")

# Mixtral-shaped: ~640M parameters, ~192M read per decoded token (lm_head + attention + 2 of 8 experts)
FULL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            num_local_experts=8, num_experts_per_tok=2, intermediate_size=2816, vocab_size=32000)
# the same shape family, small enough to iterate on
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_local_experts=8, num_experts_per_tok=2, intermediate_size=704, vocab_size=4096)
COMMON = dict(max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SEED = 1234

BYTES_PER_ELEMENT = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def spec(small: bool) -> dict:
    return {**(SMALL if small else FULL), **COMMON}


def cache_dir(small: bool) -> str:
    return os.path.join(CACHE, "small" if small else "full")


def _stamp(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _fresh(path: str, stamp: str) -> bool:
    p = os.path.join(path, ".bench-stamp.json") if os.path.isdir(path) else path + ".stamp.json"
    try:
        return json.load(open(p))["stamp"] == stamp
    except (OSError, ValueError, KeyError):
        return False


def _mark(path: str, stamp: str, **extra):
    p = os.path.join(path, ".bench-stamp.json") if os.path.isdir(path) else path + ".stamp.json"
    with open(p, "w") as f:
        json.dump({"stamp": stamp, **extra}, f, indent=1)


def param_counts(s: dict) -> dict:
    """Element counts by kind, from the spec (no files needed)."""
    H, L, V = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    hd, nh, nkv = s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"]
    E, k, I = s["num_local_experts"], s["num_experts_per_tok"], s["intermediate_size"]
    attn = H * hd * (2 * nh + 2 * nkv)
    expert = 3 * H * I
    return {"embed": V * H, "lm_head": V * H, "attn_per_layer": attn, "router_per_layer": E * H,
            "norms": (2 * L + 1) * H, "expert": expert, "layers": L, "experts_per_layer": E, "top_k": k,
            "hidden": H,
            "total": 2 * V * H + L * (attn + E * H + E * expert + 2 * H) + H,
            "read_per_token": V * H + H + L * (attn + E * H + k * expert + 2 * H) + H}


# ------------------------------------------------------------------------------------------------
# the Hugging Face checkpoint

def build_hf(path: str, s: dict, log=print) -> str:
    stamp = _stamp({"spec": s, "seed": SEED, "v": 2})
    if _fresh(path, stamp):
        return path
    import torch
    from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM
    log(f"building the HF checkpoint at {path} ...")
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(SEED)
    cfg = MixtralConfig(**s)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)                                   # RMSNorm weights, as at init
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))   # std 1/sqrt(fan_in)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path)
    del model
    # to_empty leaves non-persistent buffers (rotary inv_freq) uninitialised; from_pretrained rebuilds
    # them, so every engine, transformers included, loads from disk.
    _mark(path, stamp)
    return path


class HFWeights:
    """float32 numpy views of the checkpoint, legacy (w1/w2/w3) or fused (gate_up_proj) expert layout."""

    def __init__(self, path: str):
        from safetensors import safe_open
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        self.handles = [safe_open(os.path.join(path, f), "np") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def __contains__(self, name):
        return name in self.where

    def get(self, name) -> np.ndarray:
        return np.asarray(self.where[name].get_tensor(name), dtype=np.float32)

    def experts(self, layer: int, E: int):
        """-> gate [E,I,H], up [E,I,H], down [E,H,I] float32."""
        for moe in ("block_sparse_moe", "mlp"):
            p = f"model.layers.{layer}.{moe}.experts."
            if p + "0.w1.weight" in self:
                g = np.stack([self.get(p + f"{j}.w1.weight") for j in range(E)])
                u = np.stack([self.get(p + f"{j}.w3.weight") for j in range(E)])
                d = np.stack([self.get(p + f"{j}.w2.weight") for j in range(E)])
                return g, u, d
            if p + "gate_up_proj" in self:
                gu, d = self.get(p + "gate_up_proj"), self.get(p + "down_proj")
                I = gu.shape[1] // 2
                return gu[:, :I], gu[:, I:], d
        raise KeyError(f"layer {layer}: expert weights not found")

    def router(self, layer: int) -> np.ndarray:
        for moe in ("block_sparse_moe", "mlp"):
            n = f"model.layers.{layer}.{moe}.gate.weight"
            if n in self:
                return self.get(n)
        raise KeyError(f"layer {layer}: router not found")


# ------------------------------------------------------------------------------------------------
# Colibri model directories

def colibri_dtypes() -> list:
    """Weight types `colibri convert --dtype` accepts (int8 is picked up once the converter has it)."""
    from colibri_edge.model.dtypes import WEIGHT_DTYPES
    order = ["float32", "float16", "bfloat16", "int8"]        # the block formats come from GGUF files
    return [d for d in order if d in WEIGHT_DTYPES]


def cpu_backend_dtypes() -> tuple:
    from colibri_edge.backends.cpu.backend import Backend
    return tuple(Backend.weight_dtypes)


def _converter_source_hash(extra=()) -> str:
    """The converter's code, so a model directory is rebuilt when its format may have changed."""
    import colibri_edge
    root = os.path.join(os.path.dirname(colibri_edge.__file__), "model")   # the converters and the families
    h = hashlib.sha256()
    names = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".py"))
    for name in (*names, *extra):
        with open(os.path.join(root, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def build_colibri(hf: str, out: str, dtype: str, log=print) -> str:
    hf_stamp = json.load(open(os.path.join(hf, ".bench-stamp.json")))["stamp"]
    stamp = _stamp({"hf": hf_stamp, "dtype": dtype, "converter": _converter_source_hash()})
    return _colibri_convert([hf, out, "--dtype", dtype], out, stamp, log)


def _colibri_convert(args, out, stamp, log) -> str:
    """`colibri convert ARGS --quiet` into out, unless out's stamp is already `stamp`."""
    if _fresh(out, stamp):
        return out
    log(f"colibri convert {' '.join(os.path.basename(a) for a in args)} ...")
    shutil.rmtree(out, ignore_errors=True)
    exe = os.path.join(os.path.dirname(sys.executable), "colibri")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "colibri_edge"]
    subprocess.run(cmd + ["convert", *args, "--quiet"], check=True)
    _mark(out, stamp)
    return out


# ------------------------------------------------------------------------------------------------
# GGUF for llama.cpp

def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> GGUF's interleaved pairs (llama.cpp convert_hf_to_gguf's permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _vocab(V: int):
    """A SentencePiece-style vocabulary of V placeholder tokens (the model has no tokenizer; every
    engine is fed token ids): <unk> <s> </s>, the 256 byte tokens, then numbered pieces."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += [f"\u2581t{i}" for i in range(len(tokens), V)]
    types += [1] * (V - len(types))
    return tokens[:V], [-float(i) for i in range(V)], types[:V]


def build_gguf(hf: str, out: str, qtype: str, s: dict, log=print) -> dict:
    """Write a llama-arch MoE GGUF ('f32', 'f16' or 'q8_0'). -> info: bytes per decoded token, tensor bytes."""
    import gguf
    hf_stamp = json.load(open(os.path.join(hf, ".bench-stamp.json")))["stamp"]
    stamp = _stamp({"hf": hf_stamp, "qtype": qtype, "v": 3})
    if os.path.exists(out) and _fresh(out, stamp):
        return json.load(open(out + ".stamp.json"))["info"]
    log(f"writing {out} ({qtype}) with the gguf library ...")
    H, L, V = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    nh, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    E, k, I = s["num_local_experts"], s["num_experts_per_tok"], s["intermediate_size"]
    Q = gguf.GGMLQuantizationType
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    hfw = HFWeights(hf)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e6))

    tmp = out + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name("colibri-bench-mixtral")
    w.add_context_length(s["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_rope_dimension_count(hd)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(s["rms_norm_eps"])
    w.add_rope_freq_base(float(theta))
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_vocab_size(V)
    w.add_file_type(ftype)
    tokens, scores, types = _vocab(V)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)

    sizes = {}

    def put(name, arr, keep_f32=False):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if keep_f32 or arr.ndim == 1 or qtype == "f32":
            data = arr
            w.add_tensor(name, data)
        elif qtype == "f16":
            data = arr.astype(np.float16)
            w.add_tensor(name, data)
        else:
            data = gguf.quants.quantize(arr, Q.Q8_0)
            w.add_tensor(name, data, raw_dtype=Q.Q8_0)
        sizes[name] = data.nbytes

    put("token_embd.weight", hfw.get("model.embed_tokens.weight"))
    put("output_norm.weight", hfw.get("model.norm.weight"))
    put("output.weight", hfw.get("lm_head.weight"))
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", hfw.get(p + "input_layernorm.weight"))
        put(b + "attn_q.weight", permute_rotary(hfw.get(p + "self_attn.q_proj.weight"), nh))
        put(b + "attn_k.weight", permute_rotary(hfw.get(p + "self_attn.k_proj.weight"), nkv))
        put(b + "attn_v.weight", hfw.get(p + "self_attn.v_proj.weight"))
        put(b + "attn_output.weight", hfw.get(p + "self_attn.o_proj.weight"))
        put(b + "ffn_norm.weight", hfw.get(p + "post_attention_layernorm.weight"))
        put(b + "ffn_gate_inp.weight", hfw.router(i), keep_f32=True)   # as convert_hf_to_gguf: router in f32
        g, u, d = hfw.experts(i, E)
        put(b + "ffn_gate_exps.weight", g)
        put(b + "ffn_up_exps.weight", u)
        put(b + "ffn_down_exps.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)

    # bytes read per decoded token: one embedding row, every non-expert tensor, top_k experts a layer
    emb = sizes["token_embd.weight"]
    expert_bytes = sum(sizes[f"blk.0.ffn_{x}_exps.weight"] for x in ("gate", "up", "down")) // E
    non_expert = sum(v for n, v in sizes.items() if "_exps" not in n)
    info = {"qtype": qtype, "file_bytes": os.path.getsize(out), "bytes_per_expert": expert_bytes,
            "bytes_per_decoded_token": non_expert - emb + emb // V + L * k * expert_bytes,
            "non_expert_read_bytes": non_expert - emb + emb // V}
    _mark(out, stamp, info=info)
    return info


# ------------------------------------------------------------------------------------------------

def prompts(s: dict, prompt_len: int, batch: int) -> list:
    """`batch` different prompts of prompt_len random ids (no special tokens), the same for every engine."""
    rng = np.random.default_rng(SEED + prompt_len)
    return [rng.integers(3, s["vocab_size"], size=prompt_len).tolist() for _ in range(batch)]


LLAMA_QUANTS = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
                "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}


def gguf_read_facts(path: str, s: dict) -> dict:
    """Bytes a decoded token reads from a GGUF (one embedding row, every non-expert tensor, top_k
    experts a layer), and its tensor types, from the file's own tensor table."""
    import gguf
    r = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    types = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_elements)
    L, E, k, V = s["num_hidden_layers"], s["num_local_experts"], s["num_experts_per_tok"], s["vocab_size"]
    emb = sizes["token_embd.weight"]
    expert = [sum(sizes[f"blk.{i}.ffn_{x}_exps.weight"] for x in ("gate", "up", "down")) / E for i in range(L)]
    non_expert = sum(v for n, v in sizes.items() if "_exps" not in n) - emb + emb // V
    return {"file_bytes": os.path.getsize(path), "bytes_per_expert": float(np.mean(expert)),
            "bytes_per_decoded_token": non_expert + k * sum(expert), "non_expert_read_bytes": non_expert,
            "elements_by_type": types}


def build_llama_quant(src: str, out: str, q: str, s: dict, log=print) -> dict:
    """model-f32.gguf -> llama.cpp's quantiser's `q` file (its default mix for the file type)."""
    import llama_cpp
    stamp = _stamp({"src": json.load(open(src + ".stamp.json"))["stamp"], "q": q,
                    "llama_cpp": llama_cpp.__version__})
    if not (os.path.exists(out) and _fresh(out, stamp)):
        log(f"llama_model_quantize {q} -> {out} ...")
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = getattr(llama_cpp, LLAMA_QUANTS[q])
        p.nthread = 2
        rc = llama_cpp.llama_model_quantize(src.encode(), (out + ".tmp").encode(), p)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({q}) returned {rc}")
        os.replace(out + ".tmp", out)
        _mark(out, stamp)
    return {"qtype": q, **gguf_read_facts(out, s)}


def build_colibri_from_gguf(gguf_path: str, out: str, log=print) -> str:
    stamp = _stamp({"gguf": json.load(open(gguf_path + ".stamp.json"))["stamp"],
                    "converter": _converter_source_hash()})
    return _colibri_convert([gguf_path, out], out, stamp, log)


def build_all(small: bool, with_gguf: bool = True, log=print) -> dict:
    """Build (or reuse) everything; -> paths and facts the runner needs."""
    s = spec(small)
    root = cache_dir(small)
    os.makedirs(root, exist_ok=True)
    hf = build_hf(os.path.join(root, "hf"), s, log)
    col = {dt: build_colibri(hf, os.path.join(root, f"colibri-{dt}"), dt, log) for dt in colibri_dtypes()}
    gg, llq = {}, {}
    if with_gguf:
        for q in ("f32", "f16", "q8_0"):
            path = os.path.join(root, f"model-{q}.gguf")
            gg[q] = {"path": path, **build_gguf(hf, path, q, s, log)}
        for q in LLAMA_QUANTS:
            path = os.path.join(root, f"model-llq-{q}.gguf")
            llq[q] = {"path": path, **build_llama_quant(gg["f32"]["path"], path, q, s, log),
                      "colibri": build_colibri_from_gguf(path, os.path.join(root, f"colibri-gguf-{q}"), log)}
    return {"spec": s, "root": root, "hf": hf, "colibri": col, "gguf": gg, "llama_quants": llq,
            "params": param_counts(s)}


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="build (or reuse) the benchmark model in every format")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--no-gguf", action="store_true")
    ap.add_argument("--out", help="write the paths and facts as JSON here")
    a = ap.parse_args(argv)
    info = build_all(a.small, with_gguf=not a.no_gguf, log=lambda m: print(m, file=sys.stderr, flush=True))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(info, f, indent=1)
    else:
        print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
