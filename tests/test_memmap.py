"""The memmap pays: experts never routed to are never read, so resident memory grows by far less
than the weights file when every token goes to the same two experts."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_edge.model.modeldir import ModelWriter, expected_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_skewed_model(path, H=256, I=1536, E=16, L=2, V=300):
    """Router rows built so that experts 0 and 1 win for every token: hidden dim 0 carries a large
    constant (from the embedding), and only experts 0 and 1 weigh it positively."""
    cfg = {
        "format_version": 1, "model_type": "mixtral", "num_hidden_layers": L, "hidden_size": H,
        "intermediate_size": I, "moe_intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": H // 4, "vocab_size": V, "max_position_embeddings": 128, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "experts_per_layer": E, "top_k": 2,
        "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": True,
        "shared_expert_intermediate_size": 0, "shared_expert_gate": False, "attention_bias": False,
        "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": [], "bos_token_id": None,
        "weight_dtype": "float32",
        "layers": [{"layer_id": i, "type": "moe", "moe_expert_start": i * E, "moe_num_experts": E} for i in range(L)],
    }
    rng = np.random.default_rng(0)
    w = ModelWriter(path, cfg)
    for name, (shape, dtype) in expected_tensors(cfg).items():
        arr = np.ones(shape, np.float32) if len(shape) == 1 else \
            (0.01 * rng.standard_normal(shape)).astype(np.float32)
        if name == "embed_tokens":
            arr[:, 0] = 50.0
        if name.endswith("router"):
            arr[:, 0] = -1.0
            arr[0, 0], arr[1, 0] = 2.0, 1.0
        w.add_tensor(name, arr, dtype)
    for layer in range(L):
        for j in range(E):
            mats = [(0.01 * rng.standard_normal(s)).astype(np.float32) for s in ((I, H), (I, H), (H, I))]
            w.add_expert(layer, j, *mats, "float32")
    w.finish()
    return os.path.getsize(os.path.join(path, "colibri_weights.bin"))


SCRIPT = """
import json, sys, numpy as np, psutil
from colibri_edge import Engine
proc = psutil.Process()
import colibri_edge.backends as b; b.create(sys.argv[2])   # warm the backend's imports / JIT first
before = proc.memory_info().rss
with Engine.open(sys.argv[1], backend=sys.argv[2], max_seq_len=64, max_batch=1, prefill_chunk=32) as e:
    e.infer(np.arange(1, 40) % 300)
    ids = e.generate(list(range(5, 15)), max_new_tokens=8)
    counts = e.expert_counts
after = proc.memory_info().rss
print(json.dumps({"growth": after - before, "counts": counts.tolist()}))
"""


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_unrouted_experts_are_never_read(backend, tmp_path):
    from helpers import backend_available
    ok, why = backend_available(backend)
    if not ok:
        pytest.skip(why)
    size = build_skewed_model(str(tmp_path / "m"))
    # drop the file's pages from the page cache is not possible unprivileged; RSS counts only the
    # pages this process maps and touches, which is what we measure.
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m"), backend],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"RSS growth {res['growth'] / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB weights file")
    counts = np.array(res["counts"])
    assert (counts[:, 2:] == 0).all() and (counts[:, :2] > 0).all(), counts   # only experts 0 and 1 ran
    assert size > 128 * 2 ** 20
    assert res["growth"] < 0.25 * size, f"RSS grew {res['growth'] / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
