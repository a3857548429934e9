"""`colibri serve` against llama.cpp's `llama-server` on the same weights (part of `make bench`).

    python benchmarks/serve_bench.py [--small] [--clients 1,4,16] [--prompt 64] [--new 64]

Both servers run the Mixtral-shaped benchmark model (models.py) at the same precision -- f16: Colibri
float16 from its model directory, llama-server the f16 GGUF of the same checkpoint; int8: Colibri int8
against GGUF q8_0 (--precision) -- one at a time, each on 2 threads, bound to 127.0.0.1. llama-server (benchmarks/llama_server.py builds it once) runs with
`--parallel 16 --cont-batching` and a context of 16 x the request's; Colibri with max_batch 16.
At each concurrency c, c clients each send requests back to back (streamed /v1/completions,
token-id prompts of --prompt ids, --new tokens with ignore_eos, temperature 0) until 2c requests
(at least 4) are done. Reported: output tokens/s over the wall time, time to first token p50 / p99
(first streamed chunk), and the ratio Colibri / llama-server. Results: results/serve.md, .json.

The benchmark model has no tokenizer (every engine is fed ids); the server answers in text, so the
Colibri side gets a word-level tokenizer of the GGUF's vocabulary (tokenizers' WordLevel), written
beside hard links to the model directory's files. Nothing here is a timed test.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def log(msg):
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_tokenizer(col: str, spec: dict) -> str:
    """col's files hard-linked into col + '-serve', plus a WordLevel tokenizer.json of the bench vocabulary."""
    from tokenizers import Tokenizer, models as tm
    import models
    out = col.rstrip("/") + "-serve"
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(col):
        src, dst = os.path.join(col, name), os.path.join(out, name)
        if os.path.isfile(src) and not name.startswith(".") and not os.path.exists(dst):
            os.link(src, dst)
    tokens, _, _ = models._vocab(spec["vocab_size"])
    tok = Tokenizer(tm.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.save(os.path.join(out, "tokenizer.json"))
    return out


def wait_ready(url, proc, timeout=600):
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


def one(url, model, prompt, new):
    """A streamed completion -> (seconds to the first chunk, seconds in all)."""
    import httpx
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def load(url, model, prompts, clients, new):
    """c clients, requests back to back until max(4, 2c) are done -> figures."""
    n = max(4, 2 * clients)
    todo = list(range(n))
    lock = threading.Lock()
    ttft = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            f, _ = one(url, model, prompts[i % len(prompts)], new)
            with lock:
                ttft.append(f)
    one(url, model, prompts[0], 4)                 # warm: first-request costs are not the load's
    import httpx                                   # and each request really makes `new` tokens (ignore_eos)
    r = httpx.post(url + "/v1/completions", timeout=600, json={"model": model, "prompt": prompts[1], "max_tokens": new,
                                                               "temperature": 0, "ignore_eos": True}).json()
    if r["usage"]["completion_tokens"] != new:
        raise SystemExit(f"{url}: asked for {new} tokens, got {r['usage']}")
    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": n, "output_tok_s": n * new / wall, "wall_s": wall,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99))}


def run_server(cmd, env, url, name, model, prompts, clients, new):
    log(f"{name}: {' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(url, proc)
        out = []
        for c in clients:
            r = load(url, model, prompts, c, new)
            log(f"{name} {c:>2} clients: {r['output_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                f"p99 {r['ttft_p99_ms']:.0f} ms")
            out.append(r)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="f16,int8", help="f16 (Colibri float16 / GGUF f16) and int8 "
                                                           "(Colibri int8 / GGUF q8_0), comma-separated")
    ap.add_argument("--colibri-flags", default="", help="extra `colibri serve` flags, e.g. '--interleave 0 "
                                                         "--prefill-chunk 1024' (throughput over time between tokens)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    import models
    import llama_server
    clients = [int(c) for c in a.clients.split(",")]
    s = models.spec(a.small)
    root = models.cache_dir(a.small)
    os.makedirs(root, exist_ok=True)
    hf = models.build_hf(os.path.join(root, "hf"), s, log)
    exe = llama_server.binary(log)
    prompts = models.prompts(s, a.prompt, 32)
    ctx = a.prompt + a.new
    env = {**os.environ, "COLIBRI_NUM_THREADS": str(a.threads), "NUMBA_NUM_THREADS": str(a.threads),
           "OMP_NUM_THREADS": str(a.threads)}
    res = {"model": {k: s[k] for k in ("num_hidden_layers", "hidden_size", "num_local_experts",
                                       "num_experts_per_tok", "intermediate_size")},
           "prompt_tokens": a.prompt, "new_tokens": a.new, "threads": a.threads, "date": time.strftime("%Y-%m-%d"),
           "colibri_flags": a.colibri_flags, "runs": {}}
    lines = [f"# colibri serve vs llama-server ({res['date']})", "",
             f"Mixtral-shaped benchmark model ({s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
             f"{s['num_local_experts']} experts top-{s['num_experts_per_tok']}), {a.threads} threads, 127.0.0.1; "
             f"each request {a.prompt} prompt ids -> {a.new} tokens (ignore_eos, temperature 0, streamed); "
             f"llama-server --parallel {max(clients)} --cont-batching -c {max(clients) * ctx}. One checkpoint, "
             f"converted for each: f16 is Colibri float16 against GGUF f16; int8 is Colibri's per-row int8 "
             f"against GGUF q8_0 (per-32 blocks: the nearest llama.cpp format)." +
             (f" Colibri serve with {a.colibri_flags}." if a.colibri_flags else "")]
    links = []
    for prec in a.precision.split(","):
        dtype, qtype = {"f16": ("float16", "f16"), "int8": ("int8", "q8_0")}[prec]
        col = with_tokenizer(models.build_colibri(hf, os.path.join(root, f"colibri-{dtype}"), dtype, log), s)
        links.append(col)
        gguf = os.path.join(root, f"model-{qtype}.gguf")
        models.build_gguf(hf, gguf, qtype, s, log)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        colibri = os.path.join(os.path.dirname(sys.executable), "colibri")
        c_runs = run_server([colibri, "serve", "--model", f"bench={col}", "--port", str(port),
                             "--backend", "cpu", "--max-batch", str(max(clients)),
                             "--max-seq-len", str(ctx), *a.colibri_flags.split()], env, url, f"colibri {dtype}", "bench", prompts, clients, a.new)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        l_runs = run_server([exe, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t",
                             str(a.threads), "-tb", str(a.threads), "--parallel", str(max(clients)),
                             "--cont-batching", "-c", str(max(clients) * ctx), "--no-warmup"],
                            env, url, f"llama-server {qtype}", "bench", prompts, clients, a.new)
        res["runs"][prec] = {"colibri_dtype": dtype, "gguf_type": qtype, "colibri": c_runs, "llama_server": l_runs}
        lines += ["", f"## Colibri {dtype} against llama-server {qtype}", "",
                  "| clients | Colibri tok/s | llama-server tok/s | ratio | Colibri TTFT p50 / p99 ms | "
                  "llama-server TTFT p50 / p99 ms |", "|---:|---:|---:|---:|---|---|"]
        for c, l in zip(c_runs, l_runs):
            lines.append(f"| {c['clients']} | {c['output_tok_s']:.1f} | {l['output_tok_s']:.1f} | "
                         f"{c['output_tok_s'] / l['output_tok_s']:.2f} | {c['ttft_p50_ms']:.0f} / "
                         f"{c['ttft_p99_ms']:.0f} | {l['ttft_p50_ms']:.0f} / {l['ttft_p99_ms']:.0f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "serve.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "serve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    for col in links:
        shutil.rmtree(col, ignore_errors=True)        # hard links only: the model directory stays


if __name__ == "__main__":
    main()
