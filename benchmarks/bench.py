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
    p = subprocess.run([sys.executable, os.path.join(HERE, "workers.py"), kind, "--job", jp, "--out", op],
                       env=env, timeout=timeout, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not os.path.exists(op):
        tail = (p.stdout[-2000:] + "\n" + p.stderr[-4000:]).strip()
        return {"error": f"{name} exited {p.returncode}", "log_tail": tail, "wall_s": wall}
    res = json.load(open(op))
    res["wall_s"] = wall
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="reduced model, for fast iterations")
    ap.add_argument("--out", help="results folder (default: results/, or cache/results-small/ with --small)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-reps", type=int, default=3, help="prefill runs (the median is reported)")
    ap.add_argument("--decode-reps", type=int, default=2, help="decode runs (the fastest is reported)")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps under the per-op profiler")
    ap.add_argument("--engines", default="transformers,llama,colibri",
                    help="comma list of transformers, llama, colibri")
    ap.add_argument("--dtypes", default=None, help="Colibri weight types (default: all the converter has)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-Numba-cache first-token runs")
    a = ap.parse_args(argv)
    engines = set(a.engines.split(","))
    out = a.out or (os.path.join(HERE, "cache", "results-small") if a.small else os.path.join(HERE, "results"))
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="work-", dir=os.path.join(HERE, "cache"))
    threads = a.threads
    t_start = time.time()

    results = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "small": a.small,
               "machine": machine_info(threads), "prompt_len": a.prompt_len, "decode_steps": a.decode_steps,
               "prefill_reps": a.prefill_reps, "decode_reps": a.decode_reps,
               "engines": [], "notes": []}
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
    dtypes = a.dtypes.split(",") if a.dtypes else list(m["colibri"])
    results["colibri_dtypes_converter"] = list(m["colibri"])
    results["colibri_dtypes_cpu"] = list(CpuBackend.weight_dtypes)
    if "int8" not in m["colibri"]:
        results["notes"].append("int8: `colibri convert --dtype int8` does not exist yet; the int8 rows and the "
                                "Colibri int8 / llama.cpp q8_0 ratio appear once it does")

    prompts = models.prompts(m["spec"], a.prompt_len, 4)
    base_job = {"spec": m["spec"], "prompts": prompts, "decode_steps": a.decode_steps, "threads": threads,
                "prefill_reps": a.prefill_reps, "decode_reps": a.decode_reps, "ref_logits": os.path.join(work, "ref_logits.npy"),
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

    results["bandwidth_start"] = bandwidth("start")

    # -- transformers first: its logits are the reference for the parity checks --
    if "transformers" in engines or "llama" in engines or "colibri" in engines:
        log("transformers float32 ...")
        warm_page_cache(m["hf"])
        rounded = {q: os.path.join(work, f"ref_logits_{q}.npy") for q in ("f16", "q8_0")} if "llama" in engines else {}
        r = run_worker("transformers", {**base_job, "hf": m["hf"], "rounded_refs": rounded}, work, thread_env)
        r.setdefault("engine", "transformers")
        r.setdefault("precision", "float32")
        r["bytes_per_decoded_token"] = 4 * m["params"]["read_per_token"]
        p = m["params"]
        r["bytes_per_expert"] = 4 * p["expert"]
        r["non_expert_read_bytes"] = 4 * (p["read_per_token"] - p["layers"] * p["top_k"] * p["expert"])
        if "error" in r:
            raise SystemExit(f"transformers failed (its logits are every parity check's reference):\n{r['log_tail']}")
        if "transformers" in engines:
            results["engines"].append(r)
        log(f"  done in {r['wall_s']:.0f}s")

    if "llama" in engines:
        for q in ("f16", "q8_0"):
            g = m["gguf"][q]
            log(f"llama.cpp {q} ...")
            warm_page_cache(g["path"])
            r = run_worker("llama", {**base_job, "gguf": g["path"], "qtype": q, "ref_rounded": rounded[q]}, work,
                           thread_env, name=f"llama-{q}")
            if "error" in r:
                print(r["log_tail"], file=sys.stderr)
                raise SystemExit(f"llama.cpp {q} failed; see above")
            r["bytes_per_decoded_token"] = g["bytes_per_decoded_token"]
            r["bytes_per_expert"] = g["bytes_per_expert"]
            r["non_expert_read_bytes"] = g["non_expert_read_bytes"]
            c = r["parity_same_rounding"]
            log(f"  parity vs transformers float32: max rel err {r['parity']['max_rel_err']:.2e}; vs transformers on "
                f"the same {q} weights: max {c['max_rel_err']:.2e}, median {c['median_rel_err']:.2e}, argmax "
                f"agreement {c['argmax_agree']:.3f}; done in {r['wall_s']:.0f}s")
            results["engines"].append(r)

    if "colibri" in engines:
        cpu_dtypes = set(CpuBackend.weight_dtypes)
        for dt in dtypes:
            if dt not in cpu_dtypes:
                results["engines"].append({"engine": "colibri", "precision": dt,
                                           "na": f"the cpu backend does not run {dt} weights yet"})
                continue
            path = m["colibri"][dt]
            warm_page_cache(path)
            job = {**base_job, "model": path, "profile_steps": a.profile_steps}
            # cold: a fresh, empty Numba cache, then the main run on the cache it filled (warm). With
            # --no-cold one persistent cache serves every run, so iterations skip the compiles.
            numba_dir = os.path.join(HERE, "cache", "numba") if a.no_cold else \
                tempfile.mkdtemp(prefix=f"numba-{dt}-", dir=os.path.join(HERE, "cache"))
            env = {**thread_env, "NUMBA_CACHE_DIR": numba_dir}
            cold = None
            if not a.no_cold:
                log(f"colibri {dt}: first token with a cold Numba cache ({numba_dir}) ...")
                cold = run_worker("colibri_first_token", job, work, env, name=f"colibri-{dt}-cold")
                if "error" in cold:
                    print(cold["log_tail"], file=sys.stderr)
                    raise SystemExit(f"colibri {dt} (cold) failed; see above")
            log(f"colibri {dt} ...")
            r = run_worker("colibri", job, work, env, name=f"colibri-{dt}")
            if not a.no_cold:
                shutil.rmtree(numba_dir, ignore_errors=True)
            if "error" in r:
                print(r["log_tail"], file=sys.stderr)
                raise SystemExit(f"colibri {dt} failed; see above")
            r["first_token_cold"] = cold
            log(f"  parity vs transformers: max rel err {r['parity']['max_rel_err']:.2e}; "
                f"decode {r['decode_b1']['tokens_per_s']:.1f} tok/s; done in {r['wall_s']:.0f}s")
            results["engines"].append(r)

    results["bandwidth_end"] = bandwidth("end")
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
