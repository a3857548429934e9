"""Give the embedded demo model a multi-token-prediction head (speculative decoding: `--draft mtp`).

The head is DeepSeek-V3's MTP module (its report, section 2.2), the layout Colibri converts from
DeepSeek-V3 / GLM checkpoints (model.layers.L.* after the decoder's layers):

    x      = eh_proj [enorm(embed(t_{i+1})); hnorm(h_i)]      h_i: the model's final-normed hidden at i
    x      = layer(x)                                          one decoder layer at position i
    logits = embed^T shared_head.norm(x)                       the tied head: predicts t_{i+2}

Its layer is a dense one (attention + a SwiGLU MLP of the experts' width, Mistral's layer): the
published heads carry an MoE layer like the model's, which here would add 8 experts (4.7 MB) to a
head whose job is one guess; a dense layer of one expert's width costs what the model's 2 active
experts cost. The model stays frozen. The head is trained by self-distillation, the way a draft
model earns acceptance: its distribution at i is pulled towards the model's own at i + 1 (soft cross
entropy on the model's logits, which the verifier compares against), on the demo model's training
text (train.py's corpus and split: Python's documentation and the fortune files, the same seed).

Initialisation: the layer from the model's last layer (attention; the MLP from its expert 0),
eh_proj passing the hidden state through (h_proj = I, e_proj = 0), the norms from the model's.

Writes the head into the checkpoint (--hf: model.layers.4.* and num_nextn_predict_layers = 1 in
config.json; transformers ignores both), converts the checkpoint into colibri_edge/default_model/
and records mtp_metrics.json: the head's validation agreement with the model's greedy token (the
acceptance of a first draft at temperature 0), before and after. About 10 minutes on 2 CPU cores.
Usage: python mtp_train.py [--steps 1500] [--hf hf]   (`make mtp` here)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=os.path.join(HERE, "hf"), help="the demo model's checkpoint (head added here)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--val-fraction", type=float, default=0.05, help="train.py's split")
    ap.add_argument("--cache", default=os.path.join(HERE, "build"))
    ap.add_argument("--out-colibri", default=os.path.join(train.REPO, "colibri_edge", "default_model"))
    ap.add_argument("--colibri-dtype", default="float16", choices=["float32", "float16"])
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    hf_cfg_path = os.path.join(args.hf, "config.json")
    hf_cfg = json.load(open(hf_cfg_path))
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size

    # -- the text: train.py's corpus and split, tokenised by the shipped tokenizer --
    os.makedirs(args.cache, exist_ok=True)
    docs, prov = train.gather_corpus(args.cache, True, False)
    train_docs, val_docs = train.split(docs, args.seed, args.val_fraction)
    tok = Tokenizer.from_file(os.path.join(args.hf, "tokenizer.json"))
    eos = tok.token_to_id(train.EOS)
    train_ids = torch.as_tensor(train.encode_docs(tok, train_docs, eos))
    val_ids = torch.as_tensor(train.encode_docs(tok, val_docs, eos))
    print(f"text: train {len(train_ids)} tokens, validation {len(val_ids)}", flush=True)

    # -- the head --
    lcfg = MistralConfig(hidden_size=H, intermediate_size=cfg.intermediate_size,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, vocab_size=V,
                         max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=dict(cfg.rope_parameters), num_hidden_layers=1)
    lcfg._attn_implementation = "sdpa"
    layer = MistralDecoderLayer(lcfg, 0)
    last = model.model.layers[L - 1]
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, n).weight.copy_(getattr(last.self_attn, n).weight)
        for a, b in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm")):
            getattr(layer, a).weight.copy_(getattr(last, b).weight)
        sd = {k: v for k, v in last.state_dict().items()}
        gu = next(v for k, v in sd.items() if k.endswith("gate_up_proj"))[0]     # expert 0: [2I, H]
        dn = next(v for k, v in sd.items() if k.endswith("experts.down_proj"))[0]  # [H, I]
        I = cfg.intermediate_size
        if gu.shape[0] != 2 * I:
            gu = gu.T
        if dn.shape[0] != H:
            dn = dn.T
        layer.mlp.gate_proj.weight.copy_(gu[:I])
        layer.mlp.up_proj.weight.copy_(gu[I:])
        layer.mlp.down_proj.weight.copy_(dn)
    norm_w = model.model.norm.weight.detach()
    head = torch.nn.ParameterDict({
        "enorm": torch.nn.Parameter(norm_w.clone()), "hnorm": torch.nn.Parameter(norm_w.clone()),
        "norm": torch.nn.Parameter(norm_w.clone()),
        "eh_proj": torch.nn.Parameter(torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))})
    params = list(layer.parameters()) + list(head.parameters())
    rotary = model.model.rotary_emb
    embed = model.model.embed_tokens.weight

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def head_logits(ids):
        """-> (head logits at 0..T-2 [B, T-1, V], the model's logits at 1..T-1 [B, T-1, V])."""
        with torch.no_grad():
            out = model.model(ids)
            h = out.last_hidden_state
            target = model.lm_head(h[:, 1:])
        T = ids.shape[1] - 1
        x = torch.cat([rms(F.embedding(ids[:, 1:], embed), head["enorm"]), rms(h[:, :-1], head["hnorm"])], -1)
        x = x @ head["eh_proj"].T
        pos = torch.arange(T)[None].expand(ids.shape[0], T)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        return rms(y, head["norm"]) @ embed.T, target

    def windows(src, n, rng):
        starts = rng.integers(0, len(src) - args.seq_len - 1, n)
        return torch.stack([src[s:s + args.seq_len] for s in starts])

    def agreement(n_batches=24):
        """The head's argmax equal to the model's greedy token (the next-but-one token), on validation."""
        rng = np.random.default_rng(7)
        hits = total = 0
        with torch.no_grad():
            for _ in range(n_batches):
                q, p = head_logits(windows(val_ids, args.batch, rng))
                hits += int((q.argmax(-1) == p.argmax(-1)).sum())
                total += q.shape[0] * q.shape[1]
        return hits / total

    before = agreement()
    print(f"agreement before: {before:.3f}", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        q, p = head_logits(windows(train_ids, args.batch, rng))
        loss = -(F.softmax(p, -1) * F.log_softmax(q, -1)).sum(-1).mean()     # soft cross entropy (distillation)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}, lr {lr:.2e}, {time.time() - t0:.0f} s", flush=True)
    after = agreement()
    print(f"agreement after: {after:.3f}", flush=True)

    # -- into the checkpoint (DeepSeek-V3's names), then the embedded model --
    f = os.path.join(args.hf, "model.safetensors")
    state = load_file(f)
    dt = state["model.embed_tokens.weight"].dtype
    p = f"model.layers.{L}."
    state = {k: v for k, v in state.items() if not k.startswith(p)}
    new = {p + "enorm.weight": head["enorm"], p + "hnorm.weight": head["hnorm"], p + "eh_proj.weight": head["eh_proj"],
           p + "shared_head.norm.weight": head["norm"]}
    new.update({p + k: v for k, v in layer.state_dict().items()})
    state.update({k: v.detach().to(dt).contiguous() for k, v in new.items()})
    save_file(state, f, metadata={"format": "pt"})
    hf_cfg["num_nextn_predict_layers"] = 1
    json.dump(hf_cfg, open(hf_cfg_path, "w"), indent=2, sort_keys=True)
    sys.path.insert(0, train.REPO)
    from colibri_edge.model.convert import convert
    import shutil
    if os.path.exists(args.out_colibri):
        shutil.rmtree(args.out_colibri)
    convert(args.hf, args.out_colibri, dtype=args.colibri_dtype, progress=False)
    metrics = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed,
               "threads": args.threads, "torch": torch.__version__, "seconds": round(time.time() - t0),
               "head_parameters": sum(v.numel() for v in new.values()),
               "validation_agreement": {"before": round(before, 4), "after": round(after, 4)},
               "corpus": prov}
    json.dump(metrics, open(os.path.join(HERE, "mtp_metrics.json"), "w"), indent=1)
    print(json.dumps(metrics["validation_agreement"]))


if __name__ == "__main__":
    main()
