"""The shipped demo model (colibri_edge/default_model/, trained by toolchains/demo-model/train.py):
Colibri reproduces transformers on its saved Hugging Face checkpoint, and `colibri run` without
--model prints readable text."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.model.demo import SHIPPED, ensure_default_model
from helpers import fp32
from hf_models import hf_greedy, hf_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "toolchains", "demo-model", "hf")
PROMPT = "Return a new list"
N_NEW = 24


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def test_shipped_model_is_the_default_and_small():
    path, note = ensure_default_model()
    assert path == SHIPPED and "trained" in note
    assert dir_bytes(SHIPPED) <= 40 * 2 ** 20
    cfg = json.load(open(os.path.join(SHIPPED, "config.json")))
    assert cfg["model_type"] == "mixtral" and cfg["experts_per_layer"] == 8 and cfg["top_k"] == 2
    tok_cfg = json.load(open(os.path.join(SHIPPED, "tokenizer_config.json")))
    assert tok_cfg["eos_token"] == "<|endoftext|>"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    # a plain text ends at <|endoftext|>, a chat turn at <|im_end|>: both end a sequence
    assert cfg["eos_token_ids"] == [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]
    assert json.load(open(os.path.join(HF, "generation_config.json")))["eos_token_id"] == cfg["eos_token_ids"]
    assert cfg["max_position_embeddings"] >= 2048          # a multi-turn chat fits
    assert os.path.exists(os.path.join(SHIPPED, "chat_template.jinja"))


@pytest.fixture(scope="module")
def oracle():
    """transformers on the saved checkpoint (float16 weights, upcast to float32): the prompt's ids,
    greedy continuation and teacher-forced logits of prompt + continuation."""
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(os.path.join(HF, "tokenizer.json")).encode(PROMPT).ids
    cont = hf_greedy(HF, ids, N_NEW)
    full = np.asarray([ids + cont])
    return ids, cont, hf_logits(HF, full)[0]


def test_greedy_matches_transformers(backend_name, oracle):
    ids, cont, want = oracle
    with Engine.open(SHIPPED, backend=backend_name, **fp32(backend_name)) as eng:
        assert eng.codec.encode(PROMPT) == ids
        got = eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True)
        logits = eng.infer(np.asarray(ids + cont))[0]
    assert got == cont, (eng.codec.decode(got), eng.codec.decode(cont))
    assert np.abs(logits - want).max() / np.abs(want).max() < 1e-4


def test_colibri_run_without_model_prints_words():
    env = dict(os.environ, COLIBRI_BACKEND="reference")
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "run", "--max-new-tokens", "40", "--seed", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "trained demo model" in r.stderr
    text = r.stdout.strip()
    assert len(text) >= 60, text
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
    assert printable / len(text) >= 0.95, text
    words = re.findall(r"[A-Za-z]{2,}", text)
    assert len(words) >= 10, text
    # mostly words: letters make up most of the non-space characters
    letters = sum(c.isalpha() for c in text)
    assert letters / max(1, len(text.replace(" ", "").replace("\n", ""))) >= 0.7, text


@pytest.fixture(scope="module")
def chat_oracle():
    """A two-turn conversation rendered by transformers' own apply_chat_template (the checkpoint's
    chat_template.jinja) and transformers' greedy reply to each turn, cut at <|im_end|>."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(HF)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turns, msgs = [], []
    for question in ("Tell me a fortune.", "What does json.dumps do?"):
        msgs.append({"role": "user", "content": question})
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        reply = hf_greedy(HF, ids, CHAT_NEW)
        if im_end in reply:
            reply = reply[:reply.index(im_end) + 1]
        turns.append((list(msgs), text, ids, reply))
        msgs.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
    return turns


CHAT_NEW = 32


def test_the_demo_model_chats_as_transformers_does(backend_name, chat_oracle):
    """Engine.chat on the shipped model: its template renders each turn as transformers does, and the
    reply is transformers' greedy reply token for token, ending at <|im_end|> when transformers' does."""
    with Engine.open(SHIPPED, backend=backend_name, **fp32(backend_name)) as eng:
        assert eng.codec.template_source == "model"
        for msgs, text, ids, want in chat_oracle:
            assert eng.codec.render_chat(msgs) == text
            got = eng.generate(msgs, max_new_tokens=CHAT_NEW, temperature=0)
            assert got == want, (eng.codec.decode(got), eng.codec.decode(want))
            assert eng.chat(msgs, max_new_tokens=CHAT_NEW) == eng.codec.decode(want)
    (_, text1, _, reply1), (msgs2, text2, _, _) = chat_oracle
    assert text2.startswith(text1) and text2.count("<|im_start|>user") == 2 and msgs2[1]["content"] in text2
    assert reply1 and msgs2[1]["content"].strip()           # the first turn was answered


def test_embed_is_transformers_last_hidden_state(backend_name):
    """Engine.embed (serve's /v1/embeddings pools it): every token's hidden state after the final norm,
    transformers' last_hidden_state, for sequences of different lengths at once."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(HF, dtype=torch.float32, attn_implementation="eager").eval()
    with Engine.open(SHIPPED, backend=backend_name, **fp32(backend_name)) as eng:
        seqs = [eng.codec.encode(t) for t in ("The Python interpreter", "Tell me a fortune about food, please.")]
        got = eng.embed(seqs)
        assert [g.shape for g in got] == [(len(s), eng.config["hidden_size"]) for s in seqs]
        assert np.array_equal(eng.embed(seqs[1])[0], got[1])            # alone = in a batch, bit for bit
    for ids, g in zip(seqs, got):
        with torch.no_grad():
            want = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
        assert np.abs(g - want).max() / np.abs(want).max() < 1e-4
