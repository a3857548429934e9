"""What `colibri inspect` says the engine allocates is what the backend allocates: the arena
(activations, scratch, plans, step inputs) and the per-sequence state (KV blocks), byte for byte,
for several (prefill chunk, max batch) pairs on every model type and backend; and the state pools
fail one sequence alone."""
import re
import subprocess
import sys

import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_OUT_OF_MEMORY
from colibri_edge.analysis.sizing import engine_memory, summary
from colibri_edge.runtime.state import FixedPool, PagedPool, States
from hf_models import CASES, convert_case

PAIRS = [(1, 1), (7, 3), (64, 8), (256, 2)]      # (prefill_chunk, max_batch)


def allocated(engine):
    """Bytes of every buffer the engine's runner holds on its backend."""
    r = engine.runner
    return sum(int(b.nbytes) for b in r.a.values()), sum(int(b.nbytes) for b in r.state_storage.values())


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect_equals_allocation(backend_name, case, model_cache):
    _, col = convert_case(model_cache, case)
    for chunk, batch in PAIRS:
        context, block = 48, 5
        with Engine.open(col, backend=backend_name, max_seq_len=context, max_batch=batch, prefill_chunk=chunk,
                         kv_cache_tokens=context * batch, kv_block_size=block) as eng:
            arena, state = allocated(eng)
            s = summary(eng.model, context, batch, chunk, block)
            assert (s["scratch_bytes"], s["kv_cache_bytes"]) == (arena, state), (chunk, batch)
            assert eng.runner.arena_bytes == arena
            kv_tokens = engine_memory(eng.config, context, batch, chunk, context * batch, block)["kv_tokens"]
            assert state == kv_tokens * s["kv_bytes_per_token"]


def test_inspect_prints_the_allocation(model_cache):
    _, col = convert_case(model_cache, "qwen2_moe")
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "inspect", col, "--context", "40", "--max-batch", "3",
                        "--prefill-chunk", "7", "--block-size", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    arena, kv = map(int, re.search(r"allocated at open: arena (\d+) bytes, KV cache (\d+) bytes", r.stdout).groups())
    with Engine.open(col, backend="reference", max_seq_len=40, max_batch=3, prefill_chunk=7, kv_cache_tokens=120,
                     kv_block_size=4) as eng:
        assert (arena, kv) == allocated(eng)


def test_state_pools_fail_one_sequence_alone():
    """Paged blocks and fixed slots in one engine's state: a sequence that cannot get either fails
    with COLIBRI_ERR_OUT_OF_MEMORY naming the pool, and nothing of it or of any other sequence moves."""
    st = States([PagedPool("KV cache", [0, 1], num_blocks=5, block_size=4, per_token=(2, 8)),
                 FixedPool("recurrent state", [2], num_slots=2, per_seq={"conv": (3, 16), "ssm": (4, 8, 8)})],
                max_seq_len=64)
    a, b, c = st.new(1), st.new(2), st.new(3)
    st.reserve(a, 9)                                  # 3 blocks, slot
    st.reserve(b, 4)                                  # 1 block, slot
    assert (st.paged[0].free_blocks, st.fixed[0].free_slots) == (1, 0)
    with pytest.raises(ColibriError) as ei:           # blocks would fit, but no slot is free
        st.reserve(c, 2)
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "recurrent state" in ei.value.message
    assert c.tables == [[]] and c.slots == [-1] and st.paged[0].free_blocks == 1
    with pytest.raises(ColibriError) as ei:           # a slot it has, but 2 more blocks are not there
        st.reserve(b, 12)
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "KV cache" in ei.value.message
    assert len(b.tables[0]) == 1 and st.paged[0].free_blocks == 1
    st.release(a)
    st.reserve(c, 2)                                  # now it fits
    assert st.usage() == {"KV cache": {"kind": "paged", "blocks": 5, "free": 3, "block_size": 4, "cached": 0, "idle": 0},
                          "recurrent state": {"kind": "fixed", "slots": 2, "free": 0}}
    for s in (b, c):
        st.release(s)
    assert (st.paged[0].free_blocks, st.fixed[0].free_slots) == (5, 2)
    storage = st.storage()
    assert storage[(0, 0, "k")] == (20, 2, 8) and storage[(1, 2, "ssm")] == (2, 4, 8, 8)
    assert st.fixed[0].bytes_per_seq() == 4 * (3 * 16 + 4 * 8 * 8)
