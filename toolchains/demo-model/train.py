"""Train Colibri Edge's embedded demo model: a small Mixtral-style mixture-of-experts decoder.

Everything is offline and seeded: the script gathers its own text, trains a byte-level BPE
tokenizer with `tokenizers`, trains the model with torch on the CPU, measures validation
perplexity (trained and untrained), saves a Hugging Face checkpoint with save_pretrained and
converts it with `colibri convert` into colibri_edge/default_model/.

Training text (all redistributable, all on a Debian/Ubuntu machine with Python):
  * Python's own documentation: the pydoc topics (`pydoc_data.topics.topics`, PSF licence);
  * docstrings of the standard library (every importable stdlib module, walked with
    pkgutil/inspect in a separate process; PSF licence);
  * Debian's `fortunes` / `fortunes-min` packages (BSD fortune files, Debian main; a few
    files are left out: see FORTUNE_FILES). `apt-get install fortunes-min fortunes`;
    with --no-fortunes (or when they are missing and --allow-missing-fortunes is given)
    the model is trained on the Python text only.

The corpus depends on the Python version (its docstrings) and the fortunes package version;
both are recorded, with the corpus' SHA-256, in metrics.json. Same corpus + same seed + same
torch build and thread count -> the same weights.

The defaults are the shipped model: Mixtral, 4 layers, hidden 256, 8 experts (384 wide) top-2,
vocab 4096, context 256; 1400 steps of 8 x 256 tokens with a per-layer load-balancing loss;
about 30 minutes on 2 CPU cores (torch threads spin-wait passively, so a busy machine costs less).

Usage: python train.py [--steps N] [--threads 2] [--out-hf hf] [--out-colibri ../../colibri_edge/default_model]
       (`make demo-model` at the top level, `make train` here)
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
EOS = "<|endoftext|>"

# Fortune files used. Left out: ascii art (not prose), translate-me (not English), and the files
# quoting copyrighted works at length or in poor taste for a first demo (songs-poems, literature,
# pratchett, startrek, zippy, tao, ethnic, drugs, men-women, politics).
FORTUNE_DIR = "/usr/share/games/fortunes"
FORTUNE_FILES = ["computers", "cookie", "debian", "definitions", "disclaimer", "education", "food",
                 "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie",
                 "love", "magic", "medicine", "miscellaneous", "news", "paradoxum", "people", "perl",
                 "pets", "platitudes", "riddles", "science", "sports", "wisdom", "work"]

# Standard-library modules never imported (side effects: GUIs, browsers, printing; or tests).
STDLIB_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "ensurepip",
               "lib2to3", "pydoc_data", "webbrowser", "venv", "msilib", "__main__"}


# ------------------------------------------------------------------------------------------------
# the corpus

def stdlib_docstrings() -> list:
    """Docstrings (>= 40 characters, deduplicated, in a fixed order) of the standard library's
    modules, classes, functions and methods. Runs in this process: call it in a child."""
    import importlib
    import inspect
    import pkgutil
    import warnings

    def quiet_import(name):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)

    mods = []
    for name in sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in STDLIB_SKIP):
        try:
            m = quiet_import(name)
        except BaseException:          # missing optional modules, platform-only modules
            continue
        mods.append(m)
        if hasattr(m, "__path__"):
            subs = sorted(i.name for i in pkgutil.walk_packages(m.__path__, name + ".", onerror=lambda _: None))
            for sub in subs:
                parts = sub.split(".")[1:]
                if any(p.startswith("_") or p in STDLIB_SKIP or p.startswith("test") for p in parts):
                    continue
                try:
                    mods.append(quiet_import(sub))
                except BaseException:
                    continue
    seen, docs = set(), []

    def add(obj):
        try:
            d = inspect.getdoc(obj)
        except Exception:
            return
        if d and len(d) >= 40 and d not in seen:
            seen.add(d)
            docs.append(d)

    for m in mods:
        add(m)
        for name, obj in sorted(vars(m).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != m.__name__:
                continue
            if inspect.isclass(obj):
                add(obj)
                for mname, member in sorted(vars(obj).items()):
                    if not mname.startswith("_") or mname == "__init__":
                        add(member)
            elif callable(obj):
                add(obj)
    return docs


def read_fortunes(files) -> list:
    out = []
    for name in files:
        path = os.path.join(FORTUNE_DIR, name)
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for entry in text.split("\n%\n"):
            entry = entry.strip("\n%").rstrip()
            if len(entry.strip()) >= 20:
                out.append(entry)
    return out


def package_version(pkg):
    try:
        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def gather_corpus(cache: str, use_fortunes: bool, allow_missing: bool):
    """-> (documents, provenance). Each document is one pydoc topic, one docstring or one fortune."""
    import pydoc_data.topics
    docs_path = os.path.join(cache, "stdlib_docstrings.json")
    if not os.path.exists(docs_path):
        # a child process: importing the whole standard library leaves threads, handlers and
        # memory behind that the training process should not carry
        subprocess.run([sys.executable, os.path.abspath(__file__), "--dump-docstrings", docs_path], check=True,
                       stdout=subprocess.DEVNULL)
    with open(docs_path) as f:
        docstrings = json.load(f)
    topics = [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]
    fortunes = []
    fortunes_version = None
    if use_fortunes:
        missing = [n for n in FORTUNE_FILES if not os.path.exists(os.path.join(FORTUNE_DIR, n))]
        if missing and not allow_missing:
            sys.exit(f"fortune files missing in {FORTUNE_DIR} ({', '.join(missing[:5])}...): "
                     "`apt-get install fortunes-min fortunes`, or pass --no-fortunes / --allow-missing-fortunes")
        fortunes = read_fortunes([n for n in FORTUNE_FILES if n not in missing])
        fortunes_version = package_version("fortunes")
    docs = topics + docstrings + fortunes
    prov = {"python": sys.version.split()[0], "pydoc_topics": len(topics), "stdlib_docstrings": len(docstrings),
            "fortunes": len(fortunes), "fortunes_package": fortunes_version,
            "characters": {"pydoc_topics": sum(map(len, topics)), "stdlib_docstrings": sum(map(len, docstrings)),
                           "fortunes": sum(map(len, fortunes))}}
    return docs, prov


def split(docs, seed, val_fraction):
    """Shuffle documents with the seed; the first val_fraction of characters is validation."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    total = sum(len(d) for d in docs)
    val, train, n = [], [], 0
    for i in order:
        if n < val_fraction * total:
            val.append(docs[i])
            n += len(docs[i])
        else:
            train.append(docs[i])
    return train, val


# ------------------------------------------------------------------------------------------------
# tokenizer

def train_tokenizer(train_docs, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_docs, trainer=trainer)
    return tok


def encode_docs(tok, docs, eos_id):
    """One stream: doc <eos> doc <eos> ...  (documents never share a token)."""
    import numpy as np
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int64)


# ------------------------------------------------------------------------------------------------
# model

def model_config(args, vocab_size, eos_id):
    from transformers import MixtralConfig
    return MixtralConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=args.seq_len, rope_theta=10000.0, sliding_window=None, rms_norm_eps=1e-5,
        tie_word_embeddings=True, router_aux_loss_coef=args.aux_loss, output_router_logits=False,
        initializer_range=0.02, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
        attention_dropout=0.0, router_jitter_noise=0.0)


def balance_loss(router_logits, top_k):
    """Switch-Transformer load-balancing loss, per layer, averaged over layers: E * sum_i f_i * P_i,
    f_i = share of the layer's routed slots taken by expert i, P_i = its mean router probability
    (1.0 when perfectly even). transformers' Mixtral aux loss pools all layers' tokens together,
    which lets single layers leave experts dead; this one balances every layer."""
    import torch
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        E = probs.shape[-1]
        ids = torch.topk(probs, top_k, dim=-1).indices
        f = torch.nn.functional.one_hot(ids, E).sum(1).float().mean(0) / top_k
        total = total + E * (f * probs.mean(0)).sum()
    return total / len(router_logits)


def evaluate(model, val_ids, seq_len, batch):
    """Mean next-token cross-entropy (nats) over non-overlapping windows of the validation stream."""
    import torch
    n = (len(val_ids) - 1) // seq_len
    x = torch.as_tensor(val_ids[:n * seq_len + 1])
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in range(0, n, batch):
            rows = range(b, min(n, b + batch))
            inp = torch.stack([x[r * seq_len:(r + 1) * seq_len] for r in rows])
            tgt = torch.stack([x[r * seq_len + 1:(r + 1) * seq_len + 1] for r in rows])
            logits = model(input_ids=inp).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                     reduction="sum")
            total += loss.item()
            count += tgt.numel()
    model.train()
    return total / count


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-docstrings", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it slightly)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=384, help="per expert")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss coefficient (per layer)")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--no-fortunes", action="store_true")
    ap.add_argument("--allow-missing-fortunes", action="store_true")
    ap.add_argument("--cache", default=os.path.join(HERE, "build"), help="corpus cache (not committed)")
    ap.add_argument("--out-hf", default=os.path.join(HERE, "hf"))
    ap.add_argument("--out-colibri", default=os.path.join(REPO, "colibri_edge", "default_model"))
    ap.add_argument("--colibri-dtype", default="float16", choices=["float32", "float16"])
    ap.add_argument("--benchmark", type=int, default=0, help="time N steps and exit (sizing)")
    args = ap.parse_args()
    args.cache, args.out_hf, args.out_colibri = map(os.path.abspath, (args.cache, args.out_hf, args.out_colibri))

    if args.dump_docstrings:
        docs = stdlib_docstrings()
        with open(args.dump_docstrings, "w") as f:
            json.dump(docs, f)
        return 0

    # OpenMP threads that spin while waiting waste the CPU when other work shares it (here: 3x slower)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.cache, exist_ok=True)
    t_start = time.time()

    # -- corpus, split, tokenizer --
    docs, prov = gather_corpus(args.cache, not args.no_fortunes, args.allow_missing_fortunes)
    corpus_sha = hashlib.sha256("\0".join(docs).encode()).hexdigest()
    train_docs, val_docs = split(docs, args.seed, args.val_fraction)
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M characters, sha256 {corpus_sha[:16]}; "
          f"{len(val_docs)} held out for validation", flush=True)
    tok = train_tokenizer(train_docs, args.vocab)
    eos_id = tok.token_to_id(EOS)
    train_ids = encode_docs(tok, train_docs, eos_id)
    val_ids = encode_docs(tok, val_docs, eos_id)
    V = tok.get_vocab_size()
    print(f"tokenizer: vocab {V}, eos id {eos_id}; train {len(train_ids)} tokens, val {len(val_ids)} tokens",
          flush=True)

    # -- model (the untrained weights are the same for the same seed) --
    cfg = model_config(args, V, eos_id)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)

    T, B = args.seq_len, args.batch
    windows = (len(train_ids) - 1) // T
    data = torch.as_tensor(train_ids[:windows * T + 1])
    rng = np.random.default_rng(args.seed)

    def batches():
        """Epochs over the training stream cut into windows of T tokens; each epoch a new random
        offset (so window boundaries move) and a new order."""
        while True:
            off = int(rng.integers(0, T))
            n = (len(data) - 1 - off) // T
            order = rng.permutation(n)
            for s in range(0, n - B + 1, B):
                idx = order[s:s + B]
                inp = torch.stack([data[off + i * T: off + (i + 1) * T] for i in idx])
                tgt = torch.stack([data[off + i * T + 1: off + (i + 1) * T + 1] for i in idx])
                yield inp, tgt

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    if args.benchmark:
        it = batches()
        t0 = time.time()
        for step in range(args.benchmark):
            inp, tgt = next(it)
            out = model(input_ids=inp, output_router_logits=True)
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V).float(), tgt.reshape(-1))
            (loss + args.aux_loss * balance_loss(out.router_logits, args.top_k)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            print(f"step {step} loss {loss.item():.3f} {time.time() - t0:.1f}s", flush=True)
        dt = (time.time() - t0) / args.benchmark
        print(f"{dt:.2f} s/step, {B * T / dt:.0f} tokens/s; {args.steps} steps = {args.steps * dt / 60:.1f} min; "
              f"{args.steps * B * T / len(train_ids):.2f} epochs")
        return 0

    untrained_ce = evaluate(model, val_ids, T, B)
    print(f"untrained: validation loss {untrained_ce:.3f}, perplexity {math.exp(untrained_ce):.1f}", flush=True)

    # -- train --
    log = []
    it = batches()
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        inp, tgt = next(it)
        out = model(input_ids=inp, output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V).float(), tgt.reshape(-1))
        aux = balance_loss(out.router_logits, args.top_k)
        (loss + args.aux_loss * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step:4d}/{args.steps} loss {loss.item():.3f} aux {aux.item():.3f} "
                  f"lr {lr_at(step, args):.2e} {el / 60:.1f} min (eta {el / (step + 1) * (args.steps - step - 1) / 60:.1f})",
                  flush=True)
            log.append({"step": step, "loss": round(loss.item(), 4), "aux": round(aux.item(), 4),
                        "minutes": round(el / 60, 2)})
        if args.steps >= 200 and step > 0 and step % (args.steps // 4) == 0:
            ce = evaluate(model, val_ids, T, B)
            print(f"  validation loss {ce:.3f}, perplexity {math.exp(ce):.1f}", flush=True)
            log.append({"step": step, "val_loss": round(ce, 4)})
    train_minutes = (time.time() - t0) / 60
    trained_ce = evaluate(model, val_ids, T, B)
    print(f"trained: validation loss {trained_ce:.3f}, perplexity {math.exp(trained_ce):.2f} "
          f"({train_minutes:.1f} min)", flush=True)

    # -- save: float16 checkpoint, then measure what ships (float16 weights, float32 compute) --
    if os.path.exists(args.out_hf):
        shutil.rmtree(args.out_hf)
    model.config.output_router_logits = False
    model = model.to(torch.float16)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
    model.save_pretrained(args.out_hf)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=None,
                                     model_max_length=T, clean_up_tokenization_spaces=False)
    hf_tok.save_pretrained(args.out_hf)
    shipped = AutoModelForCausalLM.from_pretrained(args.out_hf, dtype=torch.float32, attn_implementation="sdpa")
    shipped_ce = evaluate(shipped, val_ids, T, B)
    print(f"shipped float16 weights: validation loss {shipped_ce:.3f}, perplexity {math.exp(shipped_ce):.2f}",
          flush=True)

    if os.path.exists(args.out_colibri):
        shutil.rmtree(args.out_colibri)
    subprocess.run([sys.executable, "-m", "colibri_edge", "convert", args.out_hf, args.out_colibri,
                    "--dtype", args.colibri_dtype, "--quiet"], check=True, cwd=REPO)

    metrics = {
        "seed": args.seed, "torch": torch.__version__, "threads": args.threads, "corpus_sha256": corpus_sha,
        "corpus": prov, "documents": {"train": len(train_docs), "validation": len(val_docs)},
        "tokens": {"train": int(len(train_ids)), "validation": int(len(val_ids))},
        "model": {"parameters": n_params, "vocab": V, "hidden": args.hidden, "intermediate": args.intermediate,
                  "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "experts": args.experts,
                  "top_k": args.top_k, "seq_len": T},
        "training": {"steps": args.steps, "batch": B, "lr": args.lr, "aux_loss": args.aux_loss,
                     "tokens_seen": args.steps * B * T, "epochs": round(args.steps * B * T / len(train_ids), 2),
                     "minutes": round(train_minutes, 1), "total_minutes": round((time.time() - t_start) / 60, 1)},
        "validation": {"untrained_loss": round(untrained_ce, 4), "untrained_perplexity": round(math.exp(untrained_ce), 1),
                       "trained_loss": round(trained_ce, 4), "trained_perplexity": round(math.exp(trained_ce), 2),
                       "shipped_float16_loss": round(shipped_ce, 4),
                       "shipped_float16_perplexity": round(math.exp(shipped_ce), 2)},
        "log": log,
    }
    with open(os.path.join(HERE, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    print(json.dumps(metrics["validation"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
