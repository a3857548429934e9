"""The CLI (`colibri` == `python -m colibri_edge`) and the runtime knobs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from colibri_edge import knobs
from hf_models import convert_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "colibri_edge", *args], capture_output=True, text=True,
                          cwd=ROOT, env=e, timeout=600)


def test_convert_and_inspect(model_cache, tmp_path):
    hf, _ = convert_case(model_cache, "qwen2_moe")
    out = cli("convert", hf, str(tmp_path / "m"), "--dtype", "float16")
    assert out.returncode == 0, out.stderr
    assert "convert" in out.stderr          # the progress bar
    r = cli("inspect", str(tmp_path / "m"), "--context", "128")
    assert r.returncode == 0, r.stderr
    for words in ("valid", "attention + routed + shared experts", "attention + dense MLP", "bytes per",
                  "read per decoded token", "KV cache", "scratch", "context 128", "allocated at open"):
        assert words in r.stdout, (words, r.stdout)
    # the figures come from the files: 6 experts of gate+up+down [32,64] float16
    assert "6 x 12.0 KiB" in r.stdout
    # --device: how many experts fit beside the rest (a profile of 4 experts' room after the rest)
    from colibri_edge.model.modeldir import ModelDir
    from colibri_edge.analysis.sizing import summary
    s = summary(ModelDir(str(tmp_path / "m")), 128)
    rest = s["non_expert_bytes"] + s["kv_cache_bytes"] + s["scratch_bytes"]
    prof = {"name": "tiny board", "memory_bytes": rest + int(4.5 * s["bytes_per_expert"]),
            "memory_bandwidth_gbs": 1, "miss_bandwidth_gbs": 0.1}
    (tmp_path / "dev.json").write_text(json.dumps(prof))
    r = cli("inspect", str(tmp_path / "m"), "--context", "128", "--max-batch", "1", "--device", str(tmp_path / "dev.json"))
    assert r.returncode == 0 and "on tiny board: at most 4 of 6 experts resident" in r.stdout, r.stdout + r.stderr


def test_inspect_bad_model_exit_code(tmp_path):
    r = cli("inspect", str(tmp_path))
    assert r.returncode == 2 and "COLIBRI_ERR_INVALID_MODEL" in r.stderr and "config.json" in r.stderr


def test_backends_lists_each_with_reason():
    r = cli("backends")
    assert r.returncode == 0
    lines = [l for l in r.stdout.splitlines() if not l.startswith(" ")]     # indented: device details
    assert sorted(l.split()[0] for l in lines) == ["cpu", "cuda", "opencl", "reference"], r.stdout
    assert all(l.split()[1] in ("present:", "missing:") and len(l.split(": ", 1)[1]) > 5 for l in lines)
    assert any(l.startswith("cpu        present") for l in lines)


def test_run_default_model_streams_and_reports():
    r = cli("run", "--max-new-tokens", "8", "--backend", "reference")
    assert r.returncode == 0, r.stderr
    assert "default model" in r.stderr
    assert "tok/s" in r.stderr and "experts fired" in r.stderr and "layer  0" in r.stderr


@pytest.mark.parametrize("threads", ["", "1"])
def test_run_stats_reports_threads_and_step_percentiles(threads):
    """--stats: the threads the cpu backend ran with (adaptive, or fixed by COLIBRI_NUM_THREADS) and
    the decode step time p50 / p99, consistent with the decode rate printed beside them."""
    r = cli("run", "--max-new-tokens", "24", "--backend", "cpu", "--stats", "--ignore-eos",
            env={"COLIBRI_NUM_THREADS": threads})
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stderr.splitlines() if "decode step time" in l)
    p50, p99 = (float(line.split(k)[1].split()[0]) for k in ("p50 ", "p99 "))
    assert 0 < p50 <= p99
    assert "over 23 steps" in line                # 24 tokens: the first from the prefill
    cpu = next(l for l in r.stderr.splitlines() if "[colibri] cpu:" in l)
    assert ("1 threads (fixed" in cpu) if threads else ("adaptive up to" in cpu), cpu
    assert "threading layer" in cpu and "steps run:" in cpu


def test_run_with_ids(model_cache):
    _, col = convert_case(model_cache, "mixtral")
    r = cli("run", "--model", col, "--prompt", "1 2 3", "--ids", "--max-new-tokens", "4", "--backend", "reference")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 4 or 2 in [int(t) for t in r.stdout.split()]


@pytest.mark.parametrize("name,value", [("COLIBRI_KV_BLOCK_SIZE", "0"), ("COLIBRI_KV_BLOCK_SIZE", "big"),
                                        ("COLIBRI_NUM_STREAMS", "-2"), ("COLIBRI_DISABLE_FP16", "2"),
                                        ("COLIBRI_BACKEND", "tpu"), ("COLIBRI_ROUTER_WARMUP", "x"),
                                        ("COLIBRI_TOP_K", "-1"), ("COLIBRI_TOP_K", "5"), ("COLIBRI_TOP_K", "two")])
def test_bad_knob_is_an_error_at_start(model_cache, monkeypatch, name, value):
    _, col = convert_case(model_cache, "mixtral")
    monkeypatch.setenv(name, value)
    with pytest.raises(ColibriError) as ei:
        Engine.open(col)
    assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT and name in ei.value.message


def test_experts_per_token_from_the_environment_and_the_cli(model_cache, monkeypatch):
    """COLIBRI_TOP_K (or Engine.open(top_k=...)) routes each token to that many experts; `colibri run
    --experts-per-token K --stats` says what it saves against the model's own k (demo: 2 of 8)."""
    _, col = convert_case(model_cache, "mixtral")                  # 4 experts, top-2
    monkeypatch.setenv("COLIBRI_TOP_K", "3")
    with Engine.open(col, backend="reference") as e:
        assert e.runner.top_k == 3 and e.config["top_k"] == 3
    with Engine.open(col, backend="reference", top_k=1) as e:      # explicit beats the environment
        assert e.runner.top_k == 1
    monkeypatch.delenv("COLIBRI_TOP_K")
    with Engine.open(col, backend="reference") as e:               # the shared model is untouched
        assert e.runner.top_k == 2 and e.model.config["top_k"] == 2
    r = cli("run", "--max-new-tokens", "4", "--backend", "reference", "--experts-per-token", "1", "--stats")
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stderr.splitlines() if "experts per token" in l][0]
    assert "experts per token: 1 (the model's: 2)" in line and "% less" in line, line


def test_explicit_argument_beats_environment(model_cache, monkeypatch):
    _, col = convert_case(model_cache, "mixtral")
    monkeypatch.setenv("COLIBRI_KV_BLOCK_SIZE", "5")
    monkeypatch.setenv("COLIBRI_BACKEND", "reference")
    with Engine.open(col) as e:
        assert e.runner.block_size == 5 and e.backend.name == "reference"
    with Engine.open(col, kv_block_size=3, backend="reference") as e:
        assert e.runner.block_size == 3
    assert knobs.resolve("COLIBRI_KV_BLOCK_SIZE") == 5


def test_auto_picks_a_working_backend_and_never_pocl(model_cache, monkeypatch):
    from colibri_edge.backends import probe
    monkeypatch.delenv("COLIBRI_BACKEND", raising=False)
    _, col = convert_case(model_cache, "mixtral")
    with Engine.open(col) as e:
        name = e.backend.name
    gpu = [b for b in ("cuda", "opencl") if probe(b, for_auto=True)[0]]
    assert name == (gpu[0] if gpu else "cpu")


def test_unknown_backend(model_cache):
    _, col = convert_case(model_cache, "mixtral")
    with pytest.raises(ColibriError) as ei:
        Engine.open(col, backend="metal")
    assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT


def test_engines_share_mapped_weights(model_cache):
    _, col = convert_case(model_cache, "mixtral")
    with Engine.open(col, backend="reference") as a, Engine.open(col, backend="reference") as b:
        assert a.model is b.model and a.model.mmap is b.model.mmap
        assert all(a.runner.state_storage[k] is not b.runner.state_storage[k] for k in a.runner.state_storage)
        assert np.array_equal(a.infer([1, 2, 3]), b.infer([1, 2, 3]))


def test_backend_options_explicit_or_from_the_environment(model_cache, monkeypatch):
    """An option given explicitly that the chosen backend does not take is an error naming it; a knob
    from the environment (or a default) that does not apply is ignored and listed by describe()."""
    _, col = convert_case(model_cache, "mixtral")
    for opt, value in (("num_streams", 2), ("disable_fp16", True), ("cuda_graphs", False), ("num_threads", 1),
                       ("device", 0)):
        with pytest.raises(ColibriError) as ei:
            Engine.open(col, backend="reference", **{opt: value})
        assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT and opt in ei.value.message \
            and "reference backend does not take" in ei.value.message
    monkeypatch.setenv("COLIBRI_NUM_STREAMS", "3")
    with Engine.open(col, backend="reference") as e:
        d = e.backend.describe()
    assert "not applicable here" in d and "num_streams (COLIBRI_NUM_STREAMS=3)" in d and "num_threads (default)" in d
    monkeypatch.setenv("COLIBRI_NUM_STREAMS", "-1")            # a bad value is an error even where it does not apply
    with pytest.raises(ColibriError) as ei:
        Engine.open(col, backend="reference")
    assert "COLIBRI_NUM_STREAMS" in ei.value.message
