"""The request core (colibri_edge/requests/scheduler.py): many callers on one engine at once, per-request sampling
and RNG, cancellation, chunked prefill interleaved with decode, waiting and preemption instead of
failing, a bounded queue, AsyncEngine; the sampling extras against NumPy statements of their
definitions."""
import asyncio
import os
import threading
import time

import numpy as np
import pytest

from colibri_edge import AsyncEngine, ColibriError, Engine, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.requests import sampling
from colibri_edge.requests.scheduler import DONE, TOKEN
from helpers import fp32
from hf_models import convert_case

V = 96          # qwen3_moe's vocabulary (hf_models.CASES)
PROMPTS = [[(7 * i + 3 * j + 1) % V for j in range(3 + 2 * i)] for i in range(16)]


def _idle(eng, timeout=10.0):
    """Wait until the core has nothing waiting or running (a cancelled request leaves at a step)."""
    t0 = time.monotonic()
    while eng._core.busy and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    return not eng._core.busy


def test_eight_threads_stream_at_once_some_abandon(backend_name, model_cache):
    """8 threads on one engine: 4 read to the end, 2 cancel after two tokens, 2 stop reading without
    cancelling (nobody waits for them); every completed temperature-0 result equals its solo run and
    the pool ends exactly as free as it began."""
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend=backend_name, max_batch=8, max_seq_len=64, **fp32(backend_name)) as eng:
        solo = [eng.generate(p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS[:8]]
        free0 = eng.kv_free_blocks
        results, barrier = [None] * 8, threading.Barrier(8)

        def run(i):
            barrier.wait()
            if i % 4 == 1:                              # cancels after two tokens
                r = eng.submit(PROMPTS[i], max_new_tokens=10, ignore_eos=True)
                it = r.iter_events(timeout=30)
                results[i] = [next(it).token, next(it).token]
                r.cancel()
            elif i % 4 == 3:                            # stops reading, never cancels
                r = eng.submit(PROMPTS[i], max_new_tokens=10, ignore_eos=True)
                results[i] = [next(r.iter_events(timeout=30)).token]
            else:
                results[i] = eng.generate(PROMPTS[i], max_new_tokens=10, ignore_eos=True)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert _idle(eng)
        assert eng.kv_free_blocks == free0 == eng.runner.pool.num_blocks
    for i in range(8):
        if i % 2 == 0:
            assert results[i] == solo[i], i
        else:
            assert results[i] == solo[i][:len(results[i])], i      # what was read is the solo run's prefix


def test_seeded_request_alone_and_among_fifteen(model_cache):
    """A seeded sampled request's tokens do not depend on its neighbours (its own RNG): alone, and
    among 15 others with their own seeds and parameters, submitted from 16 threads at once."""
    _, col = convert_case(model_cache, "qwen3_moe")
    kw = dict(max_new_tokens=12, temperature=0.8, top_k=30, ignore_eos=True)
    with Engine.open(col, backend="reference", max_batch=16, max_seq_len=64) as eng:
        alone = eng.generate(PROMPTS[3], seed=1234, **kw)
        out = [None] * 16

        def run(i):
            if i == 5:
                out[i] = eng.generate(PROMPTS[3], seed=1234, **kw)
            else:
                out[i] = eng.generate(PROMPTS[i], seed=i, max_new_tokens=8 + i % 5, temperature=1.0 + i / 10,
                                      ignore_eos=True)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        again = eng.generate(PROMPTS[3], seed=1234, **kw)
        batch = eng.generate_batch([PROMPTS[3], PROMPTS[4]], seed=1234, **kw)
    assert out[5] == alone == again == batch[0]     # generate_batch(seed=s): prompt i seeded [s, i]
    assert all(o is not None for o in out)


def test_cancel_returns_blocks_within_one_step(backend_name, model_cache):
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend=backend_name, max_seq_len=64, **fp32(backend_name)) as eng:
        total = eng.runner.pool.num_blocks
        r = eng.submit(PROMPTS[6], max_new_tokens=40, ignore_eos=True)
        it = r.iter_events(timeout=30)
        assert next(it).kind == TOKEN
        steps = eng.runner.steps
        r.cancel()
        last = [ev for ev in it][-1]
        assert last.kind == DONE and last.reason == "cancelled"
        assert eng.runner.steps - steps <= 2         # the step in flight, then it leaves
        assert _idle(eng) and eng.kv_free_blocks == total


def test_long_prompt_is_prefilled_in_chunks_beside_live_decodes(backend_name, model_cache):
    """A long prompt arriving while 4 requests decode is prefilled a chunk per step, each step also
    carrying the 4 decode tokens; all results equal their solo runs."""
    _, col = convert_case(model_cache, "qwen3_moe")
    long = [(5 * j + 2) % V for j in range(50)]
    with Engine.open(col, backend=backend_name, max_batch=8, max_seq_len=128, prefill_chunk=16,
                     **fp32(backend_name)) as eng:
        solo = [eng.generate(p, max_new_tokens=24, ignore_eos=True) for p in PROMPTS[:4]]
        solo_long = eng.generate(long, max_new_tokens=4, ignore_eos=True)
        reqs = [eng.submit(p, max_new_tokens=24, ignore_eos=True) for p in PROMPTS[:4]]
        firsts = [next(r.iter_events(timeout=30)) for r in reqs]       # all four are decoding
        start = len(eng.runner.step_tokens)
        lreq = eng.submit(long, max_new_tokens=4, ignore_eos=True)
        got_long = [ev.token for ev in lreq.iter_events(timeout=30) if ev.kind == TOKEN]
        got = [[f.token] + [ev.token for ev in r.iter_events(timeout=30) if ev.kind == TOKEN]
               for f, r in zip(firsts, reqs)]
        steps = list(eng.runner.step_tokens)[start:]
    assert got == solo and got_long == solo_long
    mixed = [t for t in steps if t > 4]
    assert len(mixed) >= 3, steps                    # 50 tokens in chunks of at most 16 - live decodes
    assert max(steps) <= 16


def test_priority_and_submission_order_when_the_pool_is_small(model_cache):
    """A pool that holds one request at a time: requests finish by priority, then submission order,
    and none fails."""
    _, col = convert_case(model_cache, "qwen3_moe")
    # prefix_cache=False: with it the four equal prompts share their blocks, and two fit at once
    with Engine.open(col, backend="reference", max_batch=4, max_seq_len=64, kv_block_size=4,
                     kv_cache_tokens=24, prefix_cache=False) as eng:
        reqs = eng.submit_batch([PROMPTS[2]] * 4, priorities=[0, 0, 5, 0], max_new_tokens=12, ignore_eos=True)
        for r in reqs:
            for ev in r.iter_events(timeout=60):
                assert ev.kind in (TOKEN, DONE), ev
        done = sorted(range(4), key=lambda i: reqs[i].finish_no)
    assert done == [2, 0, 1, 3]
    assert all(len(r.produced) == 12 for r in reqs)


def test_queue_full_is_unavailable_and_takes_nothing(model_cache):
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend="reference", max_batch=1, max_queue=2) as eng:
        with pytest.raises(ColibriError) as ei:
            eng.submit_batch([PROMPTS[0]] * 3, max_new_tokens=2)
        assert ei.value.code == COLIBRI_ERR_UNAVAILABLE and "max_queue" in ei.value.message
        assert not eng._core.waiting
        assert len(eng.generate(PROMPTS[0], max_new_tokens=3, ignore_eos=True)) == 3


def test_async_engine_streams_and_cancels(model_cache):
    _, col = convert_case(model_cache, "qwen3_moe")

    async def main():
        async with AsyncEngine.open(col, backend="reference", max_seq_len=64) as ae:
            solo = ae.engine.generate(PROMPTS[1], max_new_tokens=9, ignore_eos=True)
            outs = await asyncio.gather(*[ae.generate(p, max_new_tokens=9, ignore_eos=True) for p in PROMPTS[:4]])
            seen = []
            async for ev in ae.events(PROMPTS[5], max_new_tokens=30, ignore_eos=True):
                seen.append(ev)
                if len(seen) == 3:
                    break                                 # leaving the loop cancels the request
            for _ in range(500):                         # the cancel lands within a step
                if not ae.engine._core.busy:
                    break
                await asyncio.sleep(0.005)
            return solo, outs, seen, not ae.engine._core.busy, ae.engine.kv_free_blocks, ae.engine.runner.pool.num_blocks
    solo, outs, seen, idle, free, total = asyncio.run(main())
    assert outs[1] == solo and all(len(o) == 9 for o in outs)
    assert len(seen) == 3 and idle and free == total


# -- sampling extras against NumPy statements of their definitions ------------------------------------

def _params(**kw):
    return sampling.SamplingParams.make(V, [2], **kw)


def test_penalties_and_logit_bias_match_their_definitions(rng):
    logits = rng.standard_normal(V).astype(np.float32) * 3
    prompt, produced = [1, 5, 5, 9], [9, 9, 40, 3]
    counts = {9: 2, 40: 1, 3: 1}
    p = _params(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 5.0, "11": -100})
    got = sampling.processed_logits(logits, p, prompt, produced, counts)
    want = logits.astype(np.float64).copy()
    want[7] += 5.0
    want[11] -= 100.0
    for t in {1, 5, 9, 40, 3}:                       # every token of prompt + generated, once
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, c in counts.items():
        want[t] -= 0.5 + 0.25 * c
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    tok, _, _ = sampling.sample_request(logits, p, prompt, produced, counts, np.random.default_rng(0))
    assert tok == int(np.argmax(want))               # greedy on the processed logits


def test_min_p_top_k_top_p_support(rng):
    """Sampled tokens always lie in the set the definitions allow: min_p keeps p >= min_p * max p
    (after temperature), top_k the k largest, top_p the smallest prefix of mass >= top_p."""
    logits = rng.standard_normal(V).astype(np.float32) * 2
    for kw in ({"min_p": 0.2}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.05, "top_k": 12}):
        p = _params(temperature=0.7, **kw)
        z = logits.astype(np.float64) / 0.7
        q = np.exp(z - z.max())
        q /= q.sum()
        allowed = np.ones(V, bool)
        if "top_k" in kw:
            allowed &= z >= np.sort(z)[-kw["top_k"]]
        if "top_p" in kw:
            order = np.argsort(-q, kind="stable")
            n = int(np.searchsorted(np.cumsum(q[order]), kw["top_p"])) + 1
            allowed &= np.isin(np.arange(V), order[:n])
        if "min_p" in kw:
            qq = np.where(allowed, q, 0.0)
            allowed &= qq >= kw["min_p"] * qq.max()
        r = np.random.default_rng(3)
        seen = {sampling.sample_request(logits, p, [], [], {}, r)[0] for _ in range(400)}
        assert seen <= set(np.flatnonzero(allowed)), kw
        assert len(seen) > 1 or allowed.sum() == 1


def test_logprobs_are_the_models_log_softmax(rng):
    logits = rng.standard_normal(V).astype(np.float32) * 4
    p = _params(logprobs=True, top_logprobs=3, temperature=0.0)
    tok, lp, top = sampling.sample_request(logits, p, [], [], {}, np.random.default_rng(0))
    x = logits.astype(np.float64)
    want = x - np.log(np.exp(x).sum())
    assert tok == int(np.argmax(x)) and lp == pytest.approx(want[tok], abs=1e-9)
    assert [t for t, _ in top] == list(np.argsort(-want)[:3])
    assert [v for _, v in top] == pytest.approx(list(np.sort(want)[::-1][:3]), abs=1e-9)


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(repetition_penalty=0), dict(presence_penalty=3),
                                 dict(logit_bias={V: 1.0}), dict(logit_bias={3: 200}), dict(logit_bias=[1]),
                                 dict(top_logprobs=50), dict(logprobs="yes"), dict(nucleus=0.5)])
def test_bad_sampling_extras_are_coded(model_cache, bad):
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend="reference", max_seq_len=32) as eng:
        with pytest.raises(ColibriError) as ei:
            eng.generate(PROMPTS[0], max_new_tokens=2, **bad)
        assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT
        assert eng.generate(PROMPTS[0], max_new_tokens=2, ignore_eos=True)   # nothing was left behind


def _decode_logits(eng, company):
    """(core thread) sequence A's logits over 6 decode steps, each step shared with company(step)'s
    entries: nothing, 3 other decoding sequences, or a 20-token prefill chunk."""
    r = eng.runner
    A, others, L = r.new_sequence(900), [r.new_sequence(901 + i) for i in range(3)], r.new_sequence(999)
    try:
        for s in [A] + others:
            r.reserve(s, 5)
        r.step([(A, [1, 2, 3, 4, 5])] + [(o, [9, 8, 7, 6, 5]) for o in others])
        out = []
        for step in range(6):
            r.reserve(A, 1)
            extra = []
            if company == "decodes":
                for o in others:
                    r.reserve(o, 1)
                extra = [(o, [3 + step]) for o in others]
            elif company == "prefill":
                r.reserve(L, 20)
                extra = [(L, list(range(10 + step, 30 + step)))]
            out.append(np.array(eng.backend.host_view(r.step([(A, [7 + step])] + extra))[0]))
        return np.stack(out)
    finally:
        for s in [A, L] + others:
            r.free(s)


def _invariance_runs(col, backend_name, **opts):
    with Engine.open(col, backend=backend_name, max_batch=8, max_seq_len=128, **opts) as eng:
        return {c: eng._core.call(lambda c=c: _decode_logits(eng, c)) for c in ("alone", "decodes", "prefill")}


BITWISE = ("reference", "cpu")       # batch invariant bit for bit (README); elsewhere within 1e-5


def test_batch_invariance(backend_name, model_cache):
    """A decoding row's logits alone, beside 3 other decoding rows, and beside a prefill chunk (which
    sends the step through the GEMM paths): bit for bit on the reference and cpu backends; within
    the kernels' tolerance elsewhere."""
    _, col = convert_case(model_cache, "qwen3_moe")
    runs = _invariance_runs(col, backend_name, **fp32(backend_name))
    scale = np.abs(runs["alone"]).max()
    for c in ("decodes", "prefill"):
        if backend_name in BITWISE:
            np.testing.assert_array_equal(runs[c], runs["alone"], err_msg=c)
        else:
            assert np.abs(runs[c] - runs["alone"]).max() / scale < 1e-5, c


@pytest.mark.parametrize("int8_activations", [True, False])
def test_batch_invariance_in_block_formats(model_cache, int8_activations):
    """The cpu backend's block formats (a q4_k_m mix: q4_k, q6_k and fallbacks), with int8
    activations (the default) and without: bit for bit alone, beside decodes, beside a prefill chunk."""
    from colibri_edge.model.convert import convert
    from hf_models import build_hf
    hf, col = os.path.join(model_cache, "inv_hf_mixtral"), os.path.join(model_cache, "inv_col_mixtral_q4_k_m")
    if not os.path.exists(os.path.join(col, "config.json")):
        build_hf(hf, "mixtral", hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=V)
        convert(hf, col, dtype="q4_k_m", progress=False)
    runs = _invariance_runs(col, "cpu", int8_activations=int8_activations)
    for c in ("decodes", "prefill"):
        np.testing.assert_array_equal(runs[c], runs["alone"], err_msg=c)


def test_inline_core_callers_run_the_steps(model_cache):
    """core_thread=False: no core thread; the waiting callers take turns running steps. Four threads
    at once get their solo tokens, a pool too small for all of them waits instead of failing, a
    cancelled request leaves at the next step, and COLIBRI_CORE_THREAD=2 is refused by name."""
    _, col = convert_case(model_cache, "qwen3_moe")
    with Engine.open(col, backend="reference", max_batch=4, max_seq_len=64, kv_block_size=4, kv_cache_tokens=40,
                     core_thread=False) as eng:
        assert eng._core.thread is None
        solo = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS[:4]]
        out = [None] * 4
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(
            i, eng.generate(PROMPTS[i], max_new_tokens=12, ignore_eos=True))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out == solo and eng._core.thread is None
        assert eng.generate_batch(PROMPTS[:4], max_new_tokens=12, ignore_eos=True) == solo
        r = eng.submit(PROMPTS[1], max_new_tokens=30, ignore_eos=True)
        next(r.iter_events())
        r.cancel()
        assert eng.infer(PROMPTS[0]).shape[1] == len(PROMPTS[0])      # a step runs: the cancelled one leaves
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks and r.finished
    with pytest.raises(ColibriError) as ei:
        Engine.open(col, backend="reference", core_thread=2)
    assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "COLIBRI_CORE_THREAD" in ei.value.message


def test_n_samples_share_one_prefill(backend_name, model_cache):
    """submit_n: the prompt is prefilled once; the other samples share its whole KV blocks (computing
    only the block with the last prompt token), so prefill tokens are P + (n-1) * (P - shared) and
    fewer blocks are held; at temperature 0 every sample equals the solo run, sampled ones follow
    their own seeds [seed, i] like generate_batch's; every block returns to the pool."""
    _, col = convert_case(model_cache, "qwen3_moe")
    prompt = [(3 * j + 1) % V for j in range(37)]                 # 37 tokens, blocks of 8: 32 shared
    # prefix_cache=False: the solo run's blocks would otherwise serve the first sample too
    with Engine.open(col, backend=backend_name, max_batch=4, max_seq_len=128, kv_block_size=8,
                     prefix_cache=False, **fp32(backend_name)) as eng:
        solo = eng.generate(prompt, max_new_tokens=10, ignore_eos=True)
        before = eng.stats.prefill_tokens
        reqs = eng.submit_n(prompt, 3, max_new_tokens=10, ignore_eos=True)
        outs = [[ev.token for ev in r.iter_events(timeout=60) if ev.kind == TOKEN] for r in reqs]
        assert outs == [solo] * 3
        assert [r.shared for r in reqs] == [0, 32, 32]
        assert eng.stats.prefill_tokens - before == 37 + 2 * 5
        sampled = eng.submit_n(prompt, 3, max_new_tokens=8, temperature=0.9, seed=4, ignore_eos=True)
        got = [[ev.token for ev in r.iter_events(timeout=60) if ev.kind == TOKEN] for r in sampled]
        assert len({tuple(g) for g in got}) > 1                    # their own seeds
        assert _idle(eng) and eng.kv_free_blocks == eng.runner.pool.num_blocks


def test_shared_blocks_are_freed_by_their_last_holder():
    """PagedPool refcounts: a block two sequences hold returns to the pool only when both release it."""
    from colibri_edge.runtime.state import PagedPool, States
    pool = PagedPool("kv", [0], 10, 4, (1, 2))
    st = States([pool], 64)
    a, b = st.new(1), st.new(2)
    st.reserve(a, 13)                                  # 4 blocks
    a.cached = 13
    assert st.share_prefix(a, b, 12) == 12 and b.tables[0] == a.tables[0][:3]
    st.reserve(b, 3)                                   # 12 -> 15 positions: one block of its own
    assert pool.free_blocks == 10 - 5
    st.release(a)
    assert pool.free_blocks == 10 - 4                  # a's own last block only
    st.release(b)
    assert pool.free_blocks == 10
    c = st.new(3)
    assert st.share_prefix(c, st.new(4), 4) == 0       # nothing cached to share


def test_step_cost_curve():
    """StepCost: per power-of-two bucket an exponential average of (tokens, seconds); linear between
    the buckets' points, constant below the first, flat to twice the last point, proportional past it."""
    from colibri_edge.requests.scheduler import StepCost
    c = StepCost(256)
    assert c(4) is None                                 # nothing measured: the core applies no cap
    c.add(1, 0.010)
    c.add(16, 0.020)
    assert np.isclose(c(1), 0.010) and np.isclose(c(0.5), 0.010)
    assert np.isclose(c(8), 0.010 + 0.010 * (8 - 1) / (16 - 1))
    assert np.isclose(c(32), 0.020) and np.isclose(c(64), 0.020 * 64 / 32)
    c.add(1, 0.020)                                     # the same bucket: 0.8 old + 0.2 new
    assert np.isclose(c(1), 0.8 * 0.010 + 0.2 * 0.020)
    c.add(24, 0.030)                                    # bucket [16, 32): its point moves to (17.6, 0.022)
    assert np.isclose(c(17.6), 0.8 * 0.020 + 0.2 * 0.030)
    assert np.allclose(c(np.array([1, 17.6])), [c(1), c(17.6)])


class _Linear:
    """A stand-in cost curve for the scheduling policy alone: seconds = a + b * tokens."""
    def __init__(self, a, b):
        self.a, self.b = a, b

    def add(self, n, seconds):
        pass

    def __call__(self, n):
        return self.a + self.b * np.asarray(n, np.float64)


@pytest.mark.parametrize("arrivals", [1, 6])
def test_prefill_takes_the_waiting_prompts_share(model_cache, arrivals):
    """One request streams; `arrivals` 40-token prompts arrive. The mixed step's size is the largest n
    with cost(n) <= cost(1) * (1 + 0.9 * max(interleave - 1, prefilling / decoding)) (core.py): with
    one arrival the stream keeps its pace (interleave 2), with six the prompts get their share of the
    step. Every result equals its solo run."""
    _, col = convert_case(model_cache, "qwen3_moe")
    prompts = [[(3 * i + 5 * j + 1) % V for j in range(40)] for i in range(arrivals)]
    with Engine.open(col, backend="reference", max_batch=8, max_seq_len=96, prefill_chunk=64,
                     core_thread=False) as eng:
        solo = [eng.generate(p, max_new_tokens=6, ignore_eos=True) for p in [PROMPTS[3]] + prompts]
        cost = eng._core.cost = _Linear(0.010, 0.00125)
        r0 = eng.submit(PROMPTS[3], max_new_tokens=6, ignore_eos=True)
        it0 = r0.iter_events(timeout=30)
        first = next(it0)                               # r0 decodes from the next step on
        reqs = eng.submit_batch(prompts, max_new_tokens=6, ignore_eos=True)
        eng._core.run_once()
        limit = cost(1) * (1 + 0.9 * max(2.0 - 1, arrivals / 1))
        want = max(n for n in range(1, 65) if cost(n) <= limit)
        assert eng.runner.step_tokens[-1] == want       # 1 decode + (want - 1) prefill tokens
        got = [[first.token] + [ev.token for ev in it0 if ev.kind == TOKEN]]
        got += [[ev.token for ev in r.iter_events(timeout=30) if ev.kind == TOKEN] for r in reqs]
    assert got == solo
    assert (want - 1 > 40) == (arrivals == 6)          # six arrivals: more than a whole prompt in one step
