"""gpt-oss decode speed: Colibri (cpu, opencl) against llama.cpp (llama-cpp-python) on the very same GGUF.

A random gpt-oss-shaped checkpoint (sliding and full layers, sinks, biases, YaRN) with OpenAI's MXFP4
experts, converted by llama.cpp's own converter (MXFP4 experts, F16 elsewhere), then imported by
Colibri without requantisation: both engines read the same bytes. Prints decode tokens/s, the
ratio, and the fraction of memory bandwidth the weights read per token reach (quiet; with one core
kept busy by a spinning process when --busy).

    python benchmarks/gpt_oss_decode.py [--hidden 1024] [--experts 32] [--layers 8] [--tokens 64] [--busy]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))


def _spin(stop):
    x = 0
    while not stop.is_set():
        x += 1


def build(d: str, H: int, E: int, L: int) -> tuple[str, dict]:
    import torch
    import transformers
    import gguf_models as gm
    from hf_models import pack_mxfp4, randomize
    gguf_path = os.path.join(d, "oss.gguf")
    if os.path.exists(gguf_path):
        return gguf_path, json.load(open(os.path.join(d, "shape.json")))
    src = os.path.join(d, "src")
    ft = gm.build_tokenizer(src)
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=H, num_hidden_layers=L, num_attention_heads=H // 64,
                                    num_key_value_heads=max(1, H // 256), head_dim=64, num_local_experts=E,
                                    num_experts_per_tok=4, vocab_size=len(ft), sliding_window=128,
                                    max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, cfg)
    model.save_pretrained(src)
    mx, oracle = pack_mxfp4(src, os.path.join(d, "mx"), os.path.join(d, "oracle"))
    gm.to_gguf(mx, gguf_path, "f16")
    shape = dict(H=H, E=E, L=L, V=len(ft))
    json.dump(shape, open(os.path.join(d, "shape.json"), "w"))
    return gguf_path, shape


def colibri_tps(col: str, backend: str, tokens: int) -> float:
    from colibri_edge import Engine
    with Engine.open(col, backend=backend, max_seq_len=256) as e:
        e.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True)          # warm
        t = time.perf_counter()
        e.generate([5, 6, 7], max_new_tokens=tokens, ignore_eos=True)
        return tokens / (time.perf_counter() - t)


def llama_tps(path: str, tokens: int, threads: int) -> float:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=256, n_threads=threads, verbose=False)
    llm.eval([5, 6, 7])
    llm.reset()
    t = time.perf_counter()
    llm.eval([5, 6, 7])
    for _ in range(tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return tokens / (time.perf_counter() - t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--backends", default="cpu")
    ap.add_argument("--busy", action="store_true", help="one core kept busy by a spinning process")
    ap.add_argument("--dir", default=os.path.expanduser("~/.cache/colibri/bench_gpt_oss"))
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    from colibri_edge.model.convert import convert
    from colibri_edge.model.modeldir import ModelDir
    from colibri_edge.analysis.sizing import summary
    path, shape = build(a.dir, a.hidden, a.experts, a.layers)
    col = os.path.join(a.dir, "col")
    if not os.path.exists(os.path.join(col, "config.json")):
        convert(path, col, progress=False)
    per_token = summary(ModelDir(col), 256)["bytes_per_decoded_token"]
    stop = mp.Event()
    spinner = mp.Process(target=_spin, args=(stop,)) if a.busy else None
    if spinner:
        spinner.start()
    try:
        rows = {f"colibri-{b}": colibri_tps(col, b, a.tokens) for b in a.backends.split(",")}
        rows["llama.cpp"] = llama_tps(path, a.tokens, os.cpu_count() or 1)
    finally:
        stop.set()
        if spinner:
            spinner.join()
    print(f"gpt-oss-shaped H={shape['H']} E={shape['E']} top-4 layers={shape['L']} (MXFP4 experts, F16 rest), "
          f"{per_token / 1e6:.2f} MB of weights read per decoded token{', one core busy' if a.busy else ''}")
    for name, tps in rows.items():
        print(f"  {name:16s} {tps:8.1f} tok/s  x{tps / rows['llama.cpp']:.2f} of llama.cpp  "
              f"{tps * per_token / 1e9:6.2f} GB/s of weights")


if __name__ == "__main__":
    main()
