"""Nothing gets past validation: a slice of the fuzz campaign (tests/fuzz.py; `make fuzz` runs the
whole of it), a named regression test for every escape the first campaign found, and a battery of
bad API arguments after each of which the engine gives the same logits as before with its KV pool
as free as before."""
import os
import shutil

import numpy as np
import pytest

import fuzz
from colibri_edge import (Engine, ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL,
                          COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE)
from colibri_edge.model.modeldir import ModelDir
from helpers import backend_available, edit_json, fp32, refused

SLICE = {"reference": 1000, "cpu": 1000, "opencl": 300}


@pytest.mark.parametrize("backend", sorted(SLICE))
def test_fuzz_slice(backend, tmp_path):
    ok, why = backend_available(backend)
    if not ok:
        pytest.skip(why)
    t = fuzz.campaign(SLICE[backend], backend, seed=12, workdir=str(tmp_path))
    print(fuzz.report([t]))
    assert t["cases"] == SLICE[backend] and not t["defects"], fuzz.report([t])
    o = t["by_outcome"]
    assert o["ok"] > 0.05 * t["cases"] and o["coded"] > 0.5 * t["cases"]      # both paths really exercised
    assert set(t["by_kind"]) == set(fuzz.KINDS)


GGUF_SLICE = {"reference": 400, "cpu": 100}


@pytest.mark.parametrize("backend", sorted(GGUF_SLICE))
def test_fuzz_slice_gguf(backend, tmp_path):
    """Mutated GGUF files through `colibri convert`, then open and run what it wrote."""
    pytest.importorskip("gguf", reason="the gguf extra is part of make test's install")
    t = fuzz.campaign(GGUF_SLICE[backend], backend, seed=21, workdir=str(tmp_path), gguf=True)
    print(fuzz.report([t]))
    assert t["cases"] == GGUF_SLICE[backend] and not t["defects"], fuzz.report([t])
    o = t["by_outcome"]
    assert o["ok"] > 0.05 * t["cases"] and o["coded"] > 0.5 * t["cases"]
    assert set(t["by_kind"]) == set(fuzz.GGUF_KINDS)


def test_fuzz_harness_counts_crashes_and_hangs(base):
    """A planted crash and a planted hang are counted as such, and the worker comes back for the next case."""
    w = fuzz.Worker("reference")
    try:
        assert w.run(base, 30, plant="crash")["outcome"] == "crash"
        assert w.run(base, 2, plant="hang")["outcome"] == "hang"
        r = w.run(base, 60)
        assert r["outcome"] == "ok" and r["stage"] == "forward" and w.restarts == 2
    finally:
        w.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return fuzz.build_base(str(tmp_path_factory.mktemp("fuzzbase") / "m"))


@pytest.fixture
def model(base, tmp_path):
    dst = str(tmp_path / "m")
    shutil.copytree(base, dst)
    return dst


# -- the escapes of the first campaign, each by name ------------------------------------------------
@pytest.mark.parametrize("name", ["config.json", "tensors.json", "experts.json", "colibri_weights.bin",
                                  "tokenizer_config.json", "generation_config.json", "tokenizer.json"])
def test_file_replaced_by_a_directory(model, name):            # was IsADirectoryError
    os.remove(os.path.join(model, name))
    os.mkdir(os.path.join(model, name))
    refused(model, name, "is a directory")


def test_file_replaced_by_a_link(model, tmp_path):
    os.remove(os.path.join(model, "tensors.json"))
    os.symlink("/dev/zero", os.path.join(model, "tensors.json"))
    refused(model, "tensors.json", "symbolic link")


def test_tensor_shape_not_a_list(model):                      # was TypeError
    edit_json(model, "tensors.json", lambda t: t["layers.0.attn.wq"].update(shape=7))
    refused(model, "layers.0.attn.wq.shape", "expected a list")


def test_deeply_nested_json(model):                           # was RecursionError
    with open(os.path.join(model, "experts.json"), "w") as f:
        f.write("[" * 100000 + "]" * 100000)
    refused(model, "experts.json", "nested deeper")


def test_huge_intermediate_size(model):                       # was MemoryError asking for 12 TiB
    edit_json(model, "config.json", lambda c: c.update(intermediate_size=2 ** 31))
    refused(model, "intermediate_size", "out of range")
    edit_json(model, "config.json", lambda c: c.update(intermediate_size=2 ** 20))
    refused(model, "tensors.json", "layers.0.mlp.gate.shape")      # the tensors say otherwise


@pytest.mark.parametrize("field,value", [("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0),
                                         ("rms_norm_eps", 1e30), ("rope_theta", float("nan")), ("rope_theta", -5.0),
                                         ("rope_theta", float("inf")), ("rope_theta", 1e300), ("rope_theta", "1e4")])
def test_absurd_norm_eps_and_rope_theta(model, field, value):  # were accepted, giving NaN logits
    edit_json(model, "config.json", lambda c: c.update({field: value}))
    refused(model, field)


@pytest.mark.parametrize("field,value", [("attention_scale", 0.0), ("attention_scale", float("nan")),
                                         ("attention_scale", "0.1"),
                                         ("folded_multipliers", {"embedding_multiplier": -1.0}),
                                         ("folded_multipliers", {"attention_multiplier": 2.0}),
                                         ("folded_multipliers", [1.0]), ("router_choice_bias", 1),
                                         ("router_norm_min", -1e-3), ("router_norm_min", 2.0),
                                         ("router_norm_min", "1e-12"), ("rope_pairs", "gptj")])
def test_optional_scale_fields_typed(model, field, value):
    """attention_scale and folded_multipliers (written for Granite), router_choice_bias,
    router_norm_min and rope_pairs (ERNIE-4.5) are typed and ranged like the rest."""
    edit_json(model, "config.json", lambda c: c.update({field: value}))
    refused(model, field)


def test_choice_bias_needs_its_tensors_and_topk(model):
    """router_choice_bias set: every MoE layer needs its [E] bias tensor (named when missing); gated
    routing takes none."""
    edit_json(model, "config.json", lambda c: c.update(router_choice_bias=True))
    refused(model, "router_choice_bias")
    edit_json(model, "config.json", lambda c: c.update(router_choice_bias=False, router_norm_min=0.5, router_mode="gated"))
    refused(model, "router_mode", "renormalisation floor")


def test_unknown_fields_and_tensors_are_refused(model):
    edit_json(model, "config.json", lambda c: c.update(attn_logit_softcapping=16.0))
    refused(model, "attn_logit_softcapping", "not a field this Colibri knows")


@pytest.mark.parametrize("edit,field,words", [
    (dict(layer_types=["sliding_attention"]), "sliding_window", "missing"),
    (dict(layer_types=["local"], sliding_window=4), "layer_types[0]", "is not one of"),
    (dict(layer_types=[], sliding_window=4), "layer_types", "entries"),
    (dict(sliding_window=0), "sliding_window", "out of range"),
    (dict(expert_act="gelu"), "expert_act", "is not one of"),
    (dict(expert_act="swiglu_oai", swiglu_alpha=1.7), "swiglu_limit", "missing"),
    (dict(expert_act="swiglu_oai", swiglu_alpha=-1.0, swiglu_limit=7.0), "swiglu_alpha", "out of range"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}),
     "rope_scaling.rope_type", "is not one of"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 8}),
     "rope_scaling.short_factor", "missing"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling.original_max_position_embeddings",
     "missing"),
    (dict(rope_scaling={"rope_type": "freq_factors"}), "rope_scaling.freq_factors", "missing"),
    (dict(rope_scaling={"rope_type": "freq_factors", "freq_factors": [1.0, 2.0]}), "rope_scaling.freq_factors",
     "head_dim / 2"),
    (dict(rope_scaling={"rope_type": "freq_factors", "freq_factors": [0.0] * 4}), "rope_scaling.freq_factors[0]",
     "out of range"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "x": 1}),
     "rope_scaling.x", "not a field"),
    (dict(attention_sinks="yes"), "attention_sinks", "true or false"),
])
def test_window_sink_and_rope_fields_are_checked(model, edit, field, words):
    """gpt-oss's fields: sliding layers, the activation, YaRN, sinks (and a sink-bearing config
    without the sink tensors is refused as a missing tensor)."""
    L = None

    def apply(c):
        nonlocal L
        L = c["num_hidden_layers"]
        e = dict(edit)
        if "layer_types" in e and e["layer_types"] == ["sliding_attention"]:
            e["layer_types"] = ["sliding_attention"] * L
        if "layer_types" in e and e["layer_types"] == ["local"]:
            e["layer_types"] = ["local"] * L
        c.update(e)
    edit_json(model, "config.json", apply)
    refused(model, field, words)


def test_sinks_without_their_tensors_are_refused(model):
    edit_json(model, "config.json", lambda c: c.update(attention_sinks=True))
    refused(model, "layers.0.attn.sinks", "missing")


def test_extra_tensor_is_refused(model):
    edit_json(model, "tensors.json", lambda t: t.update({"layers.0.attn.extra": dict(t["norm"])}))
    refused(model, "layers.0.attn.extra", "not a tensor of this layer plan")


def test_nonfinite_weights_give_their_own_outcome(model):
    """Opening never scans the weights; NaN written over an expert is reported when it is used, for
    that sequence alone, with its own message."""
    with Engine.open(model, backend="reference") as eng:
        e0 = eng.model.experts[0]
        want = eng.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True)
    with open(os.path.join(model, "colibri_weights.bin"), "r+b") as f:      # every routed expert of layer 1
        for e in ModelDir(model).experts[:4]:
            f.seek(e.weight_offset)
            f.write(np.full(e.weight_size // 4, np.nan, np.float32).tobytes())
    with Engine.open(model, backend="reference", max_batch=2) as eng:
        with pytest.raises(ColibriError) as ei:
            eng.infer([1, 2, 3])
        assert ei.value.code == COLIBRI_ERR_INVALID_MODEL and "non-finite logits" in ei.value.message
        res = eng.generate_batch([[1, 2, 3], [4, 5]], max_new_tokens=3, return_errors=True, ignore_eos=True)
        assert all(isinstance(r, ColibriError) and "non-finite" in r.message for r in res)
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks
    assert want and e0.weight_size > 0


def test_convert_refuses_nonfinite_tensors(tmp_path):
    from colibri_edge.model.convert import convert
    from hf_models import build_hf
    from safetensors.numpy import load_file, save_file
    hf = build_hf(str(tmp_path / "hf"), "olmoe")
    st = os.path.join(hf, "model.safetensors")
    tensors = load_file(st)
    name = next(n for n in sorted(tensors) if "experts" in n)
    tensors[name].reshape(-1)[3] = np.inf
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ColibriError) as ei:
        convert(hf, str(tmp_path / "out"), progress=False)
    assert ei.value.code == COLIBRI_ERR_INVALID_MODEL and "NaN or inf" in ei.value.message and "expert" in ei.value.message


# -- bad API arguments --------------------------------------------------------------------------------
BAD_CALLS = [
    ("infer", ([],), {}), ("infer", ([[]],), {}), ("infer", ([1, 2, 10 ** 6],), {}), ("infer", ([-1, 3],), {}),
    ("infer", ([0.5, 1.0],), {}), ("infer", (np.zeros((2, 0), int),), {}), ("infer", ([True, False],), {}),
    ("infer", (list(range(40)),), {}), ("infer", ([[1, 2], 3],), {}), ("infer", ("text",), {}),
    ("generate", ([1, 2],), {"temperature": float("nan")}), ("generate", ([1, 2],), {"temperature": -1}),
    ("generate", ([1, 2],), {"temperature": "hot"}), ("generate", ([1, 2],), {"temperature": float("inf")}),
    ("generate", ([1, 2],), {"top_p": 0}), ("generate", ([1, 2],), {"top_p": 1.5}),
    ("generate", ([1, 2],), {"top_p": float("nan")}), ("generate", ([1, 2],), {"top_k": -1}),
    ("generate", ([1, 2],), {"top_k": 2.5}), ("generate", ([1, 2],), {"top_k": True}),
    ("generate", ([1, 2],), {"seed": "x"}), ("generate", ([1, 2],), {"seed": -1}), ("generate", ([1, 2],), {"seed": 2 ** 70}),
    ("generate", ([1, 2],), {"seed": 1.5}), ("generate", ([1, 2],), {"stop": 123}), ("generate", ([1, 2],), {"stop": [1]}),
    ("generate", ([1, 2],), {"stop": [""]}), ("generate", ([1, 2],), {"stop": ["x"] * 100}),
    ("generate", ([1, 2],), {"max_new_tokens": -1}), ("generate", ([1, 2],), {"max_new_tokens": 1.5}),
    ("generate", ([1, 2],), {"max_new_tokens": "3"}), ("generate", ([1, 2],), {"max_new_tokens": None}),
    ("generate", ([1, 2],), {"ignore_eos": "yes"}), ("generate", ([],), {}), ("generate", (None,), {}),
    ("generate", ([{"role": 1, "content": "x"}],), {}), ("generate", ([{"role": "user"}],), {}),
    ("generate_batch", ("abc",), {}), ("generate_batch", ([],), {}), ("generate_batch", ([[1]],), {"return_errors": "x"}),
    ("generate_batch", ([[1], [10 ** 9]],), {}), ("chat", ("not messages",), {}),
    ("stream", ([1, 2],), {"temperature": -3}),
]
BAD_OPENS = [{"max_batch": 0}, {"max_batch": -1}, {"max_batch": 1.5}, {"max_batch": True}, {"max_batch": "4"},
             {"max_seq_len": 10 ** 6}, {"max_seq_len": 0}, {"prefill_chunk": 0}, {"kv_cache_tokens": 0},
             {"kv_cache_tokens": 2.0}, {"kv_block_size": 0}, {"kv_block_size": 2 ** 20}, {"kv_block_size": "big"},
             {"expert_slots": 10 ** 9}, {"expert_slots": -2}, {"slot_policy": "mru"}, {"backend": "tpu"},
             {"num_threads": -1}, {"router_warmup": 10 ** 6}, {"num_streams": 0}]
# too large for any machine, and too large for a 64 MiB budget (the arena, the KV pool by its tokens and
# by its block size)
TOO_BIG = [{"kv_cache_tokens": 2 ** 39}, {"max_seq_len": 64, "max_batch": 2 ** 16, "kv_cache_tokens": 2 ** 38}]
TOO_BIG_AT_64MIB = [{"max_batch": 4096, "prefill_chunk": 2 ** 16}, {"kv_cache_tokens": 2 ** 22},
                    {"kv_block_size": 2 ** 16, "kv_cache_tokens": 2 ** 19}]


def _probe(eng):
    V = eng.config["vocab_size"]
    return np.concatenate(eng.infer([np.arange(7) % V, (np.arange(11) * 3) % V]))


def test_bad_api_arguments_are_coded_and_lose_nothing(backend_name, base, monkeypatch):
    """Every bad call raises its code; after each the engine's logits are the same and its KV pool is
    as free as before (nothing of the failed call stays behind)."""
    with Engine.open(base, backend=backend_name, max_seq_len=32, max_batch=2, kv_cache_tokens=64, kv_block_size=4,
                     **fp32(backend_name)) as eng:
        want, free = _probe(eng), eng.kv_free_blocks
        for name, args, kw in BAD_CALLS:
            with pytest.raises(ColibriError) as ei:
                r = getattr(eng, name)(*args, **kw)
                if name == "stream":
                    list(r)
            assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT, (name, args, kw, ei.value)
            assert ei.value.message, (name, args, kw)
            assert eng.kv_free_blocks == free, (name, args, kw)
            np.testing.assert_array_equal(_probe(eng), want, err_msg=f"{name} {args} {kw}")
        for kw in BAD_OPENS:
            with pytest.raises(ColibriError) as ei:
                Engine.open(base, **{"backend": backend_name, **kw})
            assert ei.value.code in (COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE), (kw, ei.value)
        for kw in TOO_BIG:                                   # computed before anything is allocated
            with pytest.raises(ColibriError) as ei:
                Engine.open(base, backend=backend_name, **kw)
            assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "needs" in ei.value.message, (kw, ei.value)
        monkeypatch.setattr(type(eng.backend), "memory_available", lambda self: (64 << 20, "a 64 MiB test budget"))
        for kw in TOO_BIG_AT_64MIB:
            with pytest.raises(ColibriError) as ei:
                Engine.open(base, backend=backend_name, **kw)
            assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "64 MiB test budget" in ei.value.message, (kw, ei.value)
        monkeypatch.undo()
        np.testing.assert_array_equal(_probe(eng), want)
        assert eng.kv_free_blocks == free


def test_out_of_memory_names_the_numbers(base):
    with pytest.raises(ColibriError) as ei:
        Engine.open(base, backend="reference", kv_cache_tokens=2 ** 39)
    m = ei.value.message
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "KV cache (kv_cache_tokens)" in m and "leaves" in m
    assert "smaller" in m and any(u in m for u in ("TiB", "GiB"))


def _first_layer(**kw):
    return lambda c: c["layers"][0].update(kw)


@pytest.mark.parametrize("edit,field,words", [
    (lambda c: c.update(ffn_act="relu"), "ffn_act", "is not one of"),
    (lambda c: c.update(norm_layout="post"), "norm_layout", "is not one of"),
    (lambda c: c.update(embed_scale=-1.0), "embed_scale", "out of range"),
    (lambda c: c.update(final_logit_softcap=0.0), "final_logit_softcap", "out of range"),
    (lambda c: c.update(v_norm="yes"), "v_norm", "true or false"),
    (_first_layer(head_dim=7), "layers[0].head_dim", "odd"),
    (_first_layer(num_key_value_heads=3), "layers[0].num_key_value_heads", "does not divide"),
    (_first_layer(rope_partial=1.5), "layers[0].rope_partial", "out of range"),
    (_first_layer(k_eq_v=1), "layers[0].k_eq_v", "true or false"),
    (_first_layer(window=4), "layers[0].window", "not a field"),
    (lambda c: [l.update(type="moe_dense") for l in c["layers"] if l["type"] != "dense"], ".type", "sandwich"),
    (lambda c: c.update(layer_scalar=True), "layers.0.scalar", "missing"),
    (lambda c: c.update(norm_layout="sandwich"), "layers.0.attn.out_norm", "missing"),
    (_first_layer(head_dim=16), "layers.0.attn.wq", ""),
])
def test_gemma4_fields_are_checked(model, edit, field, words):
    """Gemma 4's fields (the layout, the activations, scales, a layer's own attention geometry and
    rope) are typed and ranged, and a config that implies tensors the directory lacks (or of another
    shape) is refused naming the tensor."""
    edit_json(model, "config.json", edit)
    refused(model, field, words)
