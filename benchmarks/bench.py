"""`make bench`: Colibri's `cpu` backend against llama.cpp and transformers, same weights, one run.

    python benchmarks/bench.py            the Mixtral-shaped model (~640M params); results/ (committed)
    python benchmarks/bench.py --small    a reduced model for quick iterations; cache/results-small/

Every engine runs in its own subprocess (workers.py), with 2 threads. Speed is measured here and
never asserted in tests. Output: results/bench.json, results/bench.md, results/bench.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402
import report  # noqa: E402

# llama.cpp's logits vs transformers' float32 ones: max |diff| / max |ref| over the prompt
# llama.cpp vs transformers on the same rounded weights: (median per-position max rel err, argmax agreement).
# q8_0 also quantizes activations to 8 bits in llama.cpp, so it gets more room; a wrong tensor mapping or
# a missing rotary permutation gives a median near 0.6 and ~20% argmax agreement.
# a run counts as quiet when the BLAS probes just before and after it reached this share of the best
# probe. On the shared CI host the probe is bimodal (seen 2026-11-30: 29-32 GB/s or 39-42 GB/s as the
# neighbours' memory traffic comes and goes), and a run in the slow mode is 25-35% slower for every
# engine; 0.85 sits between the modes, so every engine's figures come from the fast one when it occurs.
QUIET = 0.85
PARITY_LIMIT = {"f16": [0.01, 0.9], "q8_0": [0.05, 0.75]}


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine_info(threads):
    import numpy
    info = {"platform": platform.platform(), "python": platform.python_version(), "numpy": numpy.__version__,
            "cpu": platform.processor(), "cores": os.cpu_count(), "threads_per_engine": threads,
            "loadavg_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil
        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    from importlib import metadata, util
    for mod, dist in (("numba", "numba"), ("torch", "torch"), ("transformers", "transformers"),
                      ("llama_cpp", "llama_cpp_python"), ("gguf", "gguf")):
        try:
            if util.find_spec(mod) is None:
                raise ModuleNotFoundError(f"no module named {mod!r}")
            info[mod] = metadata.version(dist)
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable ({type(e).__name__}: {e})"
    return info


def warm_page_cache(path):
    """Read a model's files once so every engine starts with its weights in the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in files:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def run_worker(kind, job, workdir, env_extra=None, env_drop=(), timeout=3600, name=None):
    name = name or kind
    jp, op = os.path.join(workdir, f"{name}.job.json"), os.path.join(workdir, f"{name}.out.json")
    with open(jp, "w") as f:
        json.dump(job, f)
    if os.path.exists(op):
        os.remove(op)
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_extra or {})
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "workers.py"), kind, "--job", jp, "--out", op],
                           env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        def txt(b):     # bytes whatever text= says (the subprocess docs)
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        tail = (txt(e.stdout)[-2000:] + "\n" + txt(e.stderr)[-4000:]).strip()
        return {"error": f"{name} ran past {timeout} s", "log_tail": tail, "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not os.path.exists(op):
        tail = (p.stdout[-2000:] + "\n" + p.stderr[-4000:]).strip()
        how = f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0 else \
            f"exited {p.returncode}" if p.returncode else "exited 0 without its result"
        return {"error": f"{name} {how}", "log_tail": tail, "wall_s": wall}
    res = json.load(open(op))
    res["wall_s"] = wall
    return res


def last_line(r):
    """The last non-empty line of a failed worker's output: usually what killed it."""
    lines = [x for x in r.get("log_tail", "").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def merge_rounds(runs):
    """One engine's rounds -> one result: each figure from its best round, every round recorded."""
    def tps(x):
        return (x or {}).get("tokens_per_s") or 0.0
    # other work only ever slows an engine down, so each figure is its best over all its rounds
    best = dict(max(runs, key=lambda r: tps(r["decode_b1"])))
    best["decode_b1"] = dict(best["decode_b1"], round=best["round"], probe_gbps=best["probe_gbps"])
    pr = max(runs, key=lambda r: tps(r["prefill"]))
    best["prefill"] = dict(pr["prefill"], round=pr["round"])
    b4 = [r for r in runs if tps(r.get("decode_b4"))]
    if b4:
        r4 = max(b4, key=lambda r: tps(r["decode_b4"]))
        best["decode_b4"] = dict(r4["decode_b4"], round=r4["round"], probe_gbps=r4["probe_gbps"])
    best["peak_rss"] = max(r["peak_rss"] for r in runs)
    for r in runs:
        if r.get("first_token_cold"):
            best["first_token_cold"] = r["first_token_cold"]
    best["had_quiet_run"] = any(r.get("quiet") for r in runs)
    best["rounds"] = [{"round": r["round"], "prefill_tokens_per_s": tps(r["prefill"]),
                       "decode_b1_tokens_per_s": tps(r["decode_b1"]), "decode_b4_tokens_per_s": tps(r.get("decode_b4")),
                       "probe_gbps": r["probe_gbps"], "probe_after_gbps": r.get("probe_after_gbps"),
                       "quiet": r.get("quiet"), "loadavg": r["loadavg"], "peak_rss": r["peak_rss"]} for r in runs]
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="reduced model, for fast iterations")
    ap.add_argument("--out", help="results folder (default: results/, or cache/results-small/ with --small)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-reps", type=int, default=3, help="prefill runs (the median is reported)")
    ap.add_argument("--decode-reps", type=int, default=3,
                    help="decode runs a round (the fastest is kept: the host's memory bandwidth swings by ~30%% "
                         "within seconds, so one 64-step run can land wholly in a slow spell)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all engines (each figure keeps its best)")
    ap.add_argument("--max-rounds", type=int, default=5,
                    help="extra rounds, up to this many in all, for engines with no quiet run yet")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps under the per-op profiler")
    ap.add_argument("--engines", default="transformers,llama,colibri",
                    help="comma list of transformers, llama, colibri")
    ap.add_argument("--dtypes", default=None, help="Colibri weight types (default: all the converter has)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-Numba-cache first-token runs")
    ap.add_argument("--no-quant-error", action="store_true",
                    help="skip the quantiser RMS table (quant_error.py, ~12 min on 2 cores)")
    ap.add_argument("--nice", type=int, default=-10,
                    help="scheduling priority of the run (inherited by every worker); negative needs root and "
                         "keeps other work on a shared CPU from descheduling an engine's threads mid-barrier "
                         "(0: leave it)")
    a = ap.parse_args(argv)
    engines = set(a.engines.split(","))
    out = a.out or (os.path.join(HERE, "cache", "results-small") if a.small else os.path.join(HERE, "results"))
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="work-", dir=os.path.join(HERE, "cache"))
    threads = a.threads
    t_start = time.time()
    priority = "unchanged"
    if a.nice:
        try:
            os.nice(a.nice)
            priority = f"nice {a.nice}"
        except OSError as e:
            priority = f"unchanged (nice {a.nice} refused: {e.strerror})"
    log(f"priority: {priority}")

    results = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "small": a.small,
               "machine": {**machine_info(threads), "priority": priority}, "prompt_len": a.prompt_len, "decode_steps": a.decode_steps,
               "prefill_reps": a.prefill_reps, "decode_reps": a.decode_reps, "rounds": a.rounds,
               "max_rounds": a.max_rounds, "quiet_threshold": QUIET, "engines": [], "notes": []}
    have_llama = not results["machine"]["llama_cpp"].startswith("unavailable")
    if "llama" in engines and not have_llama:
        results["notes"].append(f"llama.cpp not run: llama_cpp {results['machine']['llama_cpp']} "
                                "(`make bench` installs the `bench` extra)")
        engines.discard("llama")

    # -- the model in every format (a subprocess: torch and the build's memory stay out of here) --
    log(f"model: {'small' if a.small else 'full'} -> {models.cache_dir(a.small)}")
    info_path = os.path.join(work, "model.json")
    cmd = [sys.executable, os.path.join(HERE, "models.py"), "--out", info_path] + (["--small"] if a.small else [])
    if "llama" not in engines:
        cmd.append("--no-gguf")
    subprocess.run(cmd, check=True)
    m = json.load(open(info_path))
    results["model"] = {"spec": m["spec"], "params": m["params"], "gguf": m["gguf"]}
    from colibri_edge.backends.cpu.backend import Backend as CpuBackend
    dtypes = a.dtypes.split(",") if a.dtypes else list(m["colibri"]) + [f"gguf-{q}" for q in m.get("llama_quants", {})]
    results["colibri_dtypes_converter"] = list(m["colibri"])
    results["colibri_dtypes_cpu"] = list(CpuBackend.weight_dtypes)
    if "int8" not in m["colibri"]:
        results["notes"].append("int8: `colibri convert --dtype int8` does not exist yet; the int8 rows and the "
                                "Colibri int8 / llama.cpp q8_0 ratio appear once it does")

    prompts = models.prompts(m["spec"], a.prompt_len, 4)
    base_job = {"spec": m["spec"], "prompts": prompts, "decode_steps": a.decode_steps, "threads": threads,
                "prefill_reps": a.prefill_reps, "decode_reps": a.decode_reps, "rounds": a.rounds, "ref_logits": os.path.join(work, "ref_logits.npy"),
                "parity_limit": PARITY_LIMIT}
    thread_env = {"COLIBRI_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads),
                  "OMP_NUM_THREADS": str(threads)}

    def bandwidth(tag):
        # the probe runs with OpenBLAS' own CPU detection: no forced core type or L2 size
        r = run_worker("bandwidth", {"threads": threads}, work, env_drop=("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"),
                       name=f"bandwidth-{tag}")
        if "error" in r:
            raise SystemExit(f"bandwidth probe failed:\n{r['log_tail']}")
        kernels = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']}" for b in r["blas"])
        log(f"BLAS GEMV read bandwidth ({tag}): median {r['median_gbps']:.1f} GB/s, best {r['best_gbps']:.1f} GB/s "
            f"({kernels})")
        return r

    if "f32" in m["gguf"] and have_llama and not a.no_quant_error:
        # our quantisers against llama.cpp's on the same float32 weights (a subprocess, like the engines)
        log("quantiser RMS error: ours against llama.cpp's, every block format ...")
        qe = os.path.join(work, "quant_error.json")
        subprocess.run([sys.executable, os.path.join(HERE, "quant_error.py"), m["gguf"]["f32"]["path"], qe], check=True)
        results["quantiser_rms"] = json.load(open(qe))

    results["bandwidth_start"] = bandwidth("start")
    probes = [results["bandwidth_start"]]

    # -- every engine, as (name, kind, job, env, after(result)); transformers first: its logits are the
    # reference of every parity check (and llama.cpp's check needs the rounded-weight ones) --
    plan = []
    p = m["params"]
    rounded = {q: os.path.join(work, f"ref_logits_{q}.npy") for q in ("f16", "q8_0")} if "llama" in engines else {}

    def hf_after(r):
        r["bytes_per_decoded_token"] = 4 * p["read_per_token"]
        r["bytes_per_expert"] = 4 * p["expert"]
        r["non_expert_read_bytes"] = 4 * (p["read_per_token"] - p["layers"] * p["top_k"] * p["expert"])

    plan.append(("transformers-float32", "transformers", {**base_job, "hf": m["hf"], "rounded_refs": rounded},
                 thread_env, hf_after, m["hf"]))
    # llama.cpp's rows are the peers of the Colibri types asked for (all of them without --dtypes)
    peer_of = {"f16": "float16", "q8_0": "int8"}
    if "llama" in engines:
        for q in ("f16", "q8_0"):
            if a.dtypes and peer_of[q] not in dtypes:
                continue
            g = m["gguf"][q]

            def llama_after(r, g=g):
                r["bytes_per_decoded_token"] = g["bytes_per_decoded_token"]
                r["bytes_per_expert"] = g["bytes_per_expert"]
                r["non_expert_read_bytes"] = g["non_expert_read_bytes"]
            plan.append((f"llama-{q}", "llama", {**base_job, "gguf": g["path"], "qtype": q, "ref_rounded": rounded[q]},
                         thread_env, llama_after, g["path"]))
    # llama.cpp's own quantiser's files (Q4_0, Q4_K_M, Q8_0): llama.cpp with its defaults on each, its
    # logits kept for Colibri on the same file (after `colibri convert FILE.gguf`)
    llq = m.get("llama_quants") or {}
    llama_logits = {}
    if "llama" in engines:
        for q, g in llq.items():
            if a.dtypes and f"gguf-{q}" not in dtypes:
                continue
            llama_logits[q] = os.path.join(work, f"llama_logits_{q}.npy")

            def llq_after(r, g=g):
                r["bytes_per_decoded_token"] = g["bytes_per_decoded_token"]
                r["bytes_per_expert"] = g["bytes_per_expert"]
                r["non_expert_read_bytes"] = g["non_expert_read_bytes"]
                r["elements_by_type"] = g["elements_by_type"]
            plan.append((f"llama-gguf-{q}", "llama", {**base_job, "gguf": g["path"], "qtype": q, "label": f"gguf {q}",
                                                      "save_logits": llama_logits[q]},
                         thread_env, llq_after, g["path"]))
    skipped, numba_dirs = [], {}
    if "colibri" in engines:
        cpu_dtypes = set(CpuBackend.weight_dtypes) | {f"gguf-{q}" for q in llq}
        for dt in dtypes:
            if dt not in cpu_dtypes:
                skipped.append({"engine": "colibri", "precision": dt,
                                "na": f"the cpu backend does not run {dt} weights yet"})
                continue
            # cold: a fresh, empty Numba cache; then the timed runs on the cache it filled (warm). With
            # --no-cold one persistent cache serves every run, so iterations skip the compiles.
            numba_dirs[dt] = os.path.join(HERE, "cache", "numba") if a.no_cold else \
                tempfile.mkdtemp(prefix=f"numba-{dt}-", dir=os.path.join(HERE, "cache"))
            if dt.startswith("gguf-"):
                q = dt[5:]
                job = {**base_job, "model": llq[q]["colibri"], "label": f"gguf {q}"}
                if q in llama_logits:
                    job["llama_logits"] = llama_logits[q]
            else:
                job = {**base_job, "model": m["colibri"][dt]}
            plan.append((f"colibri-{dt}", "colibri", job,
                         {**thread_env, "NUMBA_CACHE_DIR": numba_dirs[dt]}, None, job["model"]))

    # -- rounds: the CPU may be shared, so every engine runs once per round (the order reversed every
    # other round, so no engine always gets the same slot) and each figure keeps its best round --
    runs = {name: [] for name, *_ in plan}
    # a peer engine that crashes (llama.cpp's batched quantised matmul has on some hosts) is that row's
    # result, not the end of the run: its later rounds are skipped and its row says why
    failed = {}
    no_extra = {}       # llama.cpp runs retried with its extra buffer types off, and why

    def probe_now():
        r = run_worker("bandwidth", {"threads": threads, "reps": 7}, work,
                       env_drop=("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"), name="bandwidth-probe")
        if "error" in r:
            return None
        probes.append(r)
        return r["median_gbps"]

    def quiet(r):
        """A run whose BLAS probes just before and just after were near the best seen: nothing else
        was taking the CPU's memory bandwidth (or its cores) then."""
        best = max(x["median_gbps"] for x in probes)
        return min(r["probe_gbps"] or 0, r["probe_after_gbps"] or 0) >= QUIET * best

    rnd = 0
    while True:
        if rnd < a.rounds:
            order = plan if rnd % 2 == 0 else plan[::-1]
            if rnd > 0 and "transformers" not in engines:
                order = [x for x in order if x[1] != "transformers"]
        else:   # extra rounds only for the engines that have had no quiet run yet
            order = [x for x in plan if not any(quiet(r) for r in runs[x[0]]) and x[0] not in failed
                     and (x[1] != "transformers" or "transformers" in engines)]
            if not order or rnd >= a.max_rounds:
                break
            log(f"extra round for the engines without a quiet run: {', '.join(x[0] for x in order)}")
        for name, kind, job, env, after, files in order:
            if name in failed:
                continue
            job = dict(job)
            if name in no_extra:
                job["no_extra_bufts"] = True
            if job.get("llama_logits") and not os.path.exists(job["llama_logits"]):
                del job["llama_logits"]     # llama.cpp failed on this file: no comparison to make
            if kind == "transformers" and rnd > 0:
                job["rounded_refs"] = {}
            if kind == "colibri":
                job["profile_steps"] = a.profile_steps
                if rnd == 0 and not a.no_cold:
                    dt = name.split("-", 1)[1]
                    log(f"{name}: first token with a cold Numba cache ({numba_dirs[dt]}) ...")
                    cold = run_worker("colibri_first_token", job, work, env, name=f"{name}-cold")
                    if "error" in cold:
                        print(cold["log_tail"], file=sys.stderr)
                        failed[name] = (kind, job, f"{cold['error']} (first token, cold cache): {last_line(cold)}")
                        log(f"{name} failed at its cold first token; its row records that, the run goes on")
                        continue
                    job["first_token_cold"] = cold
            warm_page_cache(files)
            before = probe_now()
            log(f"round {rnd + 1}: {name} (BLAS probe just before: {before or float('nan'):.1f} GB/s, "
                f"load {os.getloadavg()[0]:.1f}) ...")
            r = run_worker(kind, job, work, env, name=name)
            if "error" in r and kind == "llama" and "SIGSEGV" in r["error"] and not job.get("no_extra_bufts"):
                # llama.cpp 0.3.36 on an AMX host (Xeon, AMX_INT8 in its system info) dies in its first
                # batched matmul of a quantised file; with its extra buffer types (AMX, repacking) off it
                # runs, slower where it would repack: said beside the row, never silently
                no_extra[name] = (f"{name}: {r['error']} with llama.cpp's extra CPU buffer types (AMX, repacked "
                                  f"weights) on; rerun with use_extra_bufts=False (no repacking: its Q4_0 / Q4_K / "
                                  f"IQ4 matmuls are slower than they could be on this host)")
                log(no_extra[name])
                job["no_extra_bufts"] = True
                r = run_worker(kind, job, work, env, name=name)
            if "error" in r:
                print(r["log_tail"], file=sys.stderr)
                if kind == "transformers":
                    raise SystemExit(f"{name} failed (its logits are every parity check's reference); see above")
                failed[name] = (kind, job, f"{r['error']} in round {rnd + 1}: {last_line(r)}")
                log(f"{name} failed; its row records that and its later rounds are skipped, the run goes on")
                continue
            after_gbps = probe_now()
            if after:
                after(r)
            if "first_token_cold" in job:
                r["first_token_cold"] = job["first_token_cold"]
            r["round"] = rnd + 1
            r["probe_gbps"], r["probe_after_gbps"] = before, after_gbps
            r["loadavg"] = os.getloadavg()[0]
            runs[name].append(r)
            msg = f"decode b1 {r['decode_b1']['tokens_per_s']:.2f} tok/s, prefill {r['prefill']['tokens_per_s']:.1f} tok/s"
            if kind == "llama" and "parity_same_rounding" in r:
                c = r["parity_same_rounding"]
                msg += (f"; parity vs transformers float32: max rel err {r['parity']['max_rel_err']:.2e}; on the same "
                        f"{job['qtype']} weights: max {c['max_rel_err']:.2e}, median {c['median_rel_err']:.2e}, "
                        f"argmax agreement {c['argmax_agree']:.3f}")
            elif kind == "colibri":
                msg += f"; parity vs transformers: max rel err {r['parity']['max_rel_err']:.2e}"
                if "parity_llama" in r:
                    msg += f", vs llama.cpp on the same file: {r['parity_llama']['max_rel_err']:.2e}"
            log(f"  {msg}; probe after {after_gbps or float('nan'):.1f} GB/s; {r['wall_s']:.0f}s")
        rnd += 1
    results["rounds_run"] = rnd
    results["notes"] += list(no_extra.values())
    for rs in runs.values():
        for r in rs:
            r["quiet"] = quiet(r)
    for name, kind, *_ in plan:
        if kind == "transformers" and "transformers" not in engines:
            continue
        if name in failed:
            k, job, why = failed[name]
            results["notes"].append(f"{name}: {why}")
            if not runs[name]:
                results["engines"].append({"engine": "llama.cpp" if k == "llama" else k,
                                           "precision": job.get("label") or job.get("qtype") or name.split("-", 1)[1],
                                           "na": f"failed: {why}"})
                continue
        results["engines"].append(merge_rounds(runs[name]))
    results["engines"] += skipped
    if not a.no_cold:
        for d in numba_dirs.values():
            shutil.rmtree(d, ignore_errors=True)

    results["bandwidth_end"] = bandwidth("end")
    probes.append(results["bandwidth_end"])
    results["bandwidth_probes"] = [{"median_gbps": x["median_gbps"], "best_gbps": x["best_gbps"]} for x in probes]
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_s"] = time.time() - t_start
    report.finish(results)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = report.markdown(results)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(md)
    report.chart(results, os.path.join(out, "bench.png"))
    shutil.rmtree(work, ignore_errors=True)
    print(md)
    log(f"wrote {out}/bench.json, bench.md, bench.png in {results['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
