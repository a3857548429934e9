"""A/B: this tree's Colibri against an earlier commit's, interleaved in one run (part of `make bench`).

    python benchmarks/ab.py --base REV [--rounds 3] [--dtypes float16,int8[,q4_k_m,...]]

The earlier commit is checked out as a git worktree (cache/ab-base-REV, reused). Each round runs, per
weight type, one subprocess per tree, the order alternating between rounds, on the benchmark model
(models.py; the same directory for both where the base tree reads this tree's format, else each tree its
own converter's output of the same weights: base_model): prefill tok/s of a 128-token
prompt (median of 3), batch-1 decode tok/s (fastest of 3 runs of 64 steps) and the decode step's
p50 latency. Each figure keeps its best round (other work only slows a run down) and the report
gives new/old. Then, on each tree's own demo model, the host overhead of a decode step: backend
calls per step (every public method of the backend object counted, an op called by another op
once; graph_step / run_parts only hand ops on), the step's wall time, the time inside backend calls
and the rest (the scheduler's Python), medians over 200 steps.

Only Engine.open / generate / infer and the backend object are used, so both trees run the same
worker. The base tree runs from its source with `python -S` (site-packages on PYTHONPATH without
their .pth files), so this tree's editable install cannot leak into it.
"""
from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def worktree(rev: str) -> str:
    path = os.path.join(HERE, "cache", f"ab-base-{rev}")
    if not os.path.exists(os.path.join(path, "colibri_edge")):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--force", path, rev], check=True,
                       capture_output=True)
    # since the backends/ move, setup.py installs backends/ as colibri_edge.backends; run from source,
    # the base tree needs that mapping as a link
    link = os.path.join(path, "colibri_edge", "backends")
    if os.path.isdir(os.path.join(path, "backends")) and not os.path.lexists(link):
        os.symlink(os.path.join("..", "backends"), link)
    return path


def base_format(tree: str) -> int:
    """The model-directory format version the tree's converter writes (FORMAT_VERSION in its source)."""
    import re
    for rel in ("colibri_edge/model/validate.py", "colibri_edge/modeldir.py"):
        path = os.path.join(tree, rel)
        if os.path.exists(path):
            m = re.search(r"^FORMAT_VERSION\s*=\s*(\d+)", open(path).read(), re.M)
            if m:
                return int(m.group(1))
    raise SystemExit(f"A/B: no FORMAT_VERSION in {tree}")


def base_model(tree: str, hf: str, dtype: str, shared: str) -> str:
    """The directory the base tree runs: the shared one where it reads this tree's format, else its own
    converter's output of the same HF weights (cache/ab-base-REV/models/colibri-DTYPE, reused; this tree
    still reads older formats, so the new tree keeps the shared directory)."""
    from colibri_edge.model.validate import FORMAT_VERSION
    if base_format(tree) >= FORMAT_VERSION:
        return shared
    out = os.path.join(tree, "models", f"colibri-{dtype}")
    if not os.path.exists(os.path.join(out, ".ab-done")):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, *site.getsitepackages()])}
        print(f"[ab] converting {dtype} with the base tree's converter (format {base_format(tree)})", file=sys.stderr,
              flush=True)
        subprocess.run([sys.executable, "-S", "-m", "colibri_edge", "convert", hf, out, "--dtype", dtype, "--quiet"],
                       env=env, cwd=tree, check=True)
        open(os.path.join(out, ".ab-done"), "w").close()
    return out


def run(tree: str | None, job: dict, threads: int) -> dict:
    """One worker: tree None = this tree (its installed package), else an earlier tree from source."""
    env = {**os.environ, "COLIBRI_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads),
           "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable]
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, *site.getsitepackages()])
        cmd.append("-S")
    p = subprocess.run(cmd + [os.path.abspath(__file__), "--worker", json.dumps(job)], env=env,
                       capture_output=True, text=True, timeout=3600, cwd=tree or REPO)
    if p.returncode != 0:
        raise SystemExit(f"A/B worker ({tree or 'this tree'}) failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- the worker (runs in either tree) -------------------------------------------------------------
def _speed(job):
    import numpy as np
    from colibri_edge import Engine
    with Engine.open(job["model"], backend="cpu", max_batch=1, max_seq_len=512) as eng:
        prompt = job["prompt"]
        eng.generate(prompt, max_new_tokens=4, ignore_eos=True)                  # warm
        pre = []
        for i in range(1, 4):   # a new prompt each time (rotated): the prefix cache must not answer it
            s0 = eng.stats.prefill_seconds
            eng.generate(prompt[i:] + prompt[:i], max_new_tokens=1, ignore_eos=True)
            pre.append(eng.stats.prefill_seconds - s0)
        best, p50 = 0.0, None
        for _ in range(3):
            st = eng.stats
            d0, t0 = st.decode_tokens, st.decode_seconds
            steps = []
            inner = eng.runner.step

            def timed(*a, **kw):
                s = time.perf_counter()
                r = inner(*a, **kw)
                steps.append(time.perf_counter() - s)
                return r
            eng.runner.step = timed
            eng.generate(prompt, max_new_tokens=job["steps"] + 1, ignore_eos=True)
            eng.runner.step = inner
            tps = (st.decode_tokens - d0) / (st.decode_seconds - t0)
            if tps > best:
                best, p50 = tps, float(np.median(steps[1:])) * 1e3
    return {"prefill_tokens_per_s": len(prompt) / float(np.median(pre)), "decode_tokens_per_s": best,
            "decode_p50_ms": p50}


def _overhead(job):
    import numpy as np
    import colibri_edge
    from colibri_edge import Engine
    shipped = os.path.join(os.path.dirname(colibri_edge.__file__), "default_model")   # both trees' layouts
    with Engine.open(shipped, backend="cpu", max_batch=1, max_seq_len=256) as eng:
        be = eng.backend
        calls, spent, on = [0], [0.0], [False]
        wrappers = ("graph_step", "run_parts")  # they call ops; the ops are what count
        names = [n for n in dir(be) if not n.startswith("_") and callable(getattr(be, n)) and n not in wrappers]

        def wrap(fn):
            def counted(*a, **kw):
                if not on[0]:
                    return fn(*a, **kw)
                on[0] = False                     # an op calling another op counts once
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    spent[0] += time.perf_counter() - t0
                    calls[0] += 1
                    on[0] = True
            return counted
        for n in names:
            setattr(be, n, wrap(getattr(be, n)))
        r = eng.runner
        seq = r.new_sequence(1)
        prompt = list(range(5, 25))
        r.reserve(seq, len(prompt))
        logits = r.step([(seq, prompt)])
        per_step = []
        for i in range(job["steps"] + 20):
            tok = int(np.argmax(be.host_view(logits)[-1]))
            r.reserve(seq, 1)
            calls[0], spent[0] = 0, 0.0
            on[0] = True
            t0 = time.perf_counter()
            logits = r.step([(seq, [tok])])
            wall = time.perf_counter() - t0
            on[0] = False
            if i >= 20:
                per_step.append((calls[0], wall, spent[0]))
        r.free(seq)
    c, w, s = (np.array(x) for x in zip(*per_step))
    return {"calls_per_step": int(np.median(c)), "step_us": float(np.median(w)) * 1e6,
            "in_backend_us": float(np.median(s)) * 1e6, "python_us": float(np.median(w - s)) * 1e6}


def worker(job):
    print(json.dumps(_speed(job) if job["kind"] == "speed" else _overhead(job)))


# -- the run -----------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the earlier commit (a git revision)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float16,int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    import models
    base = worktree(a.base)
    rev = subprocess.run(["git", "-C", base, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    new = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    m = models.build_all(a.small, with_gguf=False, log=lambda s: print(s, file=sys.stderr, flush=True))
    for dt in a.dtypes.split(","):          # block formats (q4_k_m, q8_0, ...): our converter's, from the same weights
        if dt not in m["colibri"]:
            m["colibri"][dt] = models.build_colibri(m["hf"], os.path.join(m["root"], f"colibri-{dt}"), dt,
                                                    log=lambda s: print(s, file=sys.stderr, flush=True))
    prompt = models.prompts(m["spec"], 128, 1)[0]
    trees = {"old": base, "new": None}
    res = {"base": rev, "new": new, "dirty": bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                                                   "--untracked-files=no"], capture_output=True,
                                                                  text=True).stdout.strip()),
           "rounds": a.rounds, "threads": a.threads, "speed": {}, "overhead": {}}
    for rnd in range(a.rounds):
        order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
        for dt in a.dtypes.split(","):
            for which in order:
                model = m["colibri"][dt] if which == "new" else base_model(base, m["hf"], dt, m["colibri"][dt])
                r = run(trees[which], {"kind": "speed", "model": model, "prompt": prompt, "steps": 64}, a.threads)
                res["speed"].setdefault(dt, {}).setdefault(which, []).append(r)
                print(f"[ab] round {rnd + 1} {dt} {which}: prefill {r['prefill_tokens_per_s']:.1f} tok/s, decode "
                      f"{r['decode_tokens_per_s']:.2f} tok/s (p50 {r['decode_p50_ms']:.2f} ms)", flush=True)
        for which in order:
            r = run(trees[which], {"kind": "overhead", "steps": 200}, a.threads)
            res["overhead"].setdefault(which, []).append(r)
            print(f"[ab] round {rnd + 1} overhead {which}: {r}", flush=True)
    lines = [f"# A/B: {new}{' (+ uncommitted changes)' if res['dirty'] else ''} (new) against {rev} (old)", "",
             f"{a.rounds} rounds, interleaved (old/new, then new/old); each figure the best round; cpu backend, "
             f"{a.threads} threads; the benchmark model ({m['spec']['num_hidden_layers']} layers, hidden "
             f"{m['spec']['hidden_size']}).", "",
             "| weights | figure | old | new | new/old | every round (old; new) |", "|---|---|---:|---:|---:|---|"]
    for dt, both in res["speed"].items():
        for key, label in (("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s")):
            o, n = (max(x[key] for x in both[w]) for w in ("old", "new"))
            rounds = "; ".join(", ".join(f"{x[key]:.1f}" for x in both[w]) for w in ("old", "new"))
            lines.append(f"| {dt} | {label} | {o:.1f} | {n:.1f} | {n / o:.3f} | {rounds} |")
    lines += ["", "Host overhead of a decode step (demo model: 4 layers, cpu, medians over 200 steps; best round):", "",
              "| tree | backend calls per step | step us | in backend calls us | Python (the rest) us |",
              "|---|---:|---:|---:|---:|"]
    for which in ("old", "new"):
        best = min(res["overhead"][which], key=lambda x: x["step_us"])
        lines.append(f"| {which} | {best['calls_per_step']} | {best['step_us']:.0f} | {best['in_backend_us']:.0f} | "
                     f"{best['python_us']:.0f} |")
    md = "\n".join(lines) + "\n"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ab.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "ab.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
