"""Automatic prefix caching (runtime/state.py, the request core): a request whose prompt starts with
whole KV blocks an earlier request left in the pool takes them and prefills only the rest, and
answers as a fresh engine does; idle cached blocks count as free and are evicted least recently used;
models whose state cannot be reused yet (sliding-window layers, recurrent state) run uncached."""
import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.requests.scheduler import TOKEN
from helpers import fp32, need
from hf_models import convert_case

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v2"]          # full attention (GQA, qk-norm) and latent KV


def vocab(eng):
    return eng.config["vocab_size"]


def prompts(eng, n_shared=29, tails=(5, 9)):
    """A shared opening of n_shared tokens and turns that continue it."""
    V = vocab(eng)
    head = [(5 * j + 2) % V for j in range(n_shared)]
    return head, [head + [(11 * j + 7 * t) % V for j in range(t)] for t in tails]


def run(eng, prompt, n=8):
    """Greedy tokens and every token's logprob and top-5 (floats, compared exactly)."""
    req = eng.submit(prompt, max_new_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=5)
    evs = [ev for ev in req.iter_events(timeout=120) if ev.kind == TOKEN]
    return req, [(ev.token, ev.logprob, tuple(ev.top_logprobs)) for ev in evs]


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_cached_prefix_answers_as_a_fresh_engine(backend, case, model_cache):
    """Turn 2 shares turn 1's opening: it prefills only past the cached whole blocks, and its tokens,
    logprobs and top logprobs equal a fresh engine's bit for bit; a third request repeating turn 1
    takes every whole block of it, generated tokens included."""
    _, col = convert_case(model_cache, case)
    opts = dict(backend=backend, max_seq_len=96, max_batch=2, kv_block_size=4, prefill_chunk=64, **fp32(backend))
    with Engine.open(col, **opts) as eng:
        head, (p1, p2) = prompts(eng)
        assert eng.runner.states.prefix_block == 4
        r1, out1 = run(eng, p1)
        assert r1.cached_tokens == 0
        before = eng.stats.prefill_tokens
        r2, out2 = run(eng, p2)
        assert r2.cached_tokens == len(head) // 4 * 4 == 28
        assert eng.stats.prefill_tokens - before == len(p2) - 28
        # the first prompt again, now followed by its 8 generated tokens: whole blocks of both are cached
        again = p1 + [t for t, _, _ in out1]
        r3, _ = run(eng, again, n=2)
        assert r3.cached_tokens == (len(p1) + 7) // 4 * 4          # the last generated token was never fed
        assert eng.stats.cached_tokens == 28 + r3.cached_tokens
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks     # idle cached blocks count as free
    with Engine.open(col, **opts) as fresh:
        assert run(fresh, p2)[1] == out2
    with Engine.open(col, prefix_cache=False, **opts) as off:
        r, out = run(off, p1)
        r, out = run(off, p2)
        assert r.cached_tokens == 0 and out == out2 and off.runner.pool.cached_blocks == 0


def test_idle_blocks_are_evicted_least_recently_used(model_cache):
    """A pool of 12 blocks: two finished prompts leave 4 whole blocks each cached and idle; a third,
    unrelated one needs 9 blocks, 4 free, and evicts 5: the least recently used first (all of the
    first prompt's), and of a sequence's blocks its last first (a prefix match needs the first ones),
    so a repeat of the second prompt still finds its first 3 blocks, and the first prompt none."""
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend="reference", max_seq_len=48, max_batch=1, kv_block_size=4,
                     kv_cache_tokens=48) as eng:
        pool = eng.runner.pool
        V = vocab(eng)
        a, b, c = ([(m * j + k) % V for j in range(17)] for m, k in ((3, 1), (5, 2), (7, 3)))
        eng.generate(a, max_new_tokens=3, ignore_eos=True)
        eng.generate(b, max_new_tokens=3, ignore_eos=True)
        assert pool.cached_blocks == 8 and pool.free_blocks == 12           # 2 x 4 whole blocks, all idle
        eng.generate(c + c[:15], max_new_tokens=3, ignore_eos=True)         # 32 + 3 positions: 9 blocks
        assert pool.evictions == 5
        r = eng.submit(b, max_new_tokens=1)
        list(r.iter_events(timeout=60))
        assert r.cached_tokens == 12
        r = eng.submit(a, max_new_tokens=1)
        list(r.iter_events(timeout=60))
        assert r.cached_tokens == 0
        assert pool.free_blocks == pool.num_blocks


@pytest.mark.parametrize("case", ["gpt_oss", "qwen3_5_moe"])
def test_models_it_cannot_serve_yet_run_uncached(case, model_cache):
    """Sliding-window layers and recurrent state: no prefix is adopted, answers unchanged."""
    _, col = convert_case(model_cache, case)
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=2, kv_block_size=4) as eng:
        assert eng.runner.states.prefix_block == 0
        head, (p1, p2) = prompts(eng)
        run(eng, p1)
        r, out = run(eng, p2)
        assert r.cached_tokens == 0
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=2, kv_block_size=4) as fresh:
        assert run(fresh, p2)[1] == out


def test_concurrent_requests_share_a_system_prompt(model_cache):
    """Eight requests with one long opening, submitted together after one of them ran: each takes the
    cached opening, and each answer equals its solo run on a fresh engine."""
    _, col = convert_case(model_cache, "mixtral")
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=8, kv_block_size=4) as eng:
        head, ps = prompts(eng, n_shared=40, tails=tuple(range(2, 10)))
        eng.generate(ps[0], max_new_tokens=4, ignore_eos=True)
        reqs = [eng.submit(p, max_new_tokens=6, ignore_eos=True) for p in ps]
        outs = [[ev.token for ev in r.iter_events(timeout=120) if ev.kind == TOKEN] for r in reqs]
        assert all(r.cached_tokens == 40 for r in reqs)
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=8, kv_block_size=4,
                     prefix_cache=False) as fresh:
        assert outs == [fresh.generate(p, max_new_tokens=6, ignore_eos=True) for p in ps]
    assert np.unique([len(p) for p in ps]).size == len(ps)


@pytest.mark.parametrize("backend", ["opencl", "cuda"])
def test_greedy_with_a_cached_prefix_on_gpu_backends(backend, model_cache):
    """The device backends read adopted blocks through the same block tables: turn 2's greedy tokens
    equal a fresh engine's."""
    need(backend)
    _, col = convert_case(model_cache, "mixtral")
    opts = dict(backend=backend, max_seq_len=96, max_batch=2, kv_block_size=4, **fp32(backend))
    with Engine.open(col, **opts) as eng:
        head, (p1, p2) = prompts(eng)
        eng.generate(p1, max_new_tokens=6, ignore_eos=True)
        r = eng.submit(p2, max_new_tokens=10, ignore_eos=True)
        got = [ev.token for ev in r.iter_events(timeout=300) if ev.kind == TOKEN]
        assert r.cached_tokens == 28
    with Engine.open(col, prefix_cache=False, **opts) as fresh:
        assert got == fresh.generate(p2, max_new_tokens=10, ignore_eos=True)
