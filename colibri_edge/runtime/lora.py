"""Run-time LoRA adapters: several adapters held by one engine, applied per request inside a step that
may mix requests of different adapters and of none (docs/lora.md).

The base model's weights are never copied or changed. A step lays its requests' tokens out grouped
by adapter (runner.Runner.step: the base model's first, then each adapter's, in contiguous runs), so
each projection runs once for every token and each adapter's update is one more pass over its run:

    out = x W^T  (all T rows, the backend's matmul)        then for adapter a with rows t0..t1-1:
    out[t0:t1] += (x[t0:t1] A_a^T) (s B_a)^T               (Backend.lora_update, row by row)

An FFN (routed experts, a shared expert, a dense MLP) fuses gate/up, the activation and down in one
op (grouped_ffn), so the updates go in around it: before it, each adapter row's gate and up updates
are written into `pre` [rows, 2I] (zero for the other rows), which grouped_ffn adds before the
activation; after it, each adapter row's down update reads the row's activation from grouped_ffn's
scratch:

    pre[p] = [(x[t] A_gate,e^T)(s B_gate,e)^T | (x[t] A_up,e^T)(s B_up,e)^T]      (Backend.lora_pre)
    a[p]   = act(x[t] W_gate,e^T + pre[p, :I], x[t] W_up,e^T + pre[p, I:])         (grouped_ffn)
    y[p]   = a[p] W_down,e^T + (a[p] A_down,e^T)(s B_down,e)^T                      (grouped_ffn, lora_down)

for plan row p of token t and expert e. Every expert's weights are read once per step for all its
rows, base and adapter alike; a row's arithmetic depends on its own adapter only (a base row's pre is
0), never on its neighbours: a request's logits are the same alone and in any mix (cpu: bit for bit).
An adapter's expert factors are stacked per layer ([E, H, r] and [E, r, I]; experts it leaves alone
hold zeros) so that one call covers all of a layer's rows of that adapter.

Backends: those whose buffers are host memory (reference, cpu: runs_lora) run adapters; on the GPU
backends an adapter is merged at conversion instead (colibri convert --lora)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE

_uids = itertools.count(1)

FACTOR_DTYPES = ("auto", "float32", "float16")
HALF_TOLERANCE = 1e-3       # the largest relative error (per expert and matrix, Frobenius) float16 may add


def hold(arrays: list, weight_dtype: str, want: str, what: str) -> list:
    """The factors of one update (or one FFN list's stack) in the precision they are held at:

        float32   as read (PEFT's float32 arithmetic: the oracle's logits to float32 tolerance);
        float16   half the bytes: decode is bound by the bytes it reads, and a rank-16 adapter on every
                  expert adds 10.7 MB a token to the benchmark model's 138 MB of int8 experts;
        auto      float32 where the matrix it updates is stored in float32, else float16 (a float16,
                  bfloat16, int8 or block-format weight rounds coarser than float16's 2^-11 itself:
                  llama.cpp's LoRA GGUF files hold f16 factors too).

    float16 is used only where it holds every expert's factors within HALF_TOLERANCE (relative,
    Frobenius; zero factors exact) and finite: an update that does not fit stays float32 under "auto",
    and is refused under "float16"."""
    if want == "float32" or (want == "auto" and weight_dtype == "float32"):
        return arrays
    half = []
    for a in arrays:
        h = a.astype(np.float16)
        if a.size:
            ax = tuple(range(1, a.ndim)) if a.ndim == 3 else None
            err = np.sqrt(np.sum((h.astype(np.float32) - a) ** 2, axis=ax, dtype=np.float64))
            ref = np.sqrt(np.sum(a.astype(np.float64) ** 2, axis=ax))
            if not np.isfinite(h).all() or np.any(err > HALF_TOLERANCE * ref):
                if want == "float16":
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the adapter's factors of {what} do not fit "
                                       f"float16 (values out of its range, or rounded by more than "
                                       f"{HALF_TOLERANCE:g}); load it with dtype='float32' (or 'auto')")
                return arrays
        half.append(h)
    return half


def padded_rank(r: int) -> int:
    """The rank the factors are held at: a multiple of 8 (the cpu kernels take four rows of A and eight
    of B at a time; the padding is zeros, which add exact zeros)."""
    return -(-r // 8) * 8


@dataclass
class Factors:
    """One matrix's update in the kernels' layout: a [R, in] (PEFT's lora_A), b_t [R, out] (lora_B
    transposed, the scale folded in); R the rank padded with zero rows (padded_rank)."""
    a: np.ndarray
    b_t: np.ndarray

    @classmethod
    def of(cls, a, b, weight_dtype="float32", want="float32", what=""):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        R = padded_rank(a.shape[0])
        fa, fb = np.zeros((R, a.shape[1]), np.float32), np.zeros((R, b.shape[0]), np.float32)
        fa[:a.shape[0]], fb[:a.shape[0]] = a, b.T
        return cls(*hold([fa, fb], weight_dtype, want, what))

    @property
    def dtype(self) -> str:
        return self.a.dtype.name

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b_t.nbytes


@dataclass
class FFNFactors:
    """An adapter's updates of one FFN list (a layer's routed experts, or a shared / dense MLP as a
    1-expert list), stacked by expert, scales folded in, R the largest rank padded (padded_rank):
        ag, au [E, R, H]   bg, bu [E, R, I]   ad [E, R, I]   bd [E, R, H]   (zeros where it changes nothing;
        au [0, R, 0] when up shares gate's A, as PEFT's fused gate_up does)"""
    ag: np.ndarray
    bg: np.ndarray
    au: np.ndarray
    bu: np.ndarray
    ad: np.ndarray
    bd: np.ndarray

    @classmethod
    def stack(cls, parts: dict, E: int, H: int, I: int) -> "FFNFactors":
        """parts: {expert: {"gate" | "up" | "down": (A [r, in], sB [out, r])}}."""
        R = padded_rank(max(a.shape[0] for d in parts.values() for a, _ in d.values()))
        z = lambda *shape: np.zeros(shape, np.float32)                # noqa: E731
        # PEFT's fused gate_up pair gives gate and up one A (model/lora.py): kept once (au empty), and
        # lora_pre projects x on it once
        shared = all("gate" in d and "up" in d and d["gate"][0] is d["up"][0] for d in parts.values())
        f = cls(z(E, R, H), z(E, R, I), z(0, R, 0) if shared else z(E, R, H), z(E, R, I), z(E, R, I), z(E, R, H))
        for e, d in parts.items():
            for part, (fa, fb) in (("gate", (f.ag, f.bg)), ("up", (None if shared else f.au, f.bu)),
                                   ("down", (f.ad, f.bd))):
                if part in d and fa is None:
                    fb[e, :d[part][0].shape[0], :] = d[part][1].T
                elif part in d:
                    a, b = d[part]
                    fa[e, :a.shape[0], :] = a
                    fb[e, :a.shape[0], :] = b.T
        return f

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.ag, self.bg, self.au, self.bu, self.ad, self.bd))

    @property
    def rank(self) -> int:
        return self.ag.shape[1]

    @property
    def dtype(self) -> str:
        return self.ag.dtype.name

    def held(self, weight_dtype: str, want: str, what: str) -> "FFNFactors":
        """These factors in the precision hold() picks (all six arrays alike)."""
        return FFNFactors(*hold([self.ag, self.bg, self.au, self.bu, self.ad, self.bd], weight_dtype, want, what))


@dataclass
class Loaded:
    """An adapter held by the engine: its updates keyed by the program's objects."""
    name: str
    path: str
    uid: int                    # a new one at every load: the prefix cache's key (hash_seed)
    rank: int
    nbytes: int
    linear: dict                # id(Weight) -> Factors
    ffns: dict                  # id(FFN list) -> FFNFactors
    names: list                 # the model tensors it changes (inspection)
    dtype: str = "float32"      # the factors' precision: float32, float16, or "mixed" (hold)

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

    def load(self, name: str, adapter, family, scale: float = 1.0, dtype: str = "auto") -> Loaded:
        """Map an Adapter (model/lora.py) onto the runner's program, its factors held in dtype (hold);
        refuses what cannot run here."""
        if dtype not in FACTOR_DTYPES:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter dtype {dtype!r:.40}: expected one of "
                               f"{', '.join(FACTOR_DTYPES)}")
        from ..model.lora import colibri_factors, resolve
        r = self.runner
        be, prog, cfg = r.be, r.program, r.cfg
        if not be.runs_lora:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the {be.name} backend does not run LoRA adapters at run "
                               "time; merge the adapter at conversion (colibri convert HF OUT --lora ADAPTER) or "
                               "open the engine with backend='cpu'")
        res = resolve(adapter, cfg, family, scale)
        linear, experts = colibri_factors(res, cfg, family)
        lin, parts, names = {}, {}, []          # parts: FFN list name -> {expert: {part: (A, sB)}}
        for ours, (a, b, src) in linear.items():
            bits = ours.split(".")
            if len(bits) == 4 and bits[2] in ("shared", "mlp") and bits[3] in ("gate", "up", "down"):
                lst = prog.ffn_lists.get(f"layers.{bits[1]}.{bits[2]}")
                if lst is None:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r} changes {ours}, which this "
                                       "model does not run")
                self._check(f"{src} ({ours})", a, b, getattr(lst[0], bits[3]))
                parts.setdefault(f"layers.{bits[1]}.{bits[2]}", {}).setdefault(0, {})[bits[3]] = (a, b)
                names.append(ours)
                continue
            w = prog.named.get(ours)
            if w is None or w is prog.embed or w is prog.lm_head:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r} changes {ours}, which takes no "
                                   "run-time update (embeddings, the output head); merge the adapter at conversion "
                                   "(colibri convert HF OUT --lora ADAPTER)")
            lin[id(w)] = self._check(f"{src} ({ours})", a, b, w, dtype)
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
            for p, (a, b) in d.items():
                self._check(f"layers.{layer}.experts.{j}.{p}", a, b, getattr(lst[j], p))
            parts.setdefault(f"layers.{layer}.experts", {})[j] = d
            names.append(f"layers.{layer}.experts.{j}")
        H = cfg["hidden_size"]
        ffns = {}
        for key, d in parts.items():
            lst = prog.ffn_lists[key]
            one = next((f for f in lst if f is not None), None)
            ffns[id(lst)] = FFNFactors.stack(d, len(lst), H, one.gate.shape[0] if one is not None
                                             else cfg["moe_intermediate_size"]).held(
                one.gate.dtype if one is not None else "float16", dtype, key)
        nbytes = sum(f.nbytes for f in lin.values()) + sum(f.nbytes for f in ffns.values())
        rank = max([a.shape[0] for a, _, _ in linear.values()] +         # as trained (the kernels' is padded)
                   [a.shape[0] for d in experts.values() for a, _ in d.values()] + [0])
        held = {f.dtype for f in list(lin.values()) + list(ffns.values())}
        lo = Loaded(name, getattr(adapter, "path", ""), next(_uids), rank, nbytes, lin, ffns, names,
                    held.pop() if len(held) == 1 else "mixed")
        self.loaded[name] = lo
        self._bufs = None
        return lo

    @staticmethod
    def _check(what, a, b, w, dtype="float32") -> Factors:
        if (b.shape[0], a.shape[1]) != (w.shape[0], w.shape[-1]):       # Weight.shape: logical [out, in]
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the adapter's update of {what} is [{b.shape[0]}, "
                               f"{a.shape[1]}]; the model's matrix is {list(w.shape)}")
        return Factors.of(a, b, w.dtype, dtype, what)

    def unload(self, name: str):
        self.loaded.pop(name)
        self._bufs = None

    # -- a step ----------------------------------------------------------------------------------
    def buffers(self):
        """A step's scratch, sized once for the largest step: the token -> adapter map and the FFNs'
        gate/up addends (pre, [rows, 2 I] at the widest FFN)."""
        if self._bufs is None:
            r, cfg = self.runner, self.runner.cfg
            rows = r.max_rows * max(r.top_k, 1)
            inter = max(cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["shared_expert_intermediate_size"])
            self._bufs = {"tok": np.zeros(r.max_rows, np.int32), "pre": np.zeros(rows * 2 * inter, np.float32)}
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
                self.be.lora_update(out, x, f.a, f.b_t, t0, t1)

    def ffn(self, be, out, x, experts, plan, scratch, act, dense) -> bool:
        """grouped_ffn with the updates of the adapters that change these experts around it (module
        docstring). False: no row of such an adapter in the step (the caller runs grouped_ffn alone)."""
        key = id(experts)
        which = [(i, a.ffns[key]) for i, a in enumerate(self.adapters) if key in a.ffns]
        if not which:
            return False
        k = plan.top_k
        A = plan.num_tokens * k
        order, offsets = plan.order[:A], plan.offsets
        I = which[0][1].bg.shape[2]
        pre = self.b["pre"][:A * 2 * I].reshape(A, 2 * I)
        pre.fill(0.0)
        rows = be.lora_rows(order, k, self.tok, offsets, len(self.adapters))
        for i, f in which:              # every adapter of the step has tokens, and every token rows here
            be.lora_pre(pre, x, rows[i], f.ag, f.bg, f.au, f.bu)
        be.grouped_ffn(out, x, experts, plan, scratch, act, pre=pre)
        width, flat = scratch.shape[1], scratch.reshape(-1)
        for i, f in which:
            be.lora_down(out, flat, rows[i], offsets, width, f.ad, f.bd)
        return True
