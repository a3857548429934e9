"""MoE families beyond the shared suite (issue 16), against transformers on tiny random checkpoints:
gpt-oss (sliding and full layers, sinks, YaRN, router and expert biases, the clamped SwiGLU), on
every backend; a backend without a family's activation refuses it by name."""
import math
import os

import numpy as np
import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.backends import backend_class
from colibri_edge.model.modeldir import ModelDir
from helpers import Held, fp32
from hf_models import FAMILY_CASES, convert_case, hf_logits, mxfp4_checkpoint

TOL = 1e-4
OSS = ["gpt_oss", "gpt_oss_k4"]


def open_engine(col, name, **kw):
    """The engine (every backend runs gpt-oss's experts: Backend.ffn_activations)."""
    assert "swiglu_oai" in backend_class(name).ffn_activations
    return Engine.open(col, backend=name, **fp32(name), **kw)


def test_a_backend_without_the_activation_refuses_by_name(model_cache, monkeypatch):
    """A backend that does not list swiglu_oai in ffn_activations (an out-of-tree one) refuses a
    gpt-oss model when the engine opens, naming the activation and the way out."""
    _, col = convert_case(model_cache, "gpt_oss")
    cls = backend_class("reference")
    monkeypatch.setattr(cls, "ffn_activations", ("silu",))
    with pytest.raises(ColibriError) as e:
        Engine.open(col, backend="reference")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "swiglu_oai" in e.value.message \
        and "backend='cpu'" in e.value.message


@pytest.mark.parametrize("block", [1, 4])
def test_sliding_layers_return_blocks_out_of_the_window(backend_name, block, model_cache):
    """Generating 20x the window: the sliding layers' pool holds at most ceil(W / B) + 1 blocks of
    the sequence after each decode step (the pool's free count shows them returned), the full
    layers' pool every block of the sequence."""
    _, col = convert_case(model_cache, "gpt_oss")
    W = ModelDir(col).config["sliding_window"]
    eng = open_engine(col, backend_name, kv_block_size=block, max_seq_len=160, max_batch=1,
                          kv_cache_tokens=160)
    with eng:
        full, window = eng.runner.states.paged
        assert window.window == W and full.window == 0
        held = Held(eng.runner)
        eng.generate([5, 17, 3], max_new_tokens=20 * W, ignore_eos=True)
        bound = math.ceil(W / block) + 1
        for cached, (f, w), (used_f, used_w) in held.after[1:]:
            assert w <= bound and used_w == w
            assert f == used_f == math.ceil(cached / block)
        assert held.after[-1][0] > 20 * W
        assert window.free_blocks == window.num_blocks and full.free_blocks == full.num_blocks


@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_gpt_oss_mxfp4_checkpoint(backend_name, out_dtype, model_cache):
    """OpenAI's MXFP4 experts (*_blocks / *_scales) kept as MXFP4 (repacked to ggml's layout, no
    rounding) or dequantised to float32 at conversion: the logits of transformers on the checkpoint
    dequantised in float32 by transformers' own function, within float32 tolerance."""
    from colibri_edge.model.convert import convert
    mx, oracle = mxfp4_checkpoint(model_cache)
    col = os.path.join(model_cache, f"col_gpt_oss_mx_{out_dtype}")
    if not os.path.exists(os.path.join(col, "config.json")):
        convert(mx, col, dtype=out_dtype, progress=False)
    m = ModelDir(col)
    assert set(m.layer_formats.values()) == {("mxfp4",) * 3 if out_dtype is None else ("float32",) * 3}
    ids = np.random.default_rng(3).integers(0, FAMILY_CASES["gpt_oss_mx"][1]["vocab_size"], size=(2, 11))
    want = hf_logits(oracle, ids)
    opts = {"int8_activations": False} if "int8_activations" in backend_class(backend_name).OPTIONS else {}
    eng = open_engine(col, backend_name, max_seq_len=64, **opts)
    with eng:
        got = eng.infer(ids)
    assert np.abs(got - want).max() / np.abs(want).max() < TOL


@pytest.mark.parametrize("policy", ["lru", "prefetch"])
def test_gpt_oss_through_the_slot_pool(backend_name, policy, model_cache):
    """Experts streamed through 2 slots (each backend's per-expert path, the biases indexed by the
    expert id, not the slot): the same logits and greedy tokens as with every expert resident; the
    trace of a run replays to the engine's own hit / miss / prefetch counters (prefetch predicts
    with the next layer's router and its bias)."""
    from colibri_edge.analysis.simulate import replay
    _, col = convert_case(model_cache, "gpt_oss_k4")
    ids = np.random.default_rng(5).integers(0, FAMILY_CASES["gpt_oss_k4"][1]["vocab_size"], size=(2, 9))
    prompt = [3, 9, 27, 81, 2, 6, 18]
    with open_engine(col, backend_name, max_seq_len=64) as eng:
        want, want_gen = eng.infer(ids), eng.generate(prompt, max_new_tokens=8, ignore_eos=True)
    with open_engine(col, backend_name, max_seq_len=64, expert_slots=2, slot_policy=policy) as eng:
        assert eng.runner.slot_pool is not None
        got = eng.infer(ids)
        assert eng.generate(prompt, max_new_tokens=8, ignore_eos=True) == want_gen
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    with open_engine(col, backend_name, max_seq_len=64, expert_slots=2, slot_policy=policy, max_batch=2) as eng:
        tr = eng.trace([prompt, prompt[::-1]], max_new_tokens=5, ignore_eos=True)
        counts = eng.slot_stats
    assert tr.expert_ids.shape[2] == 4 and counts["misses"] > 0
    sim = replay(tr, 2, policy, pinned=counts["pinned_keys"])   # earlier runs' hot set
    for f in ("hits", "misses", "evictions", "prefetch_hits"):
        assert sim[f] == counts[f], (f, sim, counts)


def test_inspect_shows_the_layer_plan_and_the_window_bound(model_cache, capsys):
    """`colibri inspect`: each layer's mixer (sliding window or full, with sinks), YaRN, the experts'
    activation, KV bytes per token for the full layers and the per-sequence bound of the window
    layers, which is what the pool holds at most: (ceil(W / B) + 1) * B positions of K and V."""
    from colibri_edge.serving.cli import main
    from colibri_edge.analysis.sizing import summary
    _, col = convert_case(model_cache, "gpt_oss")
    cfg = ModelDir(col).config
    main(["inspect", col, "--block-size", "4"])
    out = capsys.readouterr().out
    W, nkv, hd = cfg["sliding_window"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert f"0 sliding-window attention ({W}) with sinks" in out and "1 attention with sinks" in out
    assert "YaRN x8" in out and "swiglu_oai" in out
    s = summary(ModelDir(col), 64, block_size=4)
    per_pos = 2 * 4 * nkv * hd                                 # K and V, float32, one layer
    assert s["kv_bytes_per_token"] == per_pos * 1              # layer 1 is the only full one
    assert s["kv_window_bytes_per_sequence"] == per_pos * 2 * (math.ceil(W / 4) + 1) * 4
    assert f"{s['kv_window_bytes_per_sequence']} bytes per sequence" in out


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory):
    """llama.cpp's converter on a gpt-oss checkpoint with OpenAI's MXFP4 experts (its own repacking to
    ggml's MXFP4, f32 elsewhere), and the oracle: that checkpoint dequantised in float32."""
    import gguf_models as gm
    from hf_models import pack_mxfp4
    d = tmp_path_factory.mktemp("gguf_oss")
    src = gm.build("gpt_oss", d / "src")
    mx, oracle = pack_mxfp4(src, str(d / "mx"), str(d / "oracle"))
    path = gm.to_gguf(mx, str(d / "oss.gguf"), "f32")
    return path, oracle


def test_gpt_oss_gguf_in_mxfp4(backend_name, gpt_oss_gguf, tmp_path):
    """A gpt-oss GGUF (arch gpt-oss: sinks, router and expert biases, YaRN from its metadata, the
    window on the even layers, MXFP4 experts kept as stored) gives the float32-dequantised oracle's
    logits within float32 tolerance."""
    from colibri_edge.model.convert import convert
    path, oracle = gpt_oss_gguf
    cfg = convert(path, str(tmp_path / "col"), progress=False)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 5
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 8.0
    assert set(ModelDir(str(tmp_path / "col")).layer_formats.values()) == {("mxfp4",) * 3}
    ids = np.random.default_rng(3).integers(0, 320, size=(2, 11))
    want = hf_logits(oracle, ids)
    opts = {"int8_activations": False} if "int8_activations" in backend_class(backend_name).OPTIONS else {}
    with open_engine(str(tmp_path / "col"), backend_name, max_seq_len=64, **opts) as eng:
        got = eng.infer(ids)
    assert np.abs(got - want).max() / np.abs(want).max() < TOL


HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                    "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    """A tiny gpt-oss with a byte-level tokenizer holding harmony's special tokens, a harmony-shaped
    chat template, and generation_config's end ids <|return|>, <|call|> (as gpt-oss ships them)."""
    import json as _json
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from hf_models import build_hf
    from colibri_edge.model.convert import convert
    d = tmp_path_factory.mktemp("harmony")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the answer is four", "think hard about it", "hello world"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=HARMONY_SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", bos_token="<|startoftext|>")
    ft.chat_template = HARMONY_TEMPLATE
    hf = str(d / "hf")
    build_hf(hf, "gpt_oss_k4", vocab_size=len(ft))
    ft.save_pretrained(hf)
    ends = [ft.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    _json.dump({"eos_token_id": ends, "bos_token_id": ft.convert_tokens_to_ids("<|startoftext|>")},
               open(os.path.join(hf, "generation_config.json"), "w"))
    convert(hf, str(d / "col"), progress=False)
    return str(d / "col"), ft


def test_harmony_reply_is_the_final_channel(harmony_model):
    """chat()'s text of a harmony reply: the final channel's message; the analysis is the reasoning;
    a reply cut off before its final channel has no content; other text is itself."""
    col, ft = harmony_model
    with Engine.open(col, backend="reference", max_seq_len=64) as eng:
        codec = eng.codec
        full = ("<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>"
                "the answer is four<|return|>")
        assert codec.reply(ft.encode(full, add_special_tokens=False)) == ("the answer is four", "think hard")
        cut = "<|channel|>analysis<|message|>think hard about"
        assert codec.reply(ft.encode(cut, add_special_tokens=False)) == ("", "think hard about")
        assert codec.reply(ft.encode("hello world", add_special_tokens=False)) == ("hello world", None)


@pytest.mark.parametrize("end", ["<|return|>", "<|call|>"])
def test_harmony_end_tokens_stop_generation(harmony_model, end):
    """<|return|> and <|call|> (generation_config's eos ids) end a reply: forced by a logit bias,
    generation stops at the first one, and chat() then returns no text."""
    col, ft = harmony_model
    eid = ft.convert_tokens_to_ids(end)
    with Engine.open(col, backend="reference", max_seq_len=64) as eng:
        assert eid in eng.eos_token_ids
        msgs = [{"role": "user", "content": "hello world"}]
        assert eng.generate(msgs, max_new_tokens=8, logit_bias={eid: 100.0}) == [eid]
        assert eng.generate(msgs, max_new_tokens=8) != [eid]
        assert eng.chat(msgs, max_new_tokens=8, logit_bias={eid: 100.0}) == ""
