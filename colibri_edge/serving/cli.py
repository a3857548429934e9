"""`colibri` (also `python -m colibri_edge`): run, convert, inspect, backends."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT


def _cmd_convert(a):
    from ..model.convert import convert
    cfg = convert(a.source, a.out_dir, dtype=a.dtype, progress=not a.quiet)
    print(f"wrote {a.out_dir}: {cfg['model_type']}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['experts_per_layer']} experts/layer, top-{cfg['top_k']}, {cfg['weight_dtype']}")
    return 0


def _cmd_inspect(a):
    from ..model.modeldir import ModelDir
    from ..analysis.sizing import summary
    from ..units import human
    m = ModelDir(a.model)
    cfg = m.config
    s = summary(m, a.context, a.max_batch, a.prefill_chunk, a.block_size)
    print(f"{m.path}: valid (format {cfg['format_version']})")
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
          f"{', renormalised' + floor if cfg['norm_topk_prob'] else ''}{scaled}, qk_norm {cfg['qk_norm']}")
    la = cfg.get("latent_attention")
    if la:
        nh, L = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        full = 4 * L * nh * (la["qk_nope_head_dim"] + la["qk_rope_head_dim"] + la["v_head_dim"])
        lat = 4 * L * (la["kv_lora_rank"] + la["qk_rope_head_dim"])
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
    print(f"  KV cache: {s['kv_bytes_per_token']} bytes per token"
          + (f" (full-attention layers) + at most {s['kv_window_bytes_per_sequence']} bytes per sequence in the "
             f"sliding-window layers (blocks of {a.block_size})" if s["kv_window_bytes_per_sequence"] else "")
          + (f"; recurrent state: {s['state_bytes_per_sequence']} bytes per sequence at any length (conv + delta "
             f"rule, {sum(t == 'linear_attention' for t in types)} layers)" if s["state_bytes_per_sequence"] else ""))
    print(f"  memory at context {a.context} x batch {a.max_batch} (prefill chunk {a.prefill_chunk}, KV blocks of "
          f"{a.block_size}): weights {human(s['non_expert_bytes'])} + experts {human(s['expert_bytes'])} + "
          f"{'KV cache and recurrent state' if s['state_bytes_per_sequence'] else 'KV cache'} "
          f"{human(s['kv_cache_bytes'])} + scratch {human(s['scratch_bytes'])} = {human(s['total_bytes'])}")
    print(f"  allocated at open: arena {s['scratch_bytes']} bytes, KV cache {s['kv_cache_bytes']} bytes "
          f"(Engine.open(max_seq_len={a.context}, max_batch={a.max_batch}, prefill_chunk={a.prefill_chunk}, "
          f"kv_cache_tokens={a.context * a.max_batch}, kv_block_size={a.block_size}))")
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


def _cmd_run(a):
    from ..requests.engine import Engine
    model = a.model
    if model is None:
        model, note = _default_model()
        print(f"[colibri] no --model given: using the embedded default model ({note})", file=sys.stderr)
    with Engine.open(model, backend=a.backend, max_seq_len=a.max_seq_len, expert_slots=a.expert_slots,
                     slot_policy=a.slot_policy, top_k=a.experts_per_token) as eng:
        prompt = a.prompt
        if a.chat:
            prompt = [{"role": "user", "content": a.prompt}]
        elif a.ids:
            prompt = [int(t) for t in a.prompt.split()]
        kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                  seed=a.seed, ignore_eos=a.ignore_eos, min_p=a.min_p, repetition_penalty=a.repeat_penalty)
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


def _cmd_trace(a):
    from ..requests.engine import Engine
    lines = [l.strip() for l in open(a.prompts, encoding="utf-8") if l.strip()]
    if not lines:
        raise ColibriError(-1, f"{a.prompts}: no prompts (one a line)")
    with Engine.open(a.model, backend=a.backend, max_batch=a.max_batch, top_k=a.experts_per_token) as eng:
        prompts = [[int(t) for t in l.split()] for l in lines] if a.ids else lines
        tr = eng.trace(prompts, max_new_tokens=a.max_new_tokens, ignore_eos=a.max_new_tokens > 0)
    tr.save(a.out)
    print(f"wrote {a.out}: {tr.expert_ids.shape[0]} tokens, {tr.num_steps} steps, "
          f"{len(tr.layer_ids)} MoE layers, top-{tr.expert_ids.shape[2]}")
    return 0


def _cmd_simulate(a):
    import json as _json
    from ..analysis.simulate import estimate, load_profile, plot_sweep, replay, sweep_points
    from ..analysis.trace import Trace
    tr = Trace.load(a.trace)
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


def _cmd_serve(a):
    import os
    from ..errors import COLIBRI_ERR_INVALID_ARGUMENT
    from .serve import serve
    models = {}
    for spec in a.model:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if not name or name in models:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--model {spec!r}: give each model a distinct "
                               "name (NAME=DIR)")
        models[name] = path
    budgets, default = {}, None
    for spec in a.memory_budget or []:
        name, sep, size = spec.rpartition("=")
        if sep:
            budgets[name] = parse_size(size, f"--memory-budget {spec}")
        else:
            default = parse_size(size, f"--memory-budget {spec}")
    if default is not None:
        budgets = {**{n: default for n in models}, **budgets}
    if a.host not in ("127.0.0.1", "localhost", "::1") and not a.api_key:
        print(f"[colibri] serving on {a.host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    serve(models, host=a.host, port=a.port, api_key=a.api_key, cors=a.cors, request_timeout=a.request_timeout,
          budgets=budgets, backend=a.backend, max_seq_len=a.max_seq_len, max_batch=a.max_batch,
          max_queue=a.max_queue, prefill_chunk=a.prefill_chunk, interleave=a.interleave)
    return 0


def parse_size(text: str, what: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes (K, M, G, T are powers of 1024, as free -h prints)."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{what}: give a size such as 512M, 2G or 1.5GiB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def build_parser():
    p = argparse.ArgumentParser(prog="colibri", description="Colibri Edge: MoE inference on edge hardware")
    sub = p.add_subparsers(dest="cmd", required=True)
    from ..model.dtypes import MIXES, WEIGHT_DTYPES
    c = sub.add_parser("convert", help="Hugging Face safetensors checkpoint or GGUF file -> Colibri model directory")
    c.add_argument("source", metavar="HF_DIR|MODEL.gguf", help="a save_pretrained directory, or a GGUF file (the "
                   "first part of a split one); GGUF weights are copied in the formats they are stored in")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=WEIGHT_DTYPES + MIXES, default=None,
                   help="weight format written from a Hugging Face checkpoint (default: the checkpoint's): "
                   "int8 (symmetric, per-row scales), ggml's block formats, or q4_k_m (llama.cpp's mix)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=_cmd_convert)
    i = sub.add_parser("inspect", help="validate a model directory and print its plan and memory needs")
    i.add_argument("model")
    i.add_argument("--context", type=int, default=4096, help="context length for the memory estimate")
    i.add_argument("--max-batch", type=int, default=1)
    i.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill step (the arena's rows)")
    i.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    i.add_argument("--device", default=None, help="a device profile (rk3588, ..., this): how many experts fit")
    i.set_defaults(fn=_cmd_inspect)
    b = sub.add_parser("backends", help="which backends are present, with devices, and why others are missing")
    b.set_defaults(fn=_cmd_backends)
    r = sub.add_parser("run", help="generate text, then print speed and which experts fired")
    r.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    r.add_argument("--prompt", default="The Python interpreter")
    r.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    r.add_argument("--ids", action="store_true", help="the prompt is space-separated token ids")
    r.add_argument("--max-new-tokens", type=int, default=48)
    r.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens (as llama.cpp's)")
    # llama.cpp's sampling defaults (llama-cli), with its classic repetition guard; --temperature 0 is greedy
    r.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8, as llama.cpp)")
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--min-p", type=float, default=0.05)
    r.add_argument("--repeat-penalty", type=float, default=1.1,
                   help="divide the logits of tokens already in the context (1 turns it off)")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--backend", default=None, help="auto, cpu, opencl, cuda, reference (default: COLIBRI_BACKEND or auto)")
    r.add_argument("--max-seq-len", type=int, default=None)
    r.add_argument("--expert-slots", type=_slots_arg, default=None, metavar="N|auto",
                   help="keep at most N experts resident (slot pool); auto: as many as the free memory holds")
    r.add_argument("--slot-policy", default=None, choices=["lru", "lfu", "prefetch"])
    r.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                   help="route each token to K experts instead of the model's (Engine.open(top_k=K), "
                        "COLIBRI_TOP_K); --top-k is the sampler's")
    r.add_argument("--stats", action="store_true",
                   help="print the backend's setup (cpu: threads used), decode step time p50/p99, the slot pool's counters")
    r.set_defaults(fn=_cmd_run)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (the serve extra)")
    sv.add_argument("--model", action="append", required=True, help="DIR or NAME=DIR (repeat for several models)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    sv.add_argument("--cors", default=None, help="allow this origin (CORS), e.g. http://localhost:3000")
    sv.add_argument("--request-timeout", type=float, default=None, help="seconds a request may run")
    sv.add_argument("--backend", default=None)
    sv.add_argument("--max-seq-len", type=int, default=None)
    sv.add_argument("--max-batch", type=int, default=8)
    sv.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 429")
    sv.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per step at most")
    sv.add_argument("--interleave", type=float, default=2.0,
                    help="a step that prefills beside decodes may take this many decode steps' time "
                    "(0: no cap, more throughput, slower streams meanwhile)")
    sv.add_argument("--memory-budget", action="append", metavar="[NAME=]SIZE",
                    help="memory a model's engine may allocate (arena, KV pool, expert slots), e.g. 2G; "
                    "NAME=SIZE for one model, SIZE for the others; the server refuses to start, with the "
                    "numbers, when they do not fit")
    sv.set_defaults(fn=_cmd_serve)
    t = sub.add_parser("trace", help="record which experts every token chose, to an .npz")
    t.add_argument("--model", required=True)
    t.add_argument("--prompts", required=True, help="a file, one prompt a line")
    t.add_argument("--ids", action="store_true", help="prompts are space-separated token ids")
    t.add_argument("--out", required=True)
    t.add_argument("--max-new-tokens", type=int, default=0, help="also trace generation")
    t.add_argument("--max-batch", type=int, default=1, help="sequences decoded together (a step's tokens)")
    t.add_argument("--backend", default=None)
    t.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                   help="trace the model routed to K experts per token (COLIBRI_TOP_K): simulate what it saves")
    t.set_defaults(fn=_cmd_trace)
    sm = sub.add_parser("simulate", help="replay a trace through the expert slot pool; estimate a device")
    sm.add_argument("--trace", required=True)
    sm.add_argument("--slots", type=int, default=None)
    sm.add_argument("--policy", default="lru", help="lru, lfu, belady, prefetch (comma-separated to compare)")
    sm.add_argument("--device", default=None, help="profile name (rk3588, mali-g78-phone, jetson-orin, "
                    "a100-pcie4) or a JSON file")
    sm.add_argument("--context", type=int, default=4096, help="context length for the memory fit")
    sm.add_argument("--sweep", action="store_true", help="hit rate over slot counts")
    sm.add_argument("--plot", default=None, help="write the sweep as a PNG")
    sm.add_argument("--json", action="store_true")
    sm.add_argument("--target-ms", type=float, default=None,
                    help="recommend the fewest slots whose estimated ms/token on --device is at most this")
    sm.set_defaults(fn=_cmd_simulate)
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
