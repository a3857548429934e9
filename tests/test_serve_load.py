"""`colibri serve` on a real uvicorn socket (127.0.0.1, a free port), driven by the official `openai`
client and by concurrent httpx streams: three models of different shapes in one server under load,
clients that disconnect mid-stream, one model's KV pool exhausted while the others serve, memory
budgets, and the requests the server refuses by name (tool calls, structured output). Every loop
is bounded in count and time, and the server is stopped at the end."""
import json
import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is part of make test's install")
pytest.importorskip("openai", reason="the openai client is part of the test extra")

import httpx  # noqa: E402
import openai  # noqa: E402

from colibri_edge import ColibriError, Engine, COLIBRI_ERR_OUT_OF_MEMORY  # noqa: E402
from colibri_edge.serving.serve import check_budgets, create_app  # noqa: E402
from helpers import Server  # noqa: E402
from hf_models import build_text_model  # noqa: E402

DEMO = os.path.join(os.path.dirname(__import__("colibri_edge").__file__), "default_model")
WORDS = "the model routes each token to two experts and adds what they return".split()


def idle_and_whole(engines, timeout=30):
    """Wait (bounded) until no request runs; -> every KV pool exactly as free as at open."""
    deadline = time.monotonic() + timeout
    while any(e._core.busy for e in engines) and time.monotonic() < deadline:
        time.sleep(0.01)
    return all(not e._core.busy and e.kv_free_blocks == e.runner.pool.num_blocks for e in engines)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three shapes: the demo model (float16, 4 layers, 8 experts top-2) on cpu; a mixtral (4 experts)
    and a qwen3_moe (6 experts, a dense layer, 1 KV head) with byte-level tokenizers on the reference
    backend. Prefill chunks of 16 tokens, so the longer prompts span several chunks."""
    root = tmp_path_factory.mktemp("serve_load")
    mix = build_text_model(root / "mixtral", "mixtral")[1]
    qwen = build_text_model(root / "qwen3", "qwen3_moe")[1]
    return {"demo": (DEMO, "cpu"), "mixtral": (mix, "reference"), "qwen3": (qwen, "reference")}


def _open(models, **kw):
    return {n: Engine.open(p, backend=b, max_seq_len=128, max_batch=8, prefill_chunk=16, **kw)
            for n, (p, b) in models.items()}


def test_the_openai_client(models):
    """Completions, chat completions and streaming through openai.OpenAI: temperature 0 equals
    Engine.generate / chat; a seeded sampled request gives the same text alone and among 15 others.
    The demo model (cpu) answers completions; it has no chat template, so chat goes to the mixtral
    text model, which has one."""
    eng = Engine.open(DEMO, backend="cpu", max_seq_len=256, max_batch=16, prefill_chunk=16)
    chat_eng = Engine.open(models["mixtral"][0], backend="cpu", max_seq_len=128, max_batch=4)
    try:
        prompt = "The Python interpreter"
        want = eng.codec.decode(eng.generate(prompt, max_new_tokens=16, ignore_eos=True))
        msgs = [{"role": "user", "content": "What is a list?"}]
        want_chat = chat_eng.chat(msgs, max_new_tokens=12, ignore_eos=True)
        with Server(create_app({"demo": eng, "chat": chat_eng}, api_key="k")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=60)
            assert [m.id for m in client.models.list().data] == ["demo", "chat"]
            c = client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert c.choices[0].text == want and c.usage.completion_tokens == 16
            ch = client.chat.completions.create(model="chat", messages=msgs, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
            assert ch.choices[0].message.content == want_chat
            stream = client.chat.completions.create(model="chat", messages=msgs, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True})
            parts, usage = [], None
            for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                usage = chunk.usage or usage
            assert "".join(parts) == want_chat and usage.completion_tokens == 12
            text = "".join(ch.choices[0].text for ch in client.completions.create(
                model="demo", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True}))
            assert text == want

            sampled = dict(model="demo", prompt="A fortune:", max_tokens=14, temperature=0.9, top_p=0.95, seed=11,
                           extra_body={"ignore_eos": True})
            alone = client.completions.create(**sampled).choices[0].text
            results = {}

            def other(i):
                results[i] = client.completions.create(model="demo", prompt=" ".join(WORDS[:3 + i % 9]),
                                                       max_tokens=10 + i % 7, temperature=0.7, seed=i,
                                                       extra_body={"ignore_eos": True}).choices[0].text
            threads = [threading.Thread(target=other, args=(i,)) for i in range(15)]
            for t in threads:
                t.start()
            among = client.completions.create(**sampled).choices[0].text
            for t in threads:
                t.join(120)
            assert len(results) == 15 and among == alone
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="chat", messages=msgs, tools=[{"type": "function", "function": {
                    "name": "f", "parameters": {"type": "object", "properties": {}}}}],
                    tool_choice={"type": "function", "function": {"name": "g"}})
            assert "name one of the tools (f)" in str(e.value)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="chat", messages=msgs, response_format={"type": "xml"})
            assert "response_format type 'xml'" in str(e.value)
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="nope", prompt="x")
        assert idle_and_whole([eng, chat_eng])
    finally:
        eng.close()
        chat_eng.close()


def _stream(url, model, prompt, max_tokens, leave_after=None):
    """POST a streamed completion; -> its text (None when it leaves after `leave_after` chunks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, n = "", 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            assert "error" not in ch, ch
            text += "".join(c["text"] for c in ch["choices"])
            n += 1
            if leave_after is not None and n >= leave_after:
                return None                        # the connection closes here: the request is cancelled
    return text


def test_load_three_models_sixteen_clients(models):
    """16 concurrent streaming clients send 200 requests in all over three models of different shapes,
    prompts of 1 to 50 tokens (up to 4 prefill chunks of 16), every 9th request leaving after 2 chunks:
    no response is lost or wrong (each equals its solo run), and once the load is done every pool is
    exactly as free as before."""
    engines = _open(models)
    try:
        rng = np.random.default_rng(5)
        jobs = []
        for i in range(200):
            name = ("demo", "mixtral", "qwen3")[i % 3]
            words = int(rng.integers(1, 4)) if i % 4 else int(rng.integers(7, 9))   # 40-50 bytes: 3-4 chunks
            prompt = " ".join(WORDS[j % len(WORDS)] for j in range(i % 5, i % 5 + words))
            jobs.append((name, prompt, int(rng.integers(3, 11)), 2 if i % 9 == 4 else None))
        solo = {}
        for name, prompt, mt, _ in jobs:
            if (name, prompt, mt) not in solo:
                e = engines[name]
                solo[(name, prompt, mt)] = e.codec.decode(e.generate(prompt, max_new_tokens=mt, ignore_eos=True))
        assert max(len(engines[n].codec.encode(p)) for n, p, _, _ in jobs) > 2 * 16
        results, errors, lock = {}, [], threading.Lock()
        with Server(create_app(engines)) as srv:
            def client(c):
                for i in range(c, len(jobs), 16):
                    name, prompt, mt, leave = jobs[i]
                    try:
                        out = _stream(srv.url, name, prompt, mt, leave)
                    except Exception as ex:         # noqa: BLE001 -- reported below, with its job
                        with lock:
                            errors.append((i, repr(ex)))
                        continue
                    with lock:
                        results[i] = out
            threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            wall = time.perf_counter() - t0
            assert not errors, errors[:3]
            assert len(results) == 200, f"{200 - len(results)} responses lost"
            wrong = [i for i, (n, p, mt, leave) in enumerate(jobs) if leave is None and results[i] != solo[(n, p, mt)]]
            assert not wrong, [(jobs[i], results[i], solo[jobs[i][:3]]) for i in wrong[:3]]
            assert idle_and_whole(engines.values())
            m = httpx.get(srv.url + "/metrics").text
            done = sum(float(line.split()[-1]) for line in m.splitlines()
                       if line.startswith("colibri_requests_total") and 'status="200"' in line)
            assert done >= 200 - sum(1 for j in jobs if j[3])
        print(f"\n[serve load] 200 requests, 16 clients, 3 models: {wall:.1f} s")
    finally:
        for e in engines.values():
            e.close()


def test_one_exhausted_pool_leaves_the_others_alone(models):
    """qwen3's KV pool holds 48 tokens: 12 concurrent requests of ~30 tokens each queue for it (or are
    preempted and recomputed), and two that can never fit fail alone with a 400 naming the pool;
    meanwhile demo and mixtral serve 12 requests each, every one equal to its solo run. Their
    latency with and without the flood is printed."""
    engines = _open({k: v for k, v in models.items() if k != "qwen3"})
    p, b = models["qwen3"]
    engines["qwen3"] = Engine.open(p, backend=b, max_seq_len=128, max_batch=4, prefill_chunk=16,
                                   kv_cache_tokens=48, kv_block_size=8)
    try:
        calm = [(n, " ".join(WORDS[i % 6:i % 6 + 4]), 8) for i in range(12) for n in ("demo", "mixtral")]
        solo = {j: engines[j[0]].codec.decode(engines[j[0]].generate(j[1], max_new_tokens=8, ignore_eos=True))
                for j in calm}
        flood_prompt = " ".join(WORDS[:4])                     # ~20 tokens + 10 new: one or two fit at a time
        flood_solo = engines["qwen3"].codec.decode(engines["qwen3"].generate(flood_prompt, max_new_tokens=10,
                                                                              ignore_eos=True))
        with Server(create_app(engines)) as srv:
            def timed(jobs, out):
                for j in jobs:
                    t0 = time.perf_counter()
                    out.append((j, _stream(srv.url, *j), time.perf_counter() - t0))
            quiet = []
            timed(calm[:6], quiet)
            flood, big, busy = [], [], []

            def flooder(k):
                if k < 2:                                  # 60 + 10 tokens: never fits 48
                    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                        "model": "qwen3", "prompt": " ".join(WORDS * 2)[:60], "max_tokens": 10, "ignore_eos": True})
                    big.append((r.status_code, r.json()["error"]["message"]))
                else:
                    flood.append(_stream(srv.url, "qwen3", flood_prompt, 10))
            fl = [threading.Thread(target=flooder, args=(k,)) for k in range(14)]
            for t in fl:
                t.start()
            cl = [threading.Thread(target=timed, args=(calm[k::4], busy)) for k in range(4)]
            for t in cl:
                t.start()
            for t in cl + fl:
                t.join(300)
            assert len(busy) == len(calm) and all(out == solo[j] for j, out, _ in busy + quiet)
            assert flood == [flood_solo] * 12
            assert [s for s, _ in big] == [400, 400] and all("KV" in m or "kv_cache_tokens" in m for _, m in big)
            assert idle_and_whole(engines.values())
        q, f = np.median([t for *_, t in quiet]), np.median([t for *_, t in busy])
        print(f"\n[isolation] demo/mixtral request latency p50: {1e3 * q:.0f} ms alone, {1e3 * f:.0f} ms while "
              f"qwen3's pool is exhausted (12 waiting, 2 refused)")
    finally:
        for e in engines.values():
            e.close()


def test_memory_budgets(models, tmp_path):
    """An engine's memory budget is checked at open (OUT_OF_MEMORY with the numbers when its arena,
    KV pool and slots need more), and the server's budgets together against the memory there is."""
    p, b = models["mixtral"]
    with Engine.open(p, backend=b, max_seq_len=128, memory_budget=1 << 30) as e:
        need = e.runner.memory_need
    with pytest.raises(ColibriError) as ei:
        Engine.open(p, backend=b, max_seq_len=128, memory_budget=need - 1)
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "memory budget" in ei.value.message
    with Engine.open(p, backend=b, max_seq_len=128, memory_budget=need) as e:
        assert e.runner.memory_need == need
    check_budgets({"a": 1 << 20, "b": 1 << 20}, available=3 << 20)
    with pytest.raises(ColibriError) as ei:
        check_budgets({"a": 2 << 20, "b": 2 << 20}, available=3 << 20)
    assert ei.value.code == COLIBRI_ERR_OUT_OF_MEMORY and "4.0 MiB" in ei.value.message
    from colibri_edge.serving.cli import main                 # refused before any engine opens or port binds
    assert main(["serve", "--model", f"a={p}", "--model", f"b={p}", "--memory-budget", "a=1G",
                 "--memory-budget", "100T", "--interleave", "0", "--prefill-chunk", "64"]) == -COLIBRI_ERR_OUT_OF_MEMORY
    assert main(["serve", "--model", f"a={p}", "--memory-budget", "lots"]) == 1
    assert main(["serve", "--model", f"a={p}", "--memory-budget", "c=1G"]) == 1
