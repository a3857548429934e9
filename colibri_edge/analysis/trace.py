"""Routing traces: which experts each token chose, in every MoE layer, step by step.

File (.npz):
  expert_ids  int16   [tokens, moe_layers, top_k]
  weights     float32 [tokens, moe_layers, top_k]
  seq_ids, positions, step_ids  int32 [tokens]   (a step is one forward call: a prefill chunk or a decode step;
              Engine.trace's seq_ids are the prompts' indices)
  layer_ids   int32   [moe_layers]
  predicted_ids int16 [tokens, moe_layers, top_k]  layer j's experts as predicted by applying its router
              to the hidden state of MoE layer j-1 (-1 for the first): what the prefetch policy uses
  predicted_weights float32 [tokens, moe_layers, top_k]  their routing weights (prefetch skips those
              below slots.PREFETCH_MIN_P; a trace without them prefetches every predicted expert)
  meta        JSON string: model, backend, top_k, experts_per_layer, bytes_per_expert
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from ..runtime.hooks import RoutingHook


@dataclass
class Trace:
    expert_ids: np.ndarray
    weights: np.ndarray
    seq_ids: np.ndarray
    positions: np.ndarray
    step_ids: np.ndarray
    layer_ids: np.ndarray
    predicted_ids: np.ndarray
    meta: dict
    predicted_weights: np.ndarray | None = None

    def save(self, path):
        """To exactly `path` (a file object: NumPy would append .npz to a name that lacks it, and
        `colibri trace --out t` would then say it wrote a file that `simulate --trace t` cannot find)."""
        with open(path, "wb") as f:
            self._save(f)

    def _save(self, path):
        np.savez_compressed(path, expert_ids=self.expert_ids, weights=self.weights, seq_ids=self.seq_ids,
                            positions=self.positions, step_ids=self.step_ids, layer_ids=self.layer_ids,
                            predicted_ids=self.predicted_ids, meta=np.array(json.dumps(self.meta)),
                            **({} if self.predicted_weights is None else {"predicted_weights": self.predicted_weights}))

    @classmethod
    def load(cls, path) -> "Trace":
        try:
            z = np.load(path, allow_pickle=False)
            meta = json.loads(str(z["meta"]))
            pred = z["predicted_ids"] if "predicted_ids" in z.files else np.full_like(z["expert_ids"], -1)
            return cls(z["expert_ids"], z["weights"], z["seq_ids"], z["positions"], z["step_ids"],
                       z["layer_ids"], pred, meta, z["predicted_weights"] if "predicted_weights" in z.files else None)
        except (OSError, KeyError, ValueError) as e:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{path}: not a Colibri routing trace ({e}); "
                               "make one with `colibri trace`") from None

    @classmethod
    def concat(cls, parts) -> "Trace":
        """Traces of consecutive shards of one prompt list, as one: shard i's seq_ids (its prompts'
        indices) move past the prompts of the shards before it, its step_ids past their steps, so
        the rows come in prompt order as one process running the shards one after another writes
        them. The meta is the first part's."""
        parts = list(parts)
        if not parts:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "no traces to join")
        seq_off, step_off, seqs, steps = 0, 0, [], []
        for p in parts:
            seqs.append(p.seq_ids + seq_off)
            steps.append(p.step_ids + step_off)
            seq_off += int(p.meta.get("prompts", int(p.seq_ids.max()) + 1 if p.seq_ids.size else 0))
            step_off += p.num_steps
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts])   # noqa: E731
        pw = None if any(p.predicted_weights is None for p in parts) else cat("predicted_weights")
        meta = {**parts[0].meta, "prompts": seq_off}
        return cls(cat("expert_ids"), cat("weights"), np.concatenate(seqs).astype(np.int32), cat("positions"),
                   np.concatenate(steps).astype(np.int32), parts[0].layer_ids, cat("predicted_ids"), meta, pw)

    def with_top_k(self, k: int) -> "Trace":
        """The trace as if each token had kept only its k highest-weight experts (and k predicted ones):
        `colibri simulate --top-k`. The first MoE layer's choice is then exactly the model's at top-k;
        later layers' are approximate (their inputs would have mixed fewer experts): trace with
        `colibri trace --experts-per-token k` for the exact routing."""
        K = self.expert_ids.shape[2]
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= K:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"top_k={k!r}: give 1..{K} (the trace's experts per "
                               "token); trace with --experts-per-token for more")
        if k == K:
            return self
        order = np.argsort(-self.weights, axis=2, kind="stable")[:, :, :k]
        keep = lambda a, o: np.take_along_axis(a, o, axis=2)                   # noqa: E731
        if self.predicted_weights is not None:
            porder = np.argsort(-self.predicted_weights, axis=2, kind="stable")[:, :, :k]
            pred, pw = keep(self.predicted_ids, porder), keep(self.predicted_weights, porder)
        else:
            pred, pw = self.predicted_ids[:, :, :k], None
        return Trace(keep(self.expert_ids, order), keep(self.weights, order), self.seq_ids, self.positions,
                     self.step_ids, self.layer_ids, pred, {**self.meta, "top_k": k}, pw)

    @property
    def num_steps(self):
        return int(self.step_ids.max()) + 1 if self.step_ids.size else 0

    def steps(self):
        """Yields (step, token index array) in order."""
        if not self.step_ids.size:
            return
        bounds = np.flatnonzero(np.diff(self.step_ids)) + 1
        for idx in np.split(np.arange(self.step_ids.size), bounds):
            yield int(self.step_ids[idx[0]]), idx


class TraceRecorder(RoutingHook):
    """A routing hook on a Runner: collects the routing of every step, with the prediction of the
    next MoE layer's experts (what the prefetch policy would use)."""
    wants_prediction = True

    def __init__(self, runner, meta):
        self.runner, self.meta = runner, meta
        self.moe_layers = [m.layer for m in runner.program.moe]
        self._col = {l: j for j, l in enumerate(self.moe_layers)}
        self.chunks = []
        self._step = 0
        self._cur = None

    def begin_step(self, entries, positions):
        seq_ids = np.repeat(np.arange(len(entries)), [len(t) for _, t in entries])   # rows' entry, until trace()
        T, k = len(seq_ids), self.runner.top_k
        L = len(self.moe_layers)
        self._cur = {"ids": np.full((T, L, k), -1, np.int16), "w": np.zeros((T, L, k), np.float32),
                     "pred": np.full((T, L, k), -1, np.int16), "pred_w": np.zeros((T, L, k), np.float32),
                     "seq": np.asarray(seq_ids, np.int32), "owners": [(seq.owner, seq.seq_id) for seq, _ in entries],
                     "pos": np.asarray(positions, np.int32).copy()}

    def on_route(self, layer, ids, weights, next_layer, predicted):
        be, j = self.runner.be, self._col[layer]
        self._cur["ids"][:, j] = be.download(ids)
        self._cur["w"][:, j] = be.download(weights)
        if predicted is not None:
            self._cur["pred"][:, self._col[next_layer]] = predicted

    def on_prediction(self, next_layer, ids, weights):
        self._cur["pred_w"][:, self._col[next_layer]] = weights

    def end_step(self):
        c = self._cur
        c["step"] = np.full(len(c["seq"]), self._step, np.int32)
        self.chunks.append(c)
        self._step += 1
        self._cur = None

    def trace(self, labels=None) -> Trace:
        """labels: request -> its prompt's index (the seq_ids written); any other request's rows get
        len(labels) + its sequence id."""
        labels = labels or {}
        for c in self.chunks:
            ids = np.array([labels[o] if o in labels else len(labels) + s for o, s in c.pop("owners")], np.int32)
            c["seq"] = ids[c["seq"]] if len(ids) else c["seq"]
        L, k = len(self.moe_layers), self.runner.top_k
        cat = lambda key, shape, dt: np.concatenate([c[key] for c in self.chunks]) if self.chunks else np.zeros(shape, dt)
        meta = {**self.meta, "prompts": len(labels)} if labels else dict(self.meta)
        return Trace(cat("ids", (0, L, k), np.int16), cat("w", (0, L, k), np.float32), cat("seq", (0,), np.int32),
                     cat("pos", (0,), np.int32), cat("step", (0,), np.int32), np.array(self.moe_layers, np.int32),
                     cat("pred", (0, L, k), np.int16), meta, cat("pred_w", (0, L, k), np.float32))


# ------------------------------------------------------------------------------------------------
# statistics (`colibri stats`)

def routing_stats(tr: Trace) -> dict:
    """Per MoE layer: expert load, imbalance (max/mean), routing entropy (bits; uniform = log2 E),
    pair co-activation and how often consecutive tokens of a sequence reuse an expert."""
    E = int(tr.meta["experts_per_layer"])
    T, L, k = tr.expert_ids.shape
    layers = []
    order = np.lexsort((tr.positions, tr.seq_ids))
    seq_sorted = tr.seq_ids[order]
    same_seq = seq_sorted[1:] == seq_sorted[:-1]
    for j in range(L):
        ids = tr.expert_ids[:, j, :].astype(np.int64)
        load = np.bincount(ids.reshape(-1), minlength=E)
        p = load / max(load.sum(), 1)
        nz = p[p > 0]
        onehot = np.zeros((T, E), np.int64)
        np.put_along_axis(onehot, ids, 1, axis=1)
        co = onehot.T @ onehot
        np.fill_diagonal(co, 0)
        a, b = onehot[order][:-1][same_seq], onehot[order][1:][same_seq]
        reuse = float((a & b).any(axis=1).mean()) if len(a) else 0.0
        pred = None
        if j > 0 and (tr.predicted_ids[:, j] >= 0).all():
            # the lookahead (layer j's router on layer j-1's MoE input): per token, the share of its
            # routed experts it predicted; per step, of the experts the step ran, the share predicted
            # (what a prefetch saves) and of the predicted ones the share run (what it wastes)
            pi = tr.predicted_ids[:, j, :].astype(np.int64)
            tok = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ids.tolist(), pi.tolist())]))
            used = run_n = pred_n = 0
            for _, idx in tr.steps():
                run, pr = set(np.unique(ids[idx]).tolist()), set(np.unique(pi[idx]).tolist())
                used, run_n, pred_n = used + len(run & pr), run_n + len(run), pred_n + len(pr)
            pred = {"token_recall": tok, "recall": used / run_n, "precision": used / pred_n}
        layers.append({
            "layer": int(tr.layer_ids[j]), "load": load.tolist(), "prediction": pred,
            "imbalance": float(load.max() / load.mean()) if load.mean() > 0 else 0.0,
            "entropy_bits": float(-(nz * np.log2(nz)).sum()), "max_entropy_bits": float(np.log2(E)),
            "coactivation": co.tolist(), "consecutive_reuse": reuse,
        })
    preds = [l["prediction"] for l in layers if l["prediction"] is not None]
    overall = None if not preds else {key: float(np.mean([p[key] for p in preds])) for key in preds[0]}
    return {"tokens": int(T), "top_k": int(k), "experts_per_layer": E, "layers": layers, "prediction": overall}
