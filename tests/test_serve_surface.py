"""`colibri serve` as a llama-server / Ollama user tries it: each defect found that way has a test
here (a 20 MiB body, a non-streamed client that hangs up, a request past the timeout, the legacy
logprobs shape, models.retrieve, a 401 browsers can read, error shapes FastAPI would give), and the
endpoints users expect (/tokenize, /detokenize, /v1/embeddings, /slots, content parts, prompt
arrays, unknown fields ignored with a warning, n > 1 streamed). The slow cases run on a real
uvicorn socket; the rest through FastAPI's TestClient."""
import json
import os
import logging
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is part of make test's install")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from colibri_edge import ColibriError, Engine, COLIBRI_ERR_INVALID_ARGUMENT  # noqa: E402
from colibri_edge.serving.serve import create_app, describe, serve  # noqa: E402
from helpers import Server  # noqa: E402
from hf_models import build_text_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_text_model(tmp_path_factory.mktemp("surface"))[1]


@pytest.fixture(scope="module")
def eng(model_dir):
    e = Engine.open(model_dir, backend="reference", max_seq_len=128, max_batch=4)
    yield e
    e.close()


@pytest.fixture(scope="module")
def client(eng):
    with TestClient(create_app({"tiny": eng})) as c:
        yield c


def slowed(monkeypatch, eng, seconds=0.01):
    """Each step of eng held `seconds` (so that a tiny model cannot finish before the server acts)."""
    step = eng.runner.step

    def slow_step(*a, **k):
        time.sleep(seconds)
        return step(*a, **k)
    monkeypatch.setattr(eng.runner, "step", slow_step)


def settled(eng, timeout=20):
    deadline = time.monotonic() + timeout
    while eng._core.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    return not eng._core.busy and eng.kv_free_blocks == eng.runner.pool.num_blocks


def requests_total(client_or_url, **labels):
    text = (httpx.get(client_or_url + "/metrics").text if isinstance(client_or_url, str)
            else client_or_url.get("/metrics").text)
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("colibri_requests_total{" + want + "}"):
            return float(line.split()[-1])
    return 0.0


def sse(resp):
    out = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    return out


# -- defect 1: a 20 MiB body -------------------------------------------------------------------

def test_a_huge_body_is_413_before_it_is_read_and_health_stays_fast(eng):
    """20 MiB of prompt: refused with 413 by its Content-Length, never parsed or tokenised (no
    step ran); /health answers within 1 s meanwhile; a chunked body without a length is refused
    once it passes the limit; both are counted in colibri_requests_total."""
    app = create_app({"tiny": eng}, max_body=1 << 20)
    with Server(app) as srv:
        steps = eng.runner.steps
        big = json.dumps({"model": "tiny", "prompt": "a" * (20 << 20), "max_tokens": 1}).encode()
        result = {}

        def post():
            result["r"] = httpx.post(srv.url + "/v1/completions", content=big, timeout=60,
                                     headers={"content-type": "application/json"})
        th = threading.Thread(target=post)
        th.start()
        worst = 0.0
        while th.is_alive():
            t0 = time.perf_counter()
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.02)
        th.join()
        r = result["r"]
        assert r.status_code == 413, r.text
        assert "--max-body" in r.json()["error"]["message"]
        assert worst < 1.0, worst

        def chunks():
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(40):
                yield b"a" * 65536
            yield b'"}'
        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert eng.runner.steps == steps                  # nothing reached the engine
        assert requests_total(srv.url, model="", endpoint="completions", status="413") == 2
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


# -- defect 2: a non-streamed request whose client hangs up -------------------------------------

def test_a_non_streamed_client_that_hangs_up_cancels_its_request(eng, monkeypatch):
    """max_tokens 100 without streaming, the client gives up after 0.3 s: the request is cancelled
    (far fewer than its 100 steps run; every block is back) and counted as 499, not 200."""
    slowed(monkeypatch, eng, 0.02)
    with Server(create_app({"tiny": eng})) as srv:
        steps = eng.runner.steps
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.3),
                       json={"model": "tiny", "prompt": "long", "max_tokens": 100, "ignore_eos": True})
        t_gone = time.monotonic()
        assert settled(eng)
        assert time.monotonic() - t_gone < 5
        assert eng.runner.steps - steps < 60, eng.runner.steps - steps
        assert requests_total(srv.url, model="tiny", endpoint="completions", status="499") == 1
        assert requests_total(srv.url, model="tiny", endpoint="completions", status="200") == 0


# -- defect 3: the request timeout -------------------------------------------------------------

def test_a_request_past_the_timeout_is_a_504_and_a_stream_says_so(eng, monkeypatch):
    slowed(monkeypatch, eng, 0.02)
    app = create_app({"tiny": eng}, request_timeout=0.3)
    with TestClient(app) as c:
        body = {"model": "tiny", "prompt": "t", "max_tokens": 100, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "COLIBRI_ERR_TIMEOUT"
        assert "request timeout" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            data = sse(s)
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])["error"]
        assert err["code"] == "COLIBRI_ERR_TIMEOUT" and "request timeout" in err["message"]
        assert all("choices" in json.loads(d) for d in data[:-2])
        assert settled(eng)
        assert requests_total(c, model="tiny", endpoint="completions", status="504") == 2


# -- defect 4: completions' shapes -------------------------------------------------------------

def test_completions_logprobs_echo_and_usage(client, eng):
    """Streamed logprobs in the legacy completions shape, as non-streamed; echo when streaming;
    prompt_tokens counted once whatever n is."""
    prompt = "abc"
    n_prompt = len(eng.codec.encode(prompt))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()
    lp = whole["choices"][0]["logprobs"]
    assert set(lp) >= {"tokens", "token_logprobs", "top_logprobs"} and len(lp["tokens"]) == 5
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "echo": True}) as s:
        chunks = [json.loads(d) for d in sse(s)[:-1]]
    assert chunks[0]["choices"][0]["text"] == prompt and chunks[0]["choices"][0]["logprobs"] is None
    got = [c["choices"][0]["logprobs"] for c in chunks[1:] if c["choices"] and c["choices"][0]["logprobs"]]
    assert all("content" not in g and len(g["tokens"]) == 1 for g in got)
    assert [g["tokens"][0] for g in got] == lp["tokens"]
    assert np.allclose([g["token_logprobs"][0] for g in got], lp["token_logprobs"])
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == prompt + whole["choices"][0]["text"]
    n3 = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "n": 3,
                                              "ignore_eos": True}).json()
    assert n3["usage"]["prompt_tokens"] == n_prompt and n3["usage"]["completion_tokens"] == 6
    ids = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                               "echo": True, "temperature": 0}).json()
    assert ids["choices"][0]["text"].startswith(eng.codec.decode([5, 6, 7]))
    # llama-server's return_tokens: the ids behind the text, whole and streamed (a chunk per token)
    want = eng.generate(eng.codec.encode(prompt), max_new_tokens=5, ignore_eos=True)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["tokens"] == want
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(d) for d in sse(s)[:-1]]
    assert [t for c in chunks for t in c["choices"][0].get("tokens", [])] == want


def test_n_streams_and_prompt_arrays(client):
    """n > 1 streamed gives each choice the text the non-streamed request gives it; an array of
    prompts answers one choice per prompt (and per n), in order."""
    body = {"model": "tiny", "prompt": "q", "max_tokens": 6, "temperature": 0.9, "seed": 4, "n": 2,
            "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(d) for d in sse(s)[:-1]]
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]
    assert texts[0] != texts[1]
    for prompts in (["ab", "cd", "efg"], [[3, 4], [5], [6, 7, 8]]):
        arr = client.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 3,
                                                   "temperature": 0, "ignore_eos": True}).json()
        assert [c["index"] for c in arr["choices"]] == [0, 1, 2]
        assert arr["usage"]["completion_tokens"] == 9
        for c, p in zip(arr["choices"], prompts):
            solo = client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 3,
                                                        "temperature": 0, "ignore_eos": True}).json()
            assert c["text"] == solo["choices"][0]["text"]


# -- defect 5: models.retrieve -----------------------------------------------------------------

def test_models_retrieve(client):
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and "not served" in r.json()["error"]["message"]


# -- defect 6: auth, CORS, metrics -------------------------------------------------------------

def test_auth_cors_and_refusals_counted(eng):
    app = create_app({"tiny": eng}, api_key="sekrit", cors=["http://a.example", "http://b.example"])
    with TestClient(app) as c:
        origin = {"Origin": "http://b.example"}
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=origin)
        assert r.status_code == 401 and r.headers.get("access-control-allow-origin") == "http://b.example"
        assert "Bearer" in r.json()["error"]["message"]
        for scheme in ("Bearer", "bearer", "BEARER"):
            ok = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                        headers={"Authorization": f"{scheme} sekrit", **origin})
            assert ok.status_code == 200, (scheme, ok.text)
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                      headers={"Authorization": "Bearer sekrit2"}).status_code == 401
        for o in ("http://a.example", "http://b.example"):
            pre = c.options("/v1/completions", headers={"Origin": o, "Access-Control-Request-Method": "POST"})
            assert pre.headers.get("access-control-allow-origin") == o
        h = {"Authorization": "Bearer sekrit"}
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": "hot"},
                      headers=h).status_code == 400
        assert requests_total_with(c, h, model="", endpoint="completions", status="401") == 2
        assert requests_total_with(c, h, model="tiny", endpoint="completions", status="400") == 1


def requests_total_with(c, headers, **labels):
    text = c.get("/metrics", headers=headers).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("colibri_requests_total{" + want + "}"))


# -- defect 8: error shapes --------------------------------------------------------------------

@pytest.mark.parametrize("content,words", [
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "JSON"),
    (b'{"model": "tiny", "prompt": [[[', "JSON"),
    (b'[1, 2', "JSON"),
])
def test_unreadable_bodies_are_openai_shaped_400s(client, content, words):
    r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "detail" not in r.json() and words in r.json()["error"]["message"]


def test_unknown_paths_are_openai_shaped_404s(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


# -- endpoints and request forms ---------------------------------------------------------------

def test_tokenize_detokenize_round_trip(client, eng):
    text = "héllo wörld 🐦"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200 and r.json()["tokens"] == eng.codec.encode(text, add_special_tokens=False)
    back = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["content"]
    assert back == text
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r.json()["tokens"]
    bad = client.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
    assert client.post("/tokenize", json={"content": "x", "model": "nope"}).status_code == 404


def test_content_parts_and_unknown_fields(client, eng, caplog):
    msgs = [{"role": "user", "content": "part one\npart two"}]
    want = eng.chat(msgs, max_new_tokens=6, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]
    with caplog.at_level(logging.WARNING, logger="colibri.serve"):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": parts, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True, "mystery_knob": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert any("mystery_knob" in rec.getMessage() for rec in caplog.records)
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": img})
    assert r.status_code == 400 and "text parts only" in r.json()["error"]["message"]


def test_requests_view_shows_kv_blocks(eng, monkeypatch):
    slowed(monkeypatch, eng, 0.02)
    with Server(create_app({"tiny": eng})) as srv:
        done = {}

        def post():
            done["r"] = httpx.post(srv.url + "/v1/completions", timeout=60,
                                   json={"model": "tiny", "prompt": "view me", "max_tokens": 40, "ignore_eos": True})
        th = threading.Thread(target=post)
        th.start()
        seen = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and seen is None:
            view = httpx.get(srv.url + "/slots").json()["tiny"]
            running = [r for r in view["requests"] if r["state"] == "running" and r["generated"] > 0]
            if running:
                seen = (view, running[0])
            time.sleep(0.02)
        th.join()
        assert seen is not None
        view, r = seen
        assert r["kv_blocks"] >= 1 and r["kv_tokens"] >= r["prompt_tokens"]
        assert view["kv_blocks_total"] == eng.runner.pool.num_blocks and view["n_ctx"] == 128
        assert httpx.get(srv.url + "/v1/requests").json()["tiny"]["kv_blocks_total"] == view["kv_blocks_total"]
        assert done["r"].status_code == 200


# -- defect 7: serve's start -------------------------------------------------------------------

def test_a_busy_port_is_found_before_any_model_loads(tmp_path):
    """The port is bound first: with it taken, serve() fails naming the port (code -1) even though
    the model directory does not exist (loading it would fail with INVALID_MODEL)."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        sk.listen(1)
        port = sk.getsockname()[1]
        with pytest.raises(ColibriError) as e:
            serve({"m": str(tmp_path / "missing")}, port=port)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "--port" in e.value.message
    with pytest.raises(ColibriError) as e:
        serve({"m": str(tmp_path / "missing")}, port=80000)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "65535" in e.value.message


def test_an_engine_that_does_not_open_is_named(model_dir):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with pytest.raises(ColibriError) as e:
        serve({"first": model_dir, "second": model_dir}, port=port, options={"second": {"max_seq_len": 10 ** 6}},
              backend="reference", max_seq_len=64)
    assert "model 'second'" in e.value.message and "max_seq_len" in e.value.message


def test_startup_line_names_engine_context_kv_and_memory(eng):
    line = describe("tiny", eng)
    assert "'tiny'" in line and "reference" in line and "context 128" in line
    assert f"{eng.runner.pool.num_blocks * eng.runner.pool.block_size} tokens" in line and "memory" in line


def test_max_tokens_cap(eng):
    with TestClient(create_app({"tiny": eng}, max_tokens=3)) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 50, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                 "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3


# -- the embedded model, through the real OpenAI client ----------------------------------------

DEMO = os.path.join(os.path.dirname(__import__("colibri_edge").__file__), "default_model")


def test_the_openai_client_chats_with_the_embedded_model():
    """The model `make demo` ships answers a two-turn conversation through its own template
    (Engine.chat's replies, the prompt's tokens counted as the template renders them), and the
    client's models.retrieve, embeddings and llama-server's tokenize / detokenize work on it."""
    import openai
    eng = Engine.open(DEMO, backend="cpu", max_seq_len=2048, max_batch=4)
    try:
        u1 = [{"role": "user", "content": "Tell me a fortune."}]
        want1 = eng.chat(u1, max_new_tokens=24)
        convo = u1 + [{"role": "assistant", "content": want1}, {"role": "user", "content": "Another one, please."}]
        want2 = eng.chat(convo, max_new_tokens=24)
        n_prompt2 = len(eng.codec.encode(eng.codec.render_chat(convo), add_special_tokens=False))
        texts = ["Tell me a fortune.", "What does json.dumps do?", "Tell me a fortune."]
        states = eng.embed([eng.codec.encode(t) for t in texts])
        with Server(create_app({"colibri": eng})) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            a1 = client.chat.completions.create(model="colibri", messages=u1, max_tokens=24, temperature=0)
            assert a1.choices[0].message.content == want1 and want1.strip()
            msgs = u1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                         {"role": "user", "content": "Another one, please."}]
            a2 = client.chat.completions.create(model="colibri", messages=msgs, max_tokens=24, temperature=0)
            assert a2.choices[0].message.content == want2
            assert a2.usage.prompt_tokens == n_prompt2 > a1.usage.prompt_tokens
            # turn 2 starts with turn 1's context: its whole KV blocks come from the prefix cache
            turn1 = a1.usage.prompt_tokens + a1.usage.completion_tokens - 1     # the last token was never fed
            cached = a2.usage.prompt_tokens_details.cached_tokens
            assert turn1 // 16 * 16 <= cached < a2.usage.prompt_tokens and cached % 16 == 0
            hit = [l for l in httpx.get(srv.url + "/metrics").text.splitlines()
                   if l.startswith('colibri_prefix_cache_hit_rate{model="colibri"}')]
            assert hit and 0 < float(hit[0].split()[-1]) <= 1
            assert client.models.retrieve("colibri").id == "colibri"
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve("nope")
            emb = client.embeddings.create(model="colibri", input=texts)
            vecs = np.array([d.embedding for d in emb.data])
            assert vecs.shape == (3, eng.config["hidden_size"]) and emb.usage.prompt_tokens == sum(map(len, states))
            assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
            assert np.array_equal(vecs[0], vecs[2]) and not np.allclose(vecs[0], vecs[1])      # deterministic
            pooled = np.stack([s.mean(axis=0) for s in states])
            assert np.allclose(vecs, pooled / np.linalg.norm(pooled, axis=1, keepdims=True), atol=1e-6)
            again = client.embeddings.create(model="colibri", input=texts[1])
            assert np.array_equal(np.array(again.data[0].embedding), vecs[1])
            toks = httpx.post(srv.url + "/tokenize", json={"content": texts[1]}).json()["tokens"]
            assert toks == eng.codec.encode(texts[1], add_special_tokens=False)
            assert httpx.post(srv.url + "/detokenize", json={"tokens": toks}).json()["content"] == texts[1]
        assert settled(eng)
    finally:
        eng.close()


def test_a_restarted_server_answers_from_its_cache_dir(tmp_path):
    """--cache-dir: two turns, the server and its engine closed, a new one on the same folder: turn 3
    takes turns 1-2's whole blocks from disk (cached_tokens), and its reply equals an uncached engine's."""
    import openai
    opts = dict(backend="reference", max_seq_len=2048, max_batch=2)
    msgs = [{"role": "user", "content": "Tell me a fortune."}]

    def ask(srv, msgs):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return client.chat.completions.create(model="demo", messages=msgs, max_tokens=24, temperature=0)
    eng = Engine.open(DEMO, **opts)
    try:
        with Server(create_app({"demo": eng}, cache_dir=str(tmp_path))) as srv:
            a1 = ask(srv, msgs)
            msgs += [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "Another one, please."}]
            a2 = ask(srv, msgs)
    finally:
        eng.close()
    saved = list((tmp_path / "demo").glob("*.session"))
    # turn 2's file holds turn 1's blocks too: one file, a name (hard link) per whole block it holds
    assert len({f.stat().st_ino for f in saved}) == 1 and len(saved) == (a2.usage.prompt_tokens + 23) // 16
    msgs += [{"role": "assistant", "content": a2.choices[0].message.content},
             {"role": "user", "content": "What does json.dumps do?"}]
    eng = Engine.open(DEMO, **opts)
    try:
        with Server(create_app({"demo": eng}, cache_dir=str(tmp_path))) as srv:
            a3 = ask(srv, msgs)
    finally:
        eng.close()
    # turn 3 re-tokenises the end of turn 2's reply (cut at 24 tokens) differently: it matches turn 2's
    # tokens up to there, and takes every whole block before that from the saved file
    fed2 = eng.codec.encode(eng.codec.render_chat(msgs[:3]), add_special_tokens=False)
    want3 = eng.codec.encode(eng.codec.render_chat(msgs), add_special_tokens=False)
    assert a3.usage.prompt_tokens == len(want3) and len(fed2) == a2.usage.prompt_tokens
    assert a3.usage.prompt_tokens_details.cached_tokens >= len(fed2) // 16 * 16 > 16
    with Engine.open(DEMO, prefix_cache=False, **opts) as fresh:
        assert a3.choices[0].message.content == fresh.chat(msgs, max_new_tokens=24)


QUESTIONS = ["Tell me a fortune.", "What does json.dumps do?", "Another one, please.", "Explain the with statement.",
             "What is a list in Python?", "Tell me something funny.", "How do I use os.path.join?",
             "Say something wise.", "What does str.split do?", "Cheer me up.", "Quote of the day?"]


@pytest.mark.parametrize("which", ["demo", "hybrid"])
def test_a_ten_turn_conversation_through_the_openai_client(which, tmp_path):
    """Ten chat turns, each sending the whole conversation, through the real OpenAI client to a server
    with the prefix cache and --cache-dir and to one without (--no-prefix-cache): every reply equal;
    from turn 2 on, cached_tokens covers the previous turn's context -- its prompt and reply (the
    embedded model), up to the last snapshot (a Qwen3.5 hybrid: the recurrent state is kept at each
    prompt's and, re-prefilled after the turn, each reply's last multiple of 16 tokens). Then the
    server is restarted on the same folder:
    turn 11 takes its cached tokens from disk and answers as the uncached server does."""
    import openai
    if which == "demo":
        model = DEMO
    else:
        model = build_text_model(tmp_path / "m", "qwen3_5_moe_4k")[1]
    opts = dict(backend="cpu", max_seq_len=2048, max_batch=2)
    cache = str(tmp_path / "cache")

    def ask(srv, msgs):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0)
    on, off = Engine.open(model, settle_replies=True, **opts), Engine.open(model, prefix_cache=False, **opts)
    msgs, rows = [], []
    try:
        with Server(create_app({"m": on}, cache_dir=cache)) as son, Server(create_app({"m": off})) as soff:
            for q in QUESTIONS[:10]:
                msgs.append({"role": "user", "content": q})
                a, b = ask(son, msgs), ask(soff, msgs)
                assert a.choices[0].message.content == b.choices[0].message.content
                assert b.usage.prompt_tokens_details.cached_tokens == 0
                rows.append((a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.prompt_tokens_details.cached_tokens))
                msgs.append({"role": "assistant", "content": a.choices[0].message.content})
                assert settled(on)           # the user types: a hybrid's reply is re-prefilled meanwhile
            held = [l for l in httpx.get(son.url + "/metrics").text.splitlines()
                    if l.startswith('colibri_state_snapshots_held{model="m"}')]
            assert held and (float(held[0].split()[-1]) > 0) == (which == "hybrid")
        for (p0, c0, _), (p1, _, cached) in zip(rows, rows[1:]):
            # the previous turn's fed tokens (its prompt and reply but the last token), whole blocks of 16;
            # the hybrid resumes at a snapshot: the one its re-prefilled reply left at the reply's last
            # multiple of 16 when the next prompt re-tokenises the reply as it was generated (the
            # random model's replies are not: test_prefix_cache holds that case), else the prompt's
            covered = (p0 + c0 - 1) // 16 * 16 if which == "demo" else (p0 - 1) // 16 * 16
            assert covered <= cached < p1, rows
        assert rows[0][2] == 0 and rows[-1][0] > 100
    finally:
        on.close()
    msgs.append({"role": "user", "content": QUESTIONS[10]})
    restarted = Engine.open(model, **opts)
    try:
        with Server(create_app({"m": restarted}, cache_dir=cache)) as son, Server(create_app({"m": off})) as soff:
            a, b = ask(son, msgs), ask(soff, msgs)
        assert a.usage.prompt_tokens_details.cached_tokens >= (rows[-1][0] - 1) // 16 * 16 > 0
        assert a.choices[0].message.content == b.choices[0].message.content
    finally:
        restarted.close()
        off.close()
