"""`colibri serve` (colibri_edge/serving/serve.py) through FastAPI's TestClient (httpx, in process): the OpenAI
endpoints against the engine's own results, SSE streaming, stop strings, usage, logprobs, several
models isolated, API key, 4xx for every bad request, 429 on a full queue, /metrics, and a client
that leaves a stream early cancelling its request."""
import json
import time

import numpy as np

import pytest

pytest.importorskip("fastapi", reason="the serve extra is part of make test's install")

from fastapi.testclient import TestClient  # noqa: E402

from colibri_edge import Engine  # noqa: E402
from colibri_edge.serving.serve import create_app  # noqa: E402
from hf_models import build_text_model  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _, text_dir, _ = build_text_model(tmp_path_factory.mktemp("serve"))
    a = Engine.open(text_dir, backend="reference", max_seq_len=128, max_batch=4)
    b = Engine.open(text_dir, backend="cpu", max_seq_len=128, max_batch=4)
    app = create_app({"tiny": a, "tiny-cpu": b})
    with TestClient(app) as client:
        yield client, a, b
    a.close()
    b.close()


def _sse(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def test_completion_equals_engine(served):
    client, eng, _ = served
    want = eng.codec.decode(eng.generate("hello", max_new_tokens=12, ignore_eos=True))
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == want
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(eng.codec.encode("hello")), "completion_tokens": 12,
                             "total_tokens": len(eng.codec.encode("hello")) + 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}      # shorter than a KV block


def test_chat_stream_joins_to_the_chat_reply(served):
    client, eng, _ = served
    msgs = [{"role": "user", "content": "héllo 🐦"}]
    want = eng.chat(msgs, max_new_tokens=20, ignore_eos=True)
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": msgs, "max_tokens": 20, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == want
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 20 and chunks[-1]["choices"] == []
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 20,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": want}


def test_stop_strings_are_cut_streamed_or_not(served):
    client, eng, _ = served
    full = eng.codec.decode(eng.generate("abc", max_new_tokens=30, ignore_eos=True))
    stop = full[8:11]                                    # a string the greedy text contains
    want = full[:full.find(stop)]
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    r = client.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == want and r.json()["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want


def test_logprobs_and_seeded_sampling(served):
    client, eng, _ = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "temperature": 0.9,
            "seed": 7, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    a, b = client.post("/v1/chat/completions", json=body).json(), client.post("/v1/chat/completions", json=body).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    lp = a["choices"][0]["logprobs"]["content"]
    assert len(lp) == 6 and all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 2 for x in lp)
    assert all(x["top_logprobs"][0]["logprob"] >= x["logprob"] for x in lp)
    n3 = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5, "temperature": 1.0,
                                              "seed": 3, "n": 3, "ignore_eos": True}).json()
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2] and n3["usage"]["completion_tokens"] == 15


def test_models_health_requests_and_isolation(served):
    client, a, b = served
    ids = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in ids] == ["tiny", "tiny-cpu"] and ids[1]["backend"] == "cpu"
    assert client.get("/health").json()["status"] == "ok"
    assert set(client.get("/v1/requests").json()) == {"tiny", "tiny-cpu"}
    before = b.runner.steps
    client.post("/v1/completions", json={"model": "tiny", "prompt": "q", "max_tokens": 3, "ignore_eos": True})
    assert b.runner.steps == before                     # another model's engine never ran


@pytest.mark.parametrize("body,status,words", [
    ({"model": "nope", "prompt": "x"}, 404, "not served"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [1, 2, 10 ** 9]}, 400, "out of range"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ({"model": "tiny"}, 400, "prompt"),
])
def test_bad_requests_are_4xx_with_the_message(served, body, status, words):
    client, _, _ = served
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_internal_failure_is_a_500_for_that_request_alone(served, monkeypatch):
    """A failure no client caused (here the engine's submission raising RuntimeError) answers that
    request with a 500 in the OpenAI error shape; the next request is served as before."""
    _, a, _ = served
    app = create_app({"tiny": a})
    with TestClient(app, raise_server_exceptions=False) as c:
        host = app.state.hosts["tiny"]
        monkeypatch.setattr(host.aio, "submit_n", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        monkeypatch.undo()
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_metrics_are_prometheus(served):
    client, _, _ = served
    client.post("/v1/completions", json={"model": "tiny", "prompt": "m", "max_tokens": 4, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("colibri_requests_total", "colibri_prompt_tokens_total", "colibri_completion_tokens_total",
                 "colibri_time_to_first_token_seconds_bucket", "colibri_inter_token_seconds_bucket",
                 "colibri_queue_depth", "colibri_kv_blocks_used", "colibri_expert_slot_hit_rate"):
        assert name in text, name
    assert 'colibri_requests_total{endpoint="completions",model="tiny",status="200"}' in text


def test_client_disconnect_cancels_its_request(served, monkeypatch):
    """A real uvicorn server on a loopback port: a client that reads one chunk and closes its
    connection cancels the request (it does not run its 100 tokens; the pool is whole again). Each
    step is held 10 ms, so that the tiny model cannot finish its 100 tokens (a few ms on a quiet
    machine) before the server has noticed the disconnect, however busy the machine is."""
    import socket
    import threading
    import httpx
    import uvicorn
    _, eng, _ = served
    step = eng.runner.step

    def slow_step(*a, **k):
        time.sleep(0.01)
        return step(*a, **k)
    monkeypatch.setattr(eng.runner, "step", slow_step)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app({"tiny": eng}), host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        steps = eng.runner.steps
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "long", "max_tokens": 100, "stream": True,
                                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break                                # one chunk, then the connection closes
        for _ in range(500):
            if not eng._core.busy:
                break
            time.sleep(0.01)
        assert not eng._core.busy and eng.kv_free_blocks == eng.runner.pool.num_blocks
        assert eng.runner.steps - steps < 60, eng.runner.steps - steps      # not its 100 tokens
    finally:
        server.should_exit = True
        th.join(10)


def test_api_key_and_full_queue(served):
    _, a, _ = served
    with Engine.open(a.path, backend="reference", max_batch=1, max_queue=1) as e:
        app = create_app({"m": e}, api_key="sekrit", cors="http://localhost:3000")
        with TestClient(app) as c:
            assert c.post("/v1/completions", json={"model": "m", "prompt": [1, 2]}).status_code == 401
            assert c.get("/health").status_code == 200                   # health needs no key
            h = {"Authorization": "Bearer sekrit"}
            ok = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2}, headers=h)
            assert ok.status_code == 200, ok.text
            r = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2, "n": 3}, headers=h)
            assert r.status_code == 429 and r.headers["retry-after"] == "1" and "max_queue" in r.json()["error"]["message"]
            pre = c.options("/v1/completions", headers={"Origin": "http://localhost:3000",
                                                        "Access-Control-Request-Method": "POST"})
            assert pre.headers.get("access-control-allow-origin") == "http://localhost:3000"


def _mutate(rng, base):
    """A random request body: fields dropped, retyped, set to extreme or nonsense values, or added."""
    values = [None, True, -1, 0, 1, 2 ** 31, 2 ** 70, -1e308, 1e308, float("nan"), "x", "", "0", [], [1, -2],
              ["a", 3], {}, {"5": "a"}, {"-1": 1.0}, [[1]], "\ud800", 3.5, -0.0, "required", "auto",
              {"type": "function", "function": {"name": "f"}}, {"messages": 1, "tools": "x"},
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
              {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}]
    body = dict(base)
    for _ in range(int(rng.integers(1, 4))):
        op = rng.integers(0, 3)
        keys = list(body) + ["max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "n",
                             "logit_bias", "logprobs", "top_logprobs", "stream", "messages", "prompt",
                             "presence_penalty", "repetition_penalty", "priority", "stream_options", "junk",
                             "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                             "chat_template_kwargs", "response_format", "reasoning_effort"]
        k = keys[int(rng.integers(0, len(keys)))]
        if op == 0:
            body.pop(k, None)
        else:
            body[k] = values[int(rng.integers(0, len(values)))]
    return body


def test_http_fuzz_never_500(served):
    """300 mutated bodies against both endpoints: every answer is 200 or a 4xx with a message in the
    error body, never a 5xx or a dropped connection; the engine serves a sound request after."""
    client, eng, _ = served
    rng = np.random.default_rng(2026)
    bases = {"/v1/completions": {"model": "tiny", "prompt": "fuzz", "max_tokens": 3},
             "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "f"}],
                                      "max_tokens": 3}}
    seen = set()
    for i in range(300):
        path = list(bases)[i % 2]
        body = _mutate(rng, bases[path])
        try:
            data = json.dumps(body, allow_nan=True)
        except (TypeError, ValueError):
            continue
        r = client.post(path, content=data.encode("utf-8", "surrogatepass"),
                        headers={"content-type": "application/json"})
        seen.add(r.status_code)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, body, r.text[:300])
        if r.status_code != 200:
            assert r.json()["error"]["message"], body
    assert 200 in seen and 400 in seen
    assert not eng._core.busy or _settle(eng)
    assert eng.kv_free_blocks == eng.runner.pool.num_blocks
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200


def _settle(eng):
    for _ in range(500):
        if not eng._core.busy:
            return True
        time.sleep(0.01)
    return False
