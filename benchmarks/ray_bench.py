"""Routing studies on Ray: trace tokens/s and sweep cells/s at 1 and 2 workers on this machine, against
one process without Ray (part of `make bench`; results/ray.md).

  * trace: 48 prompts of the demo model, 16 generated tokens each (cpu backend, max_batch 1), sharded
    over N actors of a local Ray started with N CPUs (`trace_sharded`; wall time from the call to the
    merged trace, actors' engine opening included) against `Engine.trace` in this process;
  * sweep: a 4 policies x 16 slot counts x 2 devices x 2 top-k grid (256 cells) over that trace, as
    Ray tasks on N CPUs (`sweep`) against the same cells here.

    python benchmarks/ray_bench.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

WORDS = ("the quick brown fox jumps over the lazy dog while a small bird sings about rivers mountains and "
         "the quiet sea under a pale moon").split()
GRID = "slots=2:32:2,policy=lru,lfu,belady,prefetch,device=rk3588,jetson-orin,top_k=2,1"


def prompts(n=48):
    return [" ".join(WORDS[i % 7:i % 7 + 6 + i % 11]) for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    import ray
    from colibri_edge import Engine
    from colibri_edge.serving import distributed
    from colibri_edge.model.demo import ensure_default_model
    model = ensure_default_model()[0]
    ps = prompts()
    kw = {"backend": "cpu", "max_batch": 1}
    with Engine.open(model, prefix_cache=False, **kw) as eng:
        eng.trace(ps[:2], max_new_tokens=2, ignore_eos=True)          # warm (JIT)
        t0 = time.perf_counter()
        tr = eng.trace(ps, max_new_tokens=16, ignore_eos=True)
        local_trace = time.perf_counter() - t0
    tokens = tr.expert_ids.shape[0]
    grid = distributed.parse_sweep(GRID)
    t0 = time.perf_counter()
    rows = distributed.sweep(tr, grid)
    local_sweep = time.perf_counter() - t0
    cells = len(rows)
    res = {}
    for n in (1, 2):
        ray.init(num_cpus=n, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        try:
            t0 = time.perf_counter()
            got = distributed.trace_sharded(model, ps, workers=n, max_new_tokens=16, engine_kw=kw)
            t_trace = time.perf_counter() - t0
            assert got.expert_ids.shape[0] == tokens
            t0 = time.perf_counter()
            assert distributed.sweep(tr, grid, workers=n) == rows
            t_sweep = time.perf_counter() - t0
        finally:
            ray.shutdown()
        res[n] = (tokens / t_trace, cells / t_sweep)
    import platform
    lines = [f"# Routing studies on Ray ({time.strftime('%Y-%m-%d')})", "",
             f"{platform.node()}, {os.cpu_count()} cores; demo model, cpu backend. Trace: {len(ps)} prompts, 16 "
             f"generated tokens each, {tokens} traced tokens; Ray rows include starting the actors and opening "
             f"an engine in each. Sweep: {cells} cells ({GRID}). Ray {ray.__version__}, a local Ray with N CPUs.", "",
             "| | trace tokens/s | sweep cells/s |", "|---|---:|---:|",
             f"| one process, no Ray | {tokens / local_trace:.1f} | {cells / local_sweep:.1f} |"]
    for n, (tps, cps) in res.items():
        lines.append(f"| Ray, {n} worker{'s' if n > 1 else ''} | {tps:.1f} | {cps:.1f} |")
    lines += ["", f"Scaling 1 -> 2 workers: trace {res[2][0] / res[1][0]:.2f}x, sweep {res[2][1] / res[1][1]:.2f}x."]
    from report import write_lines
    write_lines(a.out, "ray.md", lines)


if __name__ == "__main__":
    main()
