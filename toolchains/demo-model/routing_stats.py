"""Routing statistics of the held-out validation text through the shipped demo model, in Colibri.

Per MoE layer: each expert's load (share of the routed token slots), load imbalance (max / mean
load), the entropy of the load (bits; log2(E) is perfectly even), the mean entropy of a token's
top-k routing weights, and how much the expert choice says about the text's source (Python docs
vs fortunes: mutual information, bits) and about the token itself, with the tokens each expert
takes far more often than the layer does.

The validation split is rebuilt exactly as train.py builds it (same corpus, seed and fraction).
Usage: python routing_stats.py [--model DIR] [--backend reference|cpu] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train  # noqa: E402


def entropy_bits(p):
    p = np.asarray(p, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())


def mutual_information(joint):
    """I(X;Y) in bits from a count table joint[x, y]."""
    j = np.asarray(joint, dtype=np.float64)
    j = j / j.sum()
    px, py = j.sum(1, keepdims=True), j.sum(0, keepdims=True)
    nz = j > 0
    return float((j[nz] * np.log2(j[nz] / (px @ py)[nz])).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(train.REPO, "colibri_edge", "default_model"))
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--cache", default=os.path.join(HERE, "build"))
    ap.add_argument("--json", default=None, help="also write the statistics here")
    args = ap.parse_args()

    from colibri_edge import Engine

    docs, prov = train.gather_corpus(args.cache, True, True)
    n_python = prov["pydoc_topics"] + prov["stdlib_docstrings"]
    source_of = {}
    for i, d in enumerate(docs):
        source_of.setdefault(d, 0 if i < n_python else 1)
    _, val_docs = train.split(docs, args.seed, args.val_fraction)

    eng = Engine.open(args.model, backend=args.backend)
    cfg = eng.config
    E, K = cfg["experts_per_layer"], cfg["top_k"]
    T = eng.max_seq_len
    eos = cfg["eos_token_ids"][0]
    stream, src = [], []
    for d in val_docs:
        ids = eng.codec.encode(d, add_special_tokens=False) + [eos]
        stream += ids
        src += [source_of[d]] * len(ids)
    stream, src = np.asarray(stream, np.int32), np.asarray(src, np.int8)

    moe_layers = [l["layer_id"] for l in cfg["layers"] if l["type"] != "dense"]
    routed = {li: [] for li in moe_layers}        # per layer: [tokens, k] ids
    weights = {li: [] for li in moe_layers}

    from colibri_edge.runtime.hooks import RoutingHook

    class Observe(RoutingHook):
        def on_route(self, layer, ids, w, next_layer, predicted):
            routed[layer].append(np.array(eng.backend.download(ids)))
            weights[layer].append(np.array(eng.backend.download(w)))

    hook = Observe()
    eng.runner.hooks.append(hook)
    n = len(stream) // T * T
    for s in range(0, n, T):
        eng.infer(stream[s:s + T])
    eng.runner.hooks.remove(hook)
    toks, src = stream[:n], src[:n]

    out = {"model": os.path.relpath(eng.path, train.REPO), "backend": eng.backend.name,
           "validation_tokens": int(n), "experts": E, "top_k": K, "layers": []}
    vocab = eng.codec.tok
    for li in moe_layers:
        ids = np.concatenate(routed[li])[:n]
        w = np.concatenate(weights[li])[:n]
        assert ids.shape == (n, K), ids.shape
        counts = np.bincount(ids.ravel(), minlength=E)
        load = counts / counts.sum()
        wn = np.clip(w / w.sum(1, keepdims=True), 1e-12, 1)
        token_entropy = float((-(wn * np.log2(wn)).sum(1)).mean())
        by_source = np.zeros((E, 2))
        for k in range(K):
            np.add.at(by_source, (ids[:, k], src), 1)
        first = ids[:, 0]  # the top-1 expert: how well the token id predicts it
        tok_index = {t: i for i, t in enumerate(np.unique(toks))}
        tok_joint = np.zeros((E, len(tok_index)))
        np.add.at(tok_joint, (first, [tok_index[t] for t in toks]), 1)
        top_tokens = {}
        layer_freq = Counter(toks.tolist())
        for e in range(E):
            c = Counter(toks[(ids == e).any(1)].tolist())
            scored = sorted(((c[t] / layer_freq[t], c[t], t) for t in c if layer_freq[t] >= 20),
                            reverse=True)
            top_tokens[e] = [vocab.decode([t]) for _, _, t in scored[:6]]
        out["layers"].append({
            "layer": li,
            "load": [round(float(x), 4) for x in load],
            "imbalance_max_over_mean": round(float(load.max() * E), 3),
            "load_entropy_bits": round(entropy_bits(counts), 3),
            "max_entropy_bits": round(math.log2(E), 3),
            "mean_token_weight_entropy_bits": round(token_entropy, 3),
            "python_share_per_expert": [round(float(b[0] / max(1, b.sum())), 3) for b in by_source],
            "mi_expert_source_bits": round(mutual_information(by_source), 4),
            "mi_top1_expert_token_bits": round(mutual_information(tok_joint), 3),
            "top_tokens": top_tokens,
        })
    out["python_share_of_tokens"] = round(float((src == 0).mean()), 3)
    eng.close()

    print(f"routing of {n} validation tokens through {out['model']} ({out['backend']} backend), "
          f"{E} experts top-{K}; {out['python_share_of_tokens']:.0%} of tokens from the Python docs")
    for L in out["layers"]:
        print(f"layer {L['layer']}: load " + " ".join(f"{x:.3f}" for x in L["load"]))
        print(f"  imbalance (max/mean) {L['imbalance_max_over_mean']:.2f}, load entropy {L['load_entropy_bits']:.3f}"
              f"/{L['max_entropy_bits']:.0f} bits, mean top-{K} weight entropy {L['mean_token_weight_entropy_bits']:.3f}"
              f" bits, I(expert;source) {L['mi_expert_source_bits']:.3f} bits, I(top-1 expert;token) "
              f"{L['mi_top1_expert_token_bits']:.2f} bits")
        print("  Python-docs share per expert: " + " ".join(f"{x:.2f}" for x in L["python_share_per_expert"]))
        for e, t in L["top_tokens"].items():
            print(f"    expert {e}: " + ", ".join(repr(x) for x in t))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
