"""`colibri serve`'s /dashboard (colibri_edge/serving/dashboard.py) in a real headless Chromium (Debian's
chromium + chromium-driver, driven by selenium; make test installs them) against a real server on
127.0.0.1: no console error, every model by name, the output-token counter rising while a client
streams, heat-map cells lighting up for the experts a tiny model's router is set to pick, a saved
trace's heat map, the chat box, the API key asked for and typed, and the JSON API equal to /metrics.
A screenshot goes to the test's tmp dir and to test-artifacts/dashboard.png. Nothing here skips: a
missing browser or driver fails."""
import os
import shutil
import threading
import time

import httpx
import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.serving.dashboard import heat_from_trace
from colibri_edge.serving.serve import create_app
from helpers import Server
from hf_models import build_text_model

PICKED = (1, 3)            # the experts the router is set to pick, in every MoE layer (of 4, top-2)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _forced_router_model(tmp):
    """build_text_model's mixtral (2 MoE layers x 4 experts, top-2) with every token routed to PICKED: the
    embeddings carry a large constant in hidden dim 0, which dominates the normed residual, and each
    router row reads dim 0 alone (+1 for PICKED, -1 for the others)."""
    from safetensors.numpy import load_file, save_file
    from colibri_edge.model.convert import convert
    hf, _, _ = build_text_model(tmp)
    f = os.path.join(hf, "model.safetensors")
    w = load_file(f)
    w["model.embed_tokens.weight"][:, 0] = 50.0
    gates = [n for n, t in w.items() if n.endswith("gate.weight") and t.shape[0] == 4]
    assert len(gates) == 2, sorted(w)
    for n in gates:
        g = np.zeros_like(w[n])
        g[:, 0] = [1.0 if e in PICKED else -1.0 for e in range(4)]
        w[n] = g
    for n in w:
        if n.endswith("post_attention_layernorm.weight"):
            w[n][0] = 1.0
    save_file(w, f, metadata={"format": "pt"})
    out = os.path.join(str(tmp), "forced")
    convert(hf, out, progress=False)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _forced_router_model(tmp_path_factory.mktemp("dashboard"))


@pytest.fixture(scope="module")
def served(model_dir):
    """Two models on one server (no API key, CORS off; alpha profiled by phase, beta with a 64 MiB memory
    budget) -> (server, {name: engine}, counts at start)."""
    engines = {n: Engine.open(model_dir, backend="reference", max_seq_len=256, max_batch=2, profile=n == "alpha",
                              memory_budget=(64 << 20) if n == "beta" else None) for n in ("alpha", "beta")}
    start = {n: e.expert_counts.copy() for n, e in engines.items()}
    with Server(create_app(engines)) as srv:
        yield srv, engines, start
    for e in engines.values():
        e.close()


def _browser():
    """Headless Chromium with its console log kept; fails (never skips) without chromium or its driver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    assert binary and driver, ("the dashboard test needs Debian's chromium and chromium-driver: "
                               "apt-get install chromium chromium-driver (make test installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture
def browser():
    b = _browser()
    yield b
    b.quit()


def _wait(fn, timeout=20, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _no_console_errors(b):
    bad = [e for e in b.get_log("browser") if e["level"] == "SEVERE"]
    assert not bad, bad


def _field(b, model, key):
    from selenium.webdriver.common.by import By
    els = b.find_elements(By.CSS_SELECTOR, f'section[data-model="{model}"] [data-field="{key}"]')
    return els[0].text if els else ""


def _cell_red(b, model, layer_row, expert):
    """The red channel at the centre of a heat-map cell as drawn on the canvas (28 = no routing, 255 = the most)."""
    return b.execute_script("""
        const c = document.querySelector(`section[data-model="${arguments[0]}"] canvas.heat`);
        const w = +c.dataset.cellW, h = +c.dataset.cellH;
        if (!w) return -1;
        return c.getContext("2d").getImageData(arguments[2] * w + (w >> 1) - 1, arguments[1] * h + (h >> 1) - 1,
                                               1, 1).data[0];""", model, layer_row, expert)


def _streams(url, model, times, n, done, headers=None):
    for _ in range(times):
        _stream(url, model, n, headers)
    done.set()


def _stream(url, model, n, headers=None):
    with httpx.stream("POST", f"{url}/v1/completions", headers=headers, timeout=120, json={
            "model": model, "prompt": "hi", "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass


def test_live_page(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    srv, engines, start = served
    b = browser
    b.get(f"{srv.url}/dashboard?interval=150")
    for name in engines:
        _wait(lambda: b.find_elements(By.CSS_SELECTOR, f'section[data-model="{name}"] h2.model-name'), what=name)
        assert b.find_element(By.CSS_SELECTOR, f'section[data-model="{name}"] h2.model-name').text == name
    _wait(lambda: _field(b, "alpha", "tokens_out") == "0", what="the counter at 0")
    assert _cell_red(b, "alpha", 0, PICKED[0]) == 28           # nothing routed yet: every cell dark

    httpx.post(f"{srv.url}/v1/completions", timeout=60, json={"model": "alpha", "prompt": "hi", "max_tokens": 20,
                                                              "ignore_eos": True})
    # the heat map: the picked experts' cells lit in every MoE layer, the others dark, equal to the engine's counts
    e = engines["alpha"]
    moe = [m.layer for m in e.runner.program.moe]
    delta = (e.expert_counts - start["alpha"])[moe]
    assert (delta[:, [x for x in range(4) if x not in PICKED]] == 0).all() and (delta[:, list(PICKED)] > 0).all()
    heat = httpx.get(f"{srv.url}/v1/dashboard/state").json()["models"][0]["heat"]
    assert heat["counts"] == delta.tolist() and heat["layers"] == moe
    for row in range(len(moe)):
        _wait(lambda: all(_cell_red(b, "alpha", row, x) == 255 for x in PICKED), what="the lit cells")
        assert all(_cell_red(b, "alpha", row, x) == 28 for x in range(4) if x not in PICKED)
        assert _cell_red(b, "beta", row, PICKED[0]) == 28      # the other model's map did not move

    # the output-token counter rises while a client streams (four streams, one after another), from the
    # first request's 20 (the page may still show a count from the middle of that request: wait for it)
    _wait(lambda: _field(b, "alpha", "tokens_out") == "20", what="the first request's count")
    done = threading.Event()
    t = threading.Thread(target=_streams, args=(srv.url, "alpha", 4, 200, done))
    t.start()
    seen = []
    while not done.is_set():
        v = _field(b, "alpha", "tokens_out")
        if v and v != "–" and (not seen or int(v) != seen[-1]):
            seen.append(int(v))
        time.sleep(0.03)
    t.join()
    assert seen == sorted(seen) and seen[0] >= 20 and len([v for v in seen if v < 820]) >= 3, seen
    _wait(lambda: _field(b, "alpha", "tokens_out") == "820", what="the final count")

    # the step-time breakdown: alpha (profiled) by phase, its phases adding up to its median step; beta says
    # how to turn it on
    step = httpx.get(f"{srv.url}/v1/dashboard/state").json()["models"][0]["step"]["phases"]
    assert list(step["phases_ms"]) == ["attention", "experts", "lm_head", "other", "host"]
    assert step["decode_steps"] > 100 and all(v >= 0 for v in step["phases_ms"].values())
    assert step["phases_ms"]["attention"] > 0 and step["phases_ms"]["experts"] > 0 and step["phases_ms"]["lm_head"] > 0
    assert abs(sum(step["phases_ms"].values()) - step["step_ms"]) < 0.5 * step["step_ms"]
    phases = lambda m: b.find_element(By.CSS_SELECTOR, f'section[data-model="{m}"] .phases').text  # noqa: E731
    _wait(lambda: "step time by phase" in phases("alpha") and "experts" in phases("alpha"), what="alpha's phases")
    assert "--profile" in phases("beta")
    # the memory bar: beta's against its budget
    mem = httpx.get(f"{srv.url}/v1/dashboard/state").json()["models"][1]["memory"]
    assert mem["budget"] == 64 << 20 and 0 < mem["weights"] + mem["kv"] + mem["arena"] < mem["budget"]
    legend = b.find_element(By.CSS_SELECTOR, 'section[data-model="beta"] .legend').text
    assert "budget 64" in legend, legend

    # the chat box streams a reply
    b.find_element(By.ID, "chat-input").send_keys("hello")
    b.find_element(By.ID, "chat-send").click()
    _wait(lambda: b.find_element(By.ID, "chat-output").text, what="a chat reply")

    # a saved trace's heat map, opened through the file input
    tr = engines["beta"].trace(["abc", "hello there"])
    path = str(tmp_path / "saved.npz")
    tr.save(path)
    b.find_element(By.ID, "trace-file").send_keys(path)
    _wait(lambda: "tokens" in b.find_element(By.ID, "trace-info").text, what="the trace's heat map")
    with open(path, "rb") as f:
        got = httpx.post(f"{srv.url}/v1/dashboard/trace", content=f.read()).json()
    assert got == heat_from_trace(tr) and got["counts"][0][PICKED[0]] == tr.expert_ids.shape[0]
    assert httpx.post(f"{srv.url}/v1/dashboard/trace", content=b"not a trace").status_code == 400

    _no_console_errors(b)
    shot = tmp_path / "dashboard.png"
    b.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    os.makedirs(os.path.join(REPO, "test-artifacts"), exist_ok=True)
    shutil.copy(shot, os.path.join(REPO, "test-artifacts", "dashboard.png"))


def test_state_equals_metrics(served):
    """With the engines idle, every number the state API takes from /metrics' sources equals /metrics'."""
    from prometheus_client.parser import text_string_to_metric_families
    srv, engines, _ = served
    httpx.post(f"{srv.url}/v1/completions", json={"model": "beta", "prompt": "xyz", "max_tokens": 5,
                                                  "ignore_eos": True}, timeout=60)
    state = httpx.get(f"{srv.url}/v1/dashboard/state").json()
    prom = {}
    for fam in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text):
        for s in fam.samples:
            if "le" not in s.labels and "model" in s.labels:
                prom[(s.name, s.labels["model"])] = s.value
    fields = {"tokens_in": "colibri_prompt_tokens_total", "tokens_out": "colibri_completion_tokens_total",
              "queue_depth": "colibri_queue_depth", "running_requests": "colibri_running_requests",
              "kv_blocks_used": "colibri_kv_blocks_used", "kv_blocks_total": "colibri_kv_blocks_total",
              "state_slots_used": "colibri_state_slots_used", "state_slots_total": "colibri_state_slots_total",
              "prefix_cache_hit_rate": "colibri_prefix_cache_hit_rate"}
    assert [m["name"] for m in state["models"]] == list(engines)
    for m in state["models"]:
        for k, metric in fields.items():
            assert m[k] == prom[(metric, m["name"])], (m["name"], k)
        for k, metric in (("ttft_s", "colibri_time_to_first_token_seconds"), ("itl_s", "colibri_inter_token_seconds")):
            assert m[k]["count"] == prom[(metric + "_count", m["name"])] and m[k]["sum"] == prom[(metric + "_sum", m["name"])]
        assert m["expert_slots"] is None and prom[("colibri_expert_slot_hit_rate", m["name"])] == 1.0
    beta = state["models"][1]
    assert beta["tokens_out"] == 5 and beta["ttft_s"]["p50"] is not None and beta["tokens_out_per_s"] > 0


def test_api_key_asked_and_typed(model_dir, browser):
    from selenium.webdriver.common.by import By
    e = Engine.open(model_dir, backend="reference", max_seq_len=256, max_batch=2)
    try:
        with Server(create_app({"keyed": e}, api_key="s3cret")) as srv:
            assert httpx.get(f"{srv.url}/v1/dashboard/state").status_code == 401
            b = browser
            b.get(f"{srv.url}/dashboard?interval=150")
            key = _wait(lambda: [x for x in b.find_elements(By.ID, "api-key") if x.is_displayed()], what="the key form")
            assert not b.find_elements(By.CSS_SELECTOR, 'section[data-model="keyed"]')
            key[0].send_keys("s3cret")
            b.find_element(By.ID, "key-submit").click()
            _wait(lambda: _field(b, "keyed", "tokens_out") == "0", what="the model after the key")
            assert b.execute_script("return sessionStorage.getItem('colibri-api-key')") == "s3cret"
            _stream(srv.url, "keyed", 8, headers={"Authorization": "Bearer s3cret"})
            _wait(lambda: _field(b, "keyed", "tokens_out") == "8", what="the counter with the key")
            _no_console_errors(b)
    finally:
        e.close()
