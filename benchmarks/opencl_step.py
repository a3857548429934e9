"""What an OpenCL decode step costs (issue 22), not run by `make bench`: per model, kernel launches,
blocking device->host reads and host->device writes per decode step (the backend's own counters)
and batch-1 decode tok/s on opencl (PoCL on this machine) against the reference backend, in one run.

    python benchmarks/opencl_step.py [--steps 32] [--rounds 3] [MODEL_DIR_OR_GGUF ...]
    python benchmarks/opencl_step.py --tree /path/to/another/checkout ...   (an earlier commit's engine)

Default models: the demo model and, when `make bench` has built them, the hidden-1024 bench model as
float16 (cache/full/colibri-float16) and its q8_0 GGUF converted (colibri-gguf-q8_0). Each engine decodes `--steps` greedy tokens
after a 4-token prompt, `--rounds` times; the best round is kept (the host is shared). The output is
one markdown table (and JSON with --json FILE).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def decode_rate(eng, steps, rounds):
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = eng.generate([1, 2, 3, 4], max_new_tokens=steps, ignore_eos=True)
        dt = time.perf_counter() - t0
        best = max(best, len(out) / dt)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", help="import colibri_edge from this checkout instead")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.tree:
        # colibri_edge from the tree, and its backends package too (an editable install maps
        # colibri_edge.backends to this checkout's backends/ whatever sys.path says)
        tree = os.path.abspath(a.tree)
        sys.path.insert(0, tree)
        import importlib.util
        import colibri_edge
        assert colibri_edge.__file__.startswith(tree), colibri_edge.__file__
        spec = importlib.util.spec_from_file_location("colibri_edge.backends", os.path.join(tree, "backends", "__init__.py"),
                                                      submodule_search_locations=[os.path.join(tree, "backends")])
        mod = sys.modules["colibri_edge.backends"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    from colibri_edge import Engine
    from colibri_edge.model.demo import SHIPPED
    models = a.models or [SHIPPED] + [p for p in (os.path.join(HERE, "cache/full/colibri-float16"),
                                                  os.path.join(HERE, "cache/full/colibri-gguf-q8_0"))
                                      if os.path.exists(p)]
    rows = []
    from colibri_edge.requests.engine import open_model_dir
    from colibri_edge.model.quant import BLOCK
    runs = []
    for m in models:
        blocks = bool(open_model_dir(m).formats & set(BLOCK))
        # block formats: opencl with int8 activations (the default) and with float32 ones
        runs += [(m, {"int8_activations": True}), (m, {"int8_activations": False})] if blocks and not a.tree \
            else [(m, {})]
    for m, opts in runs:
        row = {"model": os.path.basename(m.rstrip("/")) + "".join(
            f" ({'int8' if v else 'float32'} activations)" for v in opts.values())}
        for backend in ("opencl", "reference"):
            with Engine.open(m, backend=backend, **(opts if backend == "opencl" else {})) as eng:
                eng.generate([1, 2, 3, 4], max_new_tokens=2, ignore_eos=True)        # compile, warm
                row[backend] = decode_rate(eng, a.steps, a.rounds)
                if backend == "opencl":
                    c = eng.backend.step_counts()
                    moe = sum(1 for l in eng.config["layers"] if l["type"] != "dense")
                    row.update(launches=c["launches"], reads=c["reads"], writes=c["writes"], moe_layers=moe,
                               layers=len(eng.config["layers"]))
        rows.append(row)
        print(f"| {row['model']} | {row['layers']} ({row['moe_layers']} MoE) | {row['launches']:.0f} | "
              f"{row['reads']:.0f} | {row['writes']:.0f} | {row['opencl']:.1f} | {row['reference']:.1f} | "
              f"{row['opencl'] / row['reference']:.2f}x |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    print("| model | layers | launches/step | reads/step | writes/step | opencl tok/s | reference tok/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    main()
