"""Gemma 4 (the 26B-A4B MoE layer, issue 16) against transformers on tiny random checkpoints, on every
backend: sandwich norms, a dense GeGLU MLP beside the normed experts, the router's own input norm and
per-expert scales, sliding layers and full layers of another head geometry (keys reused as values,
proportional rope), v norm, layer scalars, the embedding scale and soft-capped logits; the wrapped
checkpoint (gemma4: a vision tower beside the text model) too."""
import math

import numpy as np
import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_INVALID_MODEL
from colibri_edge.model.convert import translate_config
from colibri_edge.model.modeldir import ModelDir
from helpers import fp32
from helpers import Held
from hf_models import FAMILY_CASES, config_for, convert_case

TOL = 1e-4
CASES = ["gemma4", "gemma4_vl"]


def open_engine(col, name, **kw):
    return Engine.open(col, backend=name, **fp32(name), **kw)


@pytest.mark.parametrize("block", [1, 4])
def test_gemma4_pools_per_geometry_and_the_window(block, model_cache, capsys):
    """The full layers (head_dim 32, 1 KV head) and the sliding layers (16, 2) keep pools of their
    own shapes; `colibri inspect` prints the KV bytes per token the engine allocates (K and V of the
    full layers, 2 x 4 x 1 x 32 x 2 layers) and the window layers' per-sequence bound; generating 20x
    the window, the sliding pool holds at most ceil(W / B) + 1 blocks of the sequence."""
    from colibri_edge.serving.cli import main
    from colibri_edge.analysis.sizing import summary
    _, col = convert_case(model_cache, "gemma4")
    cfg = ModelDir(col).config
    W = cfg["sliding_window"]
    with open_engine(col, "reference", kv_block_size=block, max_seq_len=160, max_batch=1,
                     kv_cache_tokens=160) as eng:
        full, window = eng.runner.states.paged
        assert (full.window, full.per_token, full.layers) == (0, (1, 32), (1, 3))
        assert (window.window, window.per_token, window.layers) == (W, (2, 16), (0, 2))
        assert eng.runner.state_storage[(0, 1, "v")].shape[1:] == (1, 32)
        held = Held(eng.runner)
        eng.generate([5, 17, 3], max_new_tokens=20 * W, ignore_eos=True)
        for cached, (f, w), (used_f, used_w) in held.after[1:]:
            assert w <= math.ceil(W / block) + 1 and used_w == w
            assert f == used_f == math.ceil(cached / block)
    s = summary(ModelDir(col), 64, block_size=block)
    assert s["kv_bytes_per_token"] == 2 * 4 * 1 * 32 * 2 == full.bytes_per_token()
    assert s["kv_window_bytes_per_sequence"] == 2 * 4 * 2 * 16 * 2 * (math.ceil(W / block) + 1) * block
    main(["inspect", col, "--block-size", str(block)])
    out = capsys.readouterr().out
    assert f"{s['kv_window_bytes_per_sequence']} bytes per sequence" in out and "gelu_tanh" in out


@pytest.mark.parametrize("field,value,says", [
    ("hidden_size_per_layer_input", 16, "per-layer input embeddings"),
    ("num_kv_shared_layers", 2, "reuse another layer's KV cache"),
    ("hidden_activation", "gelu", "activation"),
    ("use_bidirectional_attention", "all", "bidirectional"),
])
def test_gemma4_refuses_what_it_does_not_implement(field, value, says):
    """Per-layer input embeddings (E2B/E4B), shared KV layers, another activation, bidirectional
    attention: refused by name at conversion, never computed wrongly."""
    hf = config_for("gemma4_text", **FAMILY_CASES["gemma4"][1]).to_dict()
    translate_config(hf, {}, dtype="float32")                  # the case itself converts
    hf[field] = value
    with pytest.raises(ColibriError) as e:
        translate_config(hf, {}, dtype="float32")
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and field in e.value.message and says in e.value.message


@pytest.fixture(scope="module")
def gemma4_gguf(tmp_path_factory):
    """llama.cpp's converter (arch gemma4) on the tiny Gemma 4 with a SentencePiece-style tokenizer,
    float32: the checkpoint itself is the oracle of the file."""
    import torch
    import gguf_models as gm
    from transformers import AutoModelForCausalLM, GenerationConfig
    from hf_models import randomize
    d = tmp_path_factory.mktemp("gguf_gemma4")
    hf = str(d / "hf")
    ft = gm.build_spm_tokenizer(hf)
    ids = {t: ft.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>", "<end_of_turn>")}
    cfg = config_for("gemma4_text", **{**FAMILY_CASES["gemma4"][1], "vocab_size": len(ft), "bos_token_id": ids["<bos>"],
                                       "eos_token_id": ids["<eos>"], "pad_token_id": ids["<pad>"]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, cfg)
    model.generation_config = GenerationConfig(bos_token_id=ids["<bos>"], pad_token_id=ids["<pad>"],
                                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    model.save_pretrained(hf)
    return gm.to_gguf(hf, str(d / "gemma4.gguf"), "f32"), hf, ft


def test_gemma4_gguf(backend_name, gemma4_gguf, tmp_path):
    """A Gemma 4 GGUF (arch gemma4: per-layer KV heads, key_length / key_length_swa, the window
    pattern, both rope bases, rope_freqs' proportional rope, the router's scale and per-expert scale,
    layer output scales, soft-capping) gives the checkpoint's logits within float32 tolerance; its
    embedded vocabulary encodes as the checkpoint's tokenizer does (with the BOS the file asks for),
    and generation ends at <eos> / <end_of_turn>."""
    from colibri_edge.model.convert import convert
    path, hf, ft = gemma4_gguf
    col = str(tmp_path / "col")
    cfg = convert(path, col, progress=False)
    assert cfg["model_type"] == "gemma4_text" and cfg["layer_types"] == FAMILY_CASES["gemma4"][1]["layer_types"]
    assert cfg["layers"][1]["head_dim"] == 32 and cfg["layers"][1]["k_eq_v"] and cfg["layers"][1]["rope_partial"] == 0.25
    ids = np.random.default_rng(3).integers(0, len(ft), size=(2, 11))
    from hf_models import hf_logits
    want = hf_logits(hf, ids)
    with open_engine(col, backend_name, max_seq_len=64) as eng:
        got = eng.infer(ids)
        text = "hello world, the quick brown fox"
        assert eng.codec.encode(text) == [ft.convert_tokens_to_ids("<bos>")] + ft.encode(text)   # add_bos_token
        assert {ft.convert_tokens_to_ids("<eos>"), ft.convert_tokens_to_ids("<end_of_turn>")} <= set(eng.eos_token_ids)
    assert np.abs(got - want).max() / np.abs(want).max() < TOL


def test_gemma4_full_size_layer_plan():
    """transformers' own Gemma 4 config (30 layers, 5 sliding to 1 full, window 512; it saves its
    per-layer overrides under zero-padded keys, "05"): every full layer at the global head dim 512, one
    pool each for the full and the window layers, and the KV bytes `inspect` reports against a Mixtral
    of the same hidden size, layers and heads (fp32 cache): 81920 against 245760 bytes per token."""
    import transformers
    from colibri_edge.analysis.sizing import kv_full_bytes_per_token, kv_window_bytes
    from colibri_edge.runtime.state import attention_pools
    hf = transformers.Gemma4TextConfig(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128,
                                       top_k_experts=8, moe_intermediate_size=704).to_dict()
    assert "05" in hf["per_layer_config"]
    c = translate_config(hf, {}, dtype="bfloat16")
    full = [l["layer_id"] for l in c["layers"] if c["layer_types"][l["layer_id"]] == "full_attention"]
    assert full == [5, 11, 17, 23, 29] and all(c["layers"][i]["head_dim"] == 512 for i in full)
    pools = attention_pools(c, 4, 16)
    assert [(p.layers, p.per_token, p.window) for p in pools] == [
        (tuple(full), (4, 512), 0), (tuple(i for i in range(30) if i not in full), (4, 256), 512)]
    assert kv_full_bytes_per_token(c) == 5 * 2 * 4 * 512 * 4 == 81920
    assert kv_window_bytes(c, 16) == 25 * 2 * 4 * 256 * 4 * (512 // 16 + 1) * 16
    mixtral = translate_config(transformers.MixtralConfig(hidden_size=2304, num_hidden_layers=30, num_attention_heads=8,
                                                          num_key_value_heads=4, head_dim=256).to_dict(), {},
                               dtype="bfloat16")
    assert kv_full_bytes_per_token(mixtral) == 30 * 2 * 4 * 256 * 4 == 245760
