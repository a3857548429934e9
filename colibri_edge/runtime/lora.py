"""Run-time LoRA adapters: several adapters held by one engine, applied per request inside a step that
may mix requests of different adapters and of none (docs/lora.md).

The base model's weights are never copied or changed. A step lays its requests' tokens out grouped
by adapter (runner.Runner.step: the base model's first, then each adapter's, in contiguous runs), so
each projection runs once for every token and each adapter's update is one more pass over its run:

    out = x W^T  (all T rows, the backend's matmul)        then for adapter a with rows t0..t1-1:
    out[t0:t1] += (x[t0:t1] A_a^T) (s B_a)^T               (Backend.lora_update, row by row)

An FFN (routed experts, a shared expert, a dense MLP) fuses gate/up, the activation and down in one
op (grouped_ffn), so an update of gate or up cannot be added after it. Its rows are split instead:
in each expert's run of the plan, the rows of tokens whose adapter changes this FFN move behind the
others (a stable partition; combine reads rows through plan.inverse, updated to match), the fused op
runs the front rows (plan counts narrowed), and the back rows run split, expert by expert:

    g = X W_gate^T,  u = X W_up^T       (the backend's matmul over the expert's adapter rows at once)
    g += updates,    u += updates       (per adapter, rows of one adapter contiguous)
    a = act(g, u);   y = a W_down^T (+ bias);  y += updates of a

so every expert's weights are still read once per step. A row's arithmetic depends only on its own
adapter (fused when its adapter does not change this FFN, split when it does), never on its
neighbours: a request's logits are the same alone and in any mix (cpu: bit for bit).

Backends: those whose buffers are host memory (reference, cpu: runs_lora) run adapters; on the GPU
backends an adapter is merged at conversion instead (colibri convert --lora)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE

_uids = itertools.count(1)


@dataclass
class Factors:
    """One matrix's update in the kernels' layout: a_t [in, r], b_t [r, out] (the scale folded in)."""
    a_t: np.ndarray
    b_t: np.ndarray

    @classmethod
    def of(cls, a, b):
        return cls(np.ascontiguousarray(np.asarray(a, np.float32).T), np.ascontiguousarray(np.asarray(b, np.float32).T))

    @property
    def nbytes(self) -> int:
        return self.a_t.nbytes + self.b_t.nbytes


@dataclass
class Loaded:
    """An adapter held by the engine: its updates keyed by the program's objects."""
    name: str
    path: str
    uid: int                    # a new one at every load: the prefix cache's key (hash_seed)
    rank: int
    nbytes: int
    linear: dict                # id(Weight) -> Factors
    ffns: dict                  # id(FFN list) -> {expert index: {"gate"|"up"|"down": Factors}}
    names: list                 # the model tensors it changes (inspection)

    @property
    def hash_seed(self) -> bytes:
        return f"colibri-kv/lora/{self.name}/{self.uid}".encode()


class Adapters:
    """The adapters a Runner holds, and the split of each step (StepLora)."""

    def __init__(self, runner):
        self.runner = runner
        self.loaded: dict = {}              # name -> Loaded
        self._bufs = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())

    def load(self, name: str, adapter, family, scale: float = 1.0) -> Loaded:
        """Map an Adapter (model/lora.py) onto the runner's program; refuses what cannot run here."""
        from ..model.lora import colibri_factors, resolve
        r = self.runner
        be, prog, cfg = r.be, r.program, r.cfg
        if not be.runs_lora:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the {be.name} backend does not run LoRA adapters at run "
                               "time; merge the adapter at conversion (colibri convert HF OUT --lora ADAPTER) or "
                               "open the engine with backend='cpu'")
        res = resolve(adapter, cfg, family, scale)
        linear, experts = colibri_factors(res, cfg, family)
        lin, ffns, names = {}, {}, []
        for ours, (a, b, src) in linear.items():
            parts = ours.split(".")
            if len(parts) == 4 and parts[2] in ("shared", "mlp") and parts[3] in ("gate", "up", "down"):
                lst = prog.ffn_lists.get(f"layers.{parts[1]}.{parts[2]}")
                if lst is None:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r} changes {ours}, which this "
                                       "model does not run")
                ffns.setdefault(id(lst), {}).setdefault(0, {})[parts[3]] = self._check(f"{src} ({ours})", a, b,
                                                                                      getattr(lst[0], parts[3]))
                names.append(ours)
                continue
            w = prog.named.get(ours)
            if w is None or w is prog.embed or w is prog.lm_head:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r} changes {ours}, which takes no "
                                   "run-time update (embeddings, the output head); merge the adapter at conversion "
                                   "(colibri convert HF OUT --lora ADAPTER)")
            lin[id(w)] = self._check(f"{src} ({ours})", a, b, w)
            names.append(ours)
        if experts and r.slot_pool is not None:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"adapter {name!r} changes routed experts, and this engine "
                               "streams its experts through expert slots; open it without expert_slots, or merge the "
                               "adapter at conversion")
        for (layer, j), d in experts.items():
            lst = prog.ffn_lists.get(f"layers.{layer}.experts")
            if lst is None:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r} changes experts of layer {layer}, "
                                   "which has none")
            ffns.setdefault(id(lst), {})[j] = {p: self._check(f"layers.{layer}.experts.{j}.{p}", a, b,
                                                              getattr(lst[j], p)) for p, (a, b) in d.items()}
            names.append(f"layers.{layer}.experts.{j}")
        nbytes = sum(f.nbytes for f in lin.values()) + sum(f.nbytes for d in ffns.values() for e in d.values()
                                                           for f in e.values())
        rank = max([f.a_t.shape[1] for f in lin.values()] + [f.a_t.shape[1] for d in ffns.values()
                                                              for e in d.values() for f in e.values()] + [0])
        lo = Loaded(name, getattr(adapter, "path", ""), next(_uids), rank, nbytes, lin, ffns, names)
        self.loaded[name] = lo
        self._bufs = None
        return lo

    @staticmethod
    def _check(what, a, b, w) -> Factors:
        if (b.shape[0], a.shape[1]) != (w.shape[0], w.shape[-1]):       # Weight.shape: logical [out, in]
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the adapter's update of {what} is [{b.shape[0]}, "
                               f"{a.shape[1]}]; the model's matrix is {list(w.shape)}")
        return Factors.of(a, b)

    def unload(self, name: str):
        self.loaded.pop(name)
        self._bufs = None

    # -- a step ----------------------------------------------------------------------------------
    def buffers(self):
        """The split FFN path's scratch, sized once for the largest step (reallocated only when the
        adapters change): gathered rows, gate/up/activation, a 1-expert plan for dense FFNs."""
        if self._bufs is None:
            r, cfg = self.runner, self.runner.cfg
            rows = r.max_rows * max(r.top_k, 1)
            inter = max(cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["shared_expert_intermediate_size"])
            H = cfg["hidden_size"]
            self._bufs = {"x": np.zeros((rows, H), np.float32), "g": np.zeros(rows * inter, np.float32),
                          "u": np.zeros(rows * inter, np.float32), "e": np.zeros(rows * inter, np.float32),
                          "y": np.zeros((r.max_rows, H), np.float32),
                          "tok": np.zeros(r.max_rows, np.int32), "order": np.zeros(r.max_rows, np.int32),
                          "offsets": np.zeros(2, np.int32)}
        return self._bufs

    def step(self, runs: list, T: int) -> "StepLora":
        """runs: (adapter name or None, first token, end token) in the step's layout order."""
        b = self.buffers()
        tok = b["tok"][:T]
        held, mine = [], []
        for name, t0, t1 in runs:                   # each adapter one run (the layout groups them)
            tok[t0:t1] = -1 if name is None else len(held)
            if name is not None:
                mine.append((len(held), t0, t1))
                held.append(self.loaded[name])
        return StepLora(self.runner.be, mine, held, tok, b)


class StepLora:
    """One step's adapters: runs (adapter index, t0, t1) of tokens; the per-token adapter index."""

    def __init__(self, be, runs, adapters, tok, bufs):
        self.be, self.runs, self.adapters, self.tok, self.b = be, runs, adapters, tok, bufs

    def linear(self, out, x, w):
        key = id(w)
        for i, t0, t1 in self.runs:
            f = self.adapters[i].linear.get(key)
            if f is not None:
                self.be.lora_update(out, x, f.a_t, f.b_t, t0, t1)

    def ffn(self, be, out, x, experts, plan, scratch, act, dense) -> bool:
        """grouped_ffn with the rows of adapters that change these experts split off (module
        docstring). False: no such row in the step (the caller runs grouped_ffn as it is)."""
        key = id(experts)
        which = [i for i, a in enumerate(self.adapters) if key in a.ffns]
        if not which:
            return False
        T = len(self.tok)
        unf_tok = np.isin(self.tok, which)
        if not unf_tok.any():
            return False
        b = self.b
        if dense:                                   # a 1-expert plan of our own: the step's shared plan stays
            order = b["order"][:T]
            order[:] = np.arange(T, dtype=np.int32)
            b["offsets"][:] = (0, T)
            plan = replace(plan, offsets=b["offsets"], order=order, inverse=None, counts=np.array([T], np.int32),
                           active=None, num_tokens=T, top_k=1)
            y = b["y"][:T]
        else:
            y = out
        k = plan.top_k
        A = plan.num_tokens * k
        order = plan.order[:A]
        counts = np.asarray(plan.counts if plan.counts is not None else plan.fetch_counts())
        E = len(counts)
        seg = np.repeat(np.arange(E, dtype=np.int32), counts)
        unf = unf_tok[order // k]
        perm = np.argsort(seg * 2 + unf, kind="stable")
        order[:] = order[perm]
        unf = unf[perm]
        if plan.inverse is not None:
            plan.inverse[order] = np.arange(A, dtype=np.int32)
        fused = np.bincount(seg[~unf], minlength=E).astype(np.int32)
        if fused.any():
            be.grouped_ffn(y, x, experts, replace(plan, counts=fused, active=None), scratch, act)
        offsets = np.asarray(plan.offsets)
        tok_ad = self.tok
        for e in np.flatnonzero(counts - fused):
            e = int(e)
            p0, p1 = int(offsets[e]) + int(fused[e]), int(offsets[e]) + int(counts[e])
            self._split(be, y, x, experts[e], e, order[p0:p1] // k, p0, act, tok_ad, key)
        if dense:
            out[order] = y                          # rows back in token order
        return True

    def _split(self, be, out, x, ffn, e, tokens, p0, act, tok_ad, key):
        """The rows p0.. of expert e (its adapter rows, tokens in step order) computed split."""
        b = self.b
        n = len(tokens)
        inter = ffn.gate.shape[0]
        X = b["x"][:n]
        np.take(x, tokens, axis=0, out=X)
        g, u = (b[k][:n * inter].reshape(n, inter) for k in "gu")        # contiguous [n, inter]
        be.matmul(g, X, ffn.gate)
        be.matmul(u, X, ffn.up)
        ad = tok_ad[tokens]
        bounds = np.flatnonzero(np.diff(ad)) + 1
        runs = [(int(ad[r0]), int(r0), int(r1)) for r0, r1 in zip(np.r_[0, bounds], np.r_[bounds, n])]
        ups = [(self.adapters[i].ffns.get(key, {}).get(e), r0, r1) for i, r0, r1 in runs]
        for f, r0, r1 in ups:
            if f is not None:
                if "gate" in f:
                    be.lora_update(g, X, f["gate"].a_t, f["gate"].b_t, r0, r1)
                if "up" in f:
                    be.lora_update(u, X, f["up"].a_t, f["up"].b_t, r0, r1)
        if act is None:                             # SwiGLU: a = silu(g) * u, in place in g
            a = _swiglu(g, u, b["e"][:n * inter].reshape(n, inter))
        else:
            from ..backends.reference.backend import activation
            a = np.ascontiguousarray(activation(g, u, act, e), np.float32)
        y = out[p0:p0 + n]
        be.matmul(y, a, ffn.down)
        if act is not None and act.down_bias is not None:
            y += np.asarray(act.down_bias.data[e], np.float32)
        for f, r0, r1 in ups:
            if f is not None and "down" in f:
                be.lora_update(y, a, f["down"].a_t, f["down"].b_t, r0, r1)


def _swiglu(g, u, e):
    """g <- silu(g) * u = g / (1 + e^-g) * u, in place (float32; e: scratch of g's shape)."""
    np.negative(g, out=e)
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    e += np.float32(1.0)
    np.divide(g, e, out=g)
    g *= u
    return g
