"""The GGUF fixtures themselves: llama.cpp's converter on the tiny models, the oracle checkpoint
(GGUF -> Hugging Face names, q/k unpermuted, experts unstacked) and requantize.

An f32 GGUF is lossless, so transformers on the oracle must reproduce transformers on the original
checkpoint (1e-5): that proves the name map, the llama q/k unpermute and the expert split. The
requantize tests prove the re-encoded files re-read, keep every metadata field, and decode close.
"""
import json
import shutil
import time

import numpy as np
import pytest

import gguf_models as gm
import llamacpp_convert
from gguf_models import gguf_cases  # noqa: F401  (the session fixture)

ALL = tuple(gm.CASES)


@pytest.fixture(scope="module")
def f32_cases(gguf_cases):  # noqa: F811
    """Every case converted to f32 by llama.cpp (and mixtral to the converter's own q8_0), in one
    converter subprocess."""
    built = gm.gguf_cases_many([(case, "f32") for case in ALL] + [("mixtral", "q8_0")])
    return {c.case: c for c in built if c.outtype == "f32"}


def _ids(vocab, n=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(1, n))
    ids[0, :3] = [0, 2, 3]          # <s> <|im_start|> <|im_end|>
    return ids


def _vocab(hf_dir):
    return json.loads((hf_dir / "config.json").read_text())["vocab_size"]


def test_fetch_is_cached_and_isolated():
    d = llamacpp_convert.fetch()                      # `make test`'s set-up fetched it already
    t = time.perf_counter()
    assert llamacpp_convert.fetch() == d and llamacpp_convert.is_fetched()
    assert time.perf_counter() - t < 1.0              # a second call is free
    for rel in ("convert_hf_to_gguf.py", "conversion/base.py", "conversion/llama.py", "gguf-py/gguf/__init__.py"):
        assert (d / rel).is_file(), rel
    import gguf                                       # the venv's gguf here, never the vendored one
    assert not gguf.__file__.startswith(str(d))


@pytest.mark.parametrize("case", ALL)
def test_f32_oracle_matches_checkpoint(f32_cases, case):
    c = f32_cases[case]
    ids = _ids(_vocab(c.hf_dir))
    ref = gm.hf_logits(c.hf_dir, ids)
    got = gm.hf_logits(c.oracle(), ids)
    assert np.abs(ref).max() > 1.0                    # O(1) logits, not ~0
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ALL)
def test_gguf_metadata(f32_cases, case):
    import gguf
    c = f32_cases[case]
    r = gguf.GGUFReader(str(c.gguf))
    f = {k: v.contents() for k, v in r.fields.items()}
    model_type, kw = gm.CASES[case]
    arch = gm.GGUF_ARCH[model_type]
    assert f["general.architecture"] == arch
    assert f[f"{arch}.expert_count"] == kw.get("num_local_experts", kw.get("num_experts", kw.get("moe_num_experts")))
    assert f[f"{arch}.expert_used_count"] == kw.get("num_experts_per_tok", kw.get("moe_k"))
    assert f["general.file_type"] == gguf.LlamaFileType.ALL_F32
    # the tokenizer: every token in id order, specials as CONTROL, merges, special ids, chat template
    tok = json.loads((c.hf_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == len(vocab) == _vocab(c.hf_dir)
    assert tokens == sorted(vocab, key=vocab.get)
    types = f["tokenizer.ggml.token_type"]
    for t in gm.SPECIAL_TOKENS:
        assert types[vocab[t]] == gguf.TokenType.CONTROL, t
    assert len(f["tokenizer.ggml.merges"]) == len(tok["model"]["merges"]) > 0
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert tokens[f["tokenizer.ggml.bos_token_id"]] == gm.BOS
    assert tokens[f["tokenizer.ggml.eos_token_id"]] == gm.EOS
    assert tokens[f["tokenizer.ggml.padding_token_id"]] == gm.PAD
    assert f["tokenizer.chat_template"] == gm.CHAT_TEMPLATE
    # the experts are stacked [E, out, in]
    names = {t.name for t in r.tensors}
    first = kw.get("moe_layer_start_index", 0)           # ERNIE: dense layers first
    for kind in ("gate", "up", "down"):
        assert f"blk.{first}.ffn_{kind}_exps.weight" in names


@pytest.mark.parametrize("case", gm.K_CASES)
def test_k_cases_take_k_quants_everywhere(f32_cases, case):
    """The 256-multiple variants: Q4_K applies to every matrix weight without a fallback."""
    import gguf
    r = gguf.GGUFReader(str(f32_cases[case].gguf))
    rule, strict = gm.quant_rule("Q4_K"), gm.quant_rule("Q4_K", fallback=False)
    chosen = {t.name: strict(t.name, tuple(int(n) for n in reversed(t.shape))) for t in r.tensors}
    assert {t for t in chosen.values() if t is not None} == {gguf.GGMLQuantizationType.Q4_K}
    assert sum(t is not None for t in chosen.values()) >= 3 + 4 * 2     # embd, output, experts, attention
    for t in r.tensors:
        assert rule(t.name, tuple(int(n) for n in reversed(t.shape))) == chosen[t.name]
    if case == "mixtral8_k":
        assert r.fields["llama.expert_count"].contents() == 8


def test_oracle_refuses_mismatches(f32_cases, tmp_path):
    mix, qwen2 = f32_cases["mixtral"], f32_cases["qwen2_moe"]
    with pytest.raises(KeyError):                    # qwen2moe's shared-expert tensors have no mixtral name
        gm.oracle_tensors(qwen2.gguf, mix.hf_dir)
    with pytest.raises(AssertionError):              # same names, other shapes
        gm.oracle_tensors(f32_cases["mixtral_k"].gguf, mix.hf_dir)
    with pytest.raises(AssertionError):              # 4 experts in the HF dir, 8 in the GGUF
        gm.oracle_tensors(f32_cases["mixtral8_k"].gguf, f32_cases["mixtral_k"].hf_dir)
    # an HF tensor the GGUF does not fill
    from safetensors.numpy import load_file, save_file
    extra = tmp_path / "extra"
    shutil.copytree(mix.hf_dir, extra)
    sd = load_file(str(extra / "model.safetensors"))
    moe = "model.layers.1.block_sparse_moe.experts"
    sd[f"{moe}.4.w1.weight"] = sd[f"{moe}.0.w1.weight"]
    save_file(sd, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="experts"):
        gm.oracle_tensors(mix.gguf, extra)


def _fields(path):
    import gguf
    return {k: (v.types, v.contents()) for k, v in gguf.GGUFReader(str(path)).fields.items()}


@pytest.mark.parametrize("qtype, weight_rmse, logit_err", [("Q8_0", 0.01, 0.05), ("Q4_K", 0.1, 0.45)])
def test_requantize(f32_cases, tmp_path, qtype, weight_rmse, logit_err):
    import gguf
    from colibri_edge.model.quant import quantize as colibri_quantize
    Q = gguf.GGMLQuantizationType
    c = f32_cases["qwen2_moe_k"]
    dst = gm.requantize(c.gguf, tmp_path / f"{qtype}.gguf", gm.quant_rule(qtype),
                        file_type=gguf.LlamaFileType[f"MOSTLY_{qtype}_M" if qtype == "Q4_K" else f"MOSTLY_{qtype}"])
    src_f, dst_f = _fields(c.gguf), _fields(dst)
    assert list(dst_f) == list(src_f)                 # every key, in order, same types and values
    for k in src_f:
        if k != "general.file_type":
            assert dst_f[k] == src_f[k], k
    assert dst_f["general.file_type"][1] in (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.LlamaFileType.MOSTLY_Q4_K_M)

    src, out = gguf.GGUFReader(str(c.gguf)), gguf.GGUFReader(str(dst))
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    n_quant = 0
    for s, d in zip(src.tensors, out.tensors):
        x = gm.dequantize_tensor(s)
        assert list(d.shape) == list(s.shape)
        if d.tensor_type == Q.F32:                    # norms, biases, routers: byte-for-byte
            assert ".ffn_gate_inp" in d.name or "norm" in d.name or x.ndim == 1, d.name
            assert np.array_equal(np.asarray(d.data), np.asarray(s.data))
            continue
        assert d.tensor_type == Q[qtype], d.name
        n_quant += 1
        y = gm.dequantize_tensor(d)
        rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
        assert rel < weight_rmse, (d.name, rel)
        if qtype == "Q4_K":                           # exactly what our quantiser wrote
            want = colibri_quantize(x.reshape(-1, x.shape[-1]), "q4_k").reshape(np.asarray(d.data).shape)
            assert np.array_equal(np.asarray(d.data), want), d.name
    assert n_quant >= 3 + 4 * 2 + 3 * 2

    ids = _ids(_vocab(c.hf_dir), n=16)
    ref = gm.hf_logits(c.hf_dir, ids)
    got = gm.hf_logits(gm.oracle_checkpoint(dst, c.hf_dir, tmp_path / f"oracle-{qtype}"), ids)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < err < logit_err, err


def test_requantize_q8_0_matches_the_converter(gguf_cases, f32_cases, tmp_path):  # noqa: F811
    """gguf-py's Q8_0 through requantize == llama.cpp's converter writing q8_0 itself, byte for byte."""
    import gguf
    case = "mixtral"
    conv = gguf_cases(case, "q8_0")
    ours = gm.requantize(f32_cases[case].gguf, tmp_path / "q8.gguf", gm.quant_rule("Q8_0"),
                         file_type=gguf.LlamaFileType.MOSTLY_Q8_0)
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(conv.gguf))
    assert _fields(ours) == _fields(conv.gguf)
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert (x.name, x.tensor_type) == (y.name, y.tensor_type)
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), x.name


def test_gguf_case_is_cached(gguf_cases, f32_cases):  # noqa: F811
    a = gguf_cases("olmoe", "f32")
    assert a == f32_cases["olmoe"] and a.gguf.is_file()
    assert gguf_cases("olmoe") is not None and gm.gguf_case("olmoe", "F32").gguf == a.gguf
    assert a.oracle() == a.oracle()


def test_requantize_synthetic(tmp_path):
    """Field types, a custom general.alignment, and F16 / BF16 / quantised sources kept byte-for-byte."""
    import gguf
    from gguf import quants
    Q, T = gguf.GGMLQuantizationType, gguf.GGUFValueType
    rng = np.random.default_rng(1)
    src = tmp_path / "src.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 7)
    w.add_int32("t.i32", -3)
    w.add_uint64("t.u64", 1 << 40)
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "caf\u00e9 \u4e2d")
    w.add_array("t.strs", ["a", "\u0120b", "<|im_end|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_key_value("t.floats", [0.5, 1.25], T.ARRAY, sub_type=T.FLOAT32)
    x = {n: rng.standard_normal(s).astype(np.float32) for n, s in
         [("a.weight", (8, 256)), ("b.weight", (4, 64)), ("c.weight", (4, 64)), ("d.weight", (4, 64)),
          ("n.bias", (5,))]}
    w.add_tensor("a.weight", x["a.weight"])
    w.add_tensor("b.weight", x["b.weight"].astype(np.float16))
    w.add_tensor("c.weight", quants.quantize(x["c.weight"], Q.BF16), raw_dtype=Q.BF16)
    w.add_tensor("d.weight", quants.quantize(x["d.weight"], Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("n.bias", x["n.bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    to = {"a.weight": Q.Q6_K, "b.weight": Q.Q4_0}
    dst = gm.requantize(src, tmp_path / "dst.gguf", lambda name, shape: to.get(name))
    assert _fields(dst) == _fields(src)
    r, s = gguf.GGUFReader(str(dst)), gguf.GGUFReader(str(src))
    assert r.alignment == 64 and all(t.data_offset % 64 == 0 for t in r.tensors)
    got = {t.name: t for t in r.tensors}
    for t in s.tensors:
        g = got[t.name]
        if t.name in to:
            assert g.tensor_type == to[t.name]
            y = gm.dequantize_tensor(g)
            assert y.shape == x[t.name].shape
            assert np.sqrt(np.mean((y - x[t.name]) ** 2)) < 0.15
        else:
            assert g.tensor_type == t.tensor_type and np.array_equal(np.asarray(g.data), np.asarray(t.data)), t.name
    with pytest.raises(ValueError):                   # a row the block does not divide
        gm.requantize(src, tmp_path / "bad.gguf", lambda name, shape: Q.Q4_K if name == "b.weight" else None)
