"""Helpers shared by the test files (conftest.py holds only fixtures): the backends expected here and
the variants each backend's suites run with, engine options, logits comparisons, routing hooks that
record what the engine did, and the checks every family's suite runs. No test file imports another."""
import json
import os
import tracemalloc

import numpy as np
import pytest

from colibri_edge.backends import create, probe
from colibri_edge.runtime.hooks import RoutingHook

# Backends the machine is expected to have: a missing one fails instead of skipping, so a broken
# install can never pass as "skipped" in CI (.ci/run sets this).
REQUIRED = {b for b in os.environ.get("COLIBRI_REQUIRE_BACKENDS", "").split(",") if b}
ALL_BACKENDS = ("reference", "cpu", "opencl", "cuda")

# Backend options of the kernel suite (create(name, **options)): each variant reaches another path.
KERNEL_VARIANTS = {
    "cpu": {"": {}, "1thread": {"num_threads": 1}, "f32act": {"int8_activations": False}},
    "opencl": {"": {}, "3queues": {"num_streams": 3}},
    "cuda": {"": {}, "3streams": {"num_streams": 3}, "nocublas": {"use_cublas": False}},
}
# Engine.open options of the whole-model suites: prefill chunks that reach each matmul path
# (GEMV / blocked / tiled or cuBLAS sized steps), block sizes, and queue or stream counts.
# fp32 compute everywhere (disable_fp16) where the backend has an fp16 mode: parity is at 1e-4.
ENGINE_VARIANTS = {
    "reference": {"": {}},
    "cpu": {"": {}, "chunk5": {"prefill_chunk": 5, "kv_block_size": 3}},
    "opencl": {"": {"disable_fp16": True}, "chunk8-3queues": {"disable_fp16": True, "prefill_chunk": 8,
                                                                 "kv_block_size": 4, "num_streams": 3}},
    "cuda": {"": {"disable_fp16": True}, "chunk6": {"disable_fp16": True, "prefill_chunk": 6},
             "2streams": {"disable_fp16": True, "num_streams": 2}},
}


def backend_available(name):
    ok, detail = probe(name)
    if not ok and name in REQUIRED:
        pytest.fail(f"backend {name} is required here (COLIBRI_REQUIRE_BACKENDS) but unavailable: {detail}")
    return ok, detail


def need(name):
    ok, detail = backend_available(name)
    if not ok:
        pytest.skip(f"backend {name} unavailable: {detail}")


def pairs(table, names):
    return [pytest.param((b, opts), id=f"{b}-{v}" if v else b) for b in names for v, opts in table[b].items()]


def fp32(name) -> dict:
    """Engine.open options for float32 compute on `name` (backends with an fp16 mode take disable_fp16)."""
    from colibri_edge.backends import backend_class
    return {"disable_fp16": True} if "disable_fp16" in backend_class(name).OPTIONS else {}


# The cpu backend decodes block formats with int8 activations by default (llama.cpp's arithmetic:
# activation quantisation error on purpose, checked exactly against a NumPy emulation in
# test_kernels.py); whole-model parity at float32 tolerance runs with it off, and the default is
# held to the error int8 activations make.
INT8_ACTIVATION_TOL = 0.05            # median over positions of |logit error| / |logits| (L2): measured
# 0.3-2% on the test models; a top-k expert choice that flips at one position (the activations'
# rounding moved a router logit past another) gives that position 30-50%, hence the median


def activation_runs(name, opts, tol):
    """[(Engine.open options, tolerance)] for a whole model in block formats on backend `name`."""
    from colibri_edge.backends import backend_class
    if "int8_activations" in backend_class(name).OPTIONS:
        return [({**opts, "int8_activations": False}, tol), ({**opts, "int8_activations": True}, INT8_ACTIVATION_TOL)]
    return [(opts, tol)]


def close(got, want, tol) -> bool:
    """Logits agree: within tol of max |logit| everywhere (float32 tolerances), or for the int8
    tolerance the median position within it (L2) and the same argmax at 80% of positions."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if tol < INT8_ACTIVATION_TOL:
        return float(np.abs(got - want).max() / np.abs(want).max()) < tol
    per = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    return float(np.median(per)) < tol and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def chat_turns(eng, n_shared=29, tails=(5, 9)):
    """Prompts of a conversation (prefix caching): a shared opening of n_shared token ids and turns that
    continue it, one per tail length. -> (opening, [turns])."""
    V = eng.config["vocab_size"]
    head = [(5 * j + 2) % V for j in range(n_shared)]
    return head, [head + [(11 * j + 7 * t) % V for j in range(t)] for t in tails]


def run_logprobs(eng, prompt, n=8):
    """n greedy tokens and each one's logprob and top-5 (floats, compared exactly) -> (request, [(token,
    logprob, top-5)])."""
    from colibri_edge.requests.scheduler import TOKEN
    req = eng.submit(prompt, max_new_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=5)
    evs = [ev for ev in req.iter_events(timeout=120) if ev.kind == TOKEN]
    return req, [(ev.token, ev.logprob, tuple(ev.top_logprobs)) for ev in evs]


class ExpertIds(RoutingHook):
    """Records the expert ids every MoE layer chose, token by token."""

    def __init__(self, engine):
        self.be, self.ids = engine.backend, {}
        engine.runner.hooks.append(self)

    def on_route(self, layer, ids, weights, next_layer, predicted):
        self.ids.setdefault(layer, []).append(np.array(self.be.download(ids)))

    def by_layer(self):
        return {l: np.concatenate(v) for l, v in self.ids.items()}


FAMILY_TOL = 1e-4   # max |colibri - transformers| / max |transformers logit| for the family suites


def check_batch_single_ragged(eng, batch, want, choices, oracle, min_margin):
    """The engine's logits of a batch [3, n], its second prompt alone and ragged prompts (the first's
    first 5 tokens, the third) within FAMILY_TOL of max |want| (oracle(ids) gives the 5-token prompt's), and
    each token's experts equal to the oracle's router choice (choices: layer -> (ids, margin)) wherever
    the k-th and (k+1)-th scores are more than min_margin apart, at 90% of the positions or more."""
    ids = ExpertIds(eng)
    got = eng.infer(batch)
    eng.runner.hooks.clear()
    single = eng.infer(batch[1])
    ragged = eng.infer([batch[0][:5], batch[2]])
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < FAMILY_TOL
    assert np.abs(single[0] - want[1]).max() / scale < FAMILY_TOL
    assert np.abs(ragged[0] - oracle(batch[:1, :5])[0]).max() / scale < FAMILY_TOL
    assert np.abs(ragged[1] - want[2]).max() / scale < FAMILY_TOL
    compared = 0
    mine = ids.by_layer()
    for layer, (hf_idx, margin) in choices.items():
        for t in np.flatnonzero(margin > min_margin):
            assert sorted(mine[layer][t]) == sorted(hf_idx[t]), (layer, t)
            compared += 1
    assert compared > 0.9 * sum(len(m) for _, m in choices.values())


def check_slot_pool(opener, vocab):
    """Experts streamed through 4 slots (opener(expert_slots=4)): the same logits and 8 greedy tokens
    as with every expert resident (opener()), with slot misses on the way."""
    ids = np.random.default_rng(5).integers(0, vocab, size=(2, 9))
    prompt = [3, 9, 27, 81, 2, 6, 18]
    with opener() as eng:
        want, want_gen = eng.infer(ids), eng.generate(prompt, max_new_tokens=8, ignore_eos=True)
    with opener(expert_slots=4) as eng:
        got = eng.infer(ids)
        assert eng.generate(prompt, max_new_tokens=8, ignore_eos=True) == want_gen
        assert eng.slot_stats["misses"] > 0
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


class Held(RoutingHook):
    """The blocks each paged pool holds for the one sequence, after every step."""

    def __init__(self, runner):
        self.runner, self.after = runner, []
        runner.hooks.append(self)

    def begin_step(self, entries, positions):
        self.seq = entries[0][0]

    def end_step(self):
        pools = self.runner.states.paged
        self.after.append((self.seq.cached, [p.held(self.seq, i) for i, p in enumerate(pools)],
                           [p.num_blocks - p.free_blocks for p in pools]))


def backend_pair(spec):
    """(the reference backend, the backend under test) for a kernel_backend spec (name, options)."""
    name, opts = spec
    return create("reference"), create(name, **opts)


def dev(be, host):
    """host array -> a device buffer of the same shape and dtype."""
    buf = be.alloc(host.shape, host.dtype)
    be.upload_into(buf, np.ascontiguousarray(host))
    return buf


def kernel_close(a, b, tol=2e-5):
    """Kernel outputs agree: max |a - b| within tol of max(1, max |b|)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, np.abs(b).max())
    assert np.abs(a - b).max() <= tol * scale, f"max abs err {np.abs(a - b).max():.3g} (scale {scale:.3g})"


def edit_json(path, name, fn):
    """Apply fn to the JSON file `name` of the model directory `path`, in place."""
    p = os.path.join(path, name)
    obj = json.load(open(p))
    fn(obj)
    with open(p, "w") as f:
        json.dump(obj, f)


def refused(path, *words, code=None):
    """Opening `path` raises ColibriError with `code` (default COLIBRI_ERR_INVALID_MODEL) naming every word."""
    from colibri_edge import ColibriError, COLIBRI_ERR_INVALID_MODEL, Engine
    code = COLIBRI_ERR_INVALID_MODEL if code is None else code
    with pytest.raises(ColibriError) as ei:
        Engine.open(path, backend="reference")
    assert ei.value.code == code, ei.value
    for w in words:
        assert w in ei.value.message, (w, ei.value.message)
    return ei.value


def refused_edit(col, dst, edit, field, words):
    """A copy of the model directory `col` at `dst` with config.json edited by `edit` is refused naming
    `field` and `words` (the config's fields are typed and ranged, refused by name)."""
    import shutil
    shutil.copytree(col, dst)
    edit_json(dst, "config.json", edit)
    e = refused(dst)
    assert field in e.message and words in e.message, e.message


def greedy_runner(col, prompt_len=11, warmup=4):
    """An engine's runner with one sequence prefilled and `warmup` decode steps done;
    returns (engine, step) where step() runs one more greedy decode step."""
    from colibri_edge import Engine
    eng = Engine.open(col, backend="cpu", max_seq_len=128, max_batch=2)
    r = eng.runner
    seq = r.new_sequence(1)
    prompt = list(range(3, 3 + prompt_len))
    r.reserve(seq, len(prompt))
    state = {"logits": r.step([(seq, prompt)])}

    def step():
        tok = int(state["logits"][-1].argmax())
        r.reserve(seq, 1)
        state["logits"] = r.step([(seq, [tok])])

    for _ in range(warmup):
        step()
    return eng, step


def peak_step_bytes(col, steps=32) -> int:
    """The most Python/NumPy heap a greedy decode step of the model at `col` (cpu) allocated, over `steps`."""
    eng, step = greedy_runner(col)
    tracemalloc.start()
    try:
        worst = 0
        for _ in range(steps):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            step()
            worst = max(worst, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
        eng.close()
    return worst


class Server:
    """An ASGI app (serve.create_app(...)) served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app):
        import socket
        import threading
        import uvicorn
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            self.port = sk.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        import time
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def lattice_blocks(w32, wd):
    """The lattice i-quants have no quantiser: random valid blocks (seeded by w32), each block's f16 scale
    set so its RMS is w32's there (d at byte 0; iq1_m: the four scales' top nibbles). Both sides of a
    comparison read the same bytes."""
    import zlib
    from colibri_edge.model import quant
    B, nb = quant.BLOCK[wd]
    b = np.asarray(w32, np.float32).reshape(-1, B)
    raw = np.random.default_rng(zlib.crc32(b.tobytes())).integers(0, 256, (len(b), nb), dtype=np.uint8)

    def set_d(d):
        bits = np.asarray(d, np.float16).view(np.uint16).astype(np.uint32)
        if wd == "iq1_m":
            for j, at in enumerate((49, 51, 53, 55)):
                raw[:, at] = (raw[:, at] & 15) | (((bits >> (4 * j)) & 15) << 4).astype(np.uint8)
        else:
            raw[:, 0], raw[:, 1] = (bits & 255).astype(np.uint8), (bits >> 8).astype(np.uint8)
    set_d(np.ones(len(b)))
    w = quant.dequantize(raw, wd, B).astype(np.float64)
    set_d(np.sqrt((b.astype(np.float64) ** 2).mean(1) / np.maximum((w ** 2).mean(1), 1e-30)))
    return raw.reshape(w32.shape[0], -1)


def stored_weights(w32, wd):
    """float32 [rows, cols] -> (stored array, row scales or None) in weight type wd: int8 with its row
    scales, our quantisers, or (the lattice i-quants, no quantiser) lattice_blocks."""
    from colibri_edge.model import quant
    from colibri_edge.model.dtypes import narrow, quantize_rows
    if wd == "int8":
        return quantize_rows(w32)
    if wd in quant.BLOCK and wd not in quant.QUANTIZERS:
        return lattice_blocks(w32, wd), None
    return narrow(w32, wd), None


class OracleDrafter:
    """A drafter (requests/draft.py's interface) that knows the sequence the model will produce: it
    proposes the continuation of `target` (prompt + the undrafted output) from the position it has seen,
    with every `wrong`-th proposed position replaced by another token (a miss the verifier must reject
    and roll back), so a test reaches accepted runs, rejections and the bonus token at will. Registered
    in draft.DRAFTERS by the tests under a name of their own."""
    targets: dict = {}                  # tuple(prompt) -> the whole sequence (prompt + greedy output)
    wrong = 3

    def __init__(self):
        self.seq = []

    def extend(self, tokens):
        self.seq.extend(int(t) for t in tokens)

    def propose(self, k):
        for prompt, target in self.targets.items():
            n = len(prompt)
            if tuple(self.seq[:n]) == prompt and self.seq == list(target[:len(self.seq)]):
                out = list(target[len(self.seq):len(self.seq) + k])
                for j in range(len(out)):
                    if (len(self.seq) + j) % self.wrong == 0:
                        out[j] = (out[j] + 1) % 7 + 3
                return out
        return []


def mtp_logits(eng, ids) -> np.ndarray:
    """The engine's MTP head over a sequence: the model steps ids[:-1], then the head runs at positions
    0..T-2 on tokens ids[1:] and the model's hidden rows -> [T-1, V] (hf_models.reference_mtp_logits's
    rows); the engine was opened with draft='mtp' or 'auto'."""
    r = eng.runner
    seq = r.new_sequence(0)
    try:
        r.reserve(seq, len(ids))
        r.step([(seq, ids[:-1])])
        rows = r.row_of[id(seq)] + np.arange(len(ids) - 1)
        return np.array(eng.backend.host_view(r.mtp_step([(seq, 0, ids[1:], rows)], all_logits=True)))
    finally:
        r.free(seq)
