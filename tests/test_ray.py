"""Routing studies on Ray (serving/distributed.py): on a local cluster bound to 127.0.0.1 (`ray start
--head`, 2 CPUs, started and stopped here), a trace sharded over 2 worker actors -- one killed with
SIGKILL mid-trace -- equals the one-process trace of the same prompts row for row, and every cell of a
simulator sweep run as Ray tasks equals `colibri simulate` run alone for that cell."""
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import ray

from colibri_edge import COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE, ColibriError, Engine
from colibri_edge.serving import distributed
from colibri_edge.analysis.trace import Trace
from colibri_edge.model.demo import ensure_default_model

PROMPTS = ["The quick brown fox", "Once upon a time there was", "Hello world", "In the beginning",
           "A short poem about the sea", "Dear diary,", "The weather today", "My favourite food is",
           "Numbers: one two three", "Why is the sky blue?", "Write a haiku", "The end"]
FIELDS = ("expert_ids", "weights", "seq_ids", "positions", "step_ids", "layer_ids", "predicted_ids",
          "predicted_weights")
ENGINE = {"backend": "cpu", "max_batch": 1}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A loopback cluster without token authentication (Ray 2.60 turns it on for a machine where any
    local Ray wrote ~/.ray/auth_token): the head, this process and the CLI's subprocesses agree on it."""
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    temp = f"/tmp/colibri-ray-{os.getpid()}"
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    r = subprocess.run([exe, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        ray.shutdown()
        subprocess.run([exe, "stop", "--force"], capture_output=True, timeout=120)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="module")
def local_trace():
    with Engine.open(ensure_default_model()[0], prefix_cache=False, **ENGINE) as eng:
        return eng.trace(PROMPTS, max_new_tokens=4, ignore_eos=True)


def _same(a: Trace, b: Trace):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f


def test_a_sharded_trace_with_a_killed_worker_equals_one_process(cluster, local_trace):
    killed, seen = [], []

    def on_shard(done, total, pid, pids):
        seen.append(pid)
        if not killed:                              # the other worker dies while its shard runs
            victim = next(p for p in pids if p != pid)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
    got = distributed.trace_sharded(ensure_default_model()[0], PROMPTS, workers=2, address=cluster,
                                    max_new_tokens=4, engine_kw=ENGINE, on_shard=on_shard)
    assert killed and len(seen) == len(distributed._shards(len(PROMPTS), 2)) == 8
    assert len(set(seen) - set(killed)) >= 2                    # a restarted worker traced shards after
    _same(got, local_trace)
    assert sorted(set(got.seq_ids.tolist())) == list(range(len(PROMPTS))) and got.meta["prompts"] == len(PROMPTS)


def _simulate_alone(path, cell) -> dict:
    from colibri_edge.serving.cli import main
    args = ["simulate", "--trace", path, "--slots", str(cell["slots"]), "--policy", cell["policy"], "--json"]
    if "device" in cell:
        args += ["--device", cell["device"]]
    if "top_k" in cell:
        args += ["--top-k", str(cell["top_k"])]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return json.loads(out.getvalue())


def test_every_sweep_cell_equals_simulate_alone(cluster, local_trace, tmp_path):
    path = str(tmp_path / "t.npz")
    local_trace.save(path)
    grid = distributed.parse_sweep("slots=2:8:3,policy=lru,belady,prefetch,device=rk3588,jetson-orin,top_k=2,1")
    assert grid["slots"] == [2, 5, 8]
    rows = distributed.sweep(Trace.load(path), grid, address=cluster)
    assert len(rows) == 3 * 3 * 2 * 2
    assert rows == distributed.sweep(Trace.load(path), grid)           # the same grid, here
    for r in rows:
        cell = {k: r[k] for k in distributed.SWEEP_KEYS}
        alone = _simulate_alone(path, cell)
        alone["device_name"] = alone.pop("device")
        assert {k: v for k, v in r.items() if k not in distributed.SWEEP_KEYS} == \
            {k: v for k, v in alone.items() if k not in distributed.SWEEP_KEYS}
        assert (alone["slots"], alone["policy"]) == (r["slots"], r["policy"])


def test_the_cli_traces_on_the_cluster(cluster, local_trace, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "t.npz"
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "trace", "--prompts", str(prompts), "--out", str(out),
                        "--max-new-tokens", "4", "--backend", "cpu", "--workers", "2", "--ray", cluster],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "8/8 shards" in r.stderr
    _same(Trace.load(str(out)), local_trace)
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "simulate", "--trace", str(out), "--sweep",
                        "slots=4,8,policy=lru,lfu", "--ray", cluster, "--json"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [(x["slots"], x["policy"]) for x in json.loads(r.stdout)] == [(4, "lru"), (8, "lru"), (4, "lfu"),
                                                                          (8, "lfu")]


@pytest.mark.parametrize("spec,words", [
    ("slots=4:2", "start:stop:step"), ("slots=0", "1 or more"), ("bogus=1", "unknown key 'bogus'"),
    ("4,8", "key=value"), ("slots=4,slots=8", "given twice"), ("slots=a", "integers")])
def test_a_bad_sweep_is_refused(spec, words):
    with pytest.raises(ColibriError) as e:
        distributed.parse_sweep(spec)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and words in e.value.message, e.value.message


def test_without_ray_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ColibriError) as e:
        distributed.trace_sharded(ensure_default_model()[0], PROMPTS, workers=2)
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "colibri-edge[ray]" in e.value.message


def test_top_k_keeps_the_heaviest_experts(local_trace):
    one = local_trace.with_top_k(1)
    best = np.argmax(local_trace.weights, axis=2)[..., None]
    assert np.array_equal(one.expert_ids, np.take_along_axis(local_trace.expert_ids, best, 2))
    assert one.meta["top_k"] == 1 and local_trace.with_top_k(2) is local_trace
    with pytest.raises(ColibriError):
        local_trace.with_top_k(3)
