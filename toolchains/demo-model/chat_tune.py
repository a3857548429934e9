"""Teach the embedded demo model to chat: a ChatML template, two turn tokens and a 2,048-token context.

Starts from the base model `train.py` made (its Hugging Face checkpoint, --base), adds the special
tokens `<|im_start|>` and `<|im_end|>` (embedding rows initialised to the mean of the others; the
head is tied), raises max_position_embeddings to 2048 and fine-tunes on conversations synthesised,
seeded, from the base model's own corpus:

  * "What does json.dumps do?" / "How do I use X?" -> the first paragraphs of X's docstring
    (standard-library modules, classes, functions and methods, walked in a child process);
  * "Explain the 'with' statement in Python." -> the pydoc topic's opening paragraphs;
  * "Tell me a fortune." / "Something about food, please." -> a fortune from that file;
    the `riddles` file's "Q: ... A: ..." entries as question and answer;
  * a few greetings and questions about the model itself, with paraphrases.

Conversations hold 1-8 exchanges (a system message in some), are rendered through the template
below and packed into rows of --seq-len tokens; the loss is on the assistant's tokens and its
`<|im_end|>` only. A fifth of the rows are plain corpus text so that `colibri run` (completion
without a template) keeps working. The held-out validation documents of train.py's split are never
used for conversations; the chat validation loss is measured on conversations built from them.

Writes the checkpoint (--out-hf, the one the tests compare against), converts it into
colibri_edge/default_model/ and writes chat_metrics.json. About 18 minutes on 2 CPU cores.
Usage: python chat_tune.py [--base build/base-hf] [--steps 500]   (`make train` runs train.py first)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train  # noqa: E402

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen's and SmolLM's templates write it; the generation prompt opens the assistant turn
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

SYSTEMS = ["You are a helpful assistant.", "You are Colibri, a small demo model.",
           "Answer briefly.", "You know Python well and like fortune cookies."]
ASK_NAME = ["What does {n} do?", "Explain {n}.", "How do I use {n}?", "What is {n} in Python?",
            "Tell me about {n}.", "what does {n} do", "Can you describe {n}?"]
ASK_TOPIC = ["Explain {t} in Python.", "How does {t} work in Python?", "Tell me about {t}.",
             "What should I know about {t}?"]
ASK_FORTUNE = ["Tell me a fortune.", "Give me a fortune cookie.", "Say something wise.",
               "Tell me something funny.", "Another one, please.", "Cheer me up.", "Quote of the day?"]
ASK_FILE = ["Tell me something about {c}.", "Something about {c}, please.", "A fortune about {c}?",
            "Do you know a saying about {c}?"]
SMALL_TALK = [
    (["Hello!", "Hi", "Hi there.", "Hello, who are you?", "Good morning!"],
     ["Hello! I am the demo model of Colibri Edge, a tiny mixture of experts. Ask me about Python, "
      "or for a fortune.", "Hi! I am a small model trained on Python's documentation and fortune "
      "cookies. What would you like to know?"]),
    (["Who are you?", "What are you?", "What model is this?", "Tell me about yourself."],
     ["I am Colibri Edge's embedded demo model: 4 layers, 8 experts per layer, 2 of them active for "
      "each token. I was trained on Python's documentation and on fortune files, so I know a little "
      "Python and a lot of jokes.", "A small mixture-of-experts model that ships inside Colibri Edge. "
      "I am here to show the runtime working, not to be right."]),
    (["Thanks!", "Thank you.", "Great, thanks.", "thanks"],
     ["You are welcome!", "Glad to help.", "Any time. Ask me another one."]),
    (["Bye", "Goodbye!", "See you."], ["Goodbye!", "Bye! Come back for another fortune."]),
]
FORTUNE_NAMES = {"computers": "computers", "cookie": "luck", "debian": "Debian", "definitions": "words",
                 "education": "school", "food": "food", "humorists": "humour", "kids": "children",
                 "law": "the law", "linux": "Linux", "love": "love", "magic": "magic",
                 "medicine": "medicine", "people": "people", "perl": "Perl", "pets": "pets",
                 "science": "science", "sports": "sports", "wisdom": "wisdom", "work": "work"}


# ------------------------------------------------------------------------------------------------
# the conversations' material (from the same sources as train.py's corpus)

def named_docstrings() -> list:
    """[(qualified name, docstring)] of the standard library (train.stdlib_docstrings' walk, keeping
    names). Runs in this process: call it in a child."""
    import contextlib
    import importlib
    import inspect
    import io
    import warnings

    def quiet_import(name):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)

    out, seen = [], set()
    for name in sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in train.STDLIB_SKIP):
        try:
            m = quiet_import(name)
        except BaseException:
            continue
        for oname, obj in [(name, m)] + sorted(vars(m).items()):
            if obj is not m and (oname.startswith("_") or getattr(obj, "__module__", None) != m.__name__):
                continue
            full = name if obj is m else f"{name}.{oname}"
            members = [(full, obj)]
            if inspect.isclass(obj):
                members += [(f"{full}.{k}", v) for k, v in sorted(vars(obj).items())
                            if not k.startswith("_") and callable(v)]
            elif obj is not m and not callable(obj):
                continue
            for n, o in members:
                try:
                    d = inspect.getdoc(o)
                except Exception:
                    continue
                if d and len(d) >= 40 and d not in seen:
                    seen.add(d)
                    out.append((n, d))
    return out


def paragraphs(text, limit):
    """The opening paragraphs of text, at most `limit` characters (never cut inside a paragraph
    unless the first one alone is longer)."""
    parts = [p.strip() for p in text.strip().split("\n\n") if p.strip()]
    out = parts[0][:limit]
    for p in parts[1:]:
        if len(out) + 2 + len(p) > limit:
            break
        out += "\n\n" + p
    return out


def exchanges(named, topics, fortunes, held_out):
    """Every (question, answer) the conversations draw from, by kind, excluding held-out texts."""
    pairs = {"name": [], "topic": [], "fortune": [], "riddle": []}
    for n, d in named:
        if d not in held_out:
            pairs["name"].append((n, paragraphs(d, 700)))
    for t, text in topics:
        if text not in held_out:
            pairs["topic"].append((t, paragraphs(text, 900)))
    for fname, entry in fortunes:
        if entry in held_out:
            continue
        if fname == "riddles" and "\nA:" in entry and entry.startswith("Q:"):
            q, a = entry[2:].split("\nA:", 1)
            pairs["riddle"].append((" ".join(q.split()), a.strip()))
        else:
            pairs["fortune"].append((fname, entry))
    return pairs


def conversation(rng, pairs):
    """One conversation: [{'role', 'content'}], 1-8 exchanges."""
    msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(rng.choice([1, 1, 2, 2, 3, 4, 6, 8])):
        kind = rng.choices(["name", "topic", "fortune", "riddle", "talk"], [45, 8, 30, 5, 12])[0]
        if kind == "talk":
            qs, ans = rng.choice(SMALL_TALK)
            q, a = rng.choice(qs), rng.choice(ans)
        elif kind == "name":
            n, a = rng.choice(pairs["name"])
            q = rng.choice(ASK_NAME).format(n=n)
        elif kind == "topic":
            t, a = rng.choice(pairs["topic"])
            q = rng.choice(ASK_TOPIC).format(t=t.lower() if t.isupper() else t)
        elif kind == "riddle":
            q, a = rng.choice(pairs["riddle"])
        else:
            f, a = rng.choice(pairs["fortune"])
            q = rng.choice(ASK_FILE).format(c=FORTUNE_NAMES[f]) if f in FORTUNE_NAMES and rng.random() < 0.5 \
                else rng.choice(ASK_FORTUNE)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def encode_conversation(tok, msgs, ids_of):
    """-> (ids, trained mask): the template's rendering, token by token; the assistant's content and
    its <|im_end|> are trained, everything else is context."""
    ids, mask = [], []
    for m in msgs:
        head = tok.encode(m["role"] + "\n", add_special_tokens=False).ids
        body = tok.encode(m["content"], add_special_tokens=False).ids
        nl = tok.encode("\n", add_special_tokens=False).ids
        ids += [ids_of[IM_START]] + head
        mask += [0] * (1 + len(head))
        train_it = int(m["role"] == "assistant")
        ids += body + [ids_of[IM_END]] + nl
        mask += [train_it] * (len(body) + 1) + [0] * len(nl)
    return ids, mask


def pack(rows_of, seq_len, pad_id):
    """Conversations (ids, mask) -> rows of seq_len + 1 tokens, whole conversations only, each
    followed by <|endoftext|> (untrained); a row is closed when the next conversation does not fit."""
    rows, cur_i, cur_m = [], [], []
    for ids, mask in rows_of:
        ids, mask = ids + [pad_id], mask + [0]
        if len(ids) > seq_len + 1:
            continue
        if len(cur_i) + len(ids) > seq_len + 1:
            rows.append((cur_i + [pad_id] * (seq_len + 1 - len(cur_i)), cur_m + [0] * (seq_len + 1 - len(cur_m))))
            cur_i, cur_m = [], []
        cur_i, cur_m = cur_i + ids, cur_m + mask
    if cur_i:
        rows.append((cur_i + [pad_id] * (seq_len + 1 - len(cur_i)), cur_m + [0] * (seq_len + 1 - len(cur_m))))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-named", help=argparse.SUPPRESS)
    ap.add_argument("--base", default=os.path.join(HERE, "build", "base-hf"), help="train.py's checkpoint")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-loss", type=float, default=0.01)
    ap.add_argument("--plain-fraction", type=float, default=0.2, help="rows of plain corpus text")
    ap.add_argument("--conversations", type=int, default=12000)
    ap.add_argument("--cache", default=os.path.join(HERE, "build"))
    ap.add_argument("--out-hf", default=os.path.join(HERE, "hf"))
    ap.add_argument("--out-colibri", default=os.path.join(train.REPO, "colibri_edge", "default_model"))
    ap.add_argument("--benchmark", type=int, default=0, help="time N steps and exit (sizing)")
    args = ap.parse_args()

    if args.dump_named:
        with open(args.dump_named, "w") as f:
            json.dump(named_docstrings(), f)
        return 0

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numpy as np
    import pydoc_data.topics
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()
    os.makedirs(args.cache, exist_ok=True)

    # -- material: the base corpus' split (its validation documents stay out of training) --
    docs, _ = train.gather_corpus(args.cache, True, False)
    train_docs, val_docs = train.split(docs, args.seed, 0.05)
    named_path = os.path.join(args.cache, "named_docstrings.json")
    if not os.path.exists(named_path):
        subprocess.run([sys.executable, os.path.abspath(__file__), "--dump-named", named_path], check=True,
                       stdout=subprocess.DEVNULL)
    named = json.load(open(named_path))
    topics = [(k, pydoc_data.topics.topics[k].strip()) for k in sorted(pydoc_data.topics.topics)]
    fortunes = [(n, e) for n in train.FORTUNE_FILES for e in train.read_fortunes([n])]
    held = set(val_docs)
    pairs = exchanges(named, topics, fortunes, held)
    val_pairs = exchanges(named, topics, fortunes, set(train_docs))
    for k in pairs:                               # held-out conversations need every kind
        val_pairs[k] = val_pairs[k] or pairs[k]
    print("material: " + ", ".join(f"{k} {len(v)}" for k, v in pairs.items()), flush=True)

    # -- tokenizer: the base one plus the two turn tokens --
    tok = Tokenizer.from_file(os.path.join(args.base, "tokenizer.json"))
    V0 = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(IM_START, special=True, normalized=False),
                            AddedToken(IM_END, special=True, normalized=False)])
    ids_of = {t: tok.token_to_id(t) for t in (IM_START, IM_END, train.EOS)}
    V = tok.get_vocab_size()
    assert (ids_of[IM_START], ids_of[IM_END]) == (V0, V0 + 1), ids_of

    convs = [encode_conversation(tok, conversation(rng, pairs), ids_of) for _ in range(args.conversations)]
    rows = pack(convs, args.seq_len, ids_of[train.EOS])
    val_rows = pack([encode_conversation(tok, conversation(random.Random(args.seed + 1), val_pairs), ids_of)
                     for _ in range(200)], args.seq_len, ids_of[train.EOS])
    plain = train.encode_docs(tok, train_docs, ids_of[train.EOS])
    T, B = args.seq_len, args.batch
    trained_tokens = sum(sum(m) for _, m in rows)
    print(f"conversations: {len(convs)} in {len(rows)} rows of {T} ({trained_tokens} trained tokens); "
          f"{len(val_rows)} validation rows; plain text {len(plain)} tokens", flush=True)

    # -- model: the base, two more embedding rows, a longer context --
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32, attn_implementation="sdpa")
    model.resize_token_embeddings(V, mean_resizing=True)
    model.config.max_position_embeddings = T
    model.config.eos_token_id = [ids_of[train.EOS], ids_of[IM_END]]

    def batch(step_rng, source):
        if source is None:
            idx = step_rng.integers(0, len(plain) - T - 1, B)
            x = torch.as_tensor(np.stack([plain[i:i + T + 1] for i in idx]))
            m = torch.ones_like(x)
        else:
            pick = [source[int(i)] for i in step_rng.integers(0, len(source), B)]
            x = torch.as_tensor([p[0] for p in pick])
            m = torch.as_tensor([p[1] for p in pick])
        tgt = torch.where(m[:, 1:] > 0, x[:, 1:], torch.full_like(x[:, 1:], -100))
        return x[:, :-1], tgt

    def chat_loss(mdl, source):
        mdl.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(source), B):
                x = torch.as_tensor([r[0] for r in source[s:s + B]])
                m = torch.as_tensor([r[1] for r in source[s:s + B]])
                tgt = torch.where(m[:, 1:] > 0, x[:, 1:], torch.full_like(x[:, 1:], -100))
                lg = mdl(input_ids=x[:, :-1]).logits.float()
                tot += torch.nn.functional.cross_entropy(lg.reshape(-1, V), tgt.reshape(-1), ignore_index=-100,
                                                         reduction="sum").item()
                n += int((tgt >= 0).sum())
        mdl.train()
        return tot / n

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    steps = args.benchmark or args.steps
    step_rng = np.random.default_rng(args.seed)
    before = None if args.benchmark else chat_loss(model, val_rows)
    if before is not None:
        print(f"base model: chat validation loss {before:.3f}", flush=True)
    log, t0 = [], time.time()
    model.train()
    for step in range(steps):
        lr = args.lr * (step + 1) / args.warmup if step < args.warmup else \
            args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, steps - args.warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        inp, tgt = batch(step_rng, None if step_rng.random() < args.plain_fraction else rows)
        out = model(input_ids=inp, output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V).float(), tgt.reshape(-1), ignore_index=-100)
        aux = train.balance_loss(out.router_logits, model.config.num_experts_per_tok)
        (loss + args.aux_loss * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            el = time.time() - t0
            print(f"step {step:4d}/{steps} loss {loss.item():.3f} aux {aux.item():.3f} lr {lr:.2e} "
                  f"{el / 60:.1f} min (eta {el / (step + 1) * (steps - step - 1) / 60:.1f})", flush=True)
            log.append({"step": step, "loss": round(loss.item(), 4), "minutes": round(el / 60, 2)})
    if args.benchmark:
        dt = (time.time() - t0) / steps
        print(f"{dt:.2f} s/step; {args.steps} steps = {args.steps * dt / 60:.1f} min")
        return 0
    minutes = (time.time() - t0) / 60
    after = chat_loss(model, val_rows)
    print(f"chat validation loss {before:.3f} -> {after:.3f} ({minutes:.1f} min)", flush=True)

    # -- save: float16 checkpoint with the template, then what ships --
    if os.path.exists(args.out_hf):
        shutil.rmtree(args.out_hf)
    model.config.output_router_logits = False
    model = model.to(torch.float16)
    eos = [ids_of[train.EOS], ids_of[IM_END]]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids_of[train.EOS], bos_token_id=None)
    model.save_pretrained(args.out_hf)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=train.EOS, pad_token=train.EOS, unk_token=None,
                                     model_max_length=T, clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(args.out_hf)
    shipped = AutoModelForCausalLM.from_pretrained(args.out_hf, dtype=torch.float32, attn_implementation="sdpa")
    shipped_loss = chat_loss(shipped, val_rows)
    if os.path.exists(args.out_colibri):
        shutil.rmtree(args.out_colibri)
    subprocess.run([sys.executable, "-m", "colibri_edge", "convert", args.out_hf, args.out_colibri,
                    "--dtype", "float16", "--quiet"], check=True, cwd=train.REPO)
    metrics = {
        "seed": args.seed, "torch": torch.__version__, "threads": args.threads,
        "base_sha256": hashlib.sha256(open(os.path.join(args.base, "model.safetensors"), "rb").read()).hexdigest(),
        "material": {k: len(v) for k, v in pairs.items()},
        "conversations": args.conversations, "rows": len(rows), "trained_tokens": trained_tokens,
        "vocab": V, "special_tokens": {IM_START: ids_of[IM_START], IM_END: ids_of[IM_END]},
        "training": {"steps": args.steps, "batch": B, "seq_len": T, "lr": args.lr,
                     "plain_fraction": args.plain_fraction, "minutes": round(minutes, 1),
                     "total_minutes": round((time.time() - t_start) / 60, 1)},
        "validation": {"chat_loss_base": round(before, 4), "chat_loss": round(after, 4),
                       "chat_loss_shipped_float16": round(shipped_loss, 4)},
        "log": log,
    }
    with open(os.path.join(HERE, "chat_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    print(json.dumps(metrics["validation"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
