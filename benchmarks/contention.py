"""Decode under contention (part of `make bench`): each engine quiet, with a busy loop taking one
core, and with a loop taking half of one core, interleaved in one run.

    python benchmarks/contention.py [--rounds 3] [--steps 96] [--small]

The busy loop is a process this script starts at its own nice value (so the engine's: the engines
are its children too), pinned to the last CPU with sched_setaffinity; the engines are not pinned.
`busy`: it spins without pause; `half`: 5 ms spinning, 5 ms asleep (standing in for a core half as
fast, or a core another app uses half the time). Its iterations per second are reported per phase,
with the figure it reaches alone, so the share of its core it got is visible.

Engines (each one process for the whole run, warmed up once, then told to decode `steps` tokens
per phase; batch 1, 2 threads or whatever the engine decides): Colibri's cpu backend at float16,
int8 and on llama.cpp's own Q4_K_M file, adaptive threads (COLIBRI_NUM_THREADS unset) and fixed at
the core count; llama.cpp (llama-cpp-python) on the same weights, f16, q8_0 and the same Q4_K_M
file, n_threads = cores. Every round runs every engine in every condition, the order of the
conditions rotating between rounds; each figure is the median over rounds. Output:
results/contention.md and .json (or cache/results-small/ with --small).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONDITIONS = ("quiet", "busy", "half")
DUTY = {"busy": 1.0, "half": 0.5}
PERIOD = 0.010                      # the half loop's period: 5 ms on, 5 ms off
SETTLE = 1.0                        # seconds a condition runs before a phase: steady state is measured
                                    # (Colibri's thread governor follows a change within 0.25-0.5 s)
TARGETS = {"busy": 0.40, "half": 0.60, "p99_over_p50": 3.0}    # issue 15's


# -- the busy loop ------------------------------------------------------------------------------
def busy_loop(cpu, duty, out):
    os.sched_setaffinity(0, {cpu})
    import signal
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    n, t0 = 0, time.perf_counter()
    while not stop:
        if duty >= 1.0:
            for _ in range(10000):
                n += 1
        else:
            end = time.perf_counter() + PERIOD * duty
            while time.perf_counter() < end:
                for _ in range(100):
                    n += 1
            time.sleep(PERIOD * (1 - duty))
    with open(out, "w") as f:
        f.write(str(n / (time.perf_counter() - t0)))


class Busy:
    """The busy loop of a condition, for the length of a `with` block; .rate: its iterations/s."""

    def __init__(self, condition, cpu, workdir):
        self.condition, self.cpu, self.out, self.rate = condition, cpu, os.path.join(workdir, "busy.rate"), None

    def __enter__(self):
        self.p = None
        if self.condition in DUTY:
            self.p = subprocess.Popen([sys.executable, __file__, "--busy", str(self.cpu), str(DUTY[self.condition]),
                                       self.out])
        time.sleep(SETTLE)                # the new condition in place before the engine's phase starts
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.terminate()
            self.p.wait(timeout=30)
            with open(self.out) as f:
                self.rate = float(f.read())


# -- the engines: a process each, answering "decode N" with the step times ----------------------
def serve(spec):
    """Runs in the engine's process: open, warm up, then one line in (steps), one JSON line out."""
    prompt = list(range(5, 5 + spec["prompt_len"]))
    if spec["engine"] == "colibri":
        from colibri_edge import Engine
        kw = {} if spec["threads"] is None else {"num_threads": spec["threads"]}
        eng = Engine.open(spec["model"], backend="cpu", max_batch=1, max_seq_len=spec["max_seq"],
                          prefill_chunk=max(16, spec["prompt_len"]), **kw)
        runner, inner, times = eng.runner, eng.runner.step, []

        def timed(entries, all_logits=False, stepwise=False):
            t0 = time.perf_counter()
            out = inner(entries, all_logits=all_logits, stepwise=stepwise)
            if all(len(t) == 1 for _, t in entries):
                times.append(time.perf_counter() - t0)
            return out
        runner.step = timed

        def decode(n):
            times.clear()
            before = eng.backend.thread_steps.copy()
            eng.generate(prompt, max_new_tokens=n + 1, ignore_eos=True)
            info = eng.backend.thread_stats()
            info["steps_by_threads"] = {k: int(v) for k, v in enumerate(eng.backend.thread_steps - before) if v}
            return list(times), info
    else:
        import llama_cpp
        from llama_cpp import Llama
        llm = Llama(model_path=spec["model"], n_ctx=spec["max_seq"], n_batch=spec["prompt_len"],
                    n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False, seed=0)

        V = llm.n_vocab()

        def last_logits():         # the last token's logits (llm.scores holds them only with logits_all)
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(V,))

        def decode(n):
            llm.reset()
            llm.eval(prompt)
            tok, times = int(np.argmax(last_logits())), []
            for _ in range(n):
                t0 = time.perf_counter()
                llm.eval([tok])
                tok = int(np.argmax(last_logits()))       # greedy, as Colibri's generate here
                times.append(time.perf_counter() - t0)
            return times, {"threads": spec["threads"], "llama_cpp_python": llama_cpp.__version__}
    decode(4)                                                    # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        times, info = decode(int(line))
        print(json.dumps({"times": times, "info": info}), flush=True)


class EngineProc:
    def __init__(self, spec):
        self.spec = spec
        self.p = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(spec)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE))
        if self.p.stdout.readline().strip() != "ready":
            raise SystemExit(f"{spec['name']}: the engine process did not start (exit {self.p.poll()})")

    def decode(self, steps):
        self.p.stdin.write(f"{steps}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"{self.spec['name']}: the engine process died (exit {self.p.wait()})")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def engines(cache, threads, small):
    """The engines measured: Colibri model directories and llama.cpp GGUF files made by models.py
    (bench.py makes them; this script only reads them)."""
    out = []
    for label, d in (("float16", "colibri-float16"), ("int8", "colibri-int8"), ("Q4_K_M", "colibri-gguf-q4_k_m")):
        path = os.path.join(cache, d)
        if os.path.exists(os.path.join(path, "config.json")):
            out.append({"name": f"colibri {label}", "engine": "colibri", "model": path, "threads": None,
                        "precision": label})
            out.append({"name": f"colibri {label} fixed {threads}", "engine": "colibri", "model": path,
                        "threads": threads, "precision": label})
    for label, f in (("f16", "model-f16.gguf"), ("q8_0", "model-q8_0.gguf"), ("Q4_K_M", "model-llq-q4_k_m.gguf")):
        path = os.path.join(cache, f)
        if os.path.exists(path):
            out.append({"name": f"llama.cpp {label}", "engine": "llama", "model": path, "threads": threads,
                        "precision": label})
    if not out:
        raise SystemExit(f"no benchmark models under {cache}: run `make bench` (bench.py builds them) first")
    return out


def summarise(times):
    t = np.asarray(times, np.float64)
    return {"tokens_per_s": float(t.size / t.sum()), "p50_ms": float(np.percentile(t, 50) * 1e3),
            "p99_ms": float(np.percentile(t, 99) * 1e3), "max_ms": float(t.max() * 1e3), "steps": int(t.size)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated substrings of engine names to run")
    ap.add_argument("--busy", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.busy:
        return busy_loop(int(a.busy[0]), float(a.busy[1]), a.busy[2])
    if a.serve:
        return serve(json.loads(a.serve))
    cache = os.path.join(HERE, "cache", "small" if a.small else "full")
    out_dir = os.path.join(HERE, "cache", "results-small") if a.small else os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    threads = len(cpus)
    specs = [s for s in engines(cache, threads, a.small)
             if not a.only or any(x in s["name"] for x in a.only.split(","))]
    for s in specs:
        s.update(prompt_len=32, max_seq=32 + a.steps + 16)
    workdir = os.path.join(HERE, "cache", "contention")
    os.makedirs(workdir, exist_ok=True)
    log = lambda m: print(f"[contention {time.strftime('%H:%M:%S')}] {m}", flush=True)   # noqa: E731
    # the busy loop alone, for the share it gets later
    alone = {}
    for c in DUTY:
        with Busy(c, cpus[-1], workdir) as b:
            time.sleep(2.0)
        alone[c] = b.rate
    log(f"busy loop alone on cpu {cpus[-1]}: " + ", ".join(f"{c} {r:.3g} it/s" for c, r in alone.items()))
    procs = []
    try:
        for s in specs:
            log(f"starting {s['name']}")
            procs.append(EngineProc(s))
        phases = {s["name"]: {c: [] for c in CONDITIONS} for s in specs}
        for r in range(a.rounds):
            order = CONDITIONS[r % 3:] + CONDITIONS[:r % 3]
            for p in procs:
                for c in order:
                    with Busy(c, cpus[-1], workdir) as b:
                        res = p.decode(a.steps)
                    x = summarise(res["times"])
                    x.update(round=r + 1, busy_rate=b.rate, info=res["info"])
                    phases[p.spec["name"]][c].append(x)
                    log(f"round {r + 1} {p.spec['name']:<26} {c:5s} {x['tokens_per_s']:6.1f} tok/s  p50 "
                        f"{x['p50_ms']:6.1f} ms  p99 {x['p99_ms']:6.1f} ms"
                        + (f"  loop {b.rate:.3g} it/s" if b.rate else ""))
    finally:
        for p in procs:
            p.close()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": cpus, "threads": threads,
              "rounds": a.rounds, "steps": a.steps, "busy_alone_it_s": alone, "targets": TARGETS,
              "nice": os.nice(0), "engines": []}
    for s in specs:
        e = {"name": s["name"], "engine": s["engine"], "precision": s["precision"], "threads": s["threads"]}
        for c in CONDITIONS:
            xs = phases[s["name"]][c]
            e[c] = {k: float(np.median([x[k] for x in xs])) for k in ("tokens_per_s", "p50_ms", "p99_ms")}
            e[c]["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in xs]
            if c in DUTY:
                e[c]["busy_share"] = float(np.median([x["busy_rate"] for x in xs]) / alone[c])
                e[c]["of_quiet"] = e[c]["tokens_per_s"] / e["quiet"]["tokens_per_s"]
            e[c]["threads_info"] = xs[-1]["info"]
        result["engines"].append(e)
    with open(os.path.join(out_dir, "contention.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "contention.md"), "w") as f:
        f.write(report(result))
    print(report(result))


def report(r):
    lines = [f"# Decode under contention ({r['date']})", "",
             f"{len(r['cpus'])} CPUs; batch-1 decode of {r['steps']} tokens per phase, {r['rounds']} rounds, medians. "
             f"busy: a loop spinning on CPU {r['cpus'][-1]} (pinned, nice {r['nice']}, engines not pinned); "
             f"half: the same loop 5 ms on / 5 ms off. The loop alone: "
             + ", ".join(f"{c} {v:.3g} it/s" for c, v in r["busy_alone_it_s"].items())
             + "; `loop` = the share of that it kept beside the engine.", "",
             "| engine | quiet tok/s | p50 / p99 ms | busy tok/s | of quiet | p50 / p99 ms | loop | "
             "half tok/s | of quiet | p50 / p99 ms | loop |", "|---|" + "---|" * 10]
    for e in r["engines"]:
        q, b, h = e["quiet"], e["busy"], e["half"]
        lines.append(f"| {e['name']} | {q['tokens_per_s']:.1f} | {q['p50_ms']:.1f} / {q['p99_ms']:.1f} | "
                     f"{b['tokens_per_s']:.1f} | {b['of_quiet'] * 100:.0f}% | {b['p50_ms']:.1f} / {b['p99_ms']:.1f} | "
                     f"{b['busy_share'] * 100:.0f}% | {h['tokens_per_s']:.1f} | {h['of_quiet'] * 100:.0f}% | "
                     f"{h['p50_ms']:.1f} / {h['p99_ms']:.1f} | {h['busy_share'] * 100:.0f}% |")
    lines += ["", "Targets (issue 15): busy >= 40% of quiet, p99 <= 3x p50 under load, above llama.cpp's busy "
              "figure on the same weights; half >= 60% of quiet.", ""]
    llama = {e["precision"].lower().replace("f16", "float16").replace("q8_0", "int8"): e
             for e in r["engines"] if e["engine"] == "llama"}
    for e in r["engines"]:
        if e["engine"] != "colibri":
            continue
        b, h = e["busy"], e["half"]
        peer = llama.get(e["precision"].lower())
        checks = [f"busy {b['of_quiet'] * 100:.0f}% {'ok' if b['of_quiet'] >= TARGETS['busy'] else 'MISSED'}",
                  f"p99/p50 busy {b['p99_ms'] / b['p50_ms']:.2f}x half {h['p99_ms'] / h['p50_ms']:.2f}x "
                  f"{'ok' if max(b['p99_ms'] / b['p50_ms'], h['p99_ms'] / h['p50_ms']) <= 3 else 'MISSED'}",
                  f"half {h['of_quiet'] * 100:.0f}% {'ok' if h['of_quiet'] >= TARGETS['half'] else 'MISSED'}"]
        if peer:
            ratio = b["tokens_per_s"] / peer["busy"]["tokens_per_s"]
            checks.append(f"busy vs {peer['name']} busy {ratio:.2f}x {'ok' if ratio > 1 else 'MISSED'}")
        steps = {c: e[c]["threads_info"].get("steps_by_threads") for c in CONDITIONS}
        lines.append(f"- {e['name']}: " + "; ".join(checks) + " (last round's steps by thread count: "
                     + ", ".join(f"{c} {v}" for c, v in steps.items()) + ")")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
