"""Automatic prefix caching (runtime/state.py, the request core): a request whose prompt starts with
whole KV blocks an earlier request left in the pool takes them and prefills only the rest, and
answers as a fresh engine does; idle cached blocks count as free and are evicted least recently used;
recurrent state (Qwen3.5) resumes from snapshots taken during prefill."""
import time

import numpy as np
import pytest

from colibri_edge import COLIBRI_ERR_INVALID_ARGUMENT, ColibriError, Engine
from colibri_edge.requests.scheduler import TOKEN
from helpers import chat_turns as prompts, fp32, need, run_logprobs as run
from hf_models import convert_case

# full attention (GQA, qk-norm), latent KV, sliding-window layers beside full ones (gpt-oss; Gemma 4,
# whose full layers have a geometry and pool of their own)
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss", "gemma4"]


def vocab(eng):
    return eng.config["vocab_size"]


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


# -- recurrent state (Qwen3.5's gated delta-nets): snapshots -----------------------------------

HYBRID = dict(max_seq_len=128, max_batch=2, kv_block_size=4, prefill_chunk=64)


@pytest.mark.parametrize("case", ["qwen3_5_moe", "lfm2_moe", "granitemoehybrid"])
@pytest.mark.parametrize("backend", ["reference", "cpu", "opencl", "cuda"])
def test_a_hybrid_model_resumes_from_a_state_snapshot(backend, case, model_cache):
    """Qwen3.5 (gated delta-nets beside full attention), LFM2-MoE (short convolutions beside attention,
    the conv's last inputs its state) and Granite 4.0-H (Mamba-2: the conv's inputs and the scan's S): turn 1's prefill is cut at the last multiple
    of lcm(block 4, delta-rule chunk 16) before its last token, 32, and its recurrent state kept there;
    turn 2 (sharing 37 tokens, 9 whole blocks) resumes from that snapshot: 32 cached tokens, not 36
    (a recurrent state cannot be rewound), and answers as a fresh engine does: tokens, logprobs and top
    logprobs bit for bit on reference and cpu, greedy tokens on opencl and cuda."""
    need(backend)
    _, col = convert_case(model_cache, case)
    opts = dict(backend=backend, **HYBRID, **fp32(backend))
    with Engine.open(col, **opts) as eng:
        head, (p1, p2) = prompts(eng, n_shared=37, tails=(3, 7))
        assert eng.runner.states.prefix_block == 4
        r1, _ = run(eng, p1)
        snaps = eng.runner.states.snapshots
        assert r1.cached_tokens == 0 and snaps.taken == 1
        r2, out2 = run(eng, p2)
        assert r2.cached_tokens == 32 and snaps.restored == 1 and eng._core.settles == 0
    with Engine.open(col, prefix_cache=False, **opts) as fresh:
        want = run(fresh, p2)[1]
    if backend in ("reference", "cpu"):
        assert out2 == want
    else:
        assert [t for t, _, _ in out2] == [t for t, _, _ in want]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_hybrid_session_is_saved_at_its_snapshot(backend, model_cache, tmp_path):
    """A hybrid model's session ends at the last snapshot inside the cached prefix (turn 1's prompt cut
    at 32) and carries the recurrent state there: a restarted engine answers turn 2 from 32 cached
    tokens, bit for bit as a fresh engine."""
    _, col = convert_case(model_cache, "qwen3_5_moe")
    opts = dict(backend=backend, **HYBRID)
    path = str(tmp_path / "hybrid.session")
    with Engine.open(col, **opts) as eng:
        head, (p1, p2) = prompts(eng, n_shared=37, tails=(3, 7))
        _, out1 = run(eng, p1)
        turn1 = p1 + [t for t, _, _ in out1]
        assert eng.save_session(turn1, path) == 32
    turn2 = turn1 + p2[len(head):]
    with Engine.open(col, **opts) as restarted:
        assert restarted.load_session(path) == 32
        r, got = run(restarted, turn2)
        assert r.cached_tokens == 32
    with Engine.open(col, prefix_cache=False, **opts) as fresh:
        assert run(fresh, turn2)[1] == got
    with Engine.open(col, state_snapshots=0, **opts) as nosnap, pytest.raises(ColibriError) as e:
        nosnap.load_session(path)
    assert "state_snapshots=0" in e.value.message


def idle(eng, timeout=60):
    deadline = time.monotonic() + timeout
    while eng._core.busy:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_hybrid_reply_is_re_prefilled_for_the_next_turn(backend, model_cache):
    """settle_replies=True: the reply's recurrent state was built token by token, which a prefill does
    not reproduce bit for bit; when turn 1 ends, the core re-prefills prompt + reply (lowest priority) from the prompt's
    snapshot and keeps one at the reply's last multiple of 16 (48 for 40 + 23 fed tokens), its blocks
    replacing decode's: turn 2, which sends the reply back, resumes at 48 and answers as a fresh engine."""
    _, col = convert_case(model_cache, "qwen3_5_moe")
    opts = dict(backend=backend, **HYBRID)
    with Engine.open(col, settle_replies=True, **opts) as eng:
        head, (p1, p2) = prompts(eng, n_shared=37, tails=(3, 7))
        _, out1 = run(eng, p1, n=24)
        idle(eng)
        assert eng._core.settles == 1 and eng.runner.states.snapshots.taken == 2
        turn2 = p1 + [t for t, _, _ in out1] + p2[len(head):]
        r2, got = run(eng, turn2)
        assert r2.cached_tokens == 48
        idle(eng)
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks
    with Engine.open(col, prefix_cache=False, **opts) as fresh:
        assert run(fresh, turn2)[1] == got


def test_snapshots_align_with_every_backends_delta_rule_chunk():
    """Snapshot positions are multiples of state.DELTA_CHUNK because each backend's prefill runs the
    delta rule in chunks of that many tokens from where its step starts: the constants must agree."""
    from colibri_edge.runtime.state import DELTA_CHUNK
    from colibri_edge.backends.reference.backend import DELTA_CHUNK as ref
    from colibri_edge.backends.cpu.recurrent import DELTA_CHUNK as cpu
    from colibri_edge.backends.opencl.runtime import DELTA_CHUNK as ocl
    from colibri_edge.backends.cuda.sources import DEFINES
    assert DELTA_CHUNK == ref == cpu == ocl == DEFINES["DELTA_CHUNK"] == 16


def test_snapshots_every_n_tokens_and_least_recently_used_out(model_cache):
    """snapshot_every=16: a 50-token prefill keeps its state at 16, 32 and 48 (also its last multiple
    of 16 before the last token), so a prompt sharing only its first 20 tokens resumes at 16; with one
    snapshot slot each new snapshot evicts the one before."""
    _, col = convert_case(model_cache, "qwen3_5_moe")
    with Engine.open(col, backend="reference", snapshot_every=16, state_snapshots=4, **HYBRID) as eng:
        V = vocab(eng)
        a = [(3 * j + 1) % V for j in range(50)]
        run(eng, a, n=1)
        snaps = eng.runner.states.snapshots
        assert snaps.taken == 3 and snaps.usage()["held"] == 3
        r, got = run(eng, a[:20] + [7, 7, 7, 7, 7])
        assert r.cached_tokens == 16
    with Engine.open(col, backend="reference", prefix_cache=False, **HYBRID) as fresh:
        assert run(fresh, a[:20] + [7, 7, 7, 7, 7])[1] == got
    with Engine.open(col, backend="reference", snapshot_every=16, state_snapshots=1, **HYBRID) as eng:
        run(eng, a, n=1)
        snaps = eng.runner.states.snapshots
        assert snaps.taken == 3 and snaps.evictions == 2
        assert run(eng, a[:20] + [7, 7, 7, 7, 7])[0].cached_tokens == 0     # 16's snapshot was evicted
        # that prefill kept its own at 16 (its last multiple of 16), evicting 48's
        assert run(eng, a[:40] + [7, 7])[0].cached_tokens == 16
    with pytest.raises(ColibriError) as e:
        Engine.open(col, backend="reference", snapshot_every=-1, **HYBRID)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT


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


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("backend", ["opencl", "cuda"])
def test_greedy_with_a_cached_prefix_on_gpu_backends(backend, case, model_cache):
    """The device backends read adopted blocks through the same block tables (a window pool's below
    the window EVICTED): turn 2's greedy tokens equal a fresh engine's."""
    need(backend)
    _, col = convert_case(model_cache, case)
    opts = dict(backend=backend, max_seq_len=96, max_batch=2, kv_block_size=4, **fp32(backend))
    with Engine.open(col, **opts) as eng:
        head, (p1, p2) = prompts(eng)
        eng.generate(p1, max_new_tokens=6, ignore_eos=True)
        r = eng.submit(p2, max_new_tokens=10, ignore_eos=True)
        got = [ev.token for ev in r.iter_events(timeout=300) if ev.kind == TOKEN]
        assert r.cached_tokens == 28
    with Engine.open(col, prefix_cache=False, **opts) as fresh:
        assert got == fresh.generate(p2, max_new_tokens=10, ignore_eos=True)


# -- sessions on disk ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend,case", [("reference", "mixtral"), ("cpu", "mixtral"), ("opencl", "mixtral"),
                                          ("reference", "gpt_oss"), ("cpu", "gpt_oss"), ("cpu", "gemma4")])
def test_a_saved_session_answers_the_next_turn_without_prefilling_it(backend, case, model_cache, tmp_path):
    """Turn 1 runs, its blocks are saved; a new engine (a restart) loads the file and turn 2 takes every
    saved block: its tokens and logprobs equal the first engine's turn 2 (reference, cpu: bit for bit
    also against a fresh engine without the file) and only the rest is prefilled. Sliding-window
    layers (gpt-oss, Gemma 4) save the blocks of the last window only, what turn 2 reads there."""
    need(backend)
    _, col = convert_case(model_cache, case)
    opts = dict(backend=backend, max_seq_len=96, max_batch=2, kv_block_size=4, **fp32(backend))
    path = str(tmp_path / "chat.session")
    with Engine.open(col, **opts) as eng:
        head, (p1, p2) = prompts(eng)
        _, out1 = run(eng, p1)
        turn1 = p1 + [t for t, _, _ in out1]
        assert eng.save_session(turn1, path) == (len(turn1) - 1) // 4 * 4
        _, want = run(eng, turn1 + p2[len(head):])
    with Engine.open(col, **opts) as restarted:
        assert restarted.load_session(path) == (len(turn1) - 1) // 4 * 4
        before = restarted.stats.prefill_tokens
        r, got = run(restarted, turn1 + p2[len(head):])
        assert r.cached_tokens == (len(turn1) - 1) // 4 * 4
        assert restarted.stats.prefill_tokens - before == len(turn1) + len(p2) - len(head) - r.cached_tokens
        assert restarted.kv_free_blocks == restarted.runner.pool.num_blocks
    if backend in ("reference", "cpu"):
        assert got == want
        with Engine.open(col, prefix_cache=False, **opts) as fresh:
            assert run(fresh, turn1 + p2[len(head):])[1] == got
    else:
        assert [t for t, _, _ in got] == [t for t, _, _ in want]


def test_a_session_of_another_model_or_a_damaged_file_is_refused(model_cache, tmp_path):
    from colibri_edge import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE
    _, col = convert_case(model_cache, "mixtral")
    _, other = convert_case(model_cache, "qwen3_moe")
    opts = dict(backend="reference", max_seq_len=96, max_batch=2, kv_block_size=4)
    path = tmp_path / "s.session"
    with Engine.open(col, **opts) as eng:
        head, (p1, _) = prompts(eng)
        with pytest.raises(ColibriError) as e:
            eng.save_session(p1, str(path))
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "run a request with it first" in e.value.message
        run(eng, p1)
        eng.save_session(p1, str(path))
    data = path.read_bytes()

    def refused(engine, blob, *words):
        bad = tmp_path / "bad.session"
        bad.write_bytes(blob)
        with pytest.raises(ColibriError) as e:
            engine.load_session(str(bad))
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and all(w in e.value.message for w in words), e.value
        assert engine.runner.pool.cached_blocks == 0          # nothing of it entered the cache
    with Engine.open(col, **opts) as eng:
        refused(eng, data[:len(data) // 2], "unreadable")
        refused(eng, b"\0" * 64, "unreadable")
        refused(eng, data.replace(b'"colibri-session"', b'"colibri-sessiox"'), "not a Colibri session")
        refused(eng, data.replace(b'"version":"1"', b'"version":"9"'), "version")
    with Engine.open(col, top_k=1, **opts) as eng:                 # same weights, other routing: other KV
        refused(eng, data, "another model")
    with Engine.open(other, **opts) as eng:
        refused(eng, data, "another model")
    with Engine.open(col, **dict(opts, kv_block_size=8)) as eng:
        refused(eng, data, "blocks of 4")
    with Engine.open(col, prefix_cache=False, **opts) as eng:
        with pytest.raises(ColibriError) as e:
            eng.load_session(str(path))
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE
    with Engine.open(col, **opts) as eng:                          # the intact file still loads
        assert eng.load_session(str(path)) == len(p1) // 4 * 4


def test_cache_dir_keeps_at_most_its_size_least_recently_used_out(model_cache, tmp_path):
    """serve --cache-dir's folder: a file per conversation with a name per whole block; past max_bytes
    the least recently used file goes with all its names, and a damaged file is removed, not loaded."""
    import os
    import time
    from colibri_edge.serving.diskcache import DiskCache
    _, col = convert_case(model_cache, "mixtral")
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=2, kv_block_size=4) as eng:
        V = vocab(eng)
        a, b = ([(m * j + 1) % V for j in range(21)] for m in (3, 5))
        disk = DiskCache(str(tmp_path), "m/x", eng, max_bytes=1 << 30)
        assert disk.dir == str(tmp_path / "m_x")
        run(eng, a, n=2)
        pa = disk.store(a)
        os.utime(pa, (time.time() - 60, time.time() - 60))
        run(eng, b, n=2)
        pb = disk.store(b)
        names = sorted(os.listdir(disk.dir))
        assert len(names) == 10                                        # 20 fed positions: 5 blocks each
        assert sum(os.path.samefile(pa, os.path.join(disk.dir, f)) for f in names) == 5
        disk.max_bytes = os.path.getsize(pb)
        disk.trim()
        left = os.listdir(disk.dir)
        assert len(left) == 5 and all(os.path.samefile(os.path.join(disk.dir, f), pb) for f in left)
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=2, kv_block_size=4) as eng:
        disk = DiskCache(str(tmp_path), "m/x", eng, max_bytes=1 << 30)
        assert disk.restore(b + [1, 2]) == 20 and disk.restore(a + [1, 2]) == 0
        with open(pb, "r+b") as f:
            f.truncate(100)
    with Engine.open(col, backend="reference", max_seq_len=96, max_batch=2, kv_block_size=4) as eng:
        disk = DiskCache(str(tmp_path), "m/x", eng, max_bytes=1 << 30)
        assert disk.restore(b + [1, 2]) == 0 and not os.path.exists(pb)


@pytest.mark.parametrize("case", ["olmoe", "qwen3_5_moe"])
def test_a_preempted_request_resumes_from_its_own_cached_blocks(case, model_cache):
    """A pool too small for three requests at once: preempted requests recompute their context; with
    the prefix cache they take back the whole blocks they had written (when not taken meanwhile; a
    hybrid model from its prompt's snapshot), so fewer tokens are prefilled than without it, and every
    answer is the same."""
    _, col = convert_case(model_cache, case)
    ps = [list(range(1, 14)), list(range(20, 37)), list(range(40, 55))]
    kv = 40
    if case == "qwen3_5_moe":                    # snapshots at multiples of 16: longer prompts
        ps, kv = [list(range(1, 22)), list(range(30, 53)), list(range(60, 80))], 64
    res = {}
    for cache in (True, False):
        with Engine.open(col, backend="reference", max_batch=3, max_seq_len=64, kv_block_size=4,
                         kv_cache_tokens=kv, prefix_cache=cache) as eng:
            outs = eng.generate_batch(ps, max_new_tokens=16, ignore_eos=True)
            res[cache] = (outs, eng._core.preemptions, eng.stats.prefill_tokens)
            assert eng.kv_free_blocks == eng.runner.pool.num_blocks
    (with_cache, pre_on, prefill_on), (without, pre_off, prefill_off) = res[True], res[False]
    assert with_cache == without and pre_on > 0 and pre_off > 0
    assert prefill_on < prefill_off, (prefill_on, prefill_off)
