"""A 10-turn chat through `colibri serve` and llama.cpp's `llama-server`: time to first token per turn
with prompt caching (part of `make bench`; results/chat_serve.md, .json).

Each turn sends the whole conversation so far as token ids -- a system prompt, then per turn a user
message and the previous reply (the server's own greedy reply, read back from `return_tokens`) -- as
a chat client does; Colibri through the `openai` client (streamed completions), llama-server through
its own /completion. Servers, one at a time, each on 2 threads, bound to 127.0.0.1:
  * Colibri with its prefix cache (the default) and `--cache-dir`;
  * Colibri with `--no-prefix-cache`: the same prompts sent cold; its replies must equal the cached
    server's, turn by turn;
  * Colibri restarted on the same `--cache-dir`: turn 11 (cached_tokens read from disk);
  * llama-server with `cache_prompt` (its default) on the same weights' GGUF, `--parallel 1`; its
    turn 10 is also sent with `cache_prompt: false` (cold).
Models: the Mixtral-shaped benchmark model (models.py; Colibri float16 against GGUF f16) and the
Qwen3.5-shaped hybrid (qwen35_decode.py: gated delta-nets beside full attention; float32 against
llama.cpp's own converter's f32 GGUF). Reported per turn: prompt tokens, cached tokens, TTFT (first
streamed token); and the turn-10 ratios cached / cold and Colibri / llama-server. Nothing here is a
timed test.

    python benchmarks/chat_serve.py [--turns 10] [--system 256] [--user 24] [--reply 48] [--models mixtral,qwen35]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def log(msg):
    print(f"[chat] {msg}", file=sys.stderr, flush=True)


def isa() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    for name in ("avx512f", "avx2", "asimd", "neon"):
        if f" {name}" in flags:
            return name
    return "baseline"


def colibri_turn(url, prompt, reply, cache=True):
    """One streamed completion turn through the OpenAI client -> (ttft s, reply ids, cached tokens)."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    t0, first, toks, cached = time.perf_counter(), None, [], None
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=reply, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_tokens": True})
    for chunk in stream:
        for c in chunk.choices:
            ids = (c.model_extra or {}).get("tokens")
            if ids:
                first = first if first is not None else time.perf_counter() - t0
                toks += ids
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first, toks, cached


def llama_turn(url, prompt, reply, cache=True):
    """One streamed /completion turn of llama-server -> (ttft s, reply ids, cached tokens: the prompt
    tokens it did not evaluate). Its stream leaves out the ids of tokens that end inside a UTF-8
    character (random weights make such bytes), so the reply's ids come from the same request sent
    again unstreamed (greedy: the same reply; the slot then holds prompt + reply, as after the turn)."""
    import httpx
    body = {"prompt": prompt, "n_predict": reply, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_tokens": True, "cache_prompt": cache}
    t0, first, evaluated = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/completion", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            d = json.loads(line[6:])
            if d.get("content") or d.get("tokens"):
                first = first if first is not None else time.perf_counter() - t0
            if d.get("timings"):
                evaluated = d["timings"]["prompt_n"]
    whole = httpx.post(url + "/completion", json={**body, "stream": False}, timeout=900).json()
    toks = whole["tokens"]
    if len(toks) != reply:
        raise SystemExit(f"{url}: asked for {reply} tokens, got {len(toks)}")
    return first, toks, None if evaluated is None else len(prompt) - evaluated


class Served:
    """A server process on a free port, ready when /health answers; stopped on exit."""

    def __init__(self, cmd, env):
        from serve_bench import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.env = env

    def __enter__(self):
        from serve_bench import wait_ready
        log(" ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(self.cmd)))
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(self.url, self.proc)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def conversation(url, turn_fn, system, users, reply):
    """Turns over one server: each prompt = the previous one + its reply + the next user message."""
    prompt, rows = list(system), []
    turn_fn(url, system[:8], 4)                         # warm: first-request costs are not turn 1's
    for k, user in enumerate(users):
        prompt = prompt + user
        ttft, toks, cached = turn_fn(url, prompt, reply)
        rows.append({"turn": k + 1, "prompt": len(prompt), "cached": cached, "ttft_ms": 1e3 * ttft, "reply": toks})
        log(f"  turn {k + 1}: {len(prompt)} prompt tokens, {cached} cached, TTFT {1e3 * ttft:.0f} ms")
        prompt = prompt + toks
    return rows, prompt


def bench_model(name, col, gguf, V, a, env, exe):
    import numpy as np
    rng = np.random.default_rng(7)
    system = rng.integers(3, V, a.system).tolist()
    users = [rng.integers(3, V, a.user).tolist() for _ in range(a.turns + 1)]
    ctx = a.system + (a.turns + 1) * (a.user + a.reply) + 64
    colibri = os.path.join(os.path.dirname(sys.executable), "colibri")
    base = [colibri, "serve", "--model", f"bench={col}", "--port", "{port}", "--backend", "cpu", "--max-batch", "2",
            "--max-seq-len", str(ctx)]
    out = {"model": name}
    with tempfile.TemporaryDirectory() as cache:
        log(f"{name}: colibri serve, prefix cache and --cache-dir")
        with Served(base + ["--cache-dir", cache], env) as s:
            out["colibri"], history = conversation(s.url, colibri_turn, system, users[:a.turns], a.reply)
        log(f"{name}: colibri serve --no-prefix-cache")
        with Served(base + ["--no-prefix-cache"], env) as s:
            out["colibri_cold"], _ = conversation(s.url, colibri_turn, system, users[:a.turns], a.reply)
        same = [r["reply"] for r in out["colibri"]] == [r["reply"] for r in out["colibri_cold"]]
        out["replies_equal"] = same
        if not same:
            log(f"{name}: replies with and without the prefix cache DIFFER")
        log(f"{name}: colibri serve restarted on the same --cache-dir: turn {a.turns + 1}")
        with Served(base + ["--cache-dir", cache], env) as s:
            colibri_turn(s.url, users[a.turns][:8], 4)
            ttft, _, cached = colibri_turn(s.url, history + users[a.turns], a.reply)
            out["restart"] = {"prompt": len(history) + a.user, "cached": cached, "ttft_ms": 1e3 * ttft}
            log(f"  turn {a.turns + 1} after the restart: {cached} cached of {len(history) + a.user}, "
                f"TTFT {1e3 * ttft:.0f} ms")
    if exe and gguf:
        log(f"{name}: llama-server (cache_prompt)")
        with Served([exe, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", str(a.threads), "-tb",
                     str(a.threads), "--parallel", "1", "-c", str(ctx), "--no-warmup"], env) as s:
            out["llama"], _ = conversation(s.url, llama_turn, system, users[:a.turns], a.reply)
            last = out["llama"][-1]
            prompt = system + [t for k in range(a.turns) for t in users[k] + (out["llama"][k]["reply"]
                                                                             if k < a.turns - 1 else [])]
            ttft, _, cached = llama_turn(s.url, prompt, a.reply, cache=False)
            out["llama_cold"] = {"prompt": len(prompt), "cached": cached, "ttft_ms": 1e3 * ttft}
            log(f"  turn {a.turns} cold: {len(prompt)} tokens ({last['prompt']} in the conversation), "
                f"TTFT {1e3 * ttft:.0f} ms")
    return out


def report(res, a) -> list:
    lines = [f"# A {a.turns}-turn chat: colibri serve against llama-server ({res['date']})", "",
             f"Host: {res['cpu']}, ISA {res['isa']}, {a.threads} threads per server, 127.0.0.1, one server at a "
             f"time. Each turn sends the whole conversation as token ids: a system prompt of {a.system}, per turn "
             f"a user message of {a.user} and the server's own previous reply of {a.reply} greedy tokens "
             "(ignore_eos). TTFT: request to the first streamed token. Colibri: prefix cache on (with "
             "--cache-dir), and --no-prefix-cache (the same prompts cold); llama-server: cache_prompt (its "
             "default), --parallel 1, and its turn-10 prompt again with cache_prompt false (cold). Cached: "
             "Colibri's usage.prompt_tokens_details.cached_tokens; llama-server's prompt tokens less "
             "timings.prompt_n."]
    for m in res["models"]:
        c, cold, ll = m["colibri"], m["colibri_cold"], m.get("llama")
        lines += ["", f"## {m['model']}: {m['desc']}", "",
                  "| turn | prompt tokens | Colibri cached | Colibri TTFT ms | Colibri cold TTFT ms |"
                  + (" llama-server prompt / cached | llama-server TTFT ms |" if ll else ""),
                  "|---:|---:|---:|---:|---:|" + ("---|---:|" if ll else "")]
        for k, (r, q) in enumerate(zip(c, cold)):
            row = f"| {r['turn']} | {r['prompt']} | {r['cached']} | {r['ttft_ms']:.0f} | {q['ttft_ms']:.0f} |"
            if ll:
                row += f" {ll[k]['prompt']} / {ll[k]['cached']} | {ll[k]['ttft_ms']:.0f} |"
            lines.append(row)
        t = c[-1]
        lines += ["", f"- Colibri turn {t['turn']}: TTFT {t['ttft_ms']:.0f} ms cached against "
                      f"{cold[-1]['ttft_ms']:.0f} ms cold: **{t['ttft_ms'] / cold[-1]['ttft_ms']:.2f}x**; replies "
                      f"{'equal' if m['replies_equal'] else 'NOT equal'} with and without the prefix cache."]
        r = m["restart"]
        lines.append(f"- Restarted on the same --cache-dir: turn {a.turns + 1} took {r['cached']} of {r['prompt']} "
                     f"prompt tokens from disk, TTFT {r['ttft_ms']:.0f} ms.")
        if ll:
            lc = m["llama_cold"]
            lines.append(f"- llama-server turn {ll[-1]['turn']}: TTFT {ll[-1]['ttft_ms']:.0f} ms with cache_prompt "
                         f"({ll[-1]['cached']} of {ll[-1]['prompt']} cached) against {lc['ttft_ms']:.0f} ms cold: "
                         f"{ll[-1]['ttft_ms'] / lc['ttft_ms']:.2f}x. Colibri / llama-server at turn "
                         f"{t['turn']}: **{t['ttft_ms'] / ll[-1]['ttft_ms']:.2f}x** cached, "
                         f"{cold[-1]['ttft_ms'] / lc['ttft_ms']:.2f}x cold.")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--user", type=int, default=24)
    ap.add_argument("--reply", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="mixtral,qwen35")
    ap.add_argument("--small", action="store_true", help="the reduced benchmark model (quick iterations)")
    ap.add_argument("--no-llama", action="store_true", help="Colibri only (no llama-server build)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    import platform
    env = {**os.environ, "COLIBRI_NUM_THREADS": str(a.threads), "NUMBA_NUM_THREADS": str(a.threads),
           "OMP_NUM_THREADS": str(a.threads)}
    exe = None
    if not a.no_llama:
        import llama_server
        exe = llama_server.binary(log)
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "isa": isa(), "threads": a.threads,
           "turns": a.turns, "system": a.system, "user": a.user, "reply": a.reply, "models": []}
    for name in a.models.split(","):
        if name == "mixtral":
            import models
            from serve_bench import with_tokenizer
            s = models.spec(a.small)
            root = models.cache_dir(a.small)
            os.makedirs(root, exist_ok=True)
            hf = models.build_hf(os.path.join(root, "hf"), s, log)
            col = with_tokenizer(models.build_colibri(hf, os.path.join(root, "colibri-float16"), "float16", log), s)
            gguf = os.path.join(root, "model-f16.gguf")
            if exe:
                models.build_gguf(hf, gguf, "f16", s, log)
            out = bench_model(name, col, gguf, s["vocab_size"], a, env, exe)
            out["desc"] = (f"Mixtral-shaped benchmark model ({s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
                           f"{s['num_local_experts']} experts top-{s['num_experts_per_tok']}), Colibri float16 "
                           "against GGUF f16")
        elif name == "qwen35":
            import qwen35_decode as q
            d = os.path.join(tempfile.gettempdir(), "colibri_qwen35_bench")
            hf, col = q.build(d, 4, None, tokenizer=True)
            gguf = os.path.join(d, "f32.gguf")
            if exe and not os.path.exists(gguf):
                import gguf_models as gm
                gm.to_gguf(hf, gguf, "f32")
            V = json.load(open(os.path.join(col, "config.json")))["vocab_size"]
            out = bench_model(name, col, gguf, V, a, env, exe)
            out["desc"] = ("Qwen3.5-shaped hybrid (4 layers: 3 gated delta-nets of 16 / 32 heads of 128 and 1 full "
                           "attention layer; hidden 2048, 16 experts top-8), float32 against llama.cpp's converter's "
                           "f32 GGUF; Colibri resumes from recurrent-state snapshots")
        else:
            raise SystemExit(f"--models: unknown {name!r} (mixtral, qwen35)")
        for k in ("colibri", "colibri_cold", "llama"):
            for r in out.get(k, []):
                r.pop("reply", None)
        res["models"].append(out)
    lines = report(res, a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "chat_serve.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "chat_serve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
