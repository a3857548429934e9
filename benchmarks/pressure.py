"""Models bigger than the memory they get (part of `make bench`; issues 21 and 50): Colibri streaming
experts through its slot pool against Colibri and llama.cpp through the memory map, each engine alone
in a memory cgroup of the benchmark's own.

    python benchmarks/pressure.py [--fractions 0.5,0.25] [--routers skewed,uniform] [--policy lru]
                                  [--stream-slots auto] [--big-experts 32] [--sim-slots 0,5,8,16,24,32]  (root)

The models: the Mixtral-shaped benchmark model (models.py; float16, 1.28 GB of weights, 64 experts),
with its own random router ("uniform") and with a skewed one ("skewed": every token embedding gets a
shared direction u and every router row e gets b_e u, with b_e = -1.2 ln(rank_e) over a per-layer
random ranking -- Zipf-like popularity; the routing entropy is reported); the same checkpoint becomes
the Colibri model directory and the f16 GGUF llama.cpp runs. The big model: the same shape with 32
experts a layer (4.3 GiB), skewed.

The matrix (run_matrix): per router and memory fraction (the cgroup's limit = fraction x the weights
file): Colibri through the memory map (slots=0), Colibri streaming (--stream-slots, cold: no routing
heat yet; learned: the same workload again, its heat pinning the hot set; direct reads where
probe-device's measurement of the drive chose them), llama.cpp (llama-server, mmap); and the ceiling,
every expert resident without a limit.

The big model (big_model_check): streamed in a cgroup of its weights / --big-factor, cold and
learned, --big-repeats times each; the best and median against the simulator's prediction for the
run's own slot count and hot set, at probe-device's rate and at the rate the run's drive gave.

The simulator check (simulator_check): without the cgroup, per slot count, the prediction of
`colibri simulate --device this`'s formula against a measured run.

The pressure: each engine process runs alone in the cgroup `colibri-pressure` (memory.max on v2,
memory.limit_in_bytes on v1), which also caps its page cache; the model's file pages are dropped
from the page cache (posix_fadvise DONTNEED) before each run.

Measured per engine: decode tok/s (one stream, prompts of 32 ids, --new tokens each, three prompts,
the first a warm-up), p50 / p99 time between tokens, bytes read from storage per decoded token and
major faults (/proc/PID/io read_bytes and /proc/PID/stat majflt, before and after the timed prompts),
and Colibri's slot pool numbers (hit rate, hot set, lookahead recall, share of load time hidden).
llama.cpp: llama-server (benchmarks/llama_server.py), streamed, the times between its chunks
(--llama-new tokens a prompt: it is slow under pressure). Results: results/<--name>.md, .json.
Nothing here is a timed test.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
CG_NAME = "colibri-pressure"


def log(msg):
    print(f"[pressure] {msg}", file=sys.stderr, flush=True)


# -- the model --------------------------------------------------------------------------------------
def skewed_hf(src: str, dst: str, s: dict) -> str:
    """src's checkpoint with a Zipf-like router skew (module docstring); stamped like models.build_hf."""
    import models
    from safetensors.numpy import load_file, save_file
    src_stamp = json.load(open(os.path.join(src, ".bench-stamp.json")))["stamp"]
    stamp = models._stamp({"src": src_stamp, "skew": 1.2, "v": 1})
    if models._fresh(dst, stamp):
        return dst
    log(f"writing the skewed checkpoint {dst} ...")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    rng = np.random.default_rng(21)
    H, E = s["hidden_size"], s["num_local_experts"]
    u = rng.standard_normal(H).astype(np.float32)
    u /= np.linalg.norm(u)
    ranks = [rng.permutation(E) + 1 for _ in range(s["num_hidden_layers"])]
    for shard in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):   # one shard in memory at a time
        t = load_file(os.path.join(src, shard))
        if "model.embed_tokens.weight" in t:
            emb = t["model.embed_tokens.weight"]
            t["model.embed_tokens.weight"] = (emb + 2.0 * float(np.linalg.norm(emb, axis=1).mean()) *
                                              u[None, :]).astype(np.float32)
        for i in range(s["num_hidden_layers"]):
            name = f"model.layers.{i}.block_sparse_moe.gate.weight"
            if name in t:
                b = -1.2 * np.log(ranks[i]).astype(np.float32) / (0.9 * np.sqrt(H))   # u's part of a normed h: ~0.9 sqrt(H)
                t[name] = (t[name] + b[:, None] * u[None, :]).astype(np.float32)
        save_file(t, os.path.join(dst, shard), metadata={"format": "pt"})
        del t
    for f in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    models._mark(dst, stamp)
    return dst


# -- the cgroup ---------------------------------------------------------------------------------------
class Cgroup:
    """A memory cgroup of our own (v2 if mounted as the unified hierarchy with the memory controller,
    else v1); `wrap(cmd)` runs cmd inside it."""

    def __init__(self, limit: int):
        v2 = "/sys/fs/cgroup/cgroup.controllers"
        if os.path.exists(v2) and "memory" in open(v2).read().split():
            self.dir, self.limit_file = f"/sys/fs/cgroup/{CG_NAME}", "memory.max"
        elif os.path.isdir("/sys/fs/cgroup/memory"):
            self.dir, self.limit_file = f"/sys/fs/cgroup/memory/{CG_NAME}", "memory.limit_in_bytes"
        else:
            raise SystemExit("no memory cgroup controller here (cgroup v2 memory or v1 memory); run as root")
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, self.limit_file), "w") as f:
            f.write(str(int(limit)))
        self.limit = int(limit)

    def wrap(self, cmd: list) -> list:
        procs = os.path.join(self.dir, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]

    def close(self):
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_counters(pid: int) -> tuple[int, int]:
    """(read_bytes from storage, major faults) of a process."""
    rb = 0
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                rb = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return rb, int(fields[9])                    # majflt: field 12 of stat, 10th after the comm


# -- the engines ----------------------------------------------------------------------------------------
def colibri_worker(a):
    """Runs inside the cgroup: open, warm up, decode; prints one JSON line."""
    from colibri_edge import Engine
    from colibri_edge.requests.engine import Stats
    import models
    s = models.spec(False)
    slots = None if a.slots in ("0", "none") else ("auto" if a.slots == "auto" else int(a.slots))
    prompts = models.prompts(s, 32, 3)
    with Engine.open(a.model, backend="cpu", max_seq_len=32 + a.new + 8, max_batch=1, expert_slots=slots,
                     slot_policy=a.policy) as eng:
        eng.generate(prompts[0], max_new_tokens=a.new, ignore_eos=True)
        rb0, mf0 = proc_counters(os.getpid())
        eng.stats = Stats()
        t0 = time.perf_counter()
        times = []
        for p in prompts[1:]:
            last = None
            for ev in eng.submit(p, max_new_tokens=a.new, ignore_eos=True).iter_events():
                now = time.perf_counter()
                if last is not None:
                    times.append(now - last)
                last = now
        wall = time.perf_counter() - t0
        rb1, mf1 = proc_counters(os.getpid())
        st = eng.stats
        n = st.decode_tokens
        out = {"engine": f"colibri slots={a.slots}" + (f" {a.policy}" if slots else ""),
               "decode_tok_s": n / st.decode_seconds, "tokens": n, "wall_s": wall,
               "itl_p50_ms": 1e3 * float(np.percentile(times, 50)), "itl_p99_ms": 1e3 * float(np.percentile(times, 99)),
               "read_bytes_per_token": (rb1 - rb0) / n, "major_faults_per_token": (mf1 - mf0) / n,
               "slot_stats": eng.slot_stats, "slot_choice": eng.slot_choice,
               "expert_counts": np.asarray(eng.expert_counts).tolist()}
    print("RESULT " + json.dumps(out), flush=True)


def warm_cache(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def run_colibri(cg, model, slots, policy, new, files, resident=False, env=None):
    """One worker process, inside the cgroup (cg None: without one); resident: the weights file read
    into the page cache first (truly all resident), else its pages dropped first."""
    if resident:
        warm_cache(files)
    else:
        drop_cache(files)
    wrap = cg.wrap if cg is not None else (lambda c: c)
    cmd = wrap([sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--slots", slots,
                   "--policy", policy, "--new", str(new)])
    env = {**os.environ, "COLIBRI_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2", **(env or {})}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return {"engine": f"colibri slots={slots}", "error": (r.stderr or r.stdout)[-800:]}
    return json.loads(lines[0][7:])


def run_llama(cg, exe, gguf, new, files, s):
    import httpx
    import models
    from serve_bench import free_port, wait_ready
    drop_cache(files)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = cg.wrap([exe, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2", "-c", "256",
                   "--parallel", "1", "--no-warmup"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(url, proc, timeout=900)
        prompts = models.prompts(s, 32, 3)

        def one(p):
            body = {"prompt": p, "n_predict": new, "ignore_eos": True, "temperature": 0, "stream": True,
                    "cache_prompt": False}
            times, last, n = [], None, 0
            with httpx.stream("POST", url + "/completion", json=body, timeout=3600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        now = time.perf_counter()
                        if last is not None:
                            times.append(now - last)
                        last, n = now, n + 1
            return times, n
        one(prompts[0])
        rb0, mf0 = proc_counters(proc.pid)
        t0 = time.perf_counter()
        times, n = [], 0
        for p in prompts[1:]:
            tt, k = one(p)
            times += tt
            n += k
        wall = time.perf_counter() - t0
        rb1, mf1 = proc_counters(proc.pid)
        return {"engine": "llama.cpp (llama-server, mmap)", "decode_tok_s": len(times) / sum(times), "tokens": n,
                "wall_s": wall, "itl_p50_ms": 1e3 * float(np.percentile(times, 50)),
                "itl_p99_ms": 1e3 * float(np.percentile(times, 99)), "read_bytes_per_token": (rb1 - rb0) / n,
                "major_faults_per_token": (mf1 - mf0) / n}
    except SystemExit as e:
        return {"engine": "llama.cpp (llama-server, mmap)", "error": str(e)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def predict_timed(tr, n, policy, prof, new, pinned=(), prompt_len=32):
    """The simulator's ms per decoded token of the benchmark's timed steps (the decode steps of every
    prompt but the first, the warm-up), replaying the whole trace through SlotCache as the engine does
    (n slots, 0: all resident; pinned: the hot set the engine pinned at open) and pricing those steps'
    waves with simulate.estimate. -> (the timed counters + the estimate, the cache or None)."""
    from colibri_edge.analysis.simulate import estimate
    from colibri_edge.runtime.slots import SlotCache
    blob = int(tr.meta["bytes_per_expert"])
    seqs = list(dict.fromkeys(tr.seq_ids.tolist()))
    L = len(tr.layer_ids)
    cache = SlotCache(n, policy, blob) if n else None
    if cache is not None:
        cache.pin(pinned)
    timed = {"slots": n, "misses": 0, "cold_misses": 0, "tokens": 0}
    events = {}
    for _, idx in tr.steps():
        decode = len(idx) == 1 and int(tr.seq_ids[idx[0]]) in seqs[1:]
        timed_step = decode and int(tr.positions[idx[0]]) >= prompt_len
        before = (cache.c.misses, cache.c.cold_misses) if cache else (0, 0)
        for j in range(L):
            if cache:
                waves, _ = cache.access_layer(int(tr.layer_ids[j]), np.unique(tr.expert_ids[idx, j].astype(np.int64)))
                for w in waves if timed_step else ():
                    h = sum(hit for _, _, hit in w)
                    events[(h, len(w) - h)] = events.get((h, len(w) - h), 0) + 1
        if timed_step:
            timed["tokens"] += 1
            if cache:
                timed["misses"] += cache.c.misses - before[0]
                timed["cold_misses"] += cache.c.cold_misses - before[1]
    timed["wave_events"] = [[h, k, c] for (h, k), c in sorted(events.items())]
    timed.update(estimate(timed, tr, prof, prompt_len + new))      # `colibri simulate --device this`'s formula
    return timed, cache


def big_model_check(a, s, log_rows=None):
    """A model `a.big_factor` times the memory it gets (issue 50): the benchmark model's shape with
    `a.big_experts` experts a layer (random weights, the skewed router), streamed in a cgroup of its
    weights / big_factor, cold and then learned; each run's decode ms per token against the simulator's
    prediction for that run's own slot count and pinned hot set (predict_timed on a trace of the same
    prompts, taken with every expert resident outside the cgroup)."""
    import tempfile
    import models
    from colibri_edge import Engine
    from colibri_edge.serving.probe_device import probe
    E = a.big_experts
    spec = {**s, "num_local_experts": E}
    root = os.path.join(HERE, "cache", "pressure")
    base = models.build_hf(os.path.join(HERE, "cache", f"full-e{E}", "hf"), spec, log)
    hf = skewed_hf(base, os.path.join(root, f"big-e{E}-hf"), spec)
    col = models.build_colibri(hf, os.path.join(root, f"big-e{E}-colibri-float16"), "float16", log)
    weights = os.path.join(col, "colibri_weights.bin")
    wbytes = os.path.getsize(weights)
    prompts = models.prompts(s, 32, 3)
    with Engine.open(col, backend="cpu", max_seq_len=32 + a.new + 8, max_batch=1) as eng:
        tr = eng.trace(prompts, max_new_tokens=a.new, ignore_eos=True)
    os.sync()                                   # a freshly written model's writeback would slow the probe's reads
    prof = probe(os.path.dirname(col), blob=int(tr.meta["bytes_per_expert"]), weights_file=weights)
    log(f"big model: {wbytes / 2**30:.2f} GiB of weights, {E} experts a layer; probe-device: {json.dumps(prof)}")
    env = {"COLIBRI_DIRECT_IO": "on" if prof["direct_io"]["use"] else "off", "COLIBRI_IO_THREADS": str(a.io_threads)}
    cg = Cgroup(wbytes // a.big_factor)
    rows = []
    try:
        runs = []
        for rep in range(a.big_repeats):           # the VM's disk and cores vary run to run: best and median of N
            heat_dir = tempfile.mkdtemp(prefix="colibri-pressure-heat-")
            try:
                for name in ("cold", "learned"):
                    r = run_colibri(cg, col, a.stream_slots, a.policy, a.new, [weights],
                                    env={**env, "COLIBRI_CACHE_DIR": heat_dir})
                    log(f"big model, {name} #{rep}: " + (r.get("error") or f"{r['decode_tok_s']:.2f} tok/s"))
                    runs.append((name, r))
            finally:
                shutil.rmtree(heat_dir, ignore_errors=True)
        for name in ("cold", "learned"):
            ok = [r for n, r in runs if n == name and "error" not in r]
            if not ok:
                rows.append({"run": name, "error": next(r["error"] for n, r in runs if n == name)})
                continue
            speeds = sorted(r["decode_tok_s"] for r in ok)
            r = max(ok, key=lambda x: x["decode_tok_s"])                 # the best run, its own counters
            ss = r["slot_stats"]
            pinned = [tuple(k) for k in ss["pinned_keys"]]
            timed, _ = predict_timed(tr, ss["slots"], a.policy, prof, a.new, pinned=pinned)
            # the same prediction at the read rate this run's drive gave (bytes / time with a read in
            # flight): the model's error apart from the drive's (a VM's disk varies 3x from run to run)
            seen = {**prof, "direct_io": {**prof["direct_io"], "use": True, "direct_gbs": ss["observed_read_gbs"]}}
            timed_seen, _ = predict_timed(tr, ss["slots"], a.policy, seen, a.new, pinned=pinned)
            got = 1e3 / r["decode_tok_s"]
            row = {"run": name, "slots": ss["slots"], "hot_set": ss["hot_set"], "decode_tok_s": r["decode_tok_s"],
                   "measured_ms": got, "predicted_ms": timed["est_ms_per_token"],
                   "error_pct": 100 * (timed["est_ms_per_token"] - got) / got, "hit_rate": ss["hit_rate"],
                   "observed_read_gbs": ss["observed_read_gbs"], "predicted_seen_ms": timed_seen["est_ms_per_token"],
                   "error_seen_pct": 100 * (timed_seen["est_ms_per_token"] - got) / got,
                   "read_bytes_per_token": r["read_bytes_per_token"], "hidden_fraction": ss["hidden_fraction"],
                   "all_tok_s": speeds, "median_tok_s": float(np.median(speeds))}
            med = 1e3 / row["median_tok_s"]
            row["error_median_pct"] = 100 * (timed["est_ms_per_token"] - med) / med
            log(json.dumps(row))
            rows.append(row)
    finally:
        cg.close()
    return {"weights_bytes": wbytes, "limit_bytes": cg.limit, "experts": E, "factor": a.big_factor, "rows": rows,
            "profile": prof}


def simulator_check(col, s, new, policy, slot_counts, files):
    """The simulator against measured runs (issues 21, 50): `colibri probe-device`'s measurements, a trace
    of the benchmark's three prompts (routing does not depend on slots), and per slot count (and all
    resident) the predicted ms per decoded token of the two timed prompts -- the weights read at the
    probed rate, the step overhead, and the simulated misses of those steps priced as the pool spends
    them (simulate.estimate: each wave's misses together at the probed rate of reads in flight,
    overlapped with the resident experts' compute) -- against a measured run without the cgroup
    (misses still read from storage: direct reads, or buffered ones whose pages the pool drops), and
    the simulated slot counters against the engine's."""
    from colibri_edge import Engine
    from colibri_edge.serving.probe_device import probe
    import models
    prompts = models.prompts(s, 32, 3)
    with Engine.open(col, backend="cpu", max_seq_len=32 + new + 8, max_batch=1) as eng:
        tr = eng.trace(prompts, max_new_tokens=new, ignore_eos=True)
    blob = int(tr.meta["bytes_per_expert"])
    os.sync()
    prof = probe(os.path.dirname(col), blob=blob, weights_file=files[0])    # misses as the pool reads them
    log(f"probe-device: {json.dumps(prof)}")
    # the engine as the profile says it reads (direct or buffered), no hot set (the replay pins none)
    env = {"COLIBRI_DIRECT_IO": "on" if prof["direct_io"]["use"] else "off", "COLIBRI_HOT_SET": "0"}
    rows = []
    for n in slot_counts:
        timed, cache = predict_timed(tr, n, policy, prof, new)
        pred, read_ms, miss_ms = timed["est_ms_per_token"], timed["est_read_ms"], timed["est_miss_ms"]
        meas = run_colibri(None, col, str(n), policy, new, files, resident=not n, env=env)
        if "error" in meas:
            rows.append({"slots": n, "error": meas["error"]})
            continue
        got = 1e3 / meas["decode_tok_s"]
        row = {"slots": n or "all resident", "predicted_ms": pred, "measured_ms": got,
               "error_pct": 100 * (pred - got) / got, "read_ms": read_ms, "miss_ms": miss_ms,
               "timed_misses": timed["misses"], "timed_cold_misses": timed["cold_misses"],
               "timed_tokens": timed["tokens"]}
        if n:
            ss = meas["slot_stats"]
            row.update(sim_hits=cache.c.hits, sim_misses=cache.c.misses, engine_hits=ss["hits"],
                       engine_misses=ss["misses"], sim_hit_rate=cache.c.as_dict()["hit_rate"],
                       engine_hit_rate=ss["hit_rate"])
        log(json.dumps(row))
        rows.append(row)
    return {"profile": prof, "policy": policy, "rows": rows}


def entropy_bits(counts) -> float:
    c = np.asarray(counts, np.float64)
    out = []
    for row in c:
        p = row[row > 0] / row.sum()
        out.append(float(-(p * np.log2(p)).sum()))
    return float(np.mean(out))


def run_matrix(a, s, models_by_router, log_rows):
    """Per router and memory fraction: Colibri through the memory map, Colibri streaming (cold: no heat
    yet; learned: the same workload again with the first run's heat), llama.cpp. -> rows."""
    import tempfile
    from colibri_edge.serving.probe_device import direct_io_verdict
    rows = []
    for router, (col, gguf) in models_by_router.items():
        weights = os.path.join(col, "colibri_weights.bin")
        wbytes = os.path.getsize(weights)
        from colibri_edge.model.modeldir import ModelDir
        md = ModelDir(col)
        blob = max(e.weight_size for e in md.experts)
        verdict = direct_io_verdict(weights, blob)
        log(f"{router}: direct I/O verdict: {verdict['why']}")
        env = {"COLIBRI_DIRECT_IO": "on" if verdict["use"] else "off", "COLIBRI_IO_THREADS": str(a.io_threads)}
        r = run_colibri(None, col, "0", a.policy, a.new, [weights], resident=True)      # the ceiling
        r.update(router=router, fraction=1.0, limit_bytes=wbytes, engine="colibri all resident (no limit)")
        log(json.dumps({k: v for k, v in r.items() if k != "expert_counts"})[:400])
        rows.append(r)
        for frac in [float(x) for x in a.fractions.split(",")]:
            cg = Cgroup(int(frac * wbytes))
            heat_dir = tempfile.mkdtemp(prefix="colibri-pressure-heat-")
            base = {"router": router, "fraction": frac, "limit_bytes": cg.limit, "direct_io": verdict}
            try:
                runs = [("colibri mmap", "0", {}), ("colibri streaming, cold", a.stream_slots, {"COLIBRI_CACHE_DIR": heat_dir}),
                        ("colibri streaming, learned", a.stream_slots, {"COLIBRI_CACHE_DIR": heat_dir})]
                for name, slots, extra in runs:
                    r = run_colibri(cg, col, slots, a.policy, a.new, [weights], env={**env, **extra})
                    r.update(base, engine=name)
                    log(json.dumps({k: v for k, v in r.items() if k not in ("expert_counts", "direct_io")})[:700])
                    rows.append(r)
                if not a.no_llama:
                    import llama_server
                    r = run_llama(cg, llama_server.binary(log), gguf, a.llama_new, [gguf], s)
                    r.update(base)
                    log(json.dumps(r)[:600])
                    rows.append(r)
            finally:
                cg.close()
                shutil.rmtree(heat_dir, ignore_errors=True)
    return rows


def matrix_table(rows) -> list:
    out = ["| router | memory | engine | decode tok/s | vs mmap | vs llama.cpp | storage / token | hit rate (slots) | "
           "hot set | lookahead recall | load time hidden |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        mem = f"{r['fraction']:.0%} ({r['limit_bytes'] / 2**20:.0f} MiB)"
        if "error" in r:
            out.append(f"| {r['router']} | {mem} | {r['engine']} | failed: {r['error'][-160:]!r} | | | | | | | |")
            continue
        same = [x for x in rows if x["router"] == r["router"] and x["fraction"] == r["fraction"] and "error" not in x]
        mm = next((x["decode_tok_s"] for x in same if x["engine"] == "colibri mmap"), None)
        ll = next((x["decode_tok_s"] for x in same if x["engine"].startswith("llama.cpp")), None)
        tps = r["decode_tok_s"]
        ss = r.get("slot_stats") or {}
        rec, hid = ss.get("prediction_recall"), ss.get("hidden_fraction")
        cells = [r["router"], mem, r["engine"], f"{tps:.2f}", "-" if mm is None else f"{tps / mm:.2f}x",
                 "-" if ll is None else f"{tps / ll:.1f}x", f"{r['read_bytes_per_token'] / 2**20:.1f} MiB",
                 f"{ss['hit_rate']:.3f} ({ss['slots']})" if ss else "-", str(ss.get("hot_set", "-")) if ss else "-",
                 "-" if rec is None else f"{rec:.2f}", "-" if hid is None else f"{hid:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--slots", default="", help="extra Colibri runs in the --limit-mib cgroup: slot counts, auto, "
                                                "or 0 (every expert resident)")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--llama-new", type=int, default=16, help="llama.cpp's tokens a prompt in the matrix (it is slow "
                                                               "under pressure)")
    ap.add_argument("--limit-mib", type=int, default=600, help="the cgroup's memory limit of the --slots runs")
    ap.add_argument("--fractions", default="0.5,0.25", help="the matrix: memory limits as fractions of the weights")
    ap.add_argument("--routers", default="skewed,uniform", help="the matrix: skewed (Zipf-like), uniform (the "
                                                                "benchmark model's own random router); empty: none")
    ap.add_argument("--stream-slots", default="auto", help="the matrix's streaming runs: a slot count or auto")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--big-experts", type=int, default=32, help="the big model: experts a layer (0: no big model)")
    ap.add_argument("--big-factor", type=int, default=8, help="the big model's weights / its memory limit")
    ap.add_argument("--big-repeats", type=int, default=3, help="the big model's runs of each kind (best and median)")
    ap.add_argument("--sim-slots", default="0,5,8,16,24,32", help="the simulator check's slot counts (0: all resident), "
                                                            "lru, without the cgroup; empty: skip it")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default="pressure", help="the results' file stem (pressure-policies: `make -C "
                                                        "benchmarks pressure-policies`)")
    a = ap.parse_args(argv)
    if a.worker:
        return colibri_worker(a)
    import models
    s = models.spec(False)
    root = os.path.join(HERE, "cache", "pressure")
    os.makedirs(root, exist_ok=True)
    base_hf = models.build_hf(os.path.join(models.cache_dir(False), "hf"), s, log)
    hf = skewed_hf(base_hf, os.path.join(root, "hf"), s)
    col = models.build_colibri(hf, os.path.join(root, "colibri-float16"), "float16", log)
    gguf = os.path.join(root, "model-f16.gguf")
    models.build_gguf(hf, gguf, "f16", s, log)
    weights = os.path.join(col, "colibri_weights.bin")
    from colibri_edge.model.modeldir import ModelDir
    sizes = {"colibri_weights_bytes": os.path.getsize(weights), "gguf_bytes": os.path.getsize(gguf),
             "blob_bytes": max(e.weight_size for e in ModelDir(col).experts)}
    res = {**sizes, "date": time.strftime("%Y-%m-%d"), "new_tokens": a.new, "runs": [], "matrix": []}
    by_router = {}
    for router in filter(None, a.routers.split(",")):
        if router == "skewed":
            by_router[router] = (col, gguf)
        elif router == "uniform":
            ucol = models.build_colibri(base_hf, os.path.join(root, "uniform-colibri-float16"), "float16", log)
            ugguf = os.path.join(root, "uniform-model-f16.gguf")
            models.build_gguf(base_hf, ugguf, "f16", s, log)
            by_router[router] = (ucol, ugguf)
        else:
            raise SystemExit(f"--routers: {router!r} is not skewed or uniform")
    if by_router:
        res["matrix"] = run_matrix(a, s, by_router, log)
    if a.slots:
        cg = Cgroup(a.limit_mib << 20)
        res["limit_bytes"] = cg.limit
        try:
            for sl in filter(None, a.slots.split(",")):
                r = run_colibri(cg, col, sl, a.policy, a.new, [weights])
                log(json.dumps({k: v for k, v in r.items() if k != "expert_counts"})[:600])
                res["runs"].append(r)
        finally:
            cg.close()
    if a.big_experts:
        res["big"] = big_model_check(a, s)
    if a.sim_slots:
        res["simulator"] = simulator_check(col, s, a.new, "lru", [int(x) for x in a.sim_slots.split(",")], [weights])
    counts = next((r["expert_counts"] for r in res["runs"] + res["matrix"]
                   if "expert_counts" in r and r.get("router", "skewed") == "skewed"), None)
    if counts is not None:
        res["routing_entropy_bits"] = entropy_bits(counts)
        res["max_entropy_bits"] = float(np.log2(s["num_local_experts"]))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Models bigger than the memory they get ({res['date']})", "",
             f"Mixtral-shaped bench model, float16, 64 experts of {sizes['blob_bytes'] / 2**20:.1f} MiB; routers: skewed (Zipf-like; routing entropy {res.get('routing_entropy_bits', float('nan')):.2f} "
             f"of {res.get('max_entropy_bits', 3):.0f} bits a layer) and uniform (the model's own random router); "
             f"weights {sizes['colibri_weights_bytes'] / 2**20:.0f} MiB (Colibri) / {sizes['gguf_bytes'] / 2**20:.0f} MiB "
             f"(GGUF); each engine alone in a memory cgroup (page cache included), the model's file pages dropped "
             f"before each run; 2 threads; one stream, {a.new} tokens x 2 prompts after a warm-up "
             f"(llama.cpp: {a.llama_new}). Streaming: policy {a.policy}, slots {a.stream_slots}, {a.io_threads} I/O "
             "threads; cold = no routing heat yet, learned = the same workload again after the cold run (its heat "
             "pins the hot set).", ""]
    if res["matrix"]:
        lines += matrix_table(res["matrix"])
        v = next((r["direct_io"] for r in res["matrix"] if r.get("direct_io")), {})
        lines += ["", f"Direct I/O (probe-device's measurement on the weights file): {v.get('why', '-')}", ""]
    if res["runs"]:
        lines += [f"Extra runs in a cgroup of {a.limit_mib} MiB:", "",
                  "| engine | decode tok/s | ITL p50 / p99 ms | storage bytes / token | major faults / token | slot hit rate |",
                  "|---|---:|---|---:|---:|---:|"]
        for r in res["runs"]:
            if "error" in r:
                lines.append(f"| {r['engine']} | failed: {r['error'][-200:]!r} | | | | |")
                continue
            ss = r.get("slot_stats") or {}
            hr = f"{ss['hit_rate']:.3f} ({ss['slots']} slots)" if ss else "-"
            lines.append(f"| {r['engine']} | {r['decode_tok_s']:.2f} | {r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | "
                         f"{r['read_bytes_per_token'] / 2**20:.1f} MiB | {r['major_faults_per_token']:.0f} | {hr} |")
    if "big" in res:
        b = res["big"]
        lines += ["", f"A model {b['factor']}x the memory it gets: {b['experts']} experts a layer, "
                      f"{b['weights_bytes'] / 2**30:.2f} GiB of weights, skewed router, a cgroup of "
                      f"{b['limit_bytes'] / 2**20:.0f} MiB; the simulator's prediction for each run's own slot count "
                      "and pinned hot set:", "",
                  "| run | slots (hot set) | decode tok/s, best (all) | best ms/token | predicted (probe's rate) | error "
                  "(best / median) | drive's rate in the best run | predicted at it | error | hit rate | storage / token | "
                  "load time hidden |", "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in b["rows"]:
            if "error" in r:
                lines.append(f"| {r['run']} | failed: {r['error'][-200:]!r} | | | | | | | | | | |")
                continue
            lines.append(f"| {r['run']} | {r['slots']} ({r['hot_set']}) | {r['decode_tok_s']:.2f} "
                         f"({', '.join(f'{x:.1f}' for x in r['all_tok_s'])}) | {r['measured_ms']:.1f} | "
                         f"{r['predicted_ms']:.1f} | {r['error_pct']:+.0f}% / {r['error_median_pct']:+.0f}% | "
                         f"{r['observed_read_gbs']:.2f} GB/s | {r['predicted_seen_ms']:.1f} | {r['error_seen_pct']:+.0f}% | "
                         f"{r['hit_rate']:.3f} | {r['read_bytes_per_token'] / 2**20:.1f} MiB | {r['hidden_fraction']:.2f} |")
        d = b["profile"]["direct_io"]
        lines += ["", f"probe-device before the runs: {d['why']}."]
    if "simulator" in res:
        p = res["simulator"]["profile"]
        lines += ["", f"The simulator against measured runs (lru, without the cgroup, misses from storage): "
                      f"`colibri probe-device` measured {p['memory_bandwidth_gbs']} GB/s (cpu GEMV), "
                      f"{p['miss_bandwidth_gbs']} GB/s storage reads of one expert (cold), "
                      f"{p.get('reread_bandwidth_gbs', p['miss_bandwidth_gbs'])} GB/s re-reads after the pages were "
                      f"dropped again, {p['layer_overhead_ms']} ms overhead a layer.", "",
                  "| slots | predicted ms/token | measured ms/token | error | timed misses / token (cold) | "
                  "simulated hits / misses | engine hits / misses |",
                  "|---|---:|---:|---:|---|---|---|"]
        for r in res["simulator"]["rows"]:
            if "error" in r:
                lines.append(f"| {r['slots']} | failed: {r['error'][-120:]!r} | | | | | |")
                continue
            hm = (f"{r['sim_hits']} / {r['sim_misses']} | {r['engine_hits']} / {r['engine_misses']}"
                  if "sim_hits" in r else "- | -")
            tm = r.get("timed_misses", 0)
            per = f"{tm / max(r['timed_tokens'], 1):.1f} ({r['timed_cold_misses']} cold)" if tm else "0"
            lines.append(f"| {r['slots']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
                         f"{r['error_pct']:+.0f}% | {per} | {hm} |")
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
