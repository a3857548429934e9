"""Derived figures (bandwidth, ratios), the markdown table and the chart of a benchmark run."""
from __future__ import annotations

import numpy as np


def write_lines(out_dir: str, name: str, lines: list):
    """A results page: lines written to out_dir/name and printed."""
    import os
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def label(e):
    return f"{e['engine']} {e['precision']}"


def _get(e, *path):
    for p in path:
        if not isinstance(e, dict) or p not in e or e[p] is None:
            return None
        e = e[p]
    return e


def finish(r):
    """Add per-engine bandwidth figures and the ratios to the results, in place."""
    # the machine's read bandwidth: the best of the probes' medians (start, before each engine run, end),
    # i.e. the least disturbed; each engine's figures also keep their best round
    bws = [x["median_gbps"] for x in r.get("bandwidth_probes") or [r["bandwidth_start"], r["bandwidth_end"]]]
    r["machine_read_gbps"] = float(np.max(bws))
    r["machine_read_gbps_range"] = [float(np.min(bws)), float(np.max(bws))]
    col16 = next((e for e in r["engines"] if e["engine"] == "colibri" and e["precision"] == "float16"
                  and "decode_b4" in e), None)
    hf = next((e for e in r["engines"] if e["engine"] == "transformers" and "decode_b4" in e), None)
    for e in r["engines"]:
        if "decode_b1" not in e:
            continue
        bpt = e["bytes_per_decoded_token"]
        d1 = e["decode_b1"]
        d1["gbps"] = bpt * d1["tokens_per_s"] / 1e9
        d1["bandwidth_fraction"] = d1["gbps"] / r["machine_read_gbps"]
        # the rate at the median step: robust to the steps another process disturbed
        d1["tokens_per_s_p50"] = 1e3 / d1["step_p50_ms"]
        d1["gbps_p50"] = bpt * d1["tokens_per_s_p50"] / 1e9
        d1["bandwidth_fraction_p50"] = d1["gbps_p50"] / r["machine_read_gbps"]
        if d1.get("probe_gbps"):
            d1["probe_fraction"] = d1["gbps"] / d1["probe_gbps"]
        d4 = e.get("decode_b4") or {}
        if "tokens_per_s" in d4:
            d4["tokens_per_s_p50"] = 4e3 / d4["step_p50_ms"]
            distinct = d4.get("distinct_experts_per_layer")
            src = "measured"
            if distinct is None:      # llama.cpp: the same weights and prompts, routed by Colibri / transformers
                ref = col16 or hf
                distinct = _get(ref, "decode_b4", "distinct_experts_per_layer")
                src = f"from {label(ref)}'s routing" if ref else None
            if distinct is not None:
                L = r["model"]["spec"]["num_hidden_layers"]
                d4["bytes_per_step"] = e["non_expert_read_bytes"] + L * distinct * e["bytes_per_expert"]
                d4["distinct_experts_per_layer_used"] = distinct
                d4["distinct_source"] = src
                steps_per_s = d4["tokens_per_s"] / 4
                d4["gbps"] = d4["bytes_per_step"] * steps_per_s / 1e9
                d4["bandwidth_fraction"] = d4["gbps"] / r["machine_read_gbps"]
                d4["gbps_p50"] = d4["bytes_per_step"] * 1e3 / d4["step_p50_ms"] / 1e9

    def find(engine, prec):
        return next((e for e in r["engines"] if e["engine"] == engine and e["precision"] == prec
                     and "decode_b1" in e), None)

    ratios = []

    def ratio(name, a, b, *path):
        va, vb = _get(a, *path), _get(b, *path)
        if a is None or b is None:
            return
        ratios.append({"ratio": name, "a": label(a), "b": label(b), "what": ".".join(path),
                       "value": va / vb if va and vb else None})

    pairs = [(find("colibri", "float16"), find("llama.cpp", "f16")),
             (find("colibri", "int8"), find("llama.cpp", "q8_0")),
             (find("colibri", "float32"), find("transformers", "float32"))]
    pairs += [(find("colibri", e["precision"]), e) for e in r["engines"]
              if e["engine"] == "llama.cpp" and e["precision"].startswith("gguf ") and "decode_b1" in e]
    for a, b in pairs:
        for what, path in (("decode b1", ("decode_b1", "tokens_per_s")),
                           ("decode b1 at p50 step", ("decode_b1", "tokens_per_s_p50")),
                           ("decode b4", ("decode_b4", "tokens_per_s")),
                           ("decode b4 at p50 step", ("decode_b4", "tokens_per_s_p50")),
                           ("prefill", ("prefill", "tokens_per_s"))):
            if a is not None and b is not None:
                ratio(f"{label(a)} / {label(b)}: {what}", a, b, *path)
    r["ratios"] = ratios


def _f(v, fmt="{:.1f}", na="n/a"):
    return na if v is None else fmt.format(v)


def _mb(v):
    return "n/a" if v is None else f"{v / 1e6:.0f} MB"


def markdown(r):
    s = r["model"]["spec"]
    p = r["model"]["params"]
    m = r["machine"]
    out = [f"# Colibri Edge benchmark{' (reduced --small model)' if r['small'] else ''}", ""]
    out.append(f"Run {r['started']}, {r['wall_s'] / 60:.0f} min. Machine: {m['cpu']}, {m['cores']} cores, "
               f"{m.get('memory_bytes', 0) / 2**30:.0f} GiB; every engine with {m['threads_per_engine']} threads, each "
               f"in its own process. Load average at start {m['loadavg_start'][0]:.1f}, at end "
               f"{m['loadavg_end'][0]:.1f} (other work shares this CPU); the run's scheduling priority: "
               f"{m.get('priority', 'unchanged')}.")
    out.append("")
    out.append(f"Model: Mixtral-shaped, hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, "
               f"{s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads (head_dim {s['head_dim']}), "
               f"{s['num_local_experts']} experts top-{s['num_experts_per_tok']}, expert intermediate "
               f"{s['intermediate_size']}, vocab {s['vocab_size']}: {p['total'] / 1e6:.0f}M parameters, "
               f"{p['read_per_token'] / 1e6:.0f}M read per decoded token. Random weights (std 1/sqrt(fan_in)), one "
               f"HF float32 checkpoint converted for every engine. Prompt {r['prompt_len']} tokens; decode = "
               f"{r['decode_steps']} greedy steps (EOS ignored).")
    out.append("")
    b0 = r["bandwidth_start"]
    blas = b0["blas"][0] if b0["blas"] else {}
    lo, hi = r["machine_read_gbps_range"]
    out.append(f"Machine read bandwidth (NumPy BLAS sgemv over a {b0['bytes'] / 2**20:.0f} MiB float32 matrix, "
               f"{b0['threads']} threads, {blas.get('internal_api')} {blas.get('version')} kernel "
               f"`{blas.get('architecture')}`, OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset): "
               f"**{r['machine_read_gbps']:.1f} GB/s**, the best median of {len(r.get('bandwidth_probes', []))} probes "
               f"(at the start, just before each engine run, at the end), which ranged {lo:.1f}-{hi:.1f} GB/s as "
               f"the other work on the CPU came and went.")
    out.append("")
    out.append("## Throughput and latency")
    out.append("")
    out.append("| engine | weights | prefill tok/s | decode b1 tok/s | b1 tok/s at p50 | b1 p50 ms | b1 p99 ms "
               "| decode b4 tok/s | b4 tok/s at p50 | b4 step p50 ms | b4 step p99 ms | peak RSS | logits vs transformers |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for e in r["engines"]:
        if "na" in e:
            out.append(f"| {e['engine']} | {e['precision']} | n/a: {e['na']} |||||||||||")
            continue
        d1, d4 = e["decode_b1"], e.get("decode_b4", {})
        par = e.get("parity")
        par_s = "reference" if e["engine"] == "transformers" else \
            (f"max rel err {par['max_rel_err']:.1e}, argmax {par['argmax_agree'] * 100:.0f}%" if par else "")
        pl = e.get("parity_llama")
        if pl:
            par_s += (f"; vs llama.cpp on the same file: max \\|diff\\| / max \\|logit\\| {pl['max_rel_err']:.1e} "
                      f"(median over positions {pl['median_rel_err']:.1e}), argmax {pl['argmax_agree'] * 100:.0f}%")
        same = e.get("parity_same_rounding")
        if same:
            par_s += (f"; same {e['precision']} weights: max {same['max_rel_err']:.1e}, median "
                      f"{same['median_rel_err']:.1e}, argmax {same['argmax_agree'] * 100:.0f}%")
        b4 = (_f(d4.get("tokens_per_s"), "{:.2f}"), _f(d4.get("tokens_per_s_p50"), "{:.2f}"), _f(d4.get("step_p50_ms")),
              _f(d4.get("step_p99_ms"))) if "tokens_per_s" in d4 else (f"n/a: {d4.get('na', '')}", "", "", "")
        flag = "" if e.get("had_quiet_run", True) else " (no quiet run)"
        if e.get("extra_bufts") is False:
            flag += " (extra buffer types off: see the notes)"
        out.append(f"| {e['engine']} | {e['precision']}{flag} | {_f(e['prefill']['tokens_per_s'])} | "
                   f"{_f(d1['tokens_per_s'], '{:.2f}')} | {_f(d1['tokens_per_s_p50'], '{:.2f}')} | "
                   f"{_f(d1['step_p50_ms'])} | {_f(d1['step_p99_ms'])} | "
                   f"{b4[0]} | {b4[1]} | {b4[2]} | {b4[3]} | {e['peak_rss'] / 2**20:.0f} MiB | {par_s} |")
    out.append("")
    out.append(f"The CPU is shared with other work, so every engine ran in at least {r['rounds']} rounds (the order "
               f"reversed each round) and, up to {r.get('max_rounds', r['rounds'])} rounds, again until it had a quiet "
               f"run: one whose BLAS probes just before and after reached {r.get('quiet_threshold', 0.8) * 100:.0f}% of "
               f"the best probe. Other work only ever slows an engine down, so each figure is the engine's best over its "
               f"rounds (an engine that never had a quiet run is marked). Prefill: one {r['prompt_len']}-token prompt, median of "
               f"{r['prefill_reps']} runs in a round, logits of the last token only. Decode: {r['decode_steps']} steps, "
               f"the fastest of {r.get('decode_reps', 1)} runs in a round. "
               "Decode b1: one sequence; p50/p99 are per decoded token. Decode b4: four sequences decoded together (Colibri "
               "`generate_batch`, llama.cpp one `llama_decode` over a 4-sequence batch, transformers a [4,1] "
               "forward); tok/s counts all four, step latency is one step (4 tokens). \"tok/s at p50\" is the rate "
               "at the median step latency (1/p50, 4/p50 at b4): a preempted step does not pull it down, so on a shared "
               "CPU it is the closer estimate of the engine's own speed; \"decode tok/s\" is tokens / total decode time.")
    out.append("")
    if any(e.get("rounds") for e in r["engines"]):
        n = r.get("rounds_run", r["rounds"])
        out.append("Each run (prefill tok/s / decode b1 tok/s / decode b4 tok/s; the BLAS probe just before and "
                   "after, GB/s; **bold**: a quiet run):")
        out.append("")
        out.append("| engine | weights | " + " | ".join(f"round {i + 1}" for i in range(n)) + " |")
        out.append("|---|---|" + "---|" * n)
        for e in r["engines"]:
            if not e.get("rounds"):
                continue
            cells = [""] * n
            for x in e["rounds"]:
                c = (f"{x['prefill_tokens_per_s']:.1f} / {x['decode_b1_tokens_per_s']:.2f} / "
                     f"{x['decode_b4_tokens_per_s']:.2f}; {_f(x['probe_gbps'])}, {_f(x.get('probe_after_gbps'))}")
                cells[x["round"] - 1] = f"**{c}**" if x.get("quiet") else c
            out.append(f"| {e['engine']} | {e['precision']} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("## Memory traffic")
    out.append("")
    out.append(f"Weight bytes read per decoded token (one embedding row, every non-expert matrix incl. the "
               f"lm_head, and the top-{s['num_experts_per_tok']} experts of each layer) divided by the decode "
               f"time, next to the machine's {r['machine_read_gbps']:.1f} GB/s. Batch 4 reads each expert chosen by "
               f"any of the 4 tokens once per step.")
    out.append("")
    out.append("| engine | weights | bytes / token | b1 GB/s | b1 % of BLAS | b1 GB/s at p50 | % of BLAS "
               "| BLAS probe before that run | distinct experts / layer at b4 | bytes / b4 step | b4 GB/s "
               "| b4 GB/s at p50 | b4 % of BLAS at p50 |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in r["engines"]:
        if "na" in e:
            continue
        d1, d4 = e["decode_b1"], e.get("decode_b4", {})
        dist = d4.get("distinct_experts_per_layer_used")
        dist_s = "n/a" if dist is None else (f"{dist:.2f}" + ("" if d4.get("distinct_source") == "measured"
                                                               else f" ({d4.get('distinct_source')})"))
        out.append(f"| {e['engine']} | {e['precision']} | {_mb(e['bytes_per_decoded_token'])} | {_f(d1['gbps'])} | "
                   f"{_f(d1['bandwidth_fraction'] * 100, '{:.0f}%')} | {_f(d1['gbps_p50'])} | "
                   f"{_f(d1['bandwidth_fraction_p50'] * 100, '{:.0f}%')} | {_f(d1.get('probe_gbps'))} | {dist_s} | {_mb(d4.get('bytes_per_step'))} | "
                   f"{_f(d4.get('gbps'))} | {_f(d4.get('gbps_p50'))} | "
                   f"{_f(d4.get('gbps_p50') and d4['gbps_p50'] / r['machine_read_gbps'] * 100, '{:.0f}%')} |")
    out.append("")
    cols = [e for e in r["engines"] if e["engine"] == "colibri" and "decode_b1" in e]
    if cols:
        out.append(f"## Colibri first-token latency ({r['prompt_len']}-token prompt)")
        out.append("")
        out.append("A fresh process: import, `Engine.open`, then `generate(max_new_tokens=1)`. Cold: NUMBA_CACHE_DIR "
                   "points at an empty folder, so every kernel compiles; warm: the same folder afterwards.")
        out.append("")
        out.append("| weights | cold: open s | cold: first token s | warm: open s | warm: first token s | steady prefill s |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for e in cols:
            c, w = e.get("first_token_cold") or {}, e["first_token_warm"]
            out.append(f"| {e['precision']} | {_f(c.get('open_s'), '{:.2f}')} | {_f(c.get('first_token_s'), '{:.2f}')} | "
                       f"{_f(w['open_s'], '{:.2f}')} | {_f(w['first_token_s'], '{:.2f}')} | "
                       f"{_f(float(np.median(e['prefill']['seconds'])), '{:.2f}')} |")
        out.append("")
    if r.get("ratios"):
        out.append("## Ratios (>1: the first engine is faster)")
        out.append("")
        out.append("| ratio | value |")
        out.append("|---|---:|")
        for x in r["ratios"]:
            out.append(f"| {x['ratio']} | {_f(x['value'], '{:.2f}')} |")
        out.append("")
    prof = [e for e in cols if e.get("profile")]
    if prof:
        out.append("## Where Colibri's decode time goes (batch 1, per-op timers)")
        out.append("")
        for e in prof:
            pr = e["profile"]
            out.append(f"**{e['precision']}**: {pr['steps']} decode steps, median {pr['step_ms']:.1f} ms a step with "
                       f"timers (untimed p50 of the best round {e['decode_b1']['step_p50_ms']:.1f} ms). Medians over "
                       f"the steps; GB/s = the op's weight bytes / its median time.")
            out.append("")
            out.append("| op | ms / step | share | calls / step | weights MB / step | GB/s |")
            out.append("|---|---:|---:|---:|---:|---:|")
            for row in pr["rows"]:
                out.append(f"| {row['op']} | {row['ms_per_step']:.2f} | {row['share'] * 100:.0f}% | "
                           f"{_f(row['calls_per_step'], '{:.0f}', '')} | {_f(row['weight_mb_per_step'] or None, '{:.1f}', '')} | "
                           f"{_f(row['gbps'], '{:.1f}', '')} |")
            out.append("")
    llq = [e for e in r["engines"] if e["engine"] == "llama.cpp" and e.get("elements_by_type")]
    if llq:
        out.append("## The GGUF files of llama.cpp's quantiser")
        out.append("")
        out.append("`llama_cpp.llama_model_quantize` of the float32 GGUF (its default per-tensor mix for the file "
                   "type, no importance matrix), run by llama.cpp with its defaults (weight repacking on: "
                   "`use_extra_bufts`; `n_batch` = the prompt) and by Colibri after `colibri convert FILE.gguf` "
                   "(every block copied as stored). Elements per tensor type:")
        out.append("")
        out.append("| file | tensor types (share of elements) | bytes / decoded token |")
        out.append("|---|---|---:|")
        for e in llq:
            tot = sum(e["elements_by_type"].values())
            mix = ", ".join(f"{k} {v / tot * 100:.1f}%" for k, v in sorted(e["elements_by_type"].items(),
                                                                            key=lambda kv: -kv[1]))
            out.append(f"| {e['precision']} | {mix} | {_mb(e['bytes_per_decoded_token'])} |")
        out.append("")
    qr = r.get("quantiser_rms")
    if qr:
        out.append("## Our quantisers against llama.cpp's (same float32 weights)")
        out.append("")
        out.append("RMS of (dequantised - float32) over " + ", ".join(f"`{t}`" for t in qr["tensors"]) +
                   "; llama.cpp's from `llama_model_quantize` with every tensor in the format (`pure`, no importance "
                   "matrix), ours from `colibri_edge.model.quant.quantize`, both read back by gguf-py "
                   "(benchmarks/quant_error.py). Target: ratio <= 1.05.")
        out.append("")
        out.append("| format | RMS ours | RMS llama.cpp | ratio |")
        out.append("|---|---:|---:|---:|")
        for fmt, x in qr["formats"].items():
            out.append(f"| {fmt} | {_f(x.get('rms_ours'), '{:.5f}')} | {_f(x.get('rms_llama'), '{:.5f}')} | "
                       f"{_f(x.get('ratio'), '{:.3f}')} |")
        out.append("")
    if r.get("notes"):
        out.append("## Notes")
        out.append("")
        for n in r["notes"]:
            out.append(f"- {n}")
        out.append("")
    vers = ", ".join(f"{k} {m[k]}" for k in ("numba", "torch", "transformers", "llama_cpp", "gguf") if k in m)
    out.append(f"Versions: Python {m['python']}, NumPy {m['numpy']}, {vers}.")
    out.append("")
    return "\n".join(out)


def chart(r, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    es = [e for e in r["engines"] if "decode_b1" in e]
    if not es:          # every engine failed: bench.md says why, there is nothing to draw
        return
    names = [label(e).replace(" ", "\n", 1) for e in es]
    colours = ["#1f77b4" if e["engine"] == "colibri" else "#ff7f0e" if e["engine"] == "llama.cpp" else "#7f7f7f"
               for e in es]
    panels = [("prefill tokens/s (128-token prompt)", [e["prefill"]["tokens_per_s"] for e in es]),
              ("decode tokens/s, batch 1", [e["decode_b1"]["tokens_per_s"] for e in es]),
              ("decode tokens/s, batch 4", [_get(e, "decode_b4", "tokens_per_s") or 0 for e in es]),
              ("decode weight read GB/s, batch 1", [e["decode_b1"]["gbps"] for e in es])]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for ax, (title, vals) in zip(axes.flat, panels):
        bars = ax.bar(range(len(es)), vals, color=colours)
        ax.set_title(title)
        ax.set_xticks(range(len(es)))
        ax.set_xticklabels(names, fontsize=8)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.1f}" if v else "n/a", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        if "GB/s" in title:
            ax.axhline(r["machine_read_gbps"], color="k", ls="--", lw=1)
            ax.annotate(f"BLAS sgemv {r['machine_read_gbps']:.1f} GB/s", (0, r["machine_read_gbps"]),
                        va="bottom", fontsize=8)
        ax.set_ylim(0, max([v for v in vals if v] + [1]) * 1.18 if "GB/s" not in title
                    else max([v for v in vals if v] + [r["machine_read_gbps"]]) * 1.18)
    s = r["model"]["spec"]
    fig.suptitle(f"Colibri Edge vs llama.cpp vs transformers - Mixtral-shaped {r['model']['params']['total'] / 1e6:.0f}M "
                 f"({s['num_local_experts']} experts top-{s['num_experts_per_tok']}), {r['machine']['threads_per_engine']} "
                 f"threads, {r['machine']['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
