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
    assert cfg["eos_token_ids"] == [tok.token_to_id("<|endoftext|>")]
    assert json.load(open(os.path.join(HF, "generation_config.json")))["eos_token_id"] == cfg["eos_token_ids"][0]


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
