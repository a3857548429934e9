"""Qwen3.5 / 3.6-MoE (issue 18: gated delta-net layers with a fixed-size recurrent state per sequence)
against transformers on tiny random checkpoints, on every backend: the text model and the wrapped
vision-language checkpoint (vision tower and multi-token-prediction weights skipped), logits of batches
and ragged prompts, router choices, greedy decoding with prefill chunks of 1, 5 and the whole prompt,
a batch of 4 equal to its solo runs, the state pool (taken at a sequence's start, freed at its end,
exhaustion failing that sequence alone), the slot pool, traces, and memory: the state is a constant
per sequence, only the full-attention layers' KV grows with the context."""
import json
import os

import numpy as np
import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_INVALID_MODEL
from colibri_edge import backends
from colibri_edge.backends.reference import backend as reference
from colibri_edge.model.dtypes import is_block
from colibri_edge.model.quant import act_block, fake_quantized_activations
from colibri_edge.model.convert import translate_config
from colibri_edge.model.families.common import rope_dim_order
from colibri_edge.analysis.sizing import (engine_memory, kv_full_bytes_per_token, snapshot_bytes,
                                          state_bytes_per_sequence, summary)
from colibri_edge.model.modeldir import ModelDir
from helpers import fp32, refused_edit
from hf_models import FAMILY_CASES, QWEN35_TEXT, config_for, convert_case, hf_greedy

CASES = ["qwen3_5_moe", "qwen3_5_moe_vl"]


def open_engine(col, name, **kw):
    return Engine.open(col, backend=name, **fp32(name), **kw)


PROMPT = [5, 17, 3, 42, 8, 11, 29, 60, 2, 71, 13, 4, 50, 33, 7, 21, 9, 40, 1]      # 19 tokens: > one chunk


def greedy_oracle(model_cache, case, hf):
    key = os.path.join(model_cache, f"greedy_{case}.json")
    if not os.path.exists(key):
        json.dump(hf_greedy(hf, PROMPT, 32), open(key, "w"))
    return json.load(open(key))


def test_batch_of_four_equals_solo_runs(backend_name, model_cache):
    """Four prompts of different lengths generated together (sequences at different positions share
    each step, prefill chunks beside decode tokens) give each prompt's solo tokens."""
    _, col = convert_case(model_cache, "qwen3_5_moe")
    prompts = [PROMPT, PROMPT[:3], PROMPT[4:15], [7] * 23]
    with open_engine(col, backend_name, max_seq_len=96, prefill_chunk=8) as eng:
        solo = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        together = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        assert eng.runner.states.fixed[0].free_slots == eng.runner.states.fixed[0].num_slots
    assert together == solo


def test_preempted_sequence_recomputes_its_state(backend_name, model_cache):
    """A KV pool too small for three requests at once: the request core preempts one, frees its KV
    blocks and its state slot, and recomputes it from its prompt and the tokens it produced (the
    recurrent state is rebuilt by that prefill, not snapshotted): every request gets its solo tokens,
    every block and slot is back after."""
    _, col = convert_case(model_cache, "qwen3_5_moe")
    prompts = [PROMPT[:5], PROMPT[2:8], PROMPT[:18]]
    with open_engine(col, backend_name, max_batch=3, max_seq_len=64, kv_block_size=4, kv_cache_tokens=48) as eng:
        solo = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        got = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        assert eng._core.preemptions > 0, "the pool was sized so that the three cannot run together"
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks
        assert eng.runner.states.fixed[0].free_slots == eng.runner.states.fixed[0].num_slots
    assert got == solo


def test_vl_checkpoint_skips_the_towers_and_greedy_matches(model_cache, capfd):
    """The wrapped checkpoint: the vision tower and the multi-token-prediction weights are skipped with
    a note, and greedy decoding on the cpu backend equals transformers'."""
    from colibri_edge.model.convert import convert
    hf, _ = convert_case(model_cache, "qwen3_5_moe_vl")
    out = os.path.join(model_cache, "q35_vl_note")
    if not os.path.exists(os.path.join(out, "config.json")):
        convert(hf, out, progress=True)
        assert "multi-token-prediction tensors skipped" in capfd.readouterr().err
    cfg = ModelDir(out).config
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["layer_types"].count("linear_attention") == 2
    want = greedy_oracle(model_cache, "qwen3_5_moe_vl", hf)
    with Engine.open(out, backend="cpu", max_seq_len=96, prefill_chunk=5) as eng:
        assert eng.generate(PROMPT, max_new_tokens=32, ignore_eos=True) == want


def test_state_pool_exhaustion_fails_that_sequence_alone(model_cache):
    """A step's sequences each hold a state slot from their first token to their end; one more
    sequence than the pool holds is COLIBRI_ERR_OUT_OF_MEMORY for it alone: the others continue
    with the logits they would have had."""
    _, col = convert_case(model_cache, "qwen3_5_moe")
    ids = [np.array(PROMPT[:6], np.int32), np.array(PROMPT[6:12], np.int32)]
    with Engine.open(col, backend="reference", max_seq_len=64, max_batch=2) as eng:
        r = eng.runner
        want = [eng.infer(x)[0] for x in ids]
        pool = r.states.fixed[0]
        a, b, c = r.new_sequence(1), r.new_sequence(2), r.new_sequence(3)
        r.reserve(a, 6)
        r.reserve(b, 6)
        assert pool.free_slots == 0
        with pytest.raises(ColibriError) as e:
            r.reserve(c, 3)
        assert e.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "recurrent state pool exhausted" in e.value.message
        assert c.slots == [-1] and all(not t for t in c.tables)         # nothing half-reserved
        got = r.step([(a, ids[0]), (b, ids[1])], all_logits=True).copy()
        assert np.abs(got[:6] - want[0]).max() < 1e-5 and np.abs(got[6:] - want[1]).max() < 1e-5
        r.free(a)
        r.reserve(c, 3)                                                   # a's slot, reused: state from zero
        got_c = r.step([(c, ids[1][:3])], all_logits=True).copy()
        assert np.abs(got_c - want[1][:3]).max() < 1e-5
        r.free(b)
        r.free(c)
        assert pool.free_slots == pool.num_slots


def test_trace_replays_to_the_engine_counters(model_cache, tmp_path):
    """A routing trace of a hybrid model (experts through 8 slots) replays through the simulator to the
    engine's own hit / miss counters and expert counts; its memory need counts the recurrent state once
    per sequence."""
    from colibri_edge.analysis.simulate import estimate, replay
    from colibri_edge.analysis.trace import Trace
    _, col = convert_case(model_cache, "qwen3_5_moe")
    with Engine.open(col, backend="cpu", max_seq_len=64, expert_slots=8, max_batch=2) as eng:
        tr = eng.trace([PROMPT[:9], PROMPT[3:]], max_new_tokens=6, ignore_eos=True)
        counts, stats = eng.expert_counts, eng.slot_stats
    path = str(tmp_path / "t.npz")
    tr.save(path)
    tr = Trace.load(path)
    assert tr.meta["state_bytes_per_sequence"] == state_bytes_per_sequence(ModelDir(col).config) > 0
    seen = np.zeros_like(counts)
    for j, layer in enumerate(tr.layer_ids):
        np.add.at(seen[layer], tr.expert_ids[:, j].reshape(-1), 1)
    assert (seen == counts).all() and stats["misses"] > 0
    res = replay(tr, 8, "lru", pinned=stats["pinned_keys"])
    assert (res["hits"], res["misses"]) == (stats["hits"], stats["misses"])
    prof = {"memory_bandwidth_gbs": 10.0, "miss_bandwidth_gbs": 1.0, "memory_bytes": 1 << 30}
    need = estimate(res, tr, prof, 100)["memory_needed_bytes"]
    m = tr.meta
    assert need == m["non_expert_bytes"] + 8 * m["bytes_per_expert"] + 100 * m["kv_bytes_per_token"] + \
        m["kv_window_bytes_per_sequence"] + m["state_bytes_per_sequence"] + m["scratch_bytes"]


def full_size_config():
    """Qwen3.5-35B-A3B's text config (40 layers, 3 of 4 gated delta-nets, 256 experts) as transformers
    defaults it, translated: no weights needed for the memory plan."""
    hf = config_for("qwen3_5_moe_text").to_dict()
    return translate_config(hf, {}, "config.json", "float16")


def test_memory_constant_state_and_kv_that_grows(model_cache):
    """The engine's allocation at a context of 4,096 against 256: the recurrent state is the same, only
    the full-attention layers' KV grows, by exactly (4096 - 256) x their bytes per token; inspect's
    prediction (planning.summary) equals what the engine allocates. For the full-size Qwen3.5-35B-A3B
    plan: 10 full-attention layers' KV per token, 30 delta-net layers' state per sequence."""
    _, col = convert_case(model_cache, "qwen3_5_moe_4k")
    cfg = ModelDir(col).config
    got = {}
    for ctx in (256, 4096):
        with Engine.open(col, backend="reference", max_seq_len=ctx, max_batch=1, prefill_chunk=64,
                         kv_cache_tokens=ctx) as eng:
            r = eng.runner
            got[ctx] = (r.state_bytes, r.arena_bytes, r.state_bytes_per_seq)
            s = summary(ModelDir(col), ctx, 1, 64, eng.runner.block_size)
            assert s["kv_cache_bytes"] == r.state_bytes and s["scratch_bytes"] == r.arena_bytes
    per_token, per_seq = kv_full_bytes_per_token(cfg), state_bytes_per_sequence(cfg)
    assert got[256][2] == got[4096][2] == per_seq > 0
    assert got[4096][0] - got[256][0] == (4096 - 256) * per_token
    assert got[256][0] == 256 * per_token + 2 * per_seq       # its state and one snapshot (max_batch of them)
    big = full_size_config()
    H = 2 * 2 * 256 * 4                              # 2 KV heads x 256 dims, K and V, float32
    assert kv_full_bytes_per_token(big) == 10 * H
    la = big["linear_attention"]
    C = 2 * la["num_key_heads"] * la["key_head_dim"] + la["num_value_heads"] * la["value_head_dim"]
    assert state_bytes_per_sequence(big) == 30 * 4 * ((la["conv_kernel"] - 1) * C + 32 * 128 * 128)
    m = engine_memory(big, 4096, 1, 256, 4096)["state_bytes"] - engine_memory(big, 256, 1, 256, 256)["state_bytes"]
    assert m == (4096 - 256) * 10 * H
    # a prefix-cache snapshot of the recurrent state costs one sequence's state: 65.9 MB at this shape
    assert snapshot_bytes(big) == state_bytes_per_sequence(big) == 65_863_680


def test_partial_rotary_reorder():
    """rope_dim_order moves partial rotary's pairs (i, i + r/2) to the half-split places (i, i + D/2)
    and keeps every dim once."""
    D, r = 16, 4
    o = rope_dim_order(D, r)
    assert sorted(o) == list(range(D))
    assert list(o[:2]) == [0, 1] and list(o[8:10]) == [2, 3]
    assert (rope_dim_order(8, 8) == np.arange(8)).all()


def _lin(**kw):
    return lambda c: c["linear_attention"].update(kw)


@pytest.mark.parametrize("edit,field,words", [
    (_lin(conv_kernel=1), "linear_attention.conv_kernel", "out of range"),
    (_lin(conv_kernel=9), "linear_attention.conv_kernel", "out of range"),
    (_lin(num_value_heads=3), "linear_attention.num_value_heads", "multiple"),
    (_lin(value_head_order="interleaved"), "linear_attention.value_head_order", "is not one of"),
    (_lin(state_dim=4), "linear_attention.state_dim", "not a field"),
    (_lin(key_head_dim=16), "layers.0.lin.wqkv", "shape"),
    (lambda c: c["linear_attention"].pop("value_head_dim"), "linear_attention.value_head_dim", "missing"),
    (lambda c: c.pop("linear_attention"), "linear_attention", "missing"),
    (lambda c: c.update(layer_types=["full_attention"] * 4), "layer_types", "no linear_attention"),
    (lambda c: c.update(rope_dim=5), "rope_dim", "odd"),
    (lambda c: c.update(rope_dim=64), "rope_dim", "out of range"),
    (lambda c: c.update(attention_output_gate="yes"), "attention_output_gate", "expected"),
    (lambda c: c.update(attention_output_gate=False), "layers.1.attn.wq_gate", "not"),
])
def test_linear_fields_are_checked(model_cache, tmp_path, edit, field, words):
    """The recurrent layers' fields are typed and ranged, refused by name; a config that implies other
    tensors than the directory holds is refused naming the tensor."""
    refused_edit(convert_case(model_cache, "qwen3_5_moe")[1], str(tmp_path / "m"), edit, field, words)


def test_refusals_by_name():
    """What the converter cannot compute is refused, naming the field."""
    base = config_for("qwen3_5_moe_text", **QWEN35_TEXT).to_dict()
    for field, value in (("hidden_act", "gelu"), ("attention_bias", True),
                         ("layer_types", ["linear_attention"] * 4),
                         ("rope_parameters", dict(rope_type="yarn", factor=2.0, rope_theta=1e4))):
        with pytest.raises(ColibriError) as e:
            translate_config({**base, field: value}, {}, "config.json")
        assert field in e.value.message
    cfg = translate_config(base, {}, "config.json", "float32")
    from colibri_edge.model import validate
    bad = {**cfg, "linear_attention": {**cfg["linear_attention"], "num_value_heads": 3}}
    with pytest.raises(ColibriError) as e:
        validate.config(bad)
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and "num_value_heads" in e.value.message
    with pytest.raises(ColibriError) as e:
        validate.config({k: v for k, v in cfg.items() if k != "linear_attention"})
    assert "linear_attention" in e.value.message


@pytest.fixture(scope="module")
def qwen35_gguf(tmp_path_factory):
    """llama.cpp's converter (arch qwen35moe) on the tiny text and wrapped checkpoints with a byte-level
    BPE tokenizer and multi-token-prediction weights (appended by the converter as layer L: skipped on
    import): float32 files, and the text model in q8_0."""
    import torch
    import gguf_models as gm
    from hf_models import add_mtp_weights, model_class, randomize
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("gguf_qwen35")
    out = {}
    for case in CASES:
        hf = str(d / case)
        ft = gm.build_tokenizer(hf)
        mt, kw = FAMILY_CASES[case]
        cfg = config_for(mt, **dict(kw, vocab_size=len(ft)))
        torch.manual_seed(0)
        model = model_class(mt)._from_config(cfg, attn_implementation="eager") if mt == "qwen3_5_moe" else \
            AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        randomize(model, cfg)
        model.save_pretrained(hf)
        add_mtp_weights(hf, getattr(cfg, "text_config", cfg))
        out[case] = (hf, ft, gm.to_gguf(hf, str(d / f"{case}.gguf"), "f32"))
    out["q8"] = gm.to_gguf(out["qwen3_5_moe"][0], str(d / "q8.gguf"), "q8_0")
    return out


@pytest.mark.parametrize("case", CASES)
def test_gguf_matches_transformers(backend_name, case, qwen35_gguf, tmp_path):
    """A qwen35moe GGUF (value heads tiled by key head where Hk < Hv, the output gate's rows inside
    attn_q, A stored as -exp(A_log), norms with the + 1 folded in, partial rotary's rows reordered on
    import, the MTP layer skipped) gives the checkpoint's logits within 1e-4 of max |logit|."""
    from colibri_edge.model.convert import convert
    from hf_models import hf_logits
    hf, ft, path = qwen35_gguf[case]
    ids = np.random.default_rng(3).integers(0, len(ft), size=(2, 19))
    want = hf_logits(hf, ids)
    out = str(tmp_path / "m")
    cfg = convert(path, out, progress=False)
    la = cfg["linear_attention"]
    assert cfg["layer_types"] == FAMILY_CASES[case][1]["layer_types"]
    assert la.get("value_head_order", "grouped") == ("tiled" if la["num_key_heads"] != la["num_value_heads"]
                                                     else "grouped")
    with open_engine(out, backend_name, max_seq_len=64) as eng:
        assert np.abs(eng.infer(ids) - want).max() / np.abs(want).max() < 1e-4


def test_gguf_q8_0_runs_as_stored(backend_name, qwen35_gguf, tmp_path, monkeypatch):
    """The q8_0 file: its blocks copied (attn_q's rows split into query and gate and reordered for
    partial rotary as whole rows: decoded, they are the file's decoded rows moved), every backend equal
    to the reference backend on the same file."""
    import gguf
    from colibri_edge.model.convert import convert
    from colibri_edge.model.dtypes import widen
    from helpers import activation_runs, close
    hf, ft, _ = qwen35_gguf["qwen3_5_moe"]
    out = str(tmp_path / "q8")
    cfg = convert(qwen35_gguf["q8"], out, progress=False)
    m = ModelDir(out)
    assert m.tensor_dtype("layers.1.attn.wq") == "q8_0" and m.tensor_dtype("layers.0.lin.wqkv") == "q8_0"
    r = gguf.GGUFReader(qwen35_gguf["q8"])
    t = {x.name: x for x in r.tensors}
    nh, D = cfg["num_attention_heads"], cfg["head_dim"]
    order = rope_dim_order(D, cfg["rope_dim"])
    q = gguf.dequantize(t["blk.1.attn_q.weight"].data, t["blk.1.attn_q.weight"].tensor_type).reshape(nh, 2, D, -1)
    for ours, rows in (("layers.1.attn.wq", q[:, 0][:, order]), ("layers.1.attn.wq_gate", q[:, 1])):
        assert (widen(m.raw_tensor(ours), "q8_0") == rows.reshape(nh * D, -1)).all()
    ids = np.random.default_rng(4).integers(0, len(ft), size=(2, 17))
    with Engine.open(out, backend="reference", max_seq_len=64) as eng:
        ref = eng.infer(ids)
    for opts, _ in activation_runs(backend_name, fp32(backend_name), 1e-4):
        want = ref
        if opts.get("int8_activations"):
            # int8 activations' rounding moves a router choice at some position, and a recurrent layer
            # carries the change to every later position (0.077 median here: past INT8_ACTIVATION_TOL,
            # which assumes a flip stays where it happened): held instead to the reference run on the
            # activations as the int8 path rounds them
            with monkeypatch.context() as mp:
                mp.setattr(backends, "backend_class", lambda n, cls=backends.backend_class:
                           Int8ActivationReference if n == "reference" else cls(n))
                with Engine.open(out, backend="reference", max_seq_len=64) as eng:
                    want = eng.infer(ids)
        with Engine.open(out, backend=backend_name, max_seq_len=64, **opts) as eng:
            got = eng.infer(ids)
        if not opts.get("int8_activations"):
            assert close(got, want, 1e-4), opts
        else:   # an activation within float32 rounding of a quantisation midpoint may round either way
            per = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)   # (test_kernels):
            assert np.median(per) < 1e-4 and per.max() < 1e-2, (opts, np.median(per), per.max())  # rarely


class Int8ActivationReference(reference.Backend):
    """The reference backend with every block-format matmul's input quantised to int8 the way the int8
    activation path does (quant.fake_quantized_activations: per 32 or 256 values, q * dx): the oracle of a
    backend's int8_activations run (test_kernels checks the same per op)."""

    def matmul(self, out, x, w, bias=None):
        super().matmul(out, fake_quantized_activations(np.ascontiguousarray(x), act_block(w.dtype)) if is_block(w.dtype)
                       else x, w, bias)

    def grouped_ffn(self, out, x, experts, plan, scratch, act=None):
        for e in plan.experts_to_run():
            a, b = plan.offsets[e], plan.offsets[e + 1]
            ffn = experts[e]
            xs = x[plan.order[a:b] // plan.top_k]
            xg = fake_quantized_activations(xs, act_block(ffn.gate.dtype)) if is_block(ffn.gate.dtype) else xs
            g, u = (np.empty((b - a, ffn.gate.shape[0]), np.float32) for _ in range(2))
            reference._rows_matmul(g, xg, reference._f32(ffn.gate))
            reference._rows_matmul(u, xg, reference._f32(ffn.up))
            h = reference.activation(g, u, act, e)
            reference._rows_matmul(out[a:b], fake_quantized_activations(h, act_block(ffn.down.dtype))
                                   if is_block(ffn.down.dtype) else h,
                                   reference._f32(ffn.down))


def test_served_hybrid_model_and_its_state_metrics(qwen35_gguf, tmp_path):
    """`colibri serve` on a hybrid model (the GGUF's, with its tokenizer): a completion at temperature 0
    equals Engine.generate, a streamed one joins to it, and /metrics reports the recurrent-state slots
    (held while a request runs, all free after)."""
    from fastapi.testclient import TestClient
    from colibri_edge.model.convert import convert
    from colibri_edge.serving.serve import create_app
    out = str(tmp_path / "m")
    convert(qwen35_gguf["qwen3_5_moe"][2], out, progress=False)
    with Engine.open(out, backend="cpu", max_seq_len=96, max_batch=3) as eng:
        want = eng.codec.decode(eng.generate("the quick brown fox", max_new_tokens=10, ignore_eos=True))
        with TestClient(create_app({"q35": eng})) as client:
            body = {"model": "q35", "prompt": "the quick brown fox", "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
            assert "".join(c["choices"][0]["text"] for c in chunks) == want
            text = client.get("/metrics").text
    assert 'colibri_state_slots_total{model="q35"} 3.0' in text
    assert 'colibri_state_slots_used{model="q35"} 0.0' in text


def test_cpu_decode_step_allocates_nothing(model_cache):
    """A hybrid model's decode step on cpu allocates nothing on the Python heap (the delta rule's scratch
    is the backend's, made once per head shape; the step's state slots ride in the arena's inputs)."""
    from helpers import peak_step_bytes
    _, col = convert_case(model_cache, "qwen3_5_moe")
    worst = peak_step_bytes(col)
    assert worst < 64 * 1024, f"a decode step peaked at {worst} bytes of Python/NumPy allocation"
