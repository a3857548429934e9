"""LoRA adapters (model/lora.py, runtime/lora.py): PEFT's PeftModel is the oracle. Adapters on attention
and on the fused experts (PEFT's target_parameters), merged at conversion and applied at run time,
equal PeftModel's logits on tiny hold-out families (Mixtral; Qwen2-MoE with its shared expert and dense
MLP adapted too; DeepSeek-V3's latent attention; Qwen3-MoE with rsLoRA and per-module rank / alpha
patterns); a batch mixing the base model and two adapters equals each request's solo run bit for bit;
malformed adapters are refused with the field named; serve addresses adapters as models."""
import json
import os
import shutil

import numpy as np
import pytest

from colibri_edge import COLIBRI_ERR_INVALID_ARGUMENT, ColibriError, Engine
from colibri_edge.errors import COLIBRI_ERR_INVALID_MODEL, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.model.convert import convert
from helpers import Server, fp32, need
from hf_models import build_hf, build_lora, build_text_model, hf_logits, peft_logits

pytest.importorskip("peft", reason="the test extra installs PEFT (the oracle)")

TOL = 1e-4                    # of the largest |logit|, float32
IDS = np.array([[3, 17, 5, 9, 22, 41, 7, 11, 2, 30, 19, 8]])
CASES = {
    "mixtral": {},
    # the shared expert and the dense MLP (layer 3) through target_modules, beside attention and experts
    "qwen2_moe": dict(targets=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "deepseek_v3": {},         # latent attention: q_a / q_b / kv_a_proj_with_mqa / o_proj
    "qwen3_moe": dict(use_rslora=True, rank_pattern={"o_proj": 2}, alpha_pattern={"q_proj": 5}),
}


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """case -> (hf dir, adapter dir, model dir, merged model dir, PEFT logits, base logits); built once."""
    root = tmp_path_factory.mktemp("lora")
    made = {}

    def get(case):
        if case not in made:
            hf, ad = str(root / f"hf_{case}"), str(root / f"lora_{case}")
            build_hf(hf, case)
            build_lora(hf, ad, **CASES[case])
            col, merged = str(root / f"col_{case}"), str(root / f"merged_{case}")
            convert(hf, col, progress=False)
            convert(hf, merged, progress=False, lora=ad)
            made[case] = (hf, ad, col, merged, peft_logits(hf, ad, IDS)[0], hf_logits(hf, IDS)[0])
        return made[case]
    return get


def err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_run_time_adapter_equals_peft(lora_models, case, backend):
    """infer(ids, adapter=...) equals PeftModel; without the adapter the engine is the base model still;
    the adapter changes the logits by far more than the tolerance (a no-op adapter could not pass)."""
    need(backend)
    hf, ad, col, _, want, base = lora_models(case)
    assert err(base, want) > 100 * TOL
    with Engine.open(col, backend=backend, adapters={"a": ad}, **fp32(backend)) as eng:
        assert err(eng.infer(IDS[0], adapter="a")[0], want) < TOL
        assert err(eng.infer(IDS[0])[0], base) < TOL
        info = eng.adapters()["a"]
        assert info["rank"] == 4 and info["bytes"] > 0 and info["path"] == ad


@pytest.mark.parametrize("case", CASES)
def test_merged_at_conversion_equals_peft(lora_models, case, backend_name):
    """colibri convert --lora: W + s B A in float32 at conversion; the merged model on every backend."""
    need(backend_name)
    _, _, _, merged, want, _ = lora_models(case)
    with Engine.open(merged, backend=backend_name, **fp32(backend_name)) as eng:
        assert err(eng.infer(IDS[0])[0], want) < TOL


def test_merged_scale_and_quantised(lora_models, tmp_path):
    """--lora-scale 0 writes the base model; a merge into int8 weights is the merged float model
    quantised (close to PEFT at int8's tolerance, far from the base)."""
    hf, ad, _, _, want, base = lora_models("mixtral")
    convert(hf, str(tmp_path / "s0"), progress=False, lora=ad, lora_scale=0.0)
    convert(hf, str(tmp_path / "q8"), progress=False, lora=ad, dtype="int8")
    with Engine.open(str(tmp_path / "s0"), backend="cpu") as eng:
        assert err(eng.infer(IDS[0])[0], base) < TOL
    with Engine.open(str(tmp_path / "q8"), backend="cpu") as eng:
        got = eng.infer(IDS[0])[0]
        assert err(got, want) < 0.05 < err(got, base)


def test_gpu_backends_take_merged_adapters_only(lora_models):
    """A backend without run-time LoRA refuses load_adapter with the way out (merge at conversion)."""
    need("opencl")
    _, ad, col, _, _, _ = lora_models("mixtral")
    with Engine.open(col, backend="opencl", **fp32("opencl")) as eng:
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("a", ad)
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "--lora" in e.value.message
        assert eng.adapters() == {}


def test_mixed_batch_equals_solo_runs(lora_models, tmp_path):
    """Base, adapter A and adapter B requests (and a seeded sampled one) submitted together, so that their
    prefills and decodes share steps: every token, logprob and top-5 equals the request's solo run bit for
    bit, on the cpu backend with its default int8 activations over int8 weights as well as in float32."""
    hf, ad, _, _, _, _ = lora_models("mixtral")
    ad_b = build_lora(hf, str(tmp_path / "b"), targets=["k_proj", "o_proj"], parameters=["experts.down_proj"],
                      seed=7, r=3, alpha=5)
    q8 = str(tmp_path / "q8")
    convert(hf, q8, progress=False, dtype="int8")
    prompts = [[3, 17, 5, 9, 22], [41, 7, 11, 2, 30, 19, 8], [5, 5, 6, 1], [12, 13, 14, 15, 16, 17, 18, 19, 20],
               [3, 17, 5, 9]]
    who = [None, "A", "B", "A", None]
    for model, opts in ((lora_models("mixtral")[2], fp32("cpu")), (q8, {})):
        with Engine.open(model, backend="cpu", max_batch=8, kv_block_size=4, adapters={"A": ad, "B": ad_b},
                         **opts) as eng:
            solo = []
            for p, a in zip(prompts, who):
                r = eng.submit(p, adapter=a, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
                solo.append([(ev.token, ev.logprob, tuple(ev.top_logprobs)) for ev in r.iter_events(timeout=120)
                             if ev.kind == "token"])
            sampled = [ev.token for ev in eng.submit(prompts[1], adapter="B", max_new_tokens=6, ignore_eos=True,
                                                     temperature=0.9, seed=5).iter_events(timeout=120)
                       if ev.kind == "token"]
            reqs = [eng.submit(p, adapter=a, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
                    for p, a in zip(prompts, who)]
            samp = eng.submit(prompts[1], adapter="B", max_new_tokens=6, ignore_eos=True, temperature=0.9, seed=5)
            mixed = [[(ev.token, ev.logprob, tuple(ev.top_logprobs)) for ev in r.iter_events(timeout=120)
                      if ev.kind == "token"] for r in reqs]
            assert [ev.token for ev in samp.iter_events(timeout=120) if ev.kind == "token"] == sampled
            assert len(sampled) == 6
            for s, m in zip(solo, mixed):
                assert s == m and len(m) == 6
            # the adapter does change the output: A's tokens on the base request's prompt differ
            base = [t for t, *_ in solo[4]]
            with_a = [ev.token for ev in eng.submit(prompts[4], adapter="A", max_new_tokens=6, ignore_eos=True)
                      .iter_events(timeout=120) if ev.kind == "token"]
            assert base != with_a


@pytest.mark.parametrize("half", [False, True])
def test_cpu_lora_ops_equal_numpy_and_every_row_alone(half):
    """The cpu backend's lora_pre / lora_down / lora_update (row tiles, explicit-vector dot products and
    fma rows, column chunks) equal base.Backend's NumPy definitions, float32 and float16 factors, at
    sizes with vector tails (K, N not multiples of 16); and each row's result is bit for bit the same
    computed alone as beside any other rows (batch invariance)."""
    need("cpu")
    from colibri_edge.backends.base import Backend as Base
    from colibri_edge.backends.cpu.backend import Backend
    from colibri_edge.runtime.lora import padded_rank
    be = Backend(num_threads=2)
    rng = np.random.default_rng(3)
    E, H, I, R, T, k = 5, 72, 101, padded_rank(5), 11, 2
    f = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in
         dict(ag=(E, R, H), bg=(E, R, I), bu=(E, R, I), ad=(E, R, I), bd=(E, R, H)).items()}
    f["au"] = np.zeros((0, R, 0), np.float32)
    if half:
        f = {n: v.astype(np.float16) for n, v in f.items()}
    x = rng.standard_normal((T, H)).astype(np.float32)
    choice = np.array([rng.choice(E, k, replace=False) for _ in range(T)]).reshape(-1)
    order = np.argsort(choice, kind="stable").astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(choice, minlength=E))]).astype(np.int64)
    tok = np.array([0, 1, -1, 0, 0, 1, 0, 0, -1, 0, 0], np.int32)          # two adapters and the base
    flat = rng.standard_normal(T * k * I).astype(np.float32)

    def run(b, tokad):
        pre, out = np.zeros((T * k, 2 * I), np.float32), np.zeros((T * k, H), np.float32)
        for i, rows in enumerate(b.lora_rows(order, k, tokad, offsets, 2)):
            b.lora_pre(pre, x, rows, f["ag"], f["bg"], f["au"], f["bu"])
            b.lora_down(out, flat, rows, offsets, I, f["ad"], f["bd"])
        return pre, out
    got, want = run(be, tok), run(Base(), tok)
    for g, w in zip(got, want):
        assert np.abs(w).max() > 1 and err(g, w) < 1e-5
    for t in range(T):                      # each token's rows alone
        alone = np.full(T, -1, np.int32)
        alone[t] = tok[t]
        rows = np.flatnonzero(order // k == t)
        for g, a in zip(got, run(be, alone)):
            assert np.array_equal(g[rows], a[rows])
    a, b_t = f["ag"][1], f["bg"][2]
    y = np.zeros((T, I), np.float32)
    be.lora_update(y, x, a, b_t, 0, T)
    w = np.zeros((T, I), np.float32)
    Base.lora_update(be, w, x, a, b_t, 0, T)
    assert err(y, w) < 1e-5
    for t in range(T):
        one = np.zeros((T, I), np.float32)
        be.lora_update(one, x, a, b_t, t, t + 1)
        assert np.array_equal(one[t], y[t])


def test_factor_precision_follows_the_weights(lora_models, tmp_path):
    """auto: float32 factors over float32 weights (the PEFT oracle's tolerance), float16 over int8 ones
    (half the bytes, logits within 1e-3 of float32 factors while the adapter moves them far more);
    factors float16 cannot hold stay float32 under auto and are refused under float16."""
    from safetensors.numpy import load_file, save_file
    hf, ad, col, _, _, _ = lora_models("mixtral")
    q8 = str(tmp_path / "q8")
    convert(hf, q8, progress=False, dtype="int8")
    with Engine.open(col, backend="cpu", adapters={"A": ad}) as eng:
        assert eng.adapters()["A"]["dtype"] == "float32"
    out = {}
    for dt in ("auto", "float32"):
        with Engine.open(q8, backend="cpu", adapters={"A": ad}, adapter_dtype=dt) as eng:
            out[dt] = (eng.adapters()["A"], eng.infer(IDS[0], adapter="A"), eng.infer(IDS[0]))
    (half, lh, base), (full, lf, _) = out["auto"], out["float32"]
    assert half["dtype"] == "float16" and full["dtype"] == "float32"
    assert half["bytes"] * 2 == full["bytes"]
    assert err(lh, lf) <= 1e-3 < 0.01 <= err(lf, base)
    t = load_file(os.path.join(ad, "adapter_model.safetensors"))
    big = _copy(ad, str(tmp_path / "big"))
    save_file({k: v * np.float32(1e7) if "lora_B" in k else v for k, v in t.items()},
              os.path.join(big, "adapter_model.safetensors"))
    with Engine.open(q8, backend="cpu") as eng:
        assert eng.load_adapter("big", big)["dtype"] == "float32"
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("big16", big, dtype="float16")
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "float16" in e.value.message
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("x", ad, dtype="int4")
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "float16" in e.value.message
        assert set(eng.adapters()) == {"big"}


def test_prefix_cache_is_keyed_by_adapter(lora_models):
    """A prompt cached by the base model is not reused by an adapter's request (its KV differs), and an
    adapter's cached prompt is reused by that adapter only; outputs equal a fresh engine's."""
    _, ad, col, _, _, _ = lora_models("mixtral")
    p = [3, 17, 5, 9, 22, 41, 7, 11, 2, 30, 19, 8, 6]
    opts = dict(backend="cpu", max_batch=2, kv_block_size=4, adapters={"A": ad}, **fp32("cpu"))
    with Engine.open(col, **opts) as fresh:
        want_a = run_logprobs_adapter(fresh, p, "A")[1]
    with Engine.open(col, **opts) as eng:
        r0, _ = run_logprobs_adapter(eng, p, None)
        r1, out1 = run_logprobs_adapter(eng, p, "A")
        assert r1.cached_tokens == 0 and out1 == want_a
        r2, out2 = run_logprobs_adapter(eng, p, "A")
        assert r2.cached_tokens == 12 and out2 == want_a


def run_logprobs_adapter(eng, prompt, adapter, n=4):
    req = eng.submit(prompt, adapter=adapter, max_new_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=5)
    return req, [(ev.token, ev.logprob, tuple(ev.top_logprobs)) for ev in req.iter_events(timeout=120)
                 if ev.kind == "token"]


def test_load_unload_and_errors(lora_models, tmp_path):
    """Adapters load and unload while the engine runs; unknown names, duplicates and an adapter over the
    memory budget are coded errors with what to do."""
    _, ad, col, _, want, base = lora_models("mixtral")
    with Engine.open(col, backend="cpu", **fp32("cpu")) as eng:
        with pytest.raises(ColibriError) as e:
            eng.infer(IDS[0], adapter="A")
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "load_adapter" in e.value.message
        eng.load_adapter("A", ad)
        assert err(eng.infer(IDS[0], adapter="A")[0], want) < TOL
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("A", ad)
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "unload_adapter" in e.value.message
        with pytest.raises(ColibriError) as e:
            eng.generate([1, 2, 3], adapter="nope")
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "'nope'" in e.value.message
        eng.unload_adapter("A")
        assert eng.adapters() == {}
        with pytest.raises(ColibriError):
            eng.infer(IDS[0], adapter="A")
        eng.load_adapter("A", ad, scale=0.0)                   # a zero scale: the base model
        assert err(eng.infer(IDS[0], adapter="A")[0], base) < TOL
    with Engine.open(col, backend="cpu", max_batch=1, max_seq_len=32, **fp32("cpu")) as eng:
        budget = eng.runner.memory_need + 1000
    with Engine.open(col, backend="cpu", max_batch=1, max_seq_len=32, memory_budget=budget) as eng:
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("A", ad)
        assert e.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "budget" in e.value.message
        assert eng.adapters() == {}


def _copy(ad, dst, **cfg_changes):
    shutil.copytree(ad, dst)
    path = os.path.join(dst, "adapter_config.json")
    c = json.load(open(path))
    c.update(cfg_changes)
    json.dump(c, open(path, "w"))
    return dst


@pytest.mark.parametrize("field,value", [("peft_type", "IA3"), ("use_dora", True), ("r", -2), ("lora_alpha", "x"),
                                         ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": "two"}),
                                         ("lora_bias", True)])
def test_malformed_adapter_refused_with_its_field(lora_models, tmp_path, field, value):
    _, ad, col, _, _, _ = lora_models("mixtral")
    bad = _copy(ad, str(tmp_path / "bad"), **{field: value})
    with Engine.open(col, backend="cpu") as eng:
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("x", bad)
        assert e.value.code == COLIBRI_ERR_INVALID_MODEL and f"'{field}'" in e.value.message
    with pytest.raises(ColibriError) as e:
        convert(lora_models("mixtral")[0], str(tmp_path / "out"), progress=False, lora=bad)
    assert f"'{field}'" in e.value.message


def test_damaged_or_foreign_tensors_refused(lora_models, tmp_path):
    """A missing lora_B, a factor of the wrong shape for this model and an adapter of another model are
    refused at load, named; a missing directory too."""
    from safetensors.numpy import load_file, save_file
    hf, ad, col, _, _, _ = lora_models("mixtral")
    t = load_file(os.path.join(ad, "adapter_model.safetensors"))
    key = next(k for k in t if k.endswith("q_proj.lora_B.weight"))
    cases = {"missing": {k: v for k, v in t.items() if k != key},
             "shape": {**t, key: np.zeros((7, t[key].shape[1]), np.float32)},
             "nan": {**t, key: np.full_like(t[key], np.nan)}}
    with Engine.open(col, backend="cpu") as eng:
        for what, tensors in cases.items():
            d = _copy(ad, str(tmp_path / what))
            save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
            with pytest.raises(ColibriError) as e:
                eng.load_adapter(what, d)
            assert "q_proj" in e.value.message, what
        other = str(tmp_path / "other_hf")
        build_hf(other, "qwen3_moe")
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("other", build_lora(other, str(tmp_path / "other")))
        assert e.value.code in (COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL)
        with pytest.raises(ColibriError) as e:
            eng.load_adapter("none", str(tmp_path / "nowhere"))
        assert e.value.code == COLIBRI_ERR_INVALID_MODEL and "adapter_config.json" in e.value.message
        assert eng.adapters() == {}


def test_per_expert_modules_of_older_checkpoints(lora_models, tmp_path):
    """An adapter trained on per-expert Linear modules (transformers 4's Mixtral: experts.N.w1/w2/w3) is
    read too: judged against transformers on the checkpoint with W + s B A written into it by hand."""
    import torch
    from safetensors.numpy import save_file
    from safetensors.torch import load_file as load_torch, save_file as save_torch
    hf, _, col, _, _, _ = lora_models("mixtral")
    rng = np.random.default_rng(3)
    r, alpha = 2, 6.0
    tensors, merged = {}, load_torch(os.path.join(hf, "model.safetensors"))
    for layer in range(2):
        for j in range(4):
            for w, (o, i) in {"w1": (48, 64), "w3": (48, 64), "w2": (64, 48)}.items():
                m = f"model.layers.{layer}.block_sparse_moe.experts.{j}.{w}"
                a = rng.normal(0, 0.2, (r, i)).astype(np.float32)
                b = rng.normal(0, 0.2, (o, r)).astype(np.float32)
                tensors[f"base_model.model.{m}.lora_A.weight"], tensors[f"base_model.model.{m}.lora_B.weight"] = a, b
                merged[m + ".weight"] = merged[m + ".weight"] + torch.from_numpy(alpha / r * b @ a)
    ad = str(tmp_path / "per_expert")
    os.makedirs(ad)
    save_file(tensors, os.path.join(ad, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["w1", "w2", "w3"]},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    oracle = str(tmp_path / "oracle")
    shutil.copytree(hf, oracle)
    save_torch(merged, os.path.join(oracle, "model.safetensors"), metadata={"format": "pt"})
    want = hf_logits(oracle, IDS)[0]
    with Engine.open(col, backend="cpu", adapters={"e": ad}, **fp32("cpu")) as eng:
        assert err(eng.infer(IDS[0], adapter="e")[0], want) < TOL


def test_serve_adapters_as_models(tmp_path):
    """serve --lora NAME=DIR: /v1/models lists the adapter with its parent; a completion for model NAME
    equals Engine.stream(adapter=NAME) and the base model's its own; an unknown model is a 404 naming
    what is served."""
    pytest.importorskip("fastapi", reason="make test installs the serve extra")
    import httpx
    from colibri_edge.serving.serve import create_app
    hf, col, _ = build_text_model(tmp_path, "mixtral")
    ad = build_lora(hf, str(tmp_path / "ad"), std=0.4)
    prompt = "The cat sat"
    with Engine.open(col, backend="cpu", max_seq_len=64, adapters={"tenant-a": ad}) as eng:
        want = {m: "".join(eng.stream(prompt, adapter=a, max_new_tokens=6, ignore_eos=True))
                for m, a in (("tenant-a", "tenant-a"), ("base", None))}
        assert want["tenant-a"] != want["base"]
        with Server(create_app({"base": eng}, adapters={"tenant-a": "base"})) as srv:
            models = httpx.get(srv.url + "/v1/models").json()["data"]
            card = next(m for m in models if m["id"] == "tenant-a")
            assert card["parent"] == "base" and card["root"] == ad and card["lora"]["rank"] == 4
            for model, text in want.items():
                r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                                   "ignore_eos": True, "temperature": 0}, timeout=60)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == text and r.json()["model"] == model
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tenant-b", "prompt": "hi"}, timeout=60)
            assert r.status_code == 404 and "tenant-a" in r.json()["error"]["message"]


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_gguf_adapter_from_llama_cpp(case, tmp_path):
    """llama.cpp's own convert_lora_to_gguf.py output of a PEFT adapter (attention: its converter does not
    take PEFT's fused expert parameters), applied at run time to the model converted from llama.cpp's
    GGUF of the same checkpoint (Mixtral is llama.cpp's llama arch: q/k rows permuted in both files,
    un-permuted here), equals PeftModel; without it, the base model."""
    pytest.importorskip("gguf", reason="make test installs the gguf extra")
    import gguf_models
    import llamacpp_convert
    hf = gguf_models.hf_case(case)
    ad = build_lora(str(hf), str(tmp_path / "ad"), targets=["q_proj", "k_proj", "v_proj", "o_proj"], parameters=[])
    lora = llamacpp_convert.convert_lora(hf, ad, tmp_path / "lora.gguf")
    col = str(tmp_path / "col")
    convert(str(gguf_models.gguf_case(case).gguf), col, progress=False)
    ids = IDS[:, :8]
    want, base = peft_logits(str(hf), ad, ids)[0], hf_logits(str(hf), ids)[0]
    assert err(base, want) > 100 * TOL
    with Engine.open(col, backend="cpu", adapters={"g": str(lora)}, **fp32("cpu"), int8_activations=False) as eng:
        assert err(eng.infer(ids[0], adapter="g")[0], want) < TOL
        assert err(eng.infer(ids[0])[0], base) < TOL


def test_adapter_fuzz_only_coded_errors(lora_models, tmp_path):
    """300 random mutations of an adapter (config values of every JSON type, dropped and reshaped
    factors, other dtypes, truncated files): loading either works or raises ColibriError with a code,
    never another exception; the engine keeps serving the base model and a good adapter meanwhile."""
    from safetensors.numpy import load_file, save_file
    _, ad, col, _, want, base = lora_models("mixtral")
    good = load_file(os.path.join(ad, "adapter_model.safetensors"))
    cfg0 = json.load(open(os.path.join(ad, "adapter_config.json")))
    rng = np.random.default_rng(7)
    values = [None, True, 0, -1, 3, 1e9, 0.5, "x", "LORA", [], ["q_proj"], {}, {"q_proj": 2}, {"(": 1}]
    keys = sorted(good)
    with Engine.open(col, backend="cpu", adapters={"ok": ad}, **fp32("cpu")) as eng:
        for n in range(300):
            d = str(tmp_path / f"m{n}")
            os.makedirs(d)
            cfg, tensors = dict(cfg0), dict(good)
            kind = n % 4
            if kind == 0:
                cfg[str(rng.choice(sorted(cfg0) + ["r", "lora_alpha", "peft_type"]))] = values[rng.integers(len(values))]
            elif kind == 1:
                k = keys[rng.integers(len(keys))]
                t = tensors[k]
                tensors[k] = rng.standard_normal((int(rng.integers(1, 9)), t.shape[1])).astype(
                    [np.float32, np.float16, np.float64][rng.integers(3)])
            elif kind == 2:
                del tensors[keys[rng.integers(len(keys))]]
            json.dump(cfg, open(os.path.join(d, "adapter_config.json"), "w"))
            save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
            if kind == 3:
                path = os.path.join(d, "adapter_model.safetensors")
                raw = open(path, "rb").read()
                open(path, "wb").write(raw[:int(rng.integers(0, len(raw)))])
            try:
                eng.load_adapter(f"m{n}", d)
                eng.unload_adapter(f"m{n}")
            except ColibriError as e:
                assert e.code in (COLIBRI_ERR_INVALID_MODEL, COLIBRI_ERR_INVALID_ARGUMENT), e
        assert set(eng.adapters()) == {"ok"}
        assert err(eng.infer(IDS[0], adapter="ok")[0], want) < TOL
        assert err(eng.infer(IDS[0])[0], base) < TOL
