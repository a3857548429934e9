"""Generation on every backend: greedy parity with transformers through the paged KV cache,
batching, per-sequence failure, bad input, streaming text, stop strings and chat templates."""
import json
import os
import time

import numpy as np
import pytest

from colibri_edge import (Engine, ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY)
from helpers import fp32
from hf_models import MODEL_TYPES, convert_case, hf_greedy

N_NEW = 32


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("block", [1, 7, 16])
def test_greedy_matches_transformers(backend_name, model_type, block, model_cache):
    hf, col = convert_case(model_cache, model_type)
    prompt = [5, 17, 3, 42, 8, 11, 29]
    key = os.path.join(model_cache, f"greedy_{model_type}.json")
    if not os.path.exists(key):
        json.dump(hf_greedy(hf, prompt, N_NEW), open(key, "w"))
    want = json.load(open(key))
    with Engine.open(col, backend=backend_name, kv_block_size=block, max_seq_len=128, kv_cache_tokens=20 * block + 128,
                     **fp32(backend_name)) as eng:
        # fragment the pool first: hold every other block-run of other sequences
        held = []
        for i in range(6):
            s = eng.runner.new_sequence(1000 + i)
            eng.runner.reserve(s, 2 * block + 1)
            held.append(s)
        for s in held[::2]:
            eng.runner.free(s)
        got = eng.generate(prompt, max_new_tokens=N_NEW, ignore_eos=True)   # the oracle ran without EOS
        for s in held[1::2]:
            eng.runner.free(s)
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks    # everything returned
    assert got == want


def test_batch_equals_solo_and_one_token_per_sequence_per_step(backend_name, model_cache):
    _, col = convert_case(model_cache, "qwen2_moe")
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1], [50, 60], [1, 2, 3, 4, 5, 6]]
    with Engine.open(col, backend=backend_name, max_batch=4, max_seq_len=64, **fp32(backend_name)) as eng:
        solo = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        eng.runner.step_tokens.clear()
        batch = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        steps = list(eng.runner.step_tokens)
    assert batch == solo
    # one prefill step with every prompt, then 11 decode steps of one token per live sequence
    assert steps[0] == sum(map(len, prompts))
    assert steps[1:] == [len(prompts)] * 11


def test_batch_sequences_finish_at_different_times(backend_name, model_cache):
    _, col = convert_case(model_cache, "mixtral")
    prompts = [[3, 4, 5], [9, 8, 7, 6], [50, 60]]
    with Engine.open(col, backend=backend_name, max_batch=2, max_seq_len=64, **fp32(backend_name)) as eng:
        solo = [eng.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, (4, 9, 6))]
        # more prompts than max_batch: the third is admitted when the first finishes and is freed
        outs = [eng.generate_batch(prompts, max_new_tokens=9, ignore_eos=True)]
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks
    assert [o[:len(s)] for o, s in zip(outs[0], solo)] == solo


def test_kv_pool_too_small_for_all_waits_and_only_the_oversized_fails(backend_name, model_cache):
    """A pool too small for the batch at once: every request finishes with its solo tokens (waiting, or
    preempted and recomputed); one longer than the whole pool fails alone with its code."""
    _, col = convert_case(model_cache, "olmoe")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12], list(range(20, 40))]
    with Engine.open(col, backend=backend_name, max_batch=3, max_seq_len=64, kv_block_size=4,
                     kv_cache_tokens=40, **fp32(backend_name)) as eng:
        solo = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        res = eng.generate_batch(prompts + [list(range(1, 46))], max_new_tokens=12, return_errors=True,
                                 ignore_eos=True)
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks
        assert eng._core.preemptions > 0, "the pool was sized so that the three cannot run together"
        with pytest.raises(ColibriError) as ei:     # without return_errors the error is raised
            eng.generate_batch([list(range(1, 46))], max_new_tokens=2, ignore_eos=True)
    assert res[:3] == solo
    assert isinstance(res[3], ColibriError) and res[3].code == COLIBRI_ERR_OUT_OF_MEMORY
    assert "kv_cache_tokens" in res[3].message
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY


def test_bad_input(backend_name, model_cache):
    _, col = convert_case(model_cache, "mixtral")
    with Engine.open(col, backend=backend_name, max_seq_len=16) as eng:
        for bad in ([], [[]], [1, 2, 97], [-1, 3], list(range(17)), np.zeros((2, 0), int), [0.5, 1.0]):
            with pytest.raises(ColibriError) as ei:
                eng.infer(bad)
            assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT, bad
        with pytest.raises(ColibriError) as ei:
            eng.generate([1, 2, 3], max_new_tokens=2, temperature=-1)
        assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT
        with pytest.raises(ColibriError) as ei:
            eng.generate("text needs a tokenizer", max_new_tokens=2, ignore_eos=True)
        assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "tokenizer" in ei.value.message
        # the failures left nothing behind: the engine still works and the pool is whole
        assert eng.infer([1, 2, 3]).shape == (1, 3, 97)
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks


def test_sampling_is_seeded(backend_name, model_cache):
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend=backend_name, max_seq_len=64) as eng:
        a = eng.generate([1, 2, 3], max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=11, ignore_eos=True)
        b = eng.generate([1, 2, 3], max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=11, ignore_eos=True)
        c = eng.generate([1, 2, 3], max_new_tokens=10, temperature=5.0, seed=12, ignore_eos=True)
    assert a == b and len(a) == 10 and c != a


# ---- text: a byte-level tokenizer so multi-byte characters span several tokens -----------------

@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from hf_models import build_text_model
    return build_text_model(tmp_path_factory.mktemp("text"))


def test_stream_never_splits_utf8(backend_name, text_model):
    _, col, _ = text_model
    text = "héllo 世界 🐦 colibrí ✓"
    with Engine.open(col, backend=backend_name, max_seq_len=256) as eng:
        ids = eng.codec.encode(text)
        assert len(ids) == len(text.encode("utf-8"))       # one token per byte: characters span tokens
        from colibri_edge.requests.textio import StreamDecoder
        dec = StreamDecoder(eng.codec)
        pieces = [dec.push(t) for t in ids] + [dec.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
        assert sum(1 for p in pieces if p) < len(ids)       # multi-byte characters waited for their bytes
        # and generation streams whole characters too (random weights emit arbitrary bytes)
        streamed = list(eng.stream("世界", max_new_tokens=40, temperature=1.0, seed=3))
        ids_again = eng.generate("世界", max_new_tokens=40, temperature=1.0, seed=3)
    for p in streamed[:-1]:
        p.encode("utf-8")                                    # every piece is valid text
        assert not p.endswith("\ufffd") or p.count("\ufffd") == len(p)
    assert "".join(streamed) == eng.codec.decode(ids_again)


def test_stream_closed_early_cancels_its_request(backend_name, text_model):
    """Leaving a stream() loop early (the generator closed) cancels its request: its blocks are back
    within a step and another caller runs meanwhile (a paused stream blocks nobody)."""
    _, col, _ = text_model
    with Engine.open(col, backend=backend_name, max_seq_len=128, **fp32(backend_name)) as eng:
        total = eng.runner.pool.num_blocks
        want = eng.generate("other", max_new_tokens=6, ignore_eos=True)
        gen = eng.stream("hello", max_new_tokens=60, temperature=1.0, seed=1, ignore_eos=True)
        first = next(gen)
        assert eng.generate("other", max_new_tokens=6, ignore_eos=True) == want    # while gen is paused
        gen.close()
        for _ in range(1000):
            if not eng._core.busy:
                break
            time.sleep(0.005)
        assert first and eng.kv_free_blocks == total


def test_text_that_is_not_unicode_is_a_coded_error(text_model):
    """A lone surrogate (what a JSON body can carry as \ud800) is refused by name, not a TypeError."""
    _, col, _ = text_model
    with Engine.open(col, backend="reference", max_seq_len=64) as eng:
        for bad in ("a\ud800b", [{"role": "user", "content": "\udfff"}]):
            with pytest.raises(ColibriError) as ei:
                eng.generate(bad, max_new_tokens=2)
            assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "surrogate" in ei.value.message
        assert eng.generate("ok", max_new_tokens=2, ignore_eos=True)


def byte_fallback_tokenizer():
    """A Llama/Mixtral-style SentencePiece BPE with byte fallback: a few whole-word tokens, every other
    character as its UTF-8 bytes <0xNN>, Metaspace spaces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    words = ["\u2581hello", "\u2581world", "\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581colibr"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for w in words:
        vocab.setdefault(w, len(vocab))
    merges = [("\u2581", "h"), ("\u2581h", "e"), ("\u2581he", "l"), ("\u2581hel", "l"), ("\u2581hell", "o")]
    for m in merges:
        vocab.setdefault("".join(m), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


TEXTS = ["héllo 世界 🐦 colibrí ✓", "中文：日本語、한국어。", "emoji 👩‍👩‍👧 🇫🇷 ok", "def f(x):\n    return x ** 2  # ∑",
         "hello world", "a\u0301 e\u0301 \u00e9"]


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_stream_decoder_pieces_join_to_decode(kind, tmp_path):
    """DecodeStream pieces never split a character, never show U+FFFD while more bytes can come,
    join to exactly decode(ids); a special token in the middle is skipped as decode() skips it; a
    tail cut off inside a character still comes out at flush, as replacement characters after the
    complete text."""
    from colibri_edge.model.demo import byte_level_tokenizer
    from colibri_edge.requests.textio import StreamDecoder, TextCodec
    tok = byte_level_tokenizer() if kind == "byte_level" else byte_fallback_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(str(tmp_path), {})
    special = tok.token_to_id("<|endoftext|>" if kind == "byte_level" else "</s>")
    multi = 0
    for text in TEXTS:
        ids = codec.encode(text)
        ids = ids[:len(ids) // 2] + [special] + ids[len(ids) // 2:]
        dec = StreamDecoder(codec)
        pieces = [dec.push(t) for t in ids]
        tail = dec.flush()
        assert "".join(pieces) + tail == codec.decode(ids)
        assert all("\ufffd" not in p for p in pieces) and "\ufffd" not in tail, (text, pieces)
        multi += sum(1 for p in pieces if not p)        # tokens that waited for the rest of a character
        # cut off inside the last multi-byte character: the incomplete tail still comes out at flush
        cut = next((i for i in range(len(ids) - 1, 0, -1) if "\ufffd" in codec.decode(ids[:i])), None)
        if cut is not None:
            dec = StreamDecoder(codec)
            pieces = [dec.push(t) for t in ids[:cut]]
            tail = dec.flush()
            done = "".join(pieces)
            assert tail and set(tail) == {"\ufffd"}             # the unfinished character's bytes
            assert codec.decode(ids).startswith(done) and len(done) < len(codec.decode(ids))
    assert multi > 0


def test_eos_and_stop_strings_end_generation(backend_name, text_model):
    _, col, eos = text_model
    with Engine.open(col, backend=backend_name, max_seq_len=256) as eng:
        free = eng.generate("ab", max_new_tokens=30, temperature=0, ignore_eos=True)
        eng.eos_token_ids = [free[4]]
        stopped = eng.generate("ab", max_new_tokens=30)
        assert stopped == free[:free.index(free[4]) + 1]       # ends at (and includes) the EOS id
        eng.eos_token_ids = [eos]
        text = eng.codec.decode(free)
        stop = text[3:5] if len(text) >= 5 else text[-1:]
        ids = eng.generate("ab", max_new_tokens=30, stop=[stop], ignore_eos=True)
        assert stop in eng.codec.decode(ids) and len(ids) < len(free)
        assert eng.codec.decode(ids[:-1]).find(stop) == -1     # stopped at the first occurrence


def test_chat_template_matches_transformers(text_model):
    from transformers import AutoTokenizer
    hf, col, _ = text_model
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🐦"}]
    want = AutoTokenizer.from_pretrained(hf).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    with Engine.open(col, backend="reference") as eng:
        assert eng.codec.render_chat(msgs) == want
        reply = eng.chat(msgs, max_new_tokens=5, ignore_eos=True)
    assert isinstance(reply, str)
