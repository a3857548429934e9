"""LoRA adapters: PEFT's `adapter_config.json` + `adapter_model.safetensors` read, checked and mapped
onto a model's matrices (docs/lora.md).

A LoRA adapter changes a weight W [out, in] by a low-rank product, in float32:

    W' = W + s B A,    A [r, in], B [out, r],   s = lora_alpha / r   (use_rslora: lora_alpha / sqrt(r))

so y = W' x = W x + s B (A x): the update costs r (in + out) multiply-adds per token instead of a
second copy of W. PEFT stores A and B per adapted module (`<module>.lora_A.weight`, `.lora_B.weight`),
r and lora_alpha in the config (`rank_pattern` / `alpha_pattern` per module, matched as PEFT matches
them: the pattern against the module name's dotted suffix). A fused expert parameter (transformers 5's
`experts.gate_up_proj` / `experts.down_proj`, adapted through PEFT's `target_parameters`) holds every
expert's factors in one pair, PEFT's layout:

    A [r E, in]  -> expert e's A_e = A.reshape(E, r, in)[e]
    B [out, r E] -> expert e's B_e = B.reshape(out, r, E)[:, :, e]
    delta_e [out, in] = s B_e A_e          (out = 2I for gate_up: gate rows then up rows; I x H for down)

where a checkpoint whose parameter is stored [E, in, out] (gpt-oss: `is_transposed`) has the same
(in, out) by PEFT's convention; its gate and up rows interleave (Family.lora_gate_up).

Two ways to use an adapter, from the same mapping (`resolve`):
  * merged at conversion (`colibri convert HF OUT --lora DIR`): W + s B A added to each matrix read
    from the checkpoint, before the family's layout changes and before quantisation;
  * at run time (runtime/lora.py): each adapted matrix's (A, s B) carried through the same layout
    changes that convert applies to W's rows (row slices of fused tensors, row permutations, folded
    multipliers), so that (s B') A equals the converted matrix's change row for row.

Other adapter kinds (DoRA, IA3, prompt tuning, LoRA variants with extra state) are refused by name,
never approximated."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, invalid_model

PREFIX = "base_model.model."
# config fields that change what an adapter computes beyond W + s B A: refused when set (named)
REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "LoRA with a bias on lora_B",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "modules_to_save": "modules_to_save (fully trained copies of whole modules)",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "kasa_config": "KaSA",
    "arrow_config": "Arrow routing",
    "monteclora_config": "MonteCLoRA",
}
PER_EXPERT = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
FUSED_EXPERTS = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:.*\.)?experts$")
PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclass
class Pair:
    """One adapted matrix (or fused expert parameter): A [R, in], B [out, R] float32, its scale s."""
    module: str
    a: np.ndarray
    b: np.ndarray
    scale: float
    r: int


@dataclass
class Adapter:
    """An adapter as read: its pairs by module (a fused experts module may hold two: gate_up, down)."""
    path: str
    config: dict
    pairs: dict = field(default_factory=dict)        # module -> [Pair]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for ps in self.pairs.values() for p in ps)

    @property
    def rank(self) -> int:
        return max((p.r for ps in self.pairs.values() for p in ps), default=0)


def _pattern(patterns: dict, module: str):
    """PEFT's get_pattern_key: the first pattern key matching the module name's dotted suffix."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _check_config(cfg: dict, path: str):
    f = os.path.join(path, "adapter_config.json")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise invalid_model(f, "peft_type", f"{kind!r} adapters are not supported; Colibri runs LoRA adapters "
                            "(peft_type LORA)")
    for key, what in REFUSED_FIELDS.items():
        if cfg.get(key) not in (None, False, {}, [], ""):
            raise invalid_model(f, key, f"{what} is not supported; train or export a plain LoRA adapter")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 << 20:
            raise invalid_model(f, key, f"{v!r} is not a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(key) or {}
        if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                                              for x in v.values()):
            raise invalid_model(f, key, f"{v!r:.80}: expected a map of module patterns to positive numbers")
        for k in v:
            try:
                re.compile(k)
            except re.error as e:
                raise invalid_model(f, key, f"pattern {k!r} is not a regular expression ({e})") from None
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise invalid_model(f, "use_rslora", f"{cfg.get('use_rslora')!r} is not true or false")


def read_adapter(path: str) -> Adapter:
    """A PEFT LoRA adapter directory -> Adapter, every field and tensor checked (refused, named,
    COLIBRI_ERR_INVALID_MODEL, when malformed or of another kind)."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return read_gguf_adapter(path)
    cpath = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cpath):
        raise invalid_model(cpath, "(file)", "missing; an adapter is a directory PEFT's save_pretrained wrote "
                            "(adapter_config.json + adapter_model.safetensors), or llama.cpp's LoRA .gguf")
    try:
        cfg = json.load(open(cpath))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid_model(cpath, "(json)", f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise invalid_model(cpath, "(json)", "expected a JSON object")
    _check_config(cfg, path)
    wpath = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(wpath):
        alt = os.path.join(path, "adapter_model.bin")
        raise invalid_model(wpath, "(file)", "missing" + (" (adapter_model.bin is a pickle, not read: save the "
                                                          "adapter with safe_serialization=True)"
                                                          if os.path.exists(alt) else ""))
    from safetensors import SafetensorError, safe_open
    tensors = {}
    try:
        with safe_open(wpath, "np") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise invalid_model(wpath, "(header)", f"not a readable safetensors file ({e})") from None
    return Adapter(path, cfg, _pairs(tensors, cfg, wpath))


def _pairs(tensors: dict, cfg: dict, wpath: str) -> dict:
    halves = {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        m = re.match(r"^(.*?)((?:\.base_layer)*)\.lora_(A|B)(?:\.[^.]+)?\.weight$", name)
        if m is None:
            what = ("DoRA magnitudes" if "lora_magnitude" in name else "LoRA embeddings" if "lora_embedding" in name
                    else "a tensor that is not a LoRA factor")
            raise invalid_model(wpath, key, f"{what}: not supported (an adapter holds <module>.lora_A.weight and "
                                "<module>.lora_B.weight only)")
        if t.ndim != 2 or t.dtype.kind != "f" or 0 in t.shape:
            raise invalid_model(wpath, key, f"shape {list(t.shape)} {t.dtype}: a LoRA factor is a non-empty float "
                                "matrix")
        arr = np.asarray(t, np.float32)
        if not np.isfinite(arr).all():
            raise invalid_model(wpath, key, "holds NaN or inf values; the adapter is damaged")
        halves.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = (key, arr)
    pairs = {}
    for (module, nest), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            miss = "B" if "A" in ab else "A"
            raise invalid_model(wpath, f"{PREFIX}{module}{nest}.lora_{miss}.weight", "missing (LoRA factors come "
                                "in pairs)")
        (ka, a), (kb, b) = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise invalid_model(wpath, kb, f"shape {list(b.shape)} does not match lora_A's {list(a.shape)} "
                                f"(B [out, r] after A [r, in])")
        rp = _pattern(cfg.get("rank_pattern") or {}, module)
        r = int(cfg["rank_pattern"][rp]) if rp else int(cfg["r"])
        ap = _pattern(cfg.get("alpha_pattern") or {}, module)
        alpha = float(cfg["alpha_pattern"][ap]) if ap else float(cfg["lora_alpha"])
        if a.shape[0] % r:
            raise invalid_model(wpath, ka, f"{a.shape[0]} rows: not a multiple of the rank r={r} the config gives "
                                f"{module}")
        scale = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
        pairs.setdefault(module, []).append(Pair(module, a, b, scale, r))
    if not pairs:
        raise invalid_model(wpath, "(tensors)", "no LoRA factors")
    return pairs


def read_gguf_adapter(path: str) -> Adapter:
    """llama.cpp's LoRA GGUF (convert_lora_to_gguf.py): general.type "adapter", adapter.type "lora",
    adapter.lora.alpha; tensors <base tensor>.lora_a [r, in] and .lora_b [out, r] (ggml's order
    reversed), named as the base model's GGUF tensors. Kept under those names: resolve() maps them
    through the family's GGUF names."""
    import gguf
    try:
        rd = gguf.GGUFReader(path)
    except Exception as e:                                          # noqa: BLE001 (any parse failure)
        raise invalid_model(path, "(header)", f"not a readable GGUF file ({type(e).__name__}: {e})") from None

    def meta(key):
        f = rd.fields.get(key)
        if f is None:
            return None
        v = f.contents()
        return v

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise invalid_model(path, "adapter.type", f"general.type {meta('general.type')!r}, adapter.type "
                            f"{meta('adapter.type')!r}: not a LoRA adapter (llama.cpp's convert_lora_to_gguf.py "
                            "writes one)")
    alpha = meta("adapter.lora.alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise invalid_model(path, "adapter.lora.alpha", f"{alpha!r} is not a positive number")
    halves = {}
    for t in rd.tensors:
        m = re.match(r"^(.*)\.lora_(a|b)$", t.name)
        if m is None:
            raise invalid_model(path, t.name, "not a LoRA factor (<tensor>.lora_a / .lora_b)")
        if t.tensor_type.name not in ("F32", "F16", "BF16"):
            raise invalid_model(path, t.name, f"type {t.tensor_type.name}: LoRA factors are read in F32, F16 or BF16")
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        arr = arr.reshape([int(x) for x in reversed(t.shape)]) if arr.ndim != len(t.shape) else arr
        if arr.ndim != 2 or not np.isfinite(arr).all():
            raise invalid_model(path, t.name, f"shape {list(arr.shape)}: expected a finite matrix")
        halves.setdefault(m.group(1), {})[m.group(2)] = arr
    pairs = {}
    for name, ab in sorted(halves.items()):
        if set(ab) != {"a", "b"}:
            raise invalid_model(path, name + (".lora_b" if "a" in ab else ".lora_a"), "missing (factors come in pairs)")
        a, b = ab["a"], ab["b"]
        if a.shape[0] != b.shape[1]:
            raise invalid_model(path, name + ".lora_b", f"shape {list(b.shape)} does not match lora_a's "
                                f"{list(a.shape)}")
        r = a.shape[0]
        pairs[name] = [Pair(name, a, b, float(alpha) / r, r)]
    if not pairs:
        raise invalid_model(path, "(tensors)", "no LoRA factors")
    return Adapter(path, {"peft_type": "LORA", "lora_alpha": alpha, "format": "gguf"}, pairs)


# ----------------------------------------------------------------------------------------------
# mapping onto a model

@dataclass
class Resolved:
    """An adapter mapped onto a model of config `cfg`, in the checkpoint's terms:
        linear   source tensor name ("model.layers.0.self_attn.q_proj.weight", or a GGUF tensor name)
                 -> (A [r, in], sB [out, r])
        experts  (layer, expert) -> {"gate" | "up" | "down": (A, sB)} in Colibri's orientation
                 (gate/up [I, H] change, down [H, I])"""
    linear: dict
    experts: dict
    gguf: bool = False

    def delta(self, name: str):
        """The float32 change of a checkpoint tensor, or None."""
        f = self.linear.get(name)
        return None if f is None else f[1] @ f[0]


def _experts_of(cfg: dict, layer: int) -> int:
    for spec in cfg["layers"]:
        if spec["layer_id"] == layer:
            return spec["moe_num_experts"]
    return 0


def resolve(adapter: Adapter, cfg: dict, family, scale: float = 1.0) -> Resolved:
    """Map an adapter's modules onto the model (Colibri config cfg of family `family`); scale
    multiplies every update (--lora-scale). A module that adapts nothing this model has is refused,
    named."""
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    linear, experts = {}, {}
    split = getattr(family, "lora_gate_up", "halves")
    is_gguf = adapter.config.get("format") == "gguf"
    where = adapter.path if is_gguf else os.path.join(adapter.path, "adapter_model.safetensors")
    for module, pairs in adapter.pairs.items():
        name = re.sub(r"^model\.language_model\.", "model.", module)     # a wrapped model's text weights
        if is_gguf:
            m = re.match(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", name)
            if m:                       # [E, r, in] / [E, out, r] in ggml's reversed order: read as 2-D
                raise invalid_model(where, module, "LoRA on a GGUF adapter's stacked experts is not supported; "
                                    "use the PEFT adapter (adapter_model.safetensors)")
            p = pairs[0]
            linear[name] = (p.a, np.float32(p.scale * scale) * p.b)
            continue
        m = PER_EXPERT.match(name)
        if m:
            p = pairs[0]
            experts.setdefault((int(m.group(1)), int(m.group(2))), {})[PART[m.group(3)]] = \
                (p.a, np.float32(p.scale * scale) * p.b)
            continue
        m = FUSED_EXPERTS.match(name)
        if m:
            layer = int(m.group(1))
            E = _experts_of(cfg, layer)
            for p in pairs:
                if not E or p.a.shape[0] != p.r * E:
                    raise invalid_model(where, PREFIX + module, f"lora_A of {p.a.shape[0]} rows: layer {layer} has "
                                        f"{E} experts (r={p.r} per expert expected)")
                n_in, n_out = p.a.shape[1], p.b.shape[0]
                if (n_in, n_out) == (H, 2 * I):
                    kind = "gate_up"
                elif (n_in, n_out) == (I, H):
                    kind = "down"
                else:
                    raise invalid_model(where, PREFIX + module, f"factors of in {n_in} / out {n_out}: neither the "
                                        f"experts' gate_up ({H} -> {2 * I}) nor their down ({I} -> {H})")
                A = p.a.reshape(E, p.r, n_in)
                B = p.b.reshape(n_out, p.r, E)
                for j in range(E):
                    a, b = A[j].copy(), np.float32(p.scale * scale) * np.ascontiguousarray(B[:, :, j])
                    d = experts.setdefault((layer, j), {})
                    if kind == "down":
                        d["down"] = (a, b)
                    elif split == "interleaved":
                        d["gate"], d["up"] = (a, b[0::2].copy()), (a, b[1::2].copy())
                    else:
                        d["gate"], d["up"] = (a, b[:I].copy()), (a, b[I:].copy())
            continue
        if len(pairs) != 1:
            raise invalid_model(where, PREFIX + module, "several LoRA pairs on one module")
        p = pairs[0]
        linear[name + ".weight"] = (p.a, np.float32(p.scale * scale) * p.b)
    for (layer, j), d in experts.items():
        if j >= _experts_of(cfg, layer):
            raise invalid_model(where, f"layers.{layer}.experts.{j}", f"the model's layer {layer} has "
                                f"{_experts_of(cfg, layer)} experts")
        for part, (a, b) in d.items():
            want = (I, H) if part != "down" else (H, I)
            if (b.shape[0], a.shape[1]) != want:
                raise invalid_model(where, f"layers.{layer}.experts.{j}.{part}", f"factors of out {b.shape[0]} / in "
                                    f"{a.shape[1]}; the expert's matrix is {list(want)}")
    return Resolved(linear, experts, is_gguf)


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale):
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"lora scale {scale!r}: expected a finite number")
    return float(scale)


def colibri_factors(res: Resolved, cfg: dict, family) -> tuple:
    """Run-time factors in Colibri's layout: ({colibri tensor name: (A, sB', source name)}, experts as in
    Resolved),
    B's rows carried through what convert does to W's rows (row slices, row functions, folded
    factors, permutations). A matrix whose conversion is not row by row (latent attention's kv_b_proj,
    cut per head and transposed) cannot take a run-time update: refused, named, with the way out."""
    from .families.common import row_permutations, unpermute
    fold = family.fold_factors(cfg)
    if res.gguf:
        if fold:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"a GGUF LoRA adapter on a {cfg['model_type']} model "
                               "(whose multipliers Colibri folds into the weights) is not supported; use the PEFT "
                               "adapter")
        names = family.gguf_names(cfg)
        perm = {}
        if family.gguf_interleaved:          # q/k rows stored with adjacent rope pairs: un-permuted as the base's
            for spec in cfg["layers"]:
                p = f"layers.{spec['layer_id']}."
                perm[p + "attn.wq"], perm[p + "attn.wk"] = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    else:
        names = family.source_names(cfg)
        perm = row_permutations(cfg)
    out, used = {}, set()
    for ours, src in names.items():
        fn = rows = None
        if isinstance(src, tuple) and callable(src[1]):
            src, fn = src
        elif isinstance(src, tuple):
            src, rows = src[0], slice(*src[1:])
        f = res.linear.get(src)
        if f is None:
            continue
        a, b = f
        if rows is not None:
            b = b[rows]
        if fn is not None:
            try:
                b2 = fn(b)
            except (ValueError, IndexError):
                b2 = None
            if not isinstance(b2, np.ndarray) or b2.ndim != 2 or b2.shape[1] != b.shape[1]:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                                   f"the adapter changes {src}, which Colibri runs as {ours} after a conversion that "
                                   "is not row by row: it cannot be applied at run time; merge it at conversion "
                                   "(colibri convert HF OUT --lora ADAPTER)")
            b = b2
        if ours in fold:
            b = b * np.float32(fold[ours])
        if ours in perm:
            b = unpermute(b, perm[ours])
        out[ours] = (np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32), src)
        used.add(src)
    left = sorted(set(res.linear) - used)
    if left:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the adapter changes {left[0]}"
                           f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}, a matrix this "
                           f"{cfg['model_type']} model does not run as a weight (embeddings, or a module Colibri "
                           "does not read); retrain the adapter without it")
    experts = res.experts
    if "expert.down" in fold:
        experts = {k: {p: (a, b * np.float32(fold["expert.down"]) if p == "down" else b) for p, (a, b) in d.items()}
                   for k, d in experts.items()}
    return out, experts
