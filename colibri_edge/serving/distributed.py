"""Routing studies on Ray (the `ray` extra): `colibri trace` over many prompts sharded across Ray
actors, and `colibri simulate --sweep` grids as Ray tasks, with the same results as one process.

Trace. The prompts are cut into consecutive shards (about four per worker, so that a fast worker
takes more and a lost one costs little); each worker is an actor holding one Engine, opened once from
the model directory -- which every node must read at the same path (shared storage: the weights are
not shipped through the object store, they are memory-mapped where they lie) -- and traces a shard at
a time with the prefix cache off (every token's routing is recorded, whatever ran before on that
worker). Shards are merged in prompt order (Trace.concat): seq_ids are the prompts' indices and step
ids count on across shards, so with max_batch 1 the merged trace equals the one-process
`Engine.trace` of the same prompts row for row. A worker that dies is restarted by Ray
(max_restarts) and its shard run again (max_task_retries); a shard whose retries run out goes to
another worker: no prompt is lost or traced twice.

Sweep. The trace goes into the object store once; each cell (slots, policy, device, top_k) is a
task that replays it (simulate.replay, estimate) exactly as `colibri simulate` does for that cell
alone, and the rows come back in grid order.
"""
from __future__ import annotations

import itertools
import os

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE

SHARDS_PER_WORKER = 4
SWEEP_KEYS = ("slots", "policy", "device", "top_k")


def ray_module():
    try:
        import ray
    except ImportError:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "--ray / --workers need Ray: pip install 'colibri-edge[ray]'") \
            from None
    return ray


def connect(address: str | None, workers: int):
    """Ray, connected: to the cluster at address ("auto", "HOST:PORT", "ray://..."), or a local one of
    `workers` CPUs started for this run. Every node needs colibri-edge installed (the workers import
    it)."""
    ray = ray_module()
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    return ray


def _shards(n: int, workers: int) -> list:
    """Consecutive [start, stop) ranges of n prompts, about SHARDS_PER_WORKER per worker."""
    k = max(1, min(n, workers * SHARDS_PER_WORKER))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class _TraceWorker:
    """A Ray actor: one engine, shards traced one at a time."""

    def __init__(self, model, engine_kw):
        from ..requests.engine import Engine
        self.eng = Engine.open(model, prefix_cache=False, **engine_kw)

    def pid(self):
        return os.getpid()

    def run(self, index, prompts, max_new_tokens):
        tr = self.eng.trace(prompts, max_new_tokens=max_new_tokens, ignore_eos=max_new_tokens > 0)
        return index, os.getpid(), tr


def trace_sharded(model, prompts, workers=2, address=None, max_new_tokens=0, engine_kw=None, on_shard=None,
                  max_retries=2):
    """The routing Trace of prompts, traced by `workers` Ray actors (module docstring). on_shard(done,
    total, pid, pids): called as each shard comes back, with the pid of the worker that traced it and
    those of all the workers (progress; tests kill a worker from it)."""
    from ..analysis.trace import Trace
    workers = int(workers)
    if workers < 1:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--workers {workers}: give 1 or more")
    ray = connect(address, workers)
    Worker = ray.remote(num_cpus=1, max_restarts=max_retries, max_task_retries=max_retries)(_TraceWorker)
    actors = [Worker.remote(model, dict(engine_kw or {})) for _ in range(workers)]
    try:
        pids = ray.get([a.pid.remote() for a in actors])
        shards = _shards(len(prompts), workers)
        todo = list(range(len(shards)))
        out, running = {}, {}

        def start(a):
            i = todo.pop(0)
            lo, hi = shards[i]
            running[a.run.remote(i, list(prompts[lo:hi]), max_new_tokens)] = (i, a)
        for a in actors:
            if todo:
                start(a)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            i, a = running.pop(ready[0])
            try:
                _, pid, tr = ray.get(ready[0])
            except ray.exceptions.RayActorError:       # its restarts ran out: the shard goes to another
                todo.insert(0, i)
                actors.remove(a)
                if not actors:
                    raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "every trace worker died; see the Ray logs") \
                        from None
                busy = {id(x) for _, x in running.values()}
                for b in actors:
                    if todo and id(b) not in busy:
                        start(b)
                continue
            out[i] = tr
            if on_shard is not None:
                on_shard(len(out), len(shards), pid, pids)
            if todo:
                start(a)
        return Trace.concat(out[i] for i in range(len(shards)))
    finally:
        for a in actors:
            ray.kill(a)


# -- the simulator sweep --------------------------------------------------------------------------

def parse_sweep(spec: str) -> dict:
    """"slots=4:64:4,policy=lru,lfu,device=rk3588,top_k=2,1" -> {"slots": [4, 8, ..., 64], "policy":
    [...], ...}: a key's values run until the next key=; start:stop:step ranges include the stop."""
    grid, key = {}, None
    for item in (x.strip() for x in spec.split(",")):
        if "=" in item:
            key, item = (s.strip() for s in item.split("=", 1))
            if key not in SWEEP_KEYS:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--sweep: unknown key {key!r}; use "
                                   f"{', '.join(SWEEP_KEYS)}")
            if key in grid:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--sweep: {key} given twice")
            grid[key] = []
        if key is None or not item:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--sweep {spec!r}: write key=value[,value...] "
                               "per key, e.g. slots=4:64:4,policy=lru,lfu")
        if key in ("slots", "top_k"):
            grid[key] += _ints(key, item)
        else:
            grid[key].append(item)
    return grid


def _ints(key, item) -> list:
    try:
        if ":" in item:
            start, stop, *step = (int(x) for x in item.split(":"))
            step = step[0] if step else 1
            if step < 1 or stop < start or len(item.split(":")) > 3:
                raise ValueError
            vals = list(range(start, stop + 1, step))
        else:
            vals = [int(item)]
    except ValueError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--sweep {key}={item}: give integers or "
                           "start:stop:step (stop included)") from None
    if any(v < 1 for v in vals):
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--sweep {key}={item}: values must be 1 or more")
    return vals


def cells(grid: dict, default_slots) -> list:
    """The grid's cells, in order (slots fastest): dicts of the keys given (slots always)."""
    grid = dict(grid)
    grid.setdefault("slots", list(default_slots))
    keys = [k for k in ("top_k", "device", "policy", "slots") if k in grid]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def simulate_cell(tr, cell: dict, context: int) -> dict:
    """One cell, as `colibri simulate --slots S --policy P [--device D] [--top-k K] --json` prints it,
    with the cell's keys (its device as given; the profile's own "device" name as device_name)."""
    from ..analysis.simulate import estimate, load_profile, replay
    t = tr.with_top_k(cell["top_k"]) if "top_k" in cell else tr
    r = replay(t, cell["slots"], cell.get("policy", "lru"))
    if "device" in cell:
        r.update(estimate(r, t, load_profile(cell["device"]), context))
        r["device_name"] = r.pop("device")
    return {**r, **cell}


def _cell_task(tr, cell, context):
    return simulate_cell(tr, cell, context)


def sweep(tr, grid: dict, context: int = 4096, address=None, workers=None, on_cell=None) -> list:
    """Every cell of grid (parse_sweep's) on trace tr: on Ray when address or workers is given (tasks
    over the trace in the object store), else here. Rows in cells() order."""
    from ..analysis.simulate import sweep_points
    todo = cells(grid, sweep_points(tr))
    for c in todo:                                  # bad names and values: refused before anything runs
        if "top_k" in c:
            tr.with_top_k(c["top_k"])
        if "device" in c:
            from ..analysis.simulate import load_profile
            load_profile(c["device"])
    if address is None and workers is None:
        rows = []
        for c in todo:
            rows.append(simulate_cell(tr, c, context))
            if on_cell is not None:
                on_cell(len(rows), len(todo))
        return rows
    ray = connect(address, int(workers or 2))
    ref = ray.put(tr)
    task = ray.remote(num_cpus=1, max_retries=2)(_cell_task)
    refs = [task.remote(ref, c, context) for c in todo]
    pending, done = list(refs), 0
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        done += 1
        if on_cell is not None:
            on_cell(done, len(todo))
    return ray.get(refs)


def plot_grid(rows, path, title):
    """Misses and (with devices) estimated ms/token against slots, a line per (policy, device, top_k)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "--plot needs matplotlib: pip install 'colibri-edge[plot]'") \
            from None
    est = any("est_ms_per_token" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if est else 1, figsize=(12 if est else 7, 4.2), squeeze=False)
    lines = {}
    for r in rows:
        lines.setdefault(tuple((k, r[k]) for k in ("policy", "device", "top_k") if k in r), []).append(r)
    for key, pts in lines.items():
        label = " ".join(f"{v}" if k != "top_k" else f"top-{v}" for k, v in key) or "lru"
        axes[0][0].plot([r["slots"] for r in pts], [r["misses"] for r in pts], marker="o", label=label)
        if est:
            axes[0][1].plot([r["slots"] for r in pts], [r["est_ms_per_token"] for r in pts], marker="o", label=label)
    axes[0][0].set_ylabel("misses")
    if est:
        axes[0][1].set_ylabel("estimated ms / token")
    for ax in axes[0]:
        ax.set_xlabel("expert slots")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
