"""Expert slot pool, routing traces, the simulator and routing statistics."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.analysis.simulate import replay
from colibri_edge.analysis.trace import Trace, routing_stats
from helpers import fp32
from hf_models import convert_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 3, 42, 8, 11, 29, 2, 60, 61], [7, 7, 1], [90, 12, 33, 4, 4, 4, 81]]


@pytest.mark.parametrize("policy", ["lru", "lfu", "prefetch"])
def test_results_never_depend_on_slots_or_policy(backend_name, policy, model_cache):
    _, col = convert_case(model_cache, "olmoe")          # 2 MoE layers x 8 experts, top-2
    ids = np.random.default_rng(0).integers(0, 99, size=(2, 12))
    with Engine.open(col, backend=backend_name, **fp32(backend_name)) as e:
        want = e.infer(ids)
        want_gen = e.generate(PROMPTS[0], max_new_tokens=10, ignore_eos=True)
    for slots in (16, 5, 2):                             # all, in between, top_k
        with Engine.open(col, backend=backend_name, expert_slots=slots, slot_policy=policy, **fp32(backend_name)) as e:
            np.testing.assert_array_equal(e.infer(ids), want)
            assert e.generate(PROMPTS[0], max_new_tokens=10, ignore_eos=True) == want_gen
            st = e.slot_stats
            assert st["resident_bytes"] <= slots * e.trace_meta()["bytes_per_expert"]
            assert st["misses"] > 0 and st["bytes_loaded"] == \
                (st["misses"] + st["prefetches"]) * e.trace_meta()["bytes_per_expert"]


def test_kernels_read_the_slots(model_cache):
    """Scribbling over a slot the next input does not use changes nothing; over one it uses does."""
    _, col = convert_case(model_cache, "olmoe")
    a, b = np.array([3, 1, 4, 1, 5]), np.array([9, 2, 6, 5, 3, 5])
    with Engine.open(col, backend="cpu" if _has("cpu") else "reference", expert_slots=16) as e:
        e.infer(a)                                        # warm: some experts resident
        tr = e.trace([b])                                  # which experts b uses (all hits or loads)
        want = e.infer(b)
        used = {(int(l), int(x)) for j, l in enumerate(tr.layer_ids) for x in np.unique(tr.expert_ids[:, j])}
        pool = e.runner.slot_pool
        assert pool.buf.shape == (16, pool.row_bytes)     # the pool's memory is N blobs, each rounded up to a page
        assert 0 <= pool.row_bytes - pool.blob_bytes < 4096 and pool.row_bytes % 4096 == 0
        unused = [s for k, s in pool.cache.where.items() if k not in used]
        for s in unused:
            pool.buf[s] = 0xFF                             # NaN everywhere in float32
        np.testing.assert_array_equal(e.infer(b), want)
        pool.buf[pool.cache.where[sorted(used)[0]]] = 0
        assert not np.array_equal(e.infer(b), want)


def _has(name):
    from colibri_edge.backends import probe
    return probe(name)[0]


@pytest.mark.parametrize("policy", ["lru", "lfu", "prefetch"])
@pytest.mark.parametrize("slots", [2, 5, 11])
def test_simulate_equals_engine_counters(policy, slots, model_cache):
    _, col = convert_case(model_cache, "olmoe")
    with Engine.open(col, backend="reference", expert_slots=slots, slot_policy=policy, max_batch=2,
                     prefill_chunk=8) as e:
        tr = e.trace(PROMPTS, max_new_tokens=6, ignore_eos=True)   # prefill (chunked) and decode steps
        engine_counts = e.slot_stats
    sim = replay(tr, slots, policy, pinned=engine_counts["pinned_keys"])   # an earlier test's heat may pin some
    for f in ("hits", "misses", "cold_misses", "evictions", "prefetch_hits"):
        assert sim[f] == engine_counts[f], (f, sim, engine_counts)
    assert sim["bytes_moved"] == engine_counts["bytes_loaded"]


def _random_trace(seed, T=300, L=3, E=8, k=2, skew=1.5):
    rng = np.random.default_rng(seed)
    p = np.arange(1, E + 1, dtype=float) ** -skew
    p /= p.sum()
    ids = np.stack([np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(T)]) for _ in range(L)], 1)
    steps = np.repeat(np.arange(T // 3), 3)[:T]
    meta = {"top_k": k, "experts_per_layer": E, "bytes_per_expert": 1000}
    return Trace(ids.astype(np.int16), np.full(ids.shape, 0.5, np.float32), np.zeros(T, np.int32),
                 np.arange(T, dtype=np.int32), steps.astype(np.int32), np.arange(L, dtype=np.int32),
                 np.full(ids.shape, -1, np.int16), meta)


@pytest.mark.parametrize("seed", range(5))
def test_belady_bounds_lru_and_lfu_on_random_traces(seed):
    tr = _random_trace(seed)
    for slots in (2, 4, 7, 12, 20):
        b = replay(tr, slots, "belady")["misses"]
        assert b <= replay(tr, slots, "lru")["misses"] and b <= replay(tr, slots, "lfu")["misses"]


def test_cold_misses_are_first_loads():
    """A demand-loading policy's cold misses are the distinct (layer, expert) keys of the trace (each is
    read from storage once, then only re-read after an eviction); with room for every key, every miss
    is cold. The estimate charges the others at the re-read rate."""
    from colibri_edge.analysis.simulate import estimate
    tr = _random_trace(7)
    distinct = len({(j, int(x)) for j in range(3) for x in np.unique(tr.expert_ids[:, j])})
    for policy in ("lru", "lfu", "belady"):
        for slots in (2, 5, 24):
            r = replay(tr, slots, policy)
            assert r["cold_misses"] == distinct, (policy, slots, r)
            assert r["misses"] > distinct if slots < distinct else r["misses"] == distinct
    tr.meta.update(bytes_per_decoded_token=0, non_expert_bytes=0, kv_bytes_per_token=0)
    r = replay(tr, 2, "lru")
    prof = {"memory_bytes": 1 << 30, "memory_bandwidth_gbs": 1.0, "miss_bandwidth_gbs": 1.0}
    slow = estimate(r, tr, prof, 16)["est_miss_ms"]
    fast = estimate(r, tr, {**prof, "reread_bandwidth_gbs": 4.0}, 16)["est_miss_ms"]
    n, cold = r["misses"], r["cold_misses"]
    assert np.isclose(fast / slow, (cold + (n - cold) / 4) / n, rtol=1e-9)


def test_belady_bounds_on_a_real_trace(model_cache):
    _, col = convert_case(model_cache, "olmoe")
    with Engine.open(col, backend="reference") as e:
        tr = e.trace(PROMPTS, max_new_tokens=10, ignore_eos=True)
    for slots in range(2, 17):
        b = replay(tr, slots, "belady")["misses"]
        assert b <= replay(tr, slots, "lru")["misses"] and b <= replay(tr, slots, "lfu")["misses"]
    assert replay(tr, 16, "lru")["misses"] == 16 or replay(tr, 16, "lru")["misses"] == \
        len({(j, int(x)) for j in range(2) for x in np.unique(tr.expert_ids[:, j])})


def test_trace_matches_transformers_router(model_cache):
    """Trace expert ids == top-k of transformers' router logits wherever there is no near-tie."""
    import torch
    from transformers import AutoModelForCausalLM
    hf, col = convert_case(model_cache, "olmoe")
    ids = PROMPTS[0]
    with Engine.open(col, backend="reference") as e:
        tr = e.trace([ids])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    checked = 0
    for j, logits in enumerate(out.router_logits):
        p = torch.softmax(logits.float(), -1).numpy()
        order = np.argsort(-p, axis=-1, kind="stable")
        for t in range(len(ids)):
            srt = p[t, order[t]]
            if np.min(np.abs(np.diff(srt[:3]))) < 1e-5:
                continue                                       # near-tie: either choice is right
            assert list(tr.expert_ids[t, j]) == list(order[t, :2]), (t, j)
            checked += 1
    assert checked >= len(ids)


def test_trace_file_round_trip_and_fields(model_cache, tmp_path):
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend="reference") as e:
        tr = e.trace(PROMPTS[:2], max_new_tokens=3, ignore_eos=True)
    tr.save(tmp_path / "t.npz")
    z = np.load(tmp_path / "t.npz")
    T = 10 + 3 + 2 * 2          # one prefill step of both prompts, then 2 decode steps of 2 tokens
    assert z["expert_ids"].dtype == np.int16 and z["expert_ids"].shape == (T, 2, 2)
    assert z["weights"].dtype == np.float32 and z["weights"].shape == (T, 2, 2)
    for f in ("seq_ids", "positions", "step_ids"):
        assert z[f].dtype == np.int32 and z[f].shape == (T,)
    assert z["layer_ids"].tolist() == [0, 2]                # layer 1 is dense (mlp_only_layers)
    meta = json.loads(str(z["meta"]))
    assert {"model", "backend", "top_k", "experts_per_layer", "bytes_per_expert"} <= set(meta)
    assert z["step_ids"].tolist() == [0] * 13 + [1, 1, 2, 2]
    assert z["positions"].tolist()[13:] == [10, 3, 11, 4]
    np.testing.assert_allclose(z["weights"].sum(-1), 1.0, rtol=1e-5)   # norm_topk_prob


def test_cli_trace_simulate_stats(model_cache, tmp_path):
    _, col = convert_case(model_cache, "olmoe")
    (tmp_path / "p.txt").write_text("1 2 3 4 5\n9 8 7\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "colibri_edge", *a], capture_output=True, text=True,
                                    cwd=ROOT)
    r = run("trace", "--model", col, "--prompts", str(tmp_path / "p.txt"), "--ids", "--out",
            str(tmp_path / "t.npz"), "--max-new-tokens", "4", "--backend", "reference")
    assert r.returncode == 0, r.stderr
    r = run("simulate", "--trace", str(tmp_path / "t.npz"), "--slots", "5", "--policy", "lru", "--json",
            "--device", "rk3588")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for f in ("hits", "misses", "hit_rate", "bytes_moved", "policy", "slots", "est_ms_per_token", "fits"):
        assert f in res
    assert res["est_ms_per_token"] > 0 and res["policy"] == "lru" and res["slots"] == 5
    r = run("simulate", "--trace", str(tmp_path / "t.npz"), "--sweep", "--policy", "lru,belady", "--plot",
            str(tmp_path / "s.png"))
    assert r.returncode == 0 and (tmp_path / "s.png").stat().st_size > 1000, r.stderr
    r = run("stats", str(tmp_path / "t.npz"), "--plot", str(tmp_path / "h.png"))
    assert r.returncode == 0 and "imbalance" in r.stdout and (tmp_path / "h.png").exists(), r.stderr
    r = run("trace", "--model", col, "--prompts", str(tmp_path / "p.txt"), "--ids", "--out",
            str(tmp_path / "bare"), "--backend", "reference")          # a name without .npz: written as named
    assert r.returncode == 0 and f"wrote {tmp_path / 'bare'}:" in r.stdout and (tmp_path / "bare").is_file()
    assert run("simulate", "--trace", str(tmp_path / "bare"), "--slots", "5").returncode == 0
    for device in ("mali-g78-phone", "jetson-orin", "a100-pcie4"):
        r = run("simulate", "--trace", str(tmp_path / "t.npz"), "--slots", "4", "--device", device, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["fits"] is True


def test_routing_stats_on_skewed_trace():
    tr = _random_trace(0, skew=2.0)
    st = routing_stats(tr)
    for l in st["layers"]:
        assert l["imbalance"] > 1.5 and l["entropy_bits"] < l["max_entropy_bits"]
        assert sum(l["load"]) == 300 * 2
        assert np.array(l["coactivation"]).sum() == 300 * 2     # each token: one pair, counted both ways


@pytest.mark.parametrize("policy", ["lru", "prefetch"])
def test_slots_trace_and_simulate_on_ernie(backend_name, policy, model_cache):
    """ERNIE-4.5 (top-4 of 6 with a choice-only bias, two shared experts, dense first and last layers)
    through the slot pool: results equal all-resident (prefetch predicts with the next layer's bias),
    only routed experts occupy slots (shared experts and dense MLPs stay resident), the trace holds the
    MoE layers only, and the simulator replays the engine's counters exactly."""
    _, col = convert_case(model_cache, "ernie4_5_moe")
    ids = np.random.default_rng(2).integers(0, 93, size=(2, 9))
    with Engine.open(col, backend=backend_name, **fp32(backend_name)) as e:
        want, want_gen = e.infer(ids), e.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)
    with Engine.open(col, backend=backend_name, expert_slots=4, slot_policy=policy, **fp32(backend_name)) as e:
        np.testing.assert_array_equal(e.infer(ids), want)
        assert e.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True) == want_gen
        bpe = e.trace_meta()["bytes_per_expert"]
        assert e.slot_stats["resident_bytes"] <= 4 * bpe
    with Engine.open(col, backend=backend_name, expert_slots=4, slot_policy=policy, max_batch=2, prefill_chunk=8,
                     **fp32(backend_name)) as e:
        tr = e.trace(PROMPTS, max_new_tokens=5, ignore_eos=True)
        counts = e.slot_stats
    assert tr.layer_ids.tolist() == [1, 2] and tr.expert_ids.shape[2] == 4
    sim = replay(tr, 4, policy, pinned=counts["pinned_keys"])   # an earlier run's hot set
    for f in ("hits", "misses", "evictions", "prefetch_hits"):
        assert sim[f] == counts[f], (f, sim, counts)


DEMO_PROMPTS = ["The Python interpreter", "Once upon a time", "In the beginning the Universe was created.",
                "A computer is a machine", "The quick brown fox", "It was a dark and stormy night",
                "To be or not to be", "Science is organized knowledge."]


def test_prefetch_moves_no_more_than_lru_and_stalls_less():
    """The demo model's trace (8 prompts + 64 tokens each, one sequence at a time): prefetch (the next
    layer's predicted experts protected from eviction, loaded when predicted with weight >=
    slots.PREFETCH_MIN_P) moves about the bytes demand-loading lru moves (the chat-tuned demo model:
    1.000x, 1.019x, 1.002x) and stalls on a quarter fewer misses (-25%, -26%, -32%), at 12, 16 and 24
    of the 32 slots; loading every predicted expert instead (min_p 0) moves more than lru. The trace
    records the predicted weights it needs (a trace without them prefetches every predicted expert)."""
    from colibri_edge.model.demo import ensure_default_model
    with Engine.open(ensure_default_model()[0], backend="reference", max_batch=1) as e:   # one stream
        tr = e.trace(DEMO_PROMPTS, max_new_tokens=64, ignore_eos=True)
    assert tr.predicted_weights is not None and tr.predicted_weights.shape == tr.predicted_ids.shape
    for slots in (12, 16, 24):
        lru, pre = replay(tr, slots, "lru"), replay(tr, slots, "prefetch")
        assert pre["bytes_moved"] <= 1.025 * lru["bytes_moved"] and pre["misses"] <= 0.8 * lru["misses"], \
            (slots, lru, pre)
    assert replay(tr, 12, "prefetch", min_p=0.0)["bytes_moved"] > replay(tr, 12, "lru")["bytes_moved"]


def test_auto_slots_fill_the_free_memory(monkeypatch):
    """expert_slots="auto" (COLIBRI_EXPERT_SLOTS=auto): as many slots as the free memory holds after the
    non-expert weights, arena, KV cache and headroom (here the memory budget is the free memory, and
    the headroom 10% without its 128 MiB floor, so that the demo model's 32 experts of 576 KiB do not
    all fit); the logits equal the all-resident engine's; all resident when everything fits; a coded
    error naming the numbers when not even a token's experts fit."""
    from colibri_edge.runtime import runner
    from colibri_edge import ColibriError, COLIBRI_ERR_OUT_OF_MEMORY
    from colibri_edge.model.demo import ensure_default_model
    monkeypatch.setattr(runner, "AUTO_HEADROOM_MIN", 0)
    path = ensure_default_model()[0]
    ids = np.array([[5, 17, 3, 42, 8, 11, 29, 2, 60, 61, 7, 7]])
    with Engine.open(path, backend="reference", max_seq_len=64) as e:
        want = e.infer(ids)
        fixed = sum(r["nbytes"] for r in e.model.tensors.values()) + e.runner.arena_bytes + \
            sum(4 * int(np.prod(s)) for s in e.runner.states.storage().values())
        blob = max(x.weight_size for x in e.model.experts)
    budget = int((fixed + 12.5 * blob) / 0.9)                   # room for 12 slots after a 10% headroom
    monkeypatch.setenv("COLIBRI_EXPERT_SLOTS", "auto")
    with Engine.open(path, backend="reference", max_seq_len=64, memory_budget=budget) as e:
        n = e.slot_choice["slots"]
        assert n == e.runner.slot_pool.cache.n and "12 of 32 experts" in e.slot_choice["why"]
        assert fixed + n * blob + 0.1 * budget <= budget < fixed + (n + 1) * blob + 0.1 * budget
        np.testing.assert_array_equal(e.infer(ids), want)
    with Engine.open(path, backend="reference", max_seq_len=64) as e:   # the machine's memory: all fit
        assert e.slot_choice["slots"] is None and e.runner.slot_pool is None
        assert "all 32 experts fit" in e.slot_choice["why"]
    with pytest.raises(ColibriError) as ei:
        Engine.open(path, backend="reference", max_seq_len=64, memory_budget=int((fixed + blob) / 0.9))
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "fewer than the 2 a token needs" in ei.value.message


def test_probe_device_then_simulate_this(model_cache, tmp_path):
    """`colibri probe-device` measures this machine (the cpu GEMV's read rate, storage reads of blob size
    with the page cache dropped and again cached, buffered against direct with reads in flight, the demo
    model's overhead a layer) into a profile that `simulate --device this` uses: its estimate is the
    profile's formula on the trace's numbers."""
    _, col = convert_case(model_cache, "olmoe")
    env = dict(os.environ, COLIBRI_CACHE=str(tmp_path / "cache"))
    run = lambda *a: subprocess.run([sys.executable, "-m", "colibri_edge", *a], capture_output=True, text=True,
                                    cwd=ROOT, env=env, timeout=600)
    (tmp_path / "p.txt").write_text("1 2 3 4 5\n9 8 7\n")
    r = run("trace", "--model", col, "--prompts", str(tmp_path / "p.txt"), "--ids", "--out",
            str(tmp_path / "t.npz"), "--max-new-tokens", "4", "--backend", "reference")
    assert r.returncode == 0, r.stderr
    r = run("simulate", "--trace", str(tmp_path / "t.npz"), "--slots", "4", "--device", "this")
    assert r.returncode != 0 and "run `colibri probe-device` first" in r.stderr, r.stderr
    r = run("probe-device", "--dir", str(tmp_path), "--mem-mib", "64", "--file-mib", "16", "--blob", str(1 << 20))
    assert r.returncode == 0, r.stderr
    prof = json.load(open(tmp_path / "cache" / "device-this.json"))
    for f in ("memory_bandwidth_gbs", "miss_bandwidth_gbs", "reread_bandwidth_gbs", "page_cache_gbs", "memory_bytes"):
        assert prof[f] > 0, (f, prof)
    assert prof["layer_overhead_ms"] >= 0 and prof["blob_bytes"] == 1 << 20
    assert not [p for p in os.listdir(tmp_path) if p.startswith("colibri-probe-")]     # its file is gone
    r = run("simulate", "--trace", str(tmp_path / "t.npz"), "--slots", "4", "--policy", "lru", "--json",
            "--device", "this")
    assert r.returncode == 0, r.stderr
    res, m = json.loads(r.stdout), Trace.load(str(tmp_path / "t.npz")).meta
    # 4 slots for olmoe's 2 layers x top-2: some experts miss, are evicted and miss again (re-reads)
    assert 0 < res["cold_misses"] < res["misses"], res
    # the misses priced as the pool spends them: issued together, one landing every blob / io rate (the
    # direct rate where probe-device chose direct reads, else its parallel buffered rate), the resident
    # experts computed meanwhile, each landed one after the compute before it
    d = prof["direct_io"]
    assert d["buffered_gbs"] > 0 and (d["direct_gbs"] is None or d["direct_gbs"] > 0) and isinstance(d["use"], bool)
    io = d["direct_gbs"] if d["use"] else prof["parallel_miss_bandwidth_gbs"]
    c = m["bytes_per_expert"] / (prof["memory_bandwidth_gbs"] * 1e9)
    ld = m["bytes_per_expert"] / (io * 1e9)
    stall = 0.0
    for h, k, n in res["wave_events"]:
        done = [h * c]                                    # when the compute thread is free
        for i in range(1, k + 1):
            done.append(max(done[-1], i * ld) + c)
        stall += n * (done[-1] - (h + k) * c)
    assert sum(n * k for _, k, n in res["wave_events"]) == res["misses"]
    want = 1e3 * (m["bytes_per_decoded_token"] / (prof["memory_bandwidth_gbs"] * 1e9) + stall / res["tokens"]) + \
        prof["layer_overhead_ms"] * m["num_hidden_layers"]
    assert res["device"] == prof["name"] and np.isclose(res["est_ms_per_token"], want, rtol=1e-9)


def test_simulate_recommends_the_fewest_slots_for_a_target(tmp_path):
    """simulate --target-ms: the fewest slots whose estimate on the device is within the target (one
    fewer is over it), fitting its memory; an unreachable target says so."""
    from colibri_edge.analysis.simulate import estimate, recommend
    tr = _random_trace(3, skew=1.0)
    tr.meta.update(bytes_per_expert=8 << 20, bytes_per_decoded_token=100 << 20, non_expert_bytes=50 << 20,
                   kv_bytes_per_token=1 << 10, num_hidden_layers=3)
    prof = {"name": "t", "memory_bytes": 4 << 30, "memory_bandwidth_gbs": 20.0, "miss_bandwidth_gbs": 1.0}
    est = lambda n: estimate(replay(tr, n, "lru"), tr, prof, 1024)["est_ms_per_token"]     # noqa: E731
    target = (est(12) + est(13)) / 2                                 # the estimate falls from 7 slots on
    r = recommend(tr, prof, "lru", target, 1024)
    assert r["met"] and r["est_ms_per_token"] <= target and r["fits"]
    assert est(r["slots"] - 1) > target
    miss = recommend(tr, prof, "lru", est(24) / 2, 1024)              # below even all resident
    assert not miss["met"] and miss["slots"] == 24
    small = dict(prof, memory_bytes=60 << 20)                         # nothing but the weights fits
    assert not recommend(tr, small, "lru", 1e9, 1024)["met"]
    tr.save(str(tmp_path / "t.npz"))
    r2 = subprocess.run([sys.executable, "-m", "colibri_edge", "simulate", "--trace", str(tmp_path / "t.npz"),
                         "--device", "rk3588", "--target-ms", "1000"], capture_output=True, text=True, cwd=ROOT)
    assert r2.returncode == 0 and "slots meets 1000.0 ms/token" in r2.stdout, r2.stderr


# -- streaming: the I/O pool, direct reads, the learned hot set (issue 50) -----------------------------
def _direct_ok(path):
    """Whether this filesystem takes O_DIRECT (tmpfs does not): the pool then says why it reads buffered."""
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("io_threads,direct", [(0, "off"), (4, "off"), (4, "on"), (1, "on")])
def test_streaming_reads_never_change_results(backend_name, io_threads, direct, model_cache, monkeypatch):
    """Misses read on the I/O pool while resident experts compute, landing in any order, buffered or
    O_DIRECT into page-aligned slots (staged through page-aligned host memory on device backends):
    logits and tokens equal the all-resident engine's, and direct reads really happen where the
    filesystem takes them."""
    _, col = convert_case(model_cache, "olmoe")
    monkeypatch.setenv("COLIBRI_HOT_SET", "0")
    ids = np.random.default_rng(3).integers(0, 99, size=(2, 12))
    with Engine.open(col, backend=backend_name, **fp32(backend_name)) as e:
        want, want_gen = e.infer(ids), e.generate(PROMPTS[2], max_new_tokens=8, ignore_eos=True)
    for policy in ("lru", "prefetch"):
        monkeypatch.setenv("COLIBRI_IO_THREADS", str(io_threads))
        monkeypatch.setenv("COLIBRI_DIRECT_IO", direct)
        with Engine.open(col, backend=backend_name, expert_slots=3, slot_policy=policy, **fp32(backend_name)) as e:
            np.testing.assert_array_equal(e.infer(ids), want)
            assert e.generate(PROMPTS[2], max_new_tokens=8, ignore_eos=True) == want_gen
            st = e.slot_stats
        assert st["io_threads"] == io_threads and st["misses"] > 0 and st["load_seconds"] > 0
        # host slots take reads from the I/O threads; of the device backends, CUDA copies from them too
        # (its upload stream), OpenCL from the compute thread only (slot_loads_in_parallel)
        assert st["parallel_reads"] == (io_threads > 0 and backend_name != "opencl")
        assert st["read_bytes"] == st["bytes_loaded"]                   # every load whole, counted once
        # the drive's busy time is the union of the loads' intervals: no longer than their sum
        assert 0 < st["io_busy_seconds"] <= st["load_seconds"] * (1 + 1e-9)
        assert st["observed_read_gbs"] == st["read_bytes"] / st["io_busy_seconds"] / 1e9
        if direct == "on" and _direct_ok(os.path.join(col, "colibri_weights.bin")):
            assert st["direct_io"] and st["direct_reads"] > 0
        elif direct == "on":
            assert not st["direct_io"] and "refused" in st["direct_io_why"]
        else:
            assert st["direct_reads"] == 0
        monkeypatch.delenv("COLIBRI_IO_THREADS")
        monkeypatch.delenv("COLIBRI_DIRECT_IO")


def test_a_failed_read_fails_its_request_and_nothing_else(model_cache, monkeypatch):
    """A load that fails (here: a read error on the I/O pool) fails the step's request with the error;
    the slot it was loading is forgotten, so the next request loads it again and gets the right logits."""
    from colibri_edge.errors import ColibriError
    _, col = convert_case(model_cache, "olmoe")
    monkeypatch.setenv("COLIBRI_HOT_SET", "0")
    ids = np.random.default_rng(4).integers(0, 99, size=(1, 10))
    with Engine.open(col, backend="reference") as e:
        want = e.infer(ids)
    with Engine.open(col, backend="reference", expert_slots=3, slot_policy="lru") as e:
        pool = e.runner.slot_pool
        real, calls = pool._load, []

        def flaky(layer, x, slot):
            calls.append((layer, x))
            if len(calls) == 2:
                raise OSError(5, "Input/output error")
            return real(layer, x, slot)
        pool._load = flaky
        with pytest.raises((ColibriError, OSError)):
            e.infer(ids)
        bad = calls[1]
        assert bad not in pool.cache.where                # forgotten: no slot claims the half-read expert
        pool._load = real
        np.testing.assert_array_equal(e.infer(ids), want)


def test_hot_set_is_learned_and_pinned(model_cache, monkeypatch, tmp_path):
    """A run's routing heat is written at close (per model, in the cache); the next engine pins the
    hottest experts into COLIBRI_HOT_SET percent of its slots at open, keeps them through any traffic,
    and computes the same logits. The heat is the first run's own expert counts, decayed (x0.5) each run."""
    from colibri_edge.runtime.slots import HEAT_DECAY
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLIBRI_HOT_SET", "50")
    _, col = convert_case(model_cache, "olmoe")
    ids = np.random.default_rng(5).integers(0, 99, size=(2, 12))
    with Engine.open(col, backend="reference") as e:
        want = e.infer(ids)
    with Engine.open(col, backend="reference", expert_slots=6, slot_policy="lru") as e:
        assert e.slot_stats["hot_set"] == 0                # nothing learned yet
        e.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
        counts = e.expert_counts.astype(np.float64)
        heat_path = e.slot_stats["hot_set_file"]
    assert heat_path.startswith(str(tmp_path / "cache")) and os.path.exists(heat_path)
    saved = json.load(open(heat_path))
    layers = saved["layers"]
    np.testing.assert_array_equal(np.asarray(saved["heat"]), counts[layers])
    ranked = sorted(((l, x) for l in layers for x in range(counts.shape[1]) if counts[l, x] > 0),
                    key=lambda k: (-counts[k], k))
    # olmoe: 2 MoE layers x top-2, a decode token's working set W = 4 experts. 6 slots >= W: 50% of them,
    # but no more than 6 - W = 2; 3 slots < W: all but top-k = 1 (demand caching thrashes below W)
    with Engine.open(col, backend="reference", expert_slots=3, slot_policy="lru") as e:
        assert [tuple(k) for k in e.slot_stats["pinned_keys"]] == ranked[:1]
        np.testing.assert_array_equal(e.infer(ids), want)
        third = e.expert_counts.astype(np.float64)
    counts = third + HEAT_DECAY * counts                                   # the heat after that run
    hottest = sorted(((l, x) for l in layers for x in range(counts.shape[1]) if counts[l, x] > 0),
                     key=lambda k: (-counts[k], k))[:2]
    with Engine.open(col, backend="reference", expert_slots=6, slot_policy="lru") as e:
        st = e.slot_stats
        assert [tuple(k) for k in st["pinned_keys"]] == hottest and st["hot_set"] == 2
        np.testing.assert_array_equal(e.infer(ids), want)
        e.generate(PROMPTS[1], max_new_tokens=12, ignore_eos=True)
        assert all(k in e.runner.slot_pool.cache.where for k in hottest)    # never evicted
        second = e.expert_counts.astype(np.float64)
    np.testing.assert_allclose(np.asarray(json.load(open(heat_path))["heat"]),
                               second[layers] + HEAT_DECAY * counts[layers])
    monkeypatch.setenv("COLIBRI_HOT_SET", "0")
    with Engine.open(col, backend="reference", expert_slots=6) as e:
        assert e.slot_stats["hot_set"] == 0


def test_streaming_knobs_are_validated(model_cache, monkeypatch):
    from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
    _, col = convert_case(model_cache, "olmoe")
    for knob, bad in (("COLIBRI_IO_THREADS", "65"), ("COLIBRI_IO_THREADS", "-1"), ("COLIBRI_DIRECT_IO", "yes"),
                      ("COLIBRI_HOT_SET", "101"), ("COLIBRI_HOT_SET", "half")):
        monkeypatch.setenv(knob, bad)
        with pytest.raises(ColibriError) as err:
            Engine.open(col, backend="reference", expert_slots=4)
        assert err.value.code == COLIBRI_ERR_INVALID_ARGUMENT and knob in err.value.message
        monkeypatch.delenv(knob)


def test_prediction_accuracy_engine_equals_simulator(model_cache, monkeypatch):
    """The lookahead's accuracy (layer L+1's router on layer L's MoE input): the engine's counters
    (slot_stats) equal the simulator's replay of the trace, and equal a count straight from the trace."""
    monkeypatch.setenv("COLIBRI_HOT_SET", "0")
    _, col = convert_case(model_cache, "olmoe")
    with Engine.open(col, backend="reference", expert_slots=5, slot_policy="prefetch", max_batch=2,
                     prefill_chunk=8) as e:
        tr = e.trace(PROMPTS, max_new_tokens=6, ignore_eos=True)
        st = e.slot_stats
    sim = replay(tr, 5, "prefetch")
    assert st["prediction_recall"] == sim["prediction_recall"] and 0 < st["prediction_recall"] <= 1
    assert st["prediction_precision"] == sim["prediction_precision"]
    used = routed = predicted = 0
    for _, idx in tr.steps():
        for j in range(1, len(tr.layer_ids)):
            run = set(np.unique(tr.expert_ids[idx, j]).tolist())
            pred = set(np.unique(tr.predicted_ids[idx, j]).tolist())
            used, routed, predicted = used + len(run & pred), routed + len(run), predicted + len(pred)
    assert st["prediction_recall"] == used / routed and st["prediction_precision"] == used / predicted
    rs = routing_stats(tr)                                # `colibri stats`: olmoe has 2 MoE layers, one predicted
    assert rs["layers"][0]["prediction"] is None
    assert rs["layers"][1]["prediction"]["recall"] == st["prediction_recall"]
    assert rs["prediction"]["precision"] == st["prediction_precision"]


def test_streaming_numbers_reach_metrics(model_cache, monkeypatch):
    """/metrics carries the slot pool's numbers as slot_stats has them: storage bytes read, the pinned
    hot set, the lookahead's recall and precision, the share of load time hidden."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families
    from colibri_edge.serving.serve import create_app
    monkeypatch.setenv("COLIBRI_HOT_SET", "0")
    _, col = convert_case(model_cache, "olmoe")
    with Engine.open(col, backend="reference", expert_slots=4, slot_policy="prefetch") as e:
        e.generate([5, 6, 7], max_new_tokens=6, ignore_eos=True)     # (this test model has no tokenizer)
        with TestClient(create_app({"m": e})) as c:
            prom = {s.name: s.value for fam in text_string_to_metric_families(c.get("/metrics").text)
                    for s in fam.samples if s.labels.get("model") == "m"}
            st = e.slot_stats
    assert st["read_bytes"] > 0 and st["prediction_recall"] is not None
    assert prom["colibri_expert_slot_read_bytes"] == st["read_bytes"]
    assert prom["colibri_expert_slot_pinned"] == st["hot_set"] == 0
    assert prom["colibri_expert_slot_prediction_recall"] == st["prediction_recall"]
    assert prom["colibri_expert_slot_prediction_precision"] == st["prediction_precision"]
    assert prom["colibri_expert_slot_load_hidden"] == st["hidden_fraction"]


def test_plan_says_what_lives_where(model_cache, tmp_path):
    """`colibri plan MODEL --memory SIZE`: the engine's own layout in that memory (the auto slot count,
    arena, KV), the hot set the pool pins from the model's routing heat, and the simulator's prediction
    on a device profile for routing drawn from that heat; too little memory is refused with the numbers."""
    from colibri_edge.analysis.simulate import estimate, load_profile
    from colibri_edge.serving.plan import drawn_trace
    from colibri_edge.runtime.slots import load_heat
    _, col = convert_case(model_cache, "olmoe")
    env = dict(os.environ, COLIBRI_CACHE_DIR=str(tmp_path / "cache"), COLIBRI_HOT_SET="50")
    run = lambda *a: subprocess.run([sys.executable, "-m", "colibri_edge", *a], capture_output=True, text=True,
                                    cwd=ROOT, env=env, timeout=600)
    r = run("plan", col, "--memory", "1G", "--device", "rk3588", "--context", "64", "--json")
    assert r.returncode == 0, r.stderr
    big = json.loads(r.stdout)
    assert big["slots"] is None and big["pinned"] == [] and "all 16 experts fit" in big["slot_choice"]["why"]
    from colibri_edge.runtime.runner import AUTO_HEADROOM_MIN
    mem = big["resident_weight_bytes"] + big["arena_bytes"] + big["kv_bytes"] + AUTO_HEADROOM_MIN + \
        6 * big["bytes_per_expert"] + big["bytes_per_expert"] // 2         # room for 6 slots and a half
    r = run("plan", col, "--memory", str(mem), "--device", "rk3588", "--context", "64", "--json")
    assert r.returncode == 0, r.stderr
    cold = json.loads(r.stdout)
    assert cold["slots"] == 6 and cold["pinned"] == [] and "uniform routing" in cold["routing"]
    old = os.environ.get("COLIBRI_CACHE_DIR")
    os.environ["COLIBRI_CACHE_DIR"] = env["COLIBRI_CACHE_DIR"]
    try:
        with Engine.open(col, backend="reference", expert_slots=6, max_seq_len=64) as e:
            e.generate(PROMPTS[0], max_new_tokens=16, ignore_eos=True)     # learns the heat
            heat_file = e.slot_stats["hot_set_file"]
        with Engine.open(col, backend="cpu" if _has("cpu") else "reference", expert_slots="auto", memory_budget=mem, max_seq_len=64, max_batch=1) as e:
            choice, meta = e.slot_choice, e.trace_meta()
        heat = load_heat(heat_file, e.model)
    finally:
        if old is None:
            os.environ.pop("COLIBRI_CACHE_DIR")
        else:
            os.environ["COLIBRI_CACHE_DIR"] = old
    r = run("plan", col, "--memory", str(mem), "--device", "rk3588", "--context", "64", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["slots"] == choice["slots"] == 6 and p["slot_choice"]["why"] == choice["why"]
    hottest = sorted((k for k in heat if heat[k] > 0), key=lambda k: (-heat[k], k))[:2]   # min(50%, 6 - W=4)
    assert [tuple(k) for k in p["pinned"]] == hottest and p["streamed_slots"] == 4
    assert "routing heat" in p["routing"]
    tr = drawn_trace(meta, sorted({layer for layer, _ in heat}), heat)
    res = replay(tr, 6, "lru", pinned=hottest)
    est = estimate(res, tr, load_profile("rk3588"), 64)
    assert np.isclose(p["prediction"]["ms_per_token"], est["est_ms_per_token"], rtol=1e-9)
    assert p["prediction"]["hit_rate"] == res["hit_rate"]
    r = run("plan", col, "--memory", str(mem), "--context", "64")     # the text form, no profile here
    assert r.returncode == 0 and "pinned hot set: 2 experts" in r.stdout and "probe-device" in r.stdout, r.stdout
    r = run("plan", col, "--memory", "1M")
    assert r.returncode != 0 and "COLIBRI_ERR_OUT_OF_MEMORY" in r.stderr and "MiB" in r.stderr, r.stderr
