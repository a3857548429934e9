"""One engine per process: `python workers.py KIND --job job.json --out result.json`.

Each worker measures one engine and writes a JSON result; peak RSS is its own process's
(getrusage ru_maxrss), so engines never share a heap. The job file carries the model paths, the
prompts and the run lengths (bench.py writes it). Kinds:

    bandwidth       NumPy/BLAS GEMV over a 512 MB float32 matrix: the machine's read bandwidth
    transformers    float32, torch.set_num_threads(threads); also writes the reference logits
    colibri         Colibri `cpu` backend at one weight type; first-token latency, then everything
    llama           llama.cpp through llama-cpp-python on a GGUF; parity with transformers first
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else None


def latency_summary(step_seconds, tokens_per_step):
    s = np.asarray(step_seconds, dtype=np.float64)
    return {"steps": int(s.size), "seconds": float(s.sum()), "tokens": int(s.size * tokens_per_step),
            "tokens_per_s": float(s.size * tokens_per_step / s.sum()) if s.size else None,
            "step_p50_ms": pct(s, 50) * 1e3, "step_p99_ms": pct(s, 99) * 1e3,
            "step_min_ms": float(s.min()) * 1e3, "step_max_ms": float(s.max()) * 1e3}


def best_of(reps, fn, tokens_per_step):
    """Run fn() -> (step latencies, extra) `reps` times; keep the fastest run (the CPU is shared, so the
    fastest is the least disturbed), and record every run's tokens/s."""
    runs = [fn() for _ in range(max(1, reps))]
    sums = [latency_summary(lat, tokens_per_step) for lat, _ in runs]
    i = int(np.argmax([x["tokens_per_s"] for x in sums]))
    best = sums[i]
    best["runs_tokens_per_s"] = [x["tokens_per_s"] for x in sums]
    return best, runs[i][1]


def max_rel_err(got: np.ndarray, ref: np.ndarray) -> dict:
    """Relative error of logits [positions, vocab]: per position max |got - ref| / max |ref|; the max
    over positions (the headline), the median, and how often the argmax agrees."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    per_pos = np.abs(got - ref).max(-1) / np.abs(ref).max()
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    return {"max_rel_err": float(per_pos.max()), "median_rel_err": float(np.median(per_pos)),
            "argmax_agree": agree, "positions": int(ref.shape[0])}


def rounded_like_gguf(model, qtype):
    """Round the model's weights in place to what the GGUF of `qtype` stores: every matrix (embedding,
    attention, experts, lm_head) in f16 or Q8_0, norms and the router kept in float32."""
    import gguf
    import torch
    Q = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith(".gate.weight"):
                continue
            a = p.detach().numpy()
            if qtype == "f16":
                p.copy_(torch.from_numpy(a.astype(np.float16).astype(np.float32)))
            else:
                flat = a.reshape(-1, a.shape[-1])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(flat, Q), Q).reshape(a.shape)))


# ------------------------------------------------------------------------------------------------
def bandwidth(job):
    """y = A @ x with A 512 MB float32 (sgemv): every byte of A read once per call."""
    from threadpoolctl import threadpool_info, threadpool_limits
    threads = job["threads"]
    rows, cols = 8192, 16384                         # 8192 * 16384 * 4 B = 512 MiB
    rng = np.random.default_rng(0)
    A = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal(cols, dtype=np.float32)
    y = np.empty(rows, np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        for _ in range(3):
            np.matmul(A, x, out=y)
        times = []
        for _ in range(job.get("reps", 15)):
            t0 = time.perf_counter()
            np.matmul(A, x, out=y)
            times.append(time.perf_counter() - t0)
    ref = A[:64].astype(np.float64) @ x
    assert np.allclose(y[:64], ref, rtol=1e-3, atol=1e-2), "GEMV gave wrong numbers"
    t = np.asarray(times)
    return {"bytes": A.nbytes, "threads": threads, "median_gbps": A.nbytes / np.median(t) / 1e9,
            "best_gbps": A.nbytes / t.min() / 1e9, "median_ms": float(np.median(t) * 1e3),
            "blas": [{k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                             "threading_layer", "filepath")} for i in info],
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS")}}


# ------------------------------------------------------------------------------------------------
def transformers_worker(job):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(job["threads"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["hf"], dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    prompts, n_dec = job["prompts"], job["decode_steps"]
    res = {"engine": "transformers", "precision": "float32", "load_s": load_s, "threads": torch.get_num_threads(),
           "attn_implementation": model.config._attn_implementation, "torch": torch.__version__}
    E = job["spec"]["num_local_experts"]
    distinct = []                                  # distinct experts a layer, per batch-4 decode step
    state = {"record": False}

    def router_hook(mod, inp, out):
        if not state["record"]:
            return
        logits = out[0] if isinstance(out, tuple) else out
        if logits.shape[-1] != E:
            return
        ids = torch.topk(logits.reshape(-1, E), job["spec"]["num_experts_per_tok"], dim=-1).indices
        distinct.append(int(torch.unique(ids).numel()))

    for name, mod in model.named_modules():
        if name.endswith(".gate") and ("block_sparse_moe" in name or name.split(".")[-2] == "mlp"):
            mod.register_forward_hook(router_hook)

    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        # reference logits for the parity checks of the other engines (every position)
        ref = model(input_ids=ids).logits[0].float().numpy()
        np.save(job["ref_logits"], ref)
        res["first_token_s"] = None

        def run(batch, steps, timed_prefill=True):
            x = torch.tensor(prompts[:batch])
            t0 = time.perf_counter()
            out = model(input_ids=x, use_cache=True, logits_to_keep=1)
            pre = time.perf_counter() - t0
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            lat, toks = [], [tok[:, 0].tolist()]
            state["record"] = batch > 1
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                lat.append(time.perf_counter() - t0)
                toks.append(tok[:, 0].tolist())
            state["record"] = False
            return pre, lat, toks

        run(1, 2)                                                   # warm-up
        pre = [run(1, 0)[0] for _ in range(job["prefill_reps"])]
        res["prefill"] = {"tokens": len(prompts[0]), "seconds": pre, "tokens_per_s": len(prompts[0]) / np.median(pre)}
        reps = job.get("decode_reps", 1)
        res["decode_b1"], toks = best_of(reps, lambda: run(1, n_dec)[1:], 1)
        res["tokens_b1"] = [t[0] for t in toks]
        res["decode_b4"], toks = best_of(reps, lambda: run(4, n_dec)[1:], 4)
        res["decode_b4"]["distinct_experts_per_layer"] = float(np.mean(distinct)) if distinct else None
    res["peak_rss"] = peak_rss()
    # after timing: reference logits of the weights exactly as each GGUF holds them, so llama.cpp's
    # check measures its mapping and arithmetic, not the rounding both share
    for qtype, path in job.get("rounded_refs", {}).items():
        del model
        model = AutoModelForCausalLM.from_pretrained(job["hf"], dtype=torch.float32)
        model.eval()
        rounded_like_gguf(model, qtype)
        with torch.inference_mode():
            np.save(path, model(input_ids=torch.tensor([prompts[0]])).logits[0].float().numpy())
    return res


# ------------------------------------------------------------------------------------------------
def _colibri_open(job, max_batch):
    from colibri_edge import Engine
    P, n = len(job["prompts"][0]), job["decode_steps"]
    seq = -(-(P + n + 2) // 16) * 16
    # prefix_cache off: the timed prefills repeat one prompt, which the cache would answer from its KV
    # blocks (a re-prefill of the last block, not of the prompt); interleave 0: a batch's prompts are
    # prefilled whole, a chunk a step, not in pieces beside its first decodes
    return Engine.open(job["model"], backend="cpu", max_batch=max_batch, max_seq_len=seq,
                       prefill_chunk=max(P, 16), num_threads=job["threads"], prefix_cache=False, interleave=0)


def colibri_first_token(job):
    """Import, open and the first token, in a fresh process (the Numba cache as NUMBA_CACHE_DIR finds it)."""
    t0 = time.perf_counter()
    import colibri_edge  # noqa: F401
    t_imp = time.perf_counter()
    eng = _colibri_open(job, 1)
    t_open = time.perf_counter()
    eng.generate(job["prompts"][0], max_new_tokens=1, ignore_eos=True)
    t_first = time.perf_counter()
    return {"import_s": t_imp - t0, "open_s": t_open - t_imp, "first_token_s": t_first - t_open,
            "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR"), "peak_rss": peak_rss()}


class StepTimer:
    """Wraps runner.step: times every decode step (one token per sequence)."""

    def __init__(self, runner):
        self.runner, self.inner, self.decode = runner, runner.step, []
        runner.step = self

    def __call__(self, entries, all_logits=False, stepwise=False):
        t0 = time.perf_counter()
        out = self.inner(entries, all_logits=all_logits, stepwise=stepwise)
        if all(len(t) == 1 for _, t in entries):
            self.decode.append((len(entries), time.perf_counter() - t0))
        return out


def colibri(job):
    from colibri_edge.analysis.sizing import summary
    first = colibri_first_token(job)                  # warm Numba cache: bench.py ran the cold one first
    prompts, n_dec = job["prompts"], job["decode_steps"]
    P = len(prompts[0])
    eng = _colibri_open(job, 4)
    res = {"engine": "colibri", "precision": job.get("label") or eng.config["weight_dtype"],
           "backend": eng.backend.describe(), "first_token_warm": first}
    summ = summary(eng.model, P + n_dec, 1)
    res["bytes_per_decoded_token"] = summ["bytes_per_decoded_token"]
    res["bytes_per_expert"] = summ["bytes_per_expert"]
    res["non_expert_read_bytes"] = summ["bytes_per_decoded_token"] - \
        len(eng.model.moe_layers) * eng.config["top_k"] * summ["bytes_per_expert"]
    # parity with transformers before timing
    ref = np.load(job["ref_logits"])
    got = eng.infer(np.asarray(prompts[0], np.int32))[0]
    res["parity"] = max_rel_err(got, ref)
    if job.get("llama_logits"):        # the same GGUF file under llama.cpp: max |diff| / max |logit|
        ll = np.load(job["llama_logits"])
        res["parity_llama"] = max_rel_err(got, ll)
    timer = StepTimer(eng.runner)
    from colibri_edge.runtime.hooks import RoutingHook

    class Distinct(RoutingHook):      # distinct experts per layer in batched decode steps
        def on_route(self, layer, ids, weights, next_layer, predicted):
            if 1 < ids.shape[0] <= 4 and timer.recording:
                distinct.append(len(np.unique(ids)))

    distinct = []
    eng.runner.hooks.append(Distinct())
    timer.recording = False
    eng.generate(prompts[0], max_new_tokens=4, ignore_eos=True)            # warm-up
    eng.generate_batch(prompts[:4], max_new_tokens=3, ignore_eos=True)
    pre = []
    for _ in range(job["prefill_reps"]):
        s0 = eng.stats.prefill_seconds
        eng.generate(prompts[0], max_new_tokens=1, ignore_eos=True)
        pre.append(eng.stats.prefill_seconds - s0)
    res["prefill"] = {"tokens": P, "seconds": pre, "tokens_per_s": P / np.median(pre)}
    def decode(batch):
        # n_dec decode steps: the first new token comes from the prefill, each step gives one more
        timer.decode.clear()
        timer.recording = batch > 1
        outs = eng.generate_batch(prompts[:batch], max_new_tokens=n_dec + 1, ignore_eos=True)
        timer.recording = False
        # a step's rows are prefill_chunk: the first sequences decode beside the later ones' prefill
        # chunks (~batch steps), the rest decode all `batch` sequences together: those are timed
        steps = [dt for b, dt in timer.decode if b == batch]
        assert len(steps) >= n_dec - 2 * batch, timer.decode[:8]
        return steps, outs

    reps = job.get("decode_reps", 1)
    res["decode_b1"], outs = best_of(reps, lambda: decode(1), 1)
    res["tokens_b1"] = outs[0]
    res["decode_b4"], outs = best_of(reps, lambda: decode(4), 4)
    res["decode_b4"]["distinct_experts_per_layer"] = float(np.mean(distinct))
    res["tokens_b4_first"] = outs[0][:8]
    if job.get("profile_steps"):
        import profile_decode
        res["profile"] = profile_decode.profile(eng, prompts[0], job["profile_steps"])
    res["peak_rss"] = peak_rss()
    eng.close()
    return res


# ------------------------------------------------------------------------------------------------
def llama(job):
    import llama_cpp
    from llama_cpp import Llama
    prompts, n_dec, threads = job["prompts"], job["decode_steps"], job["threads"]
    P = len(prompts[0])
    V = job["spec"]["vocab_size"]
    res = {"engine": "llama.cpp", "precision": job.get("label") or job["qtype"], "llama_cpp_python": llama_cpp.__version__}
    if job.get("no_extra_bufts"):
        # llama.cpp's extra CPU buffer types (AMX, the repacked layouts) off, as `--no-extra-bufts`
        # does for its own tools: bench.py asks for it only after the default run crashed
        default_params = llama_cpp.llama_model_default_params

        def no_extra():
            p = default_params()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama_model_default_params = no_extra
        import llama_cpp.llama as ll
        ll.llama_cpp.llama_model_default_params = no_extra
        res["extra_bufts"] = False
    t0 = time.perf_counter()
    llm = Llama(model_path=job["gguf"], n_ctx=P + 16, n_batch=P, n_ubatch=P, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False, seed=0)
    res["load_s"] = time.perf_counter() - t0
    # parity with transformers BEFORE any timing: every position's logits, against transformers' float32
    # model (reported) and against transformers on the weights rounded as this GGUF stores them (the
    # check: a wrong name, layout or rotary permutation gives O(1) errors at every position; shared
    # rounding can flip an expert choice at a rare position, hence the median)
    llm.eval(prompts[0])
    got = np.array(llm.scores[:P], dtype=np.float32)
    res["parity"] = max_rel_err(got, np.load(job["ref_logits"]))
    if job.get("ref_rounded"):         # the files we wrote; llama.cpp's own quantiser's files have no such ref
        res["parity_same_rounding"] = chk = max_rel_err(got, np.load(job["ref_rounded"]))
        limit, agree = job["parity_limit"][job["qtype"]]
        if not (chk["median_rel_err"] <= limit and chk["argmax_agree"] >= agree):
            raise SystemExit(f"llama.cpp {job['qtype']} disagrees with transformers on the same weights: {chk} "
                             f"(limits: median rel err {limit}, argmax agreement {agree}): the GGUF is wrong, not "
                             "timing it")
    if job.get("save_logits"):         # Colibri on the same file is compared with these
        np.save(job["save_logits"], got)
    # llama.cpp's defaults, as a user gets them: weight repacking (extra buffer types) on
    res["use_extra_bufts"] = bool(llama_cpp.llama_model_default_params().use_extra_bufts)
    model = llm.model if hasattr(llm, "model") and llm.model is not None else llm._model.model

    def context(n_seq, n_ctx):
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, max(P, 4), max(P, 4)
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = n_seq, threads, threads
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = True
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError(f"llama_init_from_model failed for n_seq_max={n_seq}")
        return ctx

    def clear(ctx):
        if hasattr(llama_cpp, "llama_get_memory"):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        else:
            llama_cpp.llama_kv_self_clear(ctx)

    def decode(ctx, batch, toks, seqs, pos, want):
        batch.n_tokens = len(toks)
        for i, (t, s, p, w) in enumerate(zip(toks, seqs, pos, want)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
            batch.seq_id[i][0], batch.logits[i] = s, 1 if w else 0
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits_row(ctx, i):
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(V,))

    ctx1 = context(1, P + n_dec + 16)
    batch = llama_cpp.llama_batch_init(max(P, 4), 0, 4)
    try:
        def prefill(ctx, nseq):
            firsts = []
            t0 = time.perf_counter()
            for s in range(nseq):
                decode(ctx, batch, prompts[s], [s] * P, list(range(P)), [i == P - 1 for i in range(P)])
                firsts.append(int(logits_row(ctx, -1).argmax()))
            return time.perf_counter() - t0, firsts

        def generate(ctx, nseq, steps):
            clear(ctx)
            pre, toks = prefill(ctx, nseq)
            seqs = [[t] for t in toks]
            lat = []
            for step in range(steps):
                t0 = time.perf_counter()
                decode(ctx, batch, [s[-1] for s in seqs], list(range(nseq)), [P + step] * nseq, [True] * nseq)
                for i in range(nseq):
                    seqs[i].append(int(logits_row(ctx, i).argmax()))
                lat.append(time.perf_counter() - t0)
            return pre, lat, seqs

        generate(ctx1, 1, 4)                                        # warm-up
        pre = []
        for _ in range(job["prefill_reps"]):
            clear(ctx1)
            pre.append(prefill(ctx1, 1)[0])
        res["prefill"] = {"tokens": P, "seconds": pre, "tokens_per_s": P / np.median(pre)}
        reps = job.get("decode_reps", 1)
        res["decode_b1"], seqs = best_of(reps, lambda: generate(ctx1, 1, n_dec)[1:], 1)
        res["tokens_b1"] = seqs[0]
        try:
            ctx4 = context(4, 4 * (P + n_dec + 16))
        except Exception as e:  # noqa: BLE001
            res["decode_b4"] = {"na": f"llama-cpp-python could not make a 4-sequence context: {e}"}
        else:
            generate(ctx4, 4, 2)                                    # warm-up
            res["decode_b4"], seqs = best_of(reps, lambda: generate(ctx4, 4, n_dec)[1:], 4)
            res["decode_b4"]["api"] = "llama_cpp low-level: llama_batch with 4 seq_ids per llama_decode"
            res["tokens_b4_first"] = seqs[0][:8]
            llama_cpp.llama_free(ctx4)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx1)
    res["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace")
    res["peak_rss"] = peak_rss()
    return res


KINDS = {"bandwidth": bandwidth, "transformers": transformers_worker, "colibri": colibri,
         "colibri_first_token": colibri_first_token, "llama": llama}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--job", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    job = json.load(open(a.job))
    res = KINDS[a.kind](job)
    res["pid"] = os.getpid()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
