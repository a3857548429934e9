"""`colibri` (also `python -m colibri_edge`): run, convert, inspect, backends."""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from ..knobs import KV_DTYPES


def _cmd_convert(a):
    from ..model.convert import convert
    cfg = convert(a.source, a.out_dir, dtype=a.dtype, progress=not a.quiet, lora=a.lora, lora_scale=a.lora_scale,
                  mtp=not a.no_mtp)
    print(f"wrote {a.out_dir}: {cfg['model_type']}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['experts_per_layer']} experts/layer, top-{cfg['top_k']}, {cfg['weight_dtype']}"
          + (", MTP head (draft='mtp')" if cfg.get("mtp") else "")
          + (f", LoRA {a.lora} merged (scale {a.lora_scale:g})" if a.lora else ""))
    return 0


# what Engine.open allocates when it is given neither: the engine's own defaults (engine.py)
ENGINE_MAX_BATCH, ENGINE_PREFILL_CHUNK = 8, 256


def engine_kv_tokens(max_seq_len: int, max_batch: int) -> int:
    """Engine.open's default kv_cache_tokens (engine.py): a pool for every sequence at full length,
    capped at max(4096, max_seq_len) tokens."""
    return min(max_seq_len * max_batch, max(4096, max_seq_len))


def _inspect_settings(a, cfg) -> tuple:
    """inspect's limits: each one given, or what `colibri serve` opens the engine with (its parser's
    defaults, then the engine's) -> (context, max_batch, prefill_chunk, block_size, kv_tokens, the
    settings taken from serve's defaults)."""
    from .. import knobs
    serve = a.serve_defaults or {}
    max_pos = int(cfg["max_position_embeddings"])
    assumed = []
    context = a.context
    if context is None:
        context = serve.get("max_seq_len") or max_pos
        assumed.append(f"context {context} (the model's maximum)" if context == max_pos else f"context {context}")
    if context > max_pos:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--context {context} is beyond this model's maximum context "
                           f"of {max_pos} tokens (max_position_embeddings in config.json): Engine.open("
                           f"max_seq_len={context}) refuses it, so inspect refuses it too; give --context {max_pos} "
                           "or less")
    max_batch, chunk = a.max_batch, a.prefill_chunk
    if max_batch is None:
        max_batch = serve.get("max_batch") or ENGINE_MAX_BATCH
        assumed.append(f"--max-batch {max_batch}")
    if chunk is None:
        chunk = serve.get("prefill_chunk") or ENGINE_PREFILL_CHUNK
        assumed.append(f"--prefill-chunk {chunk}")
    block = a.block_size
    if block is None:
        block = knobs.resolve("COLIBRI_KV_BLOCK_SIZE", None)
        assumed.append(f"KV blocks of {block} (COLIBRI_KV_BLOCK_SIZE)")
    for flag, v in (("--context", context), ("--max-batch", max_batch), ("--prefill-chunk", chunk),
                    ("--block-size", block), ("--kv-cache-tokens", a.kv_cache_tokens)):
        if v is not None and v < 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{flag} {v}: give a positive number")
    kv = a.kv_cache_tokens
    if kv is None:
        kv = engine_kv_tokens(context, max_batch)
        assumed.append(f"a KV pool of {kv} tokens (the engine's: min(context x batch, max(4096, context)))")
    return context, max_batch, chunk, block, kv, assumed


def _cmd_inspect(a):
    from ..model.modeldir import ModelDir
    from ..analysis.sizing import engine_memory, summary
    from ..units import human
    m = ModelDir(_model_or_default(_one_model(a.model, a.model_flag)))
    cfg = m.config
    context, max_batch, chunk, block, kv_tokens, assumed = _inspect_settings(a, cfg)
    from .. import knobs
    kv_dtype = knobs.resolve("COLIBRI_KV_DTYPE", a.kv_dtype)
    s = summary(m, context, max_batch, chunk, block, kv_dtype)
    mem = engine_memory(cfg, context, max_batch, chunk, kv_tokens, block, kv_dtype)     # what Engine.open allocates
    s["kv_cache_bytes"], s["scratch_bytes"] = mem["state_bytes"], mem["arena_bytes"]
    s["total_bytes"] = s["non_expert_bytes"] + s["expert_bytes"] + s["kv_cache_bytes"] + s["scratch_bytes"]
    print(f"{m.path}: valid (format {cfg['format_version']})")
    print(f"  maximum context: {cfg['max_position_embeddings']} tokens (max_position_embeddings; the default "
          "max_seq_len of Engine.open, colibri serve and colibri run)")
    print(f"  model_type {cfg['model_type']}, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}"
          f"/{cfg['num_key_value_heads']} kv, head_dim {cfg['head_dim']}, vocab {cfg['vocab_size']}, "
          f"weights {cfg['weight_dtype']}")
    floor = f" (denominator at least {cfg['router_norm_min']:g})" if cfg.get("router_norm_min") else ""
    g, groups, scaled = cfg.get("router_groups"), "", ""
    if g:
        by = "its best" if g["group_top"] == 1 else f"the sum of its best {g['group_top']}"
        groups = f", within the {g['topk_group']} best of {g['n_group']} expert groups (a group scored by {by})"
    if cfg.get("routed_scaling_factor"):
        scaled = f", weights x{cfg['routed_scaling_factor']:g}"
    print(f"  router {cfg['router_mode']} top-{cfg['top_k']} of {cfg['experts_per_layer']}"
          f"{' on sigmoid scores' if cfg.get('router_score') == 'sigmoid' else ''}"
          f"{', choice by p + a per-expert correction bias' if cfg.get('router_choice_bias') else ''}{groups}"
          f"{', renormalised' + floor if cfg['norm_topk_prob'] else ''}{scaled}, qk_norm {cfg['qk_norm']}"
          + (f" (jitter {cfg['router_jitter']:g}: each weight its expert's softmax within the band)"
             if cfg["router_mode"] == "sparsemixer" else "")
          + ("; LayerNorms with biases" if cfg.get("norm_type") == "layernorm" else "")
          + ("; a bias on the head" if cfg.get("lm_head_bias") else ""))
    if cfg.get("mtp"):
        spec = cfg["mtp"]["layers"][0]
        print(f"  multi-token-prediction head: one {spec['type']} layer (layer {spec['layer_id']}) after the "
              f"decoder's{', its own head' if cfg['mtp'].get('own_head') else ''}; --draft mtp / auto run it "
              "(its KV: one more layer's)")
    la = cfg.get("latent_attention")
    if la:
        nh, L = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        from ..backends.base import kv_row_bytes
        full = L * nh * (kv_row_bytes(la["qk_nope_head_dim"] + la["qk_rope_head_dim"], kv_dtype) +
                         kv_row_bytes(la["v_head_dim"], kv_dtype))
        lat = L * (kv_row_bytes(la["kv_lora_rank"], kv_dtype) + kv_row_bytes(la["qk_rope_head_dim"], kv_dtype))
        print(f"  latent attention: q {'through rank ' + str(la['q_lora_rank']) if la['q_lora_rank'] else 'projected'}"
              f", {nh} heads of {la['qk_nope_head_dim']} + {la['qk_rope_head_dim']} rope dims, values of "
              f"{la['v_head_dim']}; the cache holds the latent ({la['kv_lora_rank']}) and the rope key "
              f"({la['qk_rope_head_dim']}) per token and layer: {lat} bytes per token, against {full} for full "
              f"heads (k + v of {nh} heads): {full / lat:.1f}x less")
    if cfg.get("rope_pairs") == "interleaved":
        print("  rope: the source pairs adjacent dims; q/k rows were permuted to half-split pairs at conversion")
    if cfg["shared_expert_intermediate_size"]:
        print(f"  shared experts: {cfg['shared_expert_intermediate_size']} wide"
              f"{', behind a sigmoid gate' if cfg['shared_expert_gate'] else ', ungated'}, always resident")
    if "attention_scale" in cfg:
        print(f"  attention softmax scale {cfg['attention_scale']:g} (1/sqrt(head_dim) would be "
              f"{cfg['head_dim'] ** -0.5:.4g})")
    if cfg.get("folded_multipliers"):
        fm = cfg["folded_multipliers"]
        print(f"  folded into the weights at conversion: embedding x{fm['embedding_multiplier']:g}, o_proj and "
              f"down projections x{fm['residual_multiplier']:g}, lm_head /{fm['logits_scaling']:g}")
    if cfg.get("rope_scaling"):
        rs = cfg["rope_scaling"]
        if rs.get("rope_type") == "longrope":
            print(f"  rope: LongRoPE, short factors up to a context of {rs['original_max_position_embeddings']}, long "
                  "factors when the engine's max_seq_len is past it")
        else:
            print(f"  rope: YaRN x{rs['factor']:g} over an original context of {rs['original_max_position_embeddings']}")
    if cfg.get("expert_act", "silu") == "swiglu_oai":
        print(f"  experts: {cfg['expert_act']} (alpha {cfg['swiglu_alpha']:g}, limit {cfg['swiglu_limit']:g})"
              f"{', with biases' if cfg.get('expert_bias') else ''}{'; router with a bias' if cfg.get('router_bias') else ''}")
    elif cfg.get("expert_act", "silu") != "silu":
        print(f"  experts: {cfg['expert_act']}" + ("; router input normed and scaled, weights times a per-expert scale"
                                                   if cfg.get("router_input_norm") else ""))
    if cfg.get("norm_layout") == "sandwich":
        print(f"  sandwich norms (attention and FFN outputs normed before the residual); dense MLP "
              f"{cfg.get('ffn_act', 'silu')}; embeddings x{cfg.get('embed_scale', 1.0):g}"
              + ("; per-layer scalars" if cfg.get("layer_scalar") else "")
              + (f"; logits soft-capped at {cfg['final_logit_softcap']:g}" if cfg.get("final_logit_softcap") else ""))
    types = cfg.get("layer_types") or ["full_attention"] * len(cfg["layers"])
    sinks = " with sinks" if cfg.get("attention_sinks") else ""
    print("  layer plan (mixer + ffn):")
    for l in cfg["layers"]:
        ffn = {"dense": "dense MLP", "moe": "routed experts", "moe_shared": "routed + shared experts",
               "moe_dense": "dense MLP + routed experts"}[l["type"]]
        extra = "" if l["type"] == "dense" else f" {l['moe_expert_start']}..{l['moe_expert_start'] + l['moe_num_experts'] - 1}"
        mixer = f"sliding-window attention ({cfg['sliding_window']}){sinks}" \
            if types[l["layer_id"]] == "sliding_attention" else "latent attention" if la else f"attention{sinks}"
        if types[l["layer_id"]] == "linear_attention":
            li = cfg["linear_attention"]
            mixer = (f"gated delta-net ({li['num_key_heads']} key / {li['num_value_heads']} value heads of "
                     f"{li['key_head_dim']} / {li['value_head_dim']}, conv {li['conv_kernel']})")
        elif types[l["layer_id"]] == "short_conv":
            K = cfg["short_conv"]["conv_kernel"]
            mixer = f"gated short convolution ({K} taps; state {4 * (K - 1) * cfg['hidden_size']} bytes)"
        elif types[l["layer_id"]] == "mamba":
            mb = cfg["mamba"]
            nh, P, G, N, K = (mb[k] for k in ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel"))
            mixer = (f"Mamba-2 ({nh} heads of {P}, state {N}, conv {K}; state "
                     f"{4 * ((K - 1) * (nh * P + 2 * G * N) + nh * P * N)} bytes)")
        elif cfg.get("attention_output_gate"):
            mixer += " with an output gate" + (f", rope on {cfg['rope_dim']} of {cfg['head_dim']} dims"
                                               if cfg.get("rope_dim") else "")
        if "head_dim" in l or "num_key_value_heads" in l:
            from ..model.layerplan import geometry
            _, nkv, hd = geometry(cfg, l)
            mixer += f" [{nkv} kv x {hd}{', keys as values' if l.get('k_eq_v') else ''}" + \
                (f", rope theta {l['rope_theta']:g} on {l['rope_partial']:g} of the dims" if "rope_partial" in l else "") + "]"
        print(f"    {l['layer_id']:3d} {mixer} + {ffn}{extra}")
    print(f"  experts: {s['num_experts']} x {human(s['bytes_per_expert'])} (bytes per expert: {s['bytes_per_expert']})"
          f" = {human(s['expert_bytes'])}")
    print(f"  non-expert weights: {human(s['non_expert_bytes'])}")
    print(f"  weight bytes read per decoded token: {human(s['bytes_per_decoded_token'])}")
    print(f"  KV cache: {s['kv_bytes_per_token']} bytes per token ({kv_dtype})"
          + (f" (full-attention layers) + at most {s['kv_window_bytes_per_sequence']} bytes per sequence in the "
             f"sliding-window layers (blocks of {block})" if s["kv_window_bytes_per_sequence"] else "")
          + (f"; recurrent state: {s['state_bytes_per_sequence']} bytes per sequence at any length ("
             + (f"conv + delta rule, {sum(t == 'linear_attention' for t in types)} layers" if "linear_attention" in
                types else f"conv + selective scan, {sum(t == 'mamba' for t in types)} Mamba-2 layers" if "mamba" in
                types else f"the short convolutions' last inputs, {sum(t == 'short_conv' for t in types)} layers")
             + ")" if s["state_bytes_per_sequence"] else ""))
    if s["snapshot_bytes"]:
        print(f"  recurrent-state snapshots (prefix caching): {s['snapshots']} x {s['snapshot_bytes']} bytes "
              f"({human(s['snapshots'] * s['snapshot_bytes'])}; Engine.open state_snapshots, default max_batch), "
              "taken during prefill at each prompt's last multiple of lcm(block, 16) tokens and every "
              "snapshot_every (1024) tokens")
    print(f"  memory at context {context} x batch {max_batch} (prefill chunk {chunk}, a KV pool of {kv_tokens} "
          f"tokens in blocks of {block}): weights {human(s['non_expert_bytes'])} + experts "
          f"{human(s['expert_bytes'])} + {'KV cache and recurrent state' if s['state_bytes_per_sequence'] else 'KV cache'} "
          f"{human(s['kv_cache_bytes'])} + scratch {human(s['scratch_bytes'])} = {human(s['total_bytes'])}")
    print(f"  allocated at open: arena {s['scratch_bytes']} bytes, KV cache {s['kv_cache_bytes']} bytes "
          f"(Engine.open(max_seq_len={context}, max_batch={max_batch}, prefill_chunk={chunk}, "
          f"kv_cache_tokens={kv_tokens}, kv_block_size={block}, kv_dtype={kv_dtype!r}))")
    print("  settings: " + ("what `colibri serve` allocates with its defaults: " + ", ".join(assumed) if assumed
                            else "all given") + ("" if len(assumed) in (0, 5) else " (the rest as given)")
          + "; --context, --max-batch, --prefill-chunk, --kv-cache-tokens, --block-size change them")
    if a.device:
        from ..analysis.simulate import load_profile
        prof = load_profile(a.device)
        dev = int(prof["memory_bytes"])
        rest = s["non_expert_bytes"] + s["kv_cache_bytes"] + s["scratch_bytes"]
        n = max(dev - rest, 0) // max(s["bytes_per_expert"], 1)
        if n >= s["num_experts"]:
            verdict = f"every expert resident fits ({human(s['total_bytes'])} of {human(dev)})"
        elif n >= cfg["top_k"]:
            verdict = (f"at most {n} of {s['num_experts']} experts resident: expert_slots={n} (or auto); "
                       f"`colibri simulate --device {a.device} --target-ms X` on a trace picks the fewest for a speed")
        else:
            verdict = (f"does not fit: {human(rest)} before any expert, {human(dev)} on the device; lower the "
                       "context / batch or pick a smaller weight type")
        print(f"  on {prof.get('name', a.device)}: {verdict}")
    return 0


def _cmd_backends(a):
    from ..backends import NAMES, backend_class, probe
    for name in NAMES:
        ok, detail = probe(name)
        note = ""
        if ok and name in ("cuda", "opencl"):
            auto_ok, auto_detail = probe(name, for_auto=True)
            note = "; auto would pick it" if auto_ok else f"; auto skips it ({auto_detail})"
        print(f"{name:<10} {'present' if ok else 'missing'}: {detail}{note}")
        if ok:
            for line in backend_class(name).list_devices():
                print(f"           {line}")
    return 0


def _slots_arg(v: str):
    return "auto" if v.strip().lower() == "auto" else int(v)


def _default_model():
    from ..model.demo import ensure_default_model
    return ensure_default_model()


def _one_model(positional, flag):
    """MODEL given as a positional argument or as --model MODEL (the same twice is fine)."""
    if positional and flag and os.path.normpath(positional) != os.path.normpath(flag):
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"two models given ({positional} and --model {flag}): "
                           "give one, as MODEL or --model MODEL")
    return positional or flag


def _model_or_default(model):
    """--model as given, or the embedded demo model (saying so on stderr): every subcommand that takes
    a model (run, chat, trace, inspect) takes it this way."""
    if model is None:
        model, note = _default_model()
        print(f"[colibri] no --model given: using the embedded default model ({note})", file=sys.stderr)
    from ..model.gguf_cache import model_source
    return model_source(model)                  # a GGUF file: converted once into the cache, reused after


def _version() -> str:
    """The installed distribution's version, else the package's __version__."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("colibri-edge")
        except PackageNotFoundError:
            pass
    except ImportError:
        pass
    import colibri_edge
    return getattr(colibri_edge, "__version__", "unknown")


def _need_matplotlib(flag: str):
    """--plot's dependency, checked before any work: the plot extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{flag} needs matplotlib, which is not installed: "
                           "pip install 'colibri-edge[plot]' (or leave out --plot)") from None


def _sampling_kw(a) -> dict:
    """Engine.stream / generate arguments of the sampling flags (_add_sampling_args)."""
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                seed=a.seed, ignore_eos=a.ignore_eos, min_p=a.min_p, repetition_penalty=a.repeat_penalty)


def _open_kw(a) -> dict:
    """Engine.open arguments of the engine flags (_add_engine_args)."""
    kw = dict(backend=a.backend, max_seq_len=a.max_seq_len, expert_slots=a.expert_slots,
              slot_policy=a.slot_policy, top_k=a.experts_per_token, num_threads=a.threads,
              chat_template=a.chat_template, kv_dtype=a.kv_dtype, draft=a.draft, draft_tokens=a.draft_tokens)
    if getattr(a, "lora", None):
        kw["adapters"] = {"lora": a.lora}
    return kw


def _cmd_run(a):
    from ..requests.engine import Engine
    model = _model_or_default(_one_model(a.model_pos, a.model))
    with Engine.open(model, **_open_kw(a)) as eng:
        prompt = a.prompt
        if a.chat:
            prompt = [{"role": "user", "content": a.prompt}]
        elif a.ids:
            prompt = [int(t) for t in a.prompt.split()]
        kw = _sampling_kw(a)
        if a.lora:
            kw["adapter"] = "lora"
        t0 = time.perf_counter()
        if a.ids or not os.path.exists(os.path.join(eng.path, "tokenizer.json")):
            ids = eng.generate(prompt if a.ids else [int(t) for t in prompt.split()], **kw)
            print(" ".join(map(str, ids)))
        else:
            if not a.chat:
                print(a.prompt, end="", flush=True)
            for piece in eng.stream(prompt, **kw):
                print(piece, end="", flush=True)
            print()
        st = eng.stats
        pre = st.prefill_tokens / st.prefill_seconds if st.prefill_seconds else 0
        dec = st.decode_tokens / st.decode_seconds if st.decode_seconds else 0
        print(f"\n[colibri] backend {eng.backend.name}: prefill {st.prefill_tokens} tok at {pre:.1f} tok/s, "
              f"decode {st.decode_tokens} tok at {dec:.1f} tok/s, wall {time.perf_counter() - t0:.2f}s",
              file=sys.stderr)
        if st.draft_proposed or eng.draft != "off":
            print(f"[colibri] drafts ({eng.draft}, up to {eng.draft_tokens}): {st.draft_accepted} of "
                  f"{st.draft_proposed} drafted tokens accepted ({100 * st.acceptance:.0f}%) in {st.draft_steps} "
                  f"verifications; {st.tokens_per_stream_step:.2f} tokens per decode step",
                  file=sys.stderr)
        counts = eng.expert_counts
        print("[colibri] experts fired per layer (tokens routed to each expert):", file=sys.stderr)
        for l in eng.config["layers"]:
            if l["type"] != "dense":
                row = counts[l["layer_id"]]
                print(f"  layer {l['layer_id']:2d}: " + " ".join(f"{int(c):3d}" for c in row), file=sys.stderr)
        if a.stats:
            print(f"[colibri] {eng.backend.describe()}", file=sys.stderr)
            from ..analysis.sizing import summary
            from ..units import human
            base = getattr(eng.model, "_model", eng.model)
            k, k0 = eng.config["top_k"], base.config["top_k"]
            now = summary(eng.model, 1)["bytes_per_decoded_token"]
            line = f"[colibri] experts per token: {k}" + (f" (the model's: {k0})" if k != k0 else "") + \
                f"; weight bytes read per decoded token: {human(now)}"
            if k != k0:
                was = summary(base, 1)["bytes_per_decoded_token"]
                line += f" (at {k0}: {human(was)}, {100 * (1 - now / was):.0f}% less)"
            print(line, file=sys.stderr)
            ms = st.step_ms()
            if ms["steps"]:
                print(f"[colibri] decode step time: p50 {ms['p50']:.2f} ms, p99 {ms['p99']:.2f} ms, "
                      f"max {ms['max']:.2f} ms over {ms['steps']} steps", file=sys.stderr)
            if eng.slot_choice is not None:
                print(f"[colibri] expert slots auto: {eng.slot_choice['why']}", file=sys.stderr)
            ss = eng.slot_stats
            if ss is None:
                print("[colibri] slot pool: off (every expert resident); use --expert-slots N", file=sys.stderr)
            else:
                print("[colibri] slot pool: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in ss.items()), file=sys.stderr)
    return 0


CHAT_HELP = "commands: /reset (forget the conversation), /stats (the last reply's speed, the context used), " \
            "/help, /exit (or Ctrl-D); Ctrl-C stops a reply"


def _fit_conversation(eng, system: list, history: list, max_new: int):
    """The messages to send: the system message and as many of the latest exchanges as leave room for
    the reply (max_new tokens, at most a quarter of the context), dropping the oldest exchanges first
    -> (messages, prompt tokens, exchanges dropped); None when even the last message alone is too long."""
    reserve = min(max_new, max(1, eng.max_seq_len // 4))
    dropped = 0
    while history:
        msgs = system + history
        n = len(eng.codec.encode(eng.codec.render_chat(msgs), add_special_tokens=False))
        if n + reserve <= eng.max_seq_len:
            return msgs, n, dropped
        if len(history) == 1:
            return None
        del history[:2]                 # the oldest user message and its reply
        dropped += 1
    return None


def _cmd_chat(a):
    """An interactive chat in the terminal (as llama-cli -cnv and ollama run): each line a user turn,
    the reply streamed, the conversation kept and rendered with the model's chat template."""
    from ..requests.engine import Engine
    model = _model_or_default(_one_model(a.model_pos, a.model))
    with Engine.open(model, **_open_kw(a)) as eng:
        eng.codec.render_chat([{"role": "user", "content": "hi"}])    # no tokenizer / a broken template: now
        system = [{"role": "system", "content": a.system}] if a.system else []
        history, last = [], None
        print(f"[colibri] chat with {os.path.basename(os.path.normpath(eng.path))} on {eng.backend.name}, context "
              f"{eng.max_seq_len} tokens ({eng.codec.template_source} chat template). {CHAT_HELP}", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/exit", "/quit", "/bye"):
                    break
                if cmd == "/reset":
                    history.clear()
                    last = None
                    print("[conversation reset]")
                elif cmd == "/stats":
                    print(_chat_stats(eng, last, history))
                elif cmd == "/help":
                    print(CHAT_HELP)
                else:
                    print(f"unknown command {cmd}; {CHAT_HELP}")
                continue
            history.append({"role": "user", "content": text})
            fit = _fit_conversation(eng, system, history, a.max_new_tokens)
            if fit is None:
                history.pop()
                print(f"[colibri] that message does not fit the context of {eng.max_seq_len} tokens with room for "
                      "a reply: send a shorter one (or open the model with a larger --max-seq-len)")
                continue
            msgs, n_prompt, dropped = fit
            if dropped:
                print(f"[colibri] the conversation outgrew the context: the oldest {dropped} exchange(s) dropped")
            kw = _sampling_kw(a)
            kw["max_new_tokens"] = min(a.max_new_tokens, eng.max_seq_len - n_prompt)
            st = eng.stats
            before = (st.prefill_tokens, st.prefill_seconds, st.decode_tokens, st.decode_seconds)
            parts, t0 = [], time.perf_counter()
            gen = eng.stream(msgs, **kw)
            try:
                for piece in gen:
                    print(piece, end="", flush=True)
                    parts.append(piece)
            except KeyboardInterrupt:
                print(" [stopped]", end="")
            finally:
                gen.close()             # cancels the request if it was cut short: its KV blocks return
            print(flush=True)
            history.append({"role": "assistant", "content": "".join(parts)})
            last = dict(prompt=n_prompt, wall=time.perf_counter() - t0,
                        prefill=(st.prefill_tokens - before[0], st.prefill_seconds - before[1]),
                        decode=(st.decode_tokens - before[2], st.decode_seconds - before[3]))
    return 0


def _chat_stats(eng, last, history) -> str:
    if last is None:
        return f"no reply yet; context {eng.max_seq_len} tokens, {len(history) // 2} exchanges kept"
    (pt, ps), (dt, ds) = last["prefill"], last["decode"]
    return (f"last reply: prompt {last['prompt']} tokens (prefill {pt} at {pt / ps if ps else 0:.1f} tok/s), "
            f"{dt} tokens decoded at {dt / ds if ds else 0:.1f} tok/s, wall {last['wall']:.2f} s; "
            f"context {last['prompt'] + dt} of {eng.max_seq_len} tokens; {len(history) // 2} exchanges kept")


def _cmd_trace(a):
    from ..requests.engine import Engine
    lines = [l.strip() for l in open(a.prompts, encoding="utf-8") if l.strip()]
    if not lines:
        raise ColibriError(-1, f"{a.prompts}: no prompts (one a line)")
    prompts = [[int(t) for t in l.split()] for l in lines] if a.ids else lines
    model = _model_or_default(a.model)
    kw = dict(backend=a.backend, max_batch=a.max_batch, top_k=a.experts_per_token)
    if a.ray is not None or a.workers is not None:
        from .distributed import trace_sharded
        tr = trace_sharded(os.path.abspath(model), prompts, workers=a.workers or 2, address=a.ray,
                           max_new_tokens=a.max_new_tokens, engine_kw=kw,
                           on_shard=lambda done, total, *_: _progress("shards", done, total))
    else:
        with Engine.open(model, prefix_cache=False, **kw) as eng:
            tr = eng.trace(prompts, max_new_tokens=a.max_new_tokens, ignore_eos=a.max_new_tokens > 0)
    tr.save(a.out)
    print(f"wrote {a.out}: {tr.expert_ids.shape[0]} tokens, {tr.num_steps} steps, "
          f"{len(tr.layer_ids)} MoE layers, top-{tr.expert_ids.shape[2]}")
    return 0


def _progress(what, done, total):
    """A progress bar on stderr (stdout stays the result)."""
    n = 30 * done // max(total, 1)
    print(f"\r[{'#' * n}{'.' * (30 - n)}] {done}/{total} {what}", end="\n" if done >= total else "",
          file=sys.stderr, flush=True)


def _cmd_sweep(a, tr):
    """simulate --sweep SPEC: the grid's cells (here, or on Ray), one table or --json rows."""
    import json as _json
    from .distributed import SWEEP_KEYS, parse_sweep, plot_grid, sweep
    grid = parse_sweep(a.sweep)
    if "policy" not in grid:
        grid["policy"] = a.policy.split(",")
    if "device" not in grid and a.device:
        grid["device"] = [a.device]
    if "top_k" not in grid and a.top_k is not None:
        grid["top_k"] = [a.top_k]
    rows = sweep(tr, grid, a.context, address=a.ray, workers=a.workers,
                 on_cell=lambda done, total: _progress("cells", done, total))
    if a.json:
        print(_json.dumps(rows, indent=1))
    else:
        from ..units import human
        keys = [k for k in SWEEP_KEYS if k in rows[0]]
        est = "est_ms_per_token" in rows[0]
        print("".join(f"{k:>16}" if k == "device" else f"{k:>8}" for k in keys) + f"{'misses':>10}{'hit rate':>10}"
              f"{'moved':>12}" + (f"{'ms/token':>10}{'fits':>6}" if est else ""))
        for r in rows:
            print("".join(f"{r[k]:>16}" if k == "device" else f"{r[k]:>8}" for k in keys) + f"{r['misses']:>10}"
                  f"{r['hit_rate']:>10.3f}{human(r['bytes_moved']):>12}"
                  + (f"{r['est_ms_per_token']:>10.2f}{'yes' if r['fits'] else 'NO':>6}" if est else ""))
    if a.plot:
        plot_grid(rows, a.plot, os.path.basename(a.trace))
        print(f"wrote {a.plot}")
    return 0


def _cmd_simulate(a):
    import json as _json
    from ..analysis.simulate import estimate, load_profile, plot_sweep, replay, sweep_points
    from ..analysis.trace import Trace
    if a.plot:
        _need_matplotlib("simulate --plot")
    tr = Trace.load(a.trace)
    if isinstance(a.sweep, str):
        return _cmd_sweep(a, tr)
    if a.ray is not None or a.workers is not None:
        raise ColibriError(-1, "--ray / --workers run a grid: give --sweep KEY=VALUES (e.g. slots=4:64:4,policy=lru,lfu)")
    if a.top_k is not None:
        tr = tr.with_top_k(a.top_k)
    prof = load_profile(a.device) if a.device else None
    policies = a.policy.split(",")
    if a.target_ms is not None:
        from ..analysis.simulate import recommend
        if prof is None:
            raise ColibriError(-1, "--target-ms needs --device (a profile to estimate with)")
        from ..units import human
        for pol in policies:
            r = recommend(tr, prof, pol, a.target_ms, a.context)
            verdict = "meets" if r["met"] else "cannot meet"
            print(f"{pol}: {r['slots']} slots {verdict} {a.target_ms} ms/token on {prof.get('name')}: estimated "
                  f"{r['est_ms_per_token']:.2f} ms/token, hit rate {r['hit_rate']:.3f}, memory "
                  f"{human(r['memory_needed_bytes'])} of {human(r['device_memory_bytes'])} (context {a.context})")
        return 0
    slot_list = sweep_points(tr) if a.sweep else [a.slots]
    if not a.sweep and a.slots is None:
        raise ColibriError(-1, "give --slots N (or --sweep)")
    rows = []
    for pol in policies:
        for n in slot_list:
            r = replay(tr, n, pol)
            if prof:
                r.update(estimate(r, tr, prof, a.context))
            rows.append(r)
    if a.json:
        print(_json.dumps(rows[0] if len(rows) == 1 else rows, indent=1))
    else:
        print(f"{'policy':<9}{'slots':>6}{'hits':>9}{'misses':>9}{'hit rate':>10}{'moved':>12}"
              + (f"{'ms/token':>10}{'fits':>6}" if prof else ""))
        from ..units import human
        for r in rows:
            print(f"{r['policy']:<9}{r['slots']:>6}{r['hits']:>9}{r['misses']:>9}{r['hit_rate']:>10.3f}"
                  f"{human(r['bytes_moved']):>12}" + (f"{r['est_ms_per_token']:>10.2f}{'yes' if r['fits'] else 'NO':>6}"
                                                      if prof else ""))
        if prof:
            print(f"device: {prof.get('name')}; context {a.context}")
    if a.plot:
        plot_sweep(rows, a.plot, os.path.basename(a.trace))
        print(f"wrote {a.plot}")
    return 0


def _cmd_plan(a):
    import json as _json
    from .plan import plan, print_plan
    mem = None if a.memory is None else parse_size(a.memory, f"--memory {a.memory}")
    p = plan(a.model, mem, a.device, a.trace, a.policy, a.context, a.backend)
    if a.json:
        print(_json.dumps(p, indent=1, default=str))
    else:
        print_plan(p)
    return 0


def _cmd_probe_device(a):
    from .probe_device import probe, save
    prof = probe(a.dir, a.mem_mib, a.file_mib, a.blob)
    path = save(prof, a.out)
    for k, v in prof.items():
        print(f"  {k}: {v}")
    print(f"wrote {path} (colibri simulate --device {'this' if a.out is None else path})")
    return 0


def _cmd_stats(a):
    import json as _json
    from ..analysis.trace import Trace, routing_stats
    if a.plot:
        _need_matplotlib("stats --plot")
    tr = Trace.load(a.trace)
    st = routing_stats(tr)
    if a.json:
        print(_json.dumps(st, indent=1))
    else:
        print(f"{st['tokens']} tokens, top-{st['top_k']} of {st['experts_per_layer']} experts")
        print(f"{'layer':>5}  {'imbalance':>9}  {'entropy':>13}  {'reuse':>6}  load")
        for l in st["layers"]:
            print(f"{l['layer']:>5}  {l['imbalance']:>9.2f}  {l['entropy_bits']:>5.2f}/{l['max_entropy_bits']:<5.2f}bit"
                  f"  {l['consecutive_reuse']:>6.2f}  {' '.join(str(x) for x in l['load'])}")
            co = np.array(l["coactivation"])
            i, j = np.unravel_index(np.argmax(co), co.shape)
            print(f"       most co-activated pair: experts {i} and {j} ({co[i, j]} tokens)")
            p = l["prediction"]
            if p is not None:
                print(f"       lookahead from the layer before: {p['token_recall']:.2f} of a token's experts, "
                      f"{p['recall']:.2f} of a step's (precision {p['precision']:.2f})")
        if st["prediction"] is not None:
            p = st["prediction"]
            print(f"lookahead (layer L+1's router on layer L's MoE input), mean over layers: token recall "
                  f"{p['token_recall']:.3f}, step recall {p['recall']:.3f}, precision {p['precision']:.3f}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        loads = np.array([l["load"] for l in st["layers"]], dtype=float)
        fig, ax = plt.subplots(figsize=(1 + 0.45 * loads.shape[1], 1 + 0.4 * loads.shape[0]))
        im = ax.imshow(loads / loads.sum(axis=1, keepdims=True), aspect="auto", cmap="viridis")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_yticks(range(len(st["layers"])), [l["layer"] for l in st["layers"]])
        fig.colorbar(im, label="share of routed tokens")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"wrote {a.plot}")
    return 0


def _read_config(path: str) -> dict:
    """serve --config FILE: {"models": {NAME: {"path": DIR, OPTION: value, ...}}} in JSON, or the same
    in TOML ([models.NAME] tables) -> {name: {"path": ..., options...}}."""
    import json as _json
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        if path.lower().endswith(".toml"):
            import tomllib
            doc = tomllib.loads(raw.decode("utf-8"))
        else:
            doc = _json.loads(raw)
    except Exception as e:      # json / tomllib / UnicodeDecodeError: the file is not what it says
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--config {path}: not valid "
                           f"{'TOML' if path.lower().endswith('.toml') else 'JSON'} ({e})") from None
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict) or not models:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--config {path}: expected a 'models' table of "
                           "NAME: {path: DIR, ...options}")
    known = set(PER_MODEL) | {"path", "memory_budget"}
    for name, spec in models.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--config {path}: model {name!r} needs a 'path'")
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--config {path}: model {name!r}: unknown option(s) "
                               f"{', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return models


def _api_key(a):
    """--api-key, else --api-key-file's first line, else $COLIBRI_API_KEY, else none."""
    if a.api_key and a.api_key_file:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "--api-key and --api-key-file both given: give one")
    if a.api_key_file:
        try:
            with open(a.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--api-key-file {a.api_key_file}: cannot read it "
                               f"({e})") from None
        if not key:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--api-key-file {a.api_key_file}: its first line "
                               "is empty; write the key there")
        return key
    return a.api_key or os.environ.get("COLIBRI_API_KEY") or None


def serve_plan(a) -> tuple:
    """serve's arguments -> (models {name: dir}, options {name: {Engine.open keyword: value}}, budgets
    {name: bytes}, the Engine.open keywords every model shares)."""
    models, options, budgets = {}, {}, {}
    if a.config and a.model:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "--config and --model both given: describe the models "
                           "in one place")
    if a.config:
        for name, spec in _read_config(a.config).items():
            models[name] = spec["path"]
            options[name] = {PER_MODEL[k]: v for k, v in spec.items() if k in PER_MODEL}
            if "memory_budget" in spec:
                mb = spec["memory_budget"]
                budgets[name] = mb if isinstance(mb, int) else parse_size(str(mb), f"{name}: memory_budget")
    else:
        if not a.model:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "serve needs --model DIR (or NAME=DIR, repeated) or "
                               "--config FILE")
        for i, spec in enumerate(a.model):
            name, sep, path = spec.partition("=")
            if not sep:                 # a GGUF file is named by its stem
                name, path = re.sub(r"\.gguf$", "", os.path.basename(os.path.normpath(spec)), flags=re.I), spec
            if not name or name in models:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--model {spec!r}: give each model a distinct "
                                   "name (NAME=DIR)")
            models[name] = path
            options[name] = {PER_MODEL[k]: v for k, v in ((a.per_model or {}).get(i) or {}).items()}
    default = None
    for spec in a.memory_budget or []:
        name, sep, size = spec.rpartition("=")
        if sep:
            budgets[name] = parse_size(size, f"--memory-budget {spec}")
        else:
            default = parse_size(size, f"--memory-budget {spec}")
    if default is not None:
        budgets = {**{n: default for n in models}, **budgets}
    shared = {PER_MODEL[k]: getattr(a, k) for k in PER_MODEL}
    shared["max_queue"] = a.max_queue
    if a.no_prefix_cache:
        shared["prefix_cache"] = False
    shared["settle_replies"] = not a.no_settle_replies
    if a.profile:
        shared["profile"] = True
    return models, options, budgets, shared


def lora_plan(specs) -> dict:
    """serve --lora NAME=DIR (repeated) -> {NAME: DIR}; a malformed or repeated one refused."""
    out = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--lora {spec}: give NAME=DIR (an adapter directory)")
        if name in out:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--lora {spec}: adapter {name!r} is given twice")
        out[name] = path
    return out


def _cmd_serve(a):
    from .serve import serve
    models, options, budgets, shared = serve_plan(a)
    api_key = _api_key(a)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"[colibri] serving on {a.host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--max-tokens {a.max_tokens}: give a positive number")
    serve(models, host=a.host, port=a.port, api_key=api_key, cors=a.cors, request_timeout=a.request_timeout,
          budgets=budgets, options=options, max_body=parse_size(a.max_body, f"--max-body {a.max_body}"),
          max_tokens=a.max_tokens, cache_dir=a.cache_dir,
          cache_dir_bytes=parse_size(a.cache_dir_size, f"--cache-dir-size {a.cache_dir_size}"),
          loras=lora_plan(a.lora), **shared)
    return 0


def parse_size(text: str, what: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes (K, M, G, T are powers of 1024, as free -h prints)."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{what}: give a size such as 512M, 2G or 1.5GiB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _add_engine_args(p, per_model=False):
    """The Engine.open flags run, chat and serve share (serve: each may follow a --model, for that model)."""
    act = dict(action=_PerModel) if per_model else {}
    p.add_argument("--backend", default=None, help="auto, cpu, opencl, cuda, reference (default: COLIBRI_BACKEND or auto)",
                   **act)
    p.add_argument("--max-seq-len", type=int, default=None, help="context in tokens (default: the model's maximum)",
                   **act)
    p.add_argument("--expert-slots", type=_slots_arg, default=None, metavar="N|auto",
                   help="keep at most N experts resident (slot pool); auto: as many as the free memory holds", **act)
    p.add_argument("--slot-policy", default=None, choices=["lru", "lfu", "prefetch"], **act)
    p.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                   help="route each token to K experts instead of the model's (Engine.open(top_k=K), "
                        "COLIBRI_TOP_K)" + ("" if per_model else "; --top-k is the sampler's"), **act)
    p.add_argument("--threads", type=int, default=None, help="cpu backend threads (COLIBRI_NUM_THREADS; 0: all cores)",
                   **act)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template over the model's own (a model without one chats in ChatML, "
                        "with a warning)", **act)
    p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                   help="the KV cache's storage type: float32, float16 (half the bytes) or q8_0 (about a quarter; "
                        "reference and cpu backends) (default: COLIBRI_KV_DTYPE or float32)", **act)
    p.add_argument("--draft", default="off", choices=["off", "ngram", "mtp", "auto"],
                   help="speculative decoding: ngram (prompt lookup: drafts what followed the last tokens earlier "
                        "in the prompt or output, verified in one step), mtp (the model's own multi-token-"
                        "prediction head, when it has one), auto (the head when the model has one, else ngram, "
                        "only while the measured step costs say it pays), off (default)", **act)
    p.add_argument("--draft-tokens", type=int, default=5, metavar="N",
                   help="drafted tokens verified per step at most (default 5)", **act)


def _add_sampling_args(p, max_new=48):
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens (as llama.cpp's)")
    # llama.cpp's sampling defaults (llama-cli), with its classic repetition guard; --temperature 0 is greedy
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8, as llama.cpp)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.1,
                   help="divide the logits of tokens already in the context (1 turns it off)")
    p.add_argument("--seed", type=int, default=None)


# serve's flags that may follow a --model and then apply to that model alone -> Engine.open keyword
PER_MODEL = {"backend": "backend", "max_seq_len": "max_seq_len", "expert_slots": "expert_slots",
             "slot_policy": "slot_policy", "experts_per_token": "top_k", "threads": "num_threads",
             "chat_template": "chat_template", "max_batch": "max_batch", "kv_cache_tokens": "kv_cache_tokens",
             "prefill_chunk": "prefill_chunk", "interleave": "interleave", "kv_dtype": "kv_dtype",
             "state_snapshots": "state_snapshots", "snapshot_every": "snapshot_every", "draft": "draft",
             "draft_tokens": "draft_tokens"}


class _PerModel(argparse.Action):
    """A serve flag: before any --model it sets every model's value; after a --model, that model's."""

    def __call__(self, parser, ns, values, option_string=None):
        models = getattr(ns, "model", None) or []
        if not models:
            setattr(ns, self.dest, values)
            return
        if getattr(ns, "per_model", None) is None:
            ns.per_model = {}
        ns.per_model.setdefault(len(models) - 1, {})[self.dest] = values


def _port(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{v!r}: a TCP port is a number from 0 to 65535 (0: any free one)")
    return n


def build_parser():
    p = argparse.ArgumentParser(prog="colibri", description="Colibri Edge: MoE inference on edge hardware")
    p.add_argument("--version", action="version", version=f"colibri {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    from ..model.dtypes import MIXES, WEIGHT_DTYPES
    c = sub.add_parser("convert", help="Hugging Face safetensors checkpoint or GGUF file -> Colibri model directory")
    c.add_argument("source", metavar="HF_DIR|MODEL.gguf", help="a save_pretrained directory, or a GGUF file (the "
                   "first part of a split one); GGUF weights are copied in the formats they are stored in")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=WEIGHT_DTYPES + MIXES, default=None,
                   help="weight format written from a Hugging Face checkpoint (default: the checkpoint's): "
                   "int8 (symmetric, per-row scales), ggml's block formats, or q4_k_m (llama.cpp's mix)")
    c.add_argument("--lora", default=None, metavar="ADAPTER", help="merge a PEFT LoRA adapter directory into the "
                   "weights (W + scale B A per matrix and per expert, in float32, before --dtype)")
    c.add_argument("--lora-scale", type=float, default=1.0, metavar="S", help="the merged update's weight "
                   "(default 1)")
    c.add_argument("--no-mtp", action="store_true", help="leave out the multi-token-prediction head a checkpoint "
                   "stores (DeepSeek-V3 / GLM nextn layers, Qwen3.5's mtp.*; kept by default: it drafts for "
                   "--draft mtp)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=_cmd_convert)
    i = sub.add_parser("inspect", help="validate a model directory and print its plan and memory needs")
    i.add_argument("model", nargs="?", default=None, help="model directory or GGUF file (converted once into the cache); "
                   "default: the embedded demo model")
    i.add_argument("--model", dest="model_flag", default=None, help="the same, as the other subcommands take it")
    i.add_argument("--context", type=int, default=None,
                   help="context length for the memory estimate (default: the model's maximum, as serve opens it)")
    i.add_argument("--max-batch", type=int, default=None, help="sequences at once (default: serve's, 8)")
    i.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill step, the arena's rows "
                   "(default: serve's, 256)")
    i.add_argument("--kv-cache-tokens", type=int, default=None, help="the KV pool (default: the engine's)")
    i.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: COLIBRI_KV_BLOCK_SIZE)")
    i.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                   help="the KV cache's storage type (default: COLIBRI_KV_DTYPE or float32)")
    i.add_argument("--device", default=None, help="a device profile (rk3588, ..., this): how many experts fit")
    i.set_defaults(fn=_cmd_inspect, serve_defaults={"max_batch": 8, "prefill_chunk": 256})
    b = sub.add_parser("backends", help="which backends are present, with devices, and why others are missing")
    b.set_defaults(fn=_cmd_backends)
    r = sub.add_parser("run", help="generate text, then print speed and which experts fired")
    r.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model directory or GGUF file (the "
                   "first part of a split one: converted once into the cache, reused after); default: the embedded "
                   "demo model")
    r.add_argument("--model", default=None, help="the same, as the other subcommands take it")
    r.add_argument("--prompt", default="The Python interpreter")
    r.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    r.add_argument("--ids", action="store_true", help="the prompt is space-separated token ids")
    _add_sampling_args(r)
    _add_engine_args(r)
    r.add_argument("--lora", default=None, metavar="ADAPTER", help="run with a LoRA adapter (PEFT directory or "
                   "llama.cpp LoRA .gguf) applied at run time")
    r.add_argument("--stats", action="store_true",
                   help="print the backend's setup (cpu: threads used), decode step time p50/p99, the slot pool's counters")
    r.set_defaults(fn=_cmd_run)
    ch = sub.add_parser("chat", help="an interactive chat in the terminal (/reset, /stats, /exit)")
    ch.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model directory or GGUF file "
                    "(converted once into the cache); default: the embedded demo model")
    ch.add_argument("--model", default=None, help="the same, as the other subcommands take it")
    ch.add_argument("--system", default=None, help="a system message that opens the conversation")
    _add_sampling_args(ch, max_new=512)
    _add_engine_args(ch)
    ch.set_defaults(fn=_cmd_chat)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (the serve extra)",
                        description="Engine flags given before any --model apply to every model; given after "
                        "a --model, to that model alone (e.g. --model a=DIR --max-seq-len 4096 --model b=DIR2). "
                        "--config FILE describes the models in JSON or TOML instead.")
    sv.add_argument("--model", action="append", default=None, help="DIR or NAME=DIR (repeat for several models); "
                    "DIR may be a GGUF file (converted once into the cache)")
    sv.add_argument("--config", default=None, metavar="FILE", help="models and their options, JSON or TOML: "
                    "{\"models\": {\"NAME\": {\"path\": DIR, \"max_seq_len\": 4096, ...}}} (docs/serving.md)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    sv.add_argument("--port", type=_port, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or --api-key-file, or "
                    "the COLIBRI_API_KEY environment variable)")
    sv.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE (its first line)")
    sv.add_argument("--cors", action="append", default=None, metavar="ORIGIN",
                    help="allow this origin (CORS), e.g. http://localhost:3000; repeat for several")
    sv.add_argument("--request-timeout", type=float, default=None, help="seconds a request may run (then 504)")
    sv.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens at this")
    sv.add_argument("--max-body", default="8M", metavar="SIZE", help="largest request body (default 8M; then 413)")
    sv.add_argument("--cache-dir", default=None, metavar="DIR", help="keep conversations' KV prefixes in DIR across "
                    "restarts (session files, per model)")
    sv.add_argument("--cache-dir-size", default="2G", metavar="SIZE", help="most bytes --cache-dir keeps per model "
                    "(least recently used files go first; default 2G)")
    sv.add_argument("--profile", action="store_true", help="time every step by phase (attention, experts, "
                    "lm_head, host) for the dashboard; queued backends sync after each operation (slower)")
    sv.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole (no KV reuse "
                    "across requests)")
    sv.add_argument("--lora", action="append", default=None, metavar="NAME=DIR", help="a LoRA adapter applied at "
                    "run time to the first model's requests that name it (\"model\": NAME); repeat for several")
    _add_engine_args(sv, per_model=True)
    sv.add_argument("--max-batch", type=int, default=8, action=_PerModel)
    sv.add_argument("--kv-cache-tokens", type=int, default=None, action=_PerModel,
                    help="KV pool tokens (default: min(context x batch, max(4096, context)))")
    sv.add_argument("--no-settle-replies", action="store_true", help="hybrid models: do not re-prefill a "
                    "finished reply for the next turn (that turn then recomputes the reply)")
    sv.add_argument("--state-snapshots", type=int, default=None, action=_PerModel,
                    help="recurrent-state snapshots kept for prefix caching (hybrid models; default: --max-batch)")
    sv.add_argument("--snapshot-every", type=int, default=1024, action=_PerModel,
                    help="also snapshot the recurrent state every N prefilled tokens (rounded up to a multiple of "
                    "lcm(block size, 16); 0: at prompts' ends only)")
    sv.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 429")
    sv.add_argument("--prefill-chunk", type=int, default=256, action=_PerModel,
                    help="prompt tokens prefilled per step at most")
    sv.add_argument("--interleave", type=float, default=2.0, action=_PerModel,
                    help="a step that prefills beside decodes may take this many decode steps' time "
                    "(0: no cap, more throughput, slower streams meanwhile)")
    sv.add_argument("--memory-budget", action="append", metavar="[NAME=]SIZE",
                    help="memory a model's engine may allocate (arena, KV pool, expert slots), e.g. 2G; "
                    "NAME=SIZE for one model, SIZE for the others; the server refuses to start, with the "
                    "numbers, when they do not fit")
    sv.set_defaults(fn=_cmd_serve, per_model=None)
    t = sub.add_parser("trace", help="record which experts every token chose, to an .npz")
    t.add_argument("--model", default=None, help="model directory or GGUF file (converted once into the cache); "
                   "default: the embedded demo model")
    t.add_argument("--prompts", required=True, help="a file, one prompt a line")
    t.add_argument("--ids", action="store_true", help="prompts are space-separated token ids")
    t.add_argument("--out", required=True)
    t.add_argument("--max-new-tokens", type=int, default=0, help="also trace generation")
    t.add_argument("--max-batch", type=int, default=1, help="sequences decoded together (a step's tokens)")
    t.add_argument("--backend", default=None)
    t.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                   help="trace the model routed to K experts per token (COLIBRI_TOP_K): simulate what it saves")
    t.add_argument("--workers", type=int, default=None, metavar="N",
                   help="trace on N Ray actors, prompts sharded (the ray extra; a local Ray without --ray)")
    t.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="a Ray cluster's address (auto, HOST:PORT, ray://...); the model directory must be at "
                   "the same path on every node")
    t.set_defaults(fn=_cmd_trace)
    sm = sub.add_parser("simulate", help="replay a trace through the expert slot pool; estimate a device")
    sm.add_argument("--trace", required=True)
    sm.add_argument("--slots", type=int, default=None)
    sm.add_argument("--policy", default="lru", help="lru, lfu, belady, prefetch (comma-separated to compare)")
    sm.add_argument("--device", default=None, help="profile name (rk3588, mali-g78-phone, jetson-orin, "
                    "a100-pcie4) or a JSON file")
    sm.add_argument("--context", type=int, default=4096, help="context length for the memory fit")
    sm.add_argument("--sweep", nargs="?", const=True, default=False, metavar="KEY=VALUES",
                    help="alone: hit rate over slot counts; KEY=VALUES[,KEY=VALUES]: a grid over slots "
                    "(start:stop:step, stop included), policy, device and top_k, e.g. "
                    "slots=4:64:4,policy=lru,lfu,belady,prefetch,device=rk3588,jetson-orin,top_k=2,1")
    sm.add_argument("--top-k", type=int, default=None, metavar="K",
                    help="replay as if each token kept its K highest-weight experts (Trace.with_top_k)")
    sm.add_argument("--workers", type=int, default=None, metavar="N", help="run the grid on N Ray workers")
    sm.add_argument("--ray", default=None, metavar="ADDRESS", help="run the grid on this Ray cluster")
    sm.add_argument("--plot", default=None, help="write the sweep as a PNG")
    sm.add_argument("--json", action="store_true")
    sm.add_argument("--target-ms", type=float, default=None,
                    help="recommend the fewest slots whose estimated ms/token on --device is at most this")
    sm.set_defaults(fn=_cmd_simulate)
    pl = sub.add_parser("plan", help="what lives where (resident weights, pinned hot set, streamed experts, KV, "
                        "arena) in a memory size, and the decode speed the simulator predicts")
    pl.add_argument("model")
    pl.add_argument("--memory", default=None, metavar="SIZE", help="the memory the engine gets (600M, 4G; default: "
                    "what this machine has free)")
    pl.add_argument("--device", default=None, help="a device profile for the prediction (default: this machine "
                    "as `colibri probe-device` measured it)")
    pl.add_argument("--trace", default=None, help="a routing trace to predict with (default: the model's routing "
                    "heat, else uniform routing)")
    pl.add_argument("--policy", default="lru", choices=["lru", "lfu", "prefetch"])
    pl.add_argument("--context", type=int, default=None, help="tokens of KV cache (default: the model's maximum)")
    pl.add_argument("--backend", default="cpu")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=_cmd_plan)
    st = sub.add_parser("stats", help="routing statistics of a trace")
    st.add_argument("trace")
    st.add_argument("--json", action="store_true")
    st.add_argument("--plot", default=None, help="write a load heatmap PNG")
    st.set_defaults(fn=_cmd_stats)
    pd = sub.add_parser("probe-device", help="measure this machine into a device profile (simulate --device this)")
    pd.add_argument("--dir", default=None, help="a directory on the storage the models live on (default: the temp dir)")
    pd.add_argument("--out", default=None, help="where to write the profile (default: ~/.cache/colibri/device-this.json)")
    pd.add_argument("--mem-mib", type=int, default=512, help="weights the bandwidth probe reads (MiB)")
    pd.add_argument("--file-mib", type=int, default=256, help="size of the storage probe's file (MiB)")
    pd.add_argument("--blob", type=int, default=6 << 20, help="bytes a read, an expert's size (default 6 MiB)")
    pd.set_defaults(fn=_cmd_probe_device)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ColibriError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return abs(e.code) or 1
    except BrokenPipeError:
        return 0
