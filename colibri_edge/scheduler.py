"""The backend-neutral scheduler: the layer program of DESIGN.md run over a step of tokens.

A step packs tokens of one or more sequences (a prefill chunk, or one token per live sequence when
decoding). Per layer:

    h      = rmsnorm(x)
    q,k,v  = h @ Wqkv (+bias); optional q/k norm; rope
    kv_write(cache, k, v, slots);  a = paged_attention(q, cache, block_tables, positions)
    x     += a @ Wo
    h      = rmsnorm(x)
    ids, w = route(h @ Wrouter)            # fp32
    plan   = align(ids)                    # tokens grouped by expert
    y      = grouped_ffn(h, experts, plan) # each chosen expert reads its weights once
    x     += combine(y, w, plan) + sigmoid(g) * shared(h)

Every buffer lives in the arena, allocated at start for the largest step: the decode loop
allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from .kvcache import BlockPool
from .modeldir import ModelDir


@dataclass
class Sequence:
    """A sequence's place in the KV cache: `cached` positions are written, `table` maps blocks."""
    seq_id: int
    table: list = field(default_factory=list)
    cached: int = 0


def arena_bytes(cfg: dict, rows: int, max_batch: int) -> int:
    """Bytes of activations and scratch for steps of up to `rows` tokens (matches Runner's arena)."""
    H, hd, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    E, k = max(cfg["experts_per_layer"], 1), cfg["top_k"]
    fan = E if cfg["router_mode"] == "gated" else k
    inter = max(cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["shared_expert_intermediate_size"])
    floats = rows * (4 * H + 2 * nq + 2 * nkv + E + 2 * fan + 1) + rows * fan * (H + 2 * inter) + rows * V
    ints = rows * (6 + 3 * fan) + max_batch * 64
    return 4 * (floats + ints)


class Runner:
    """Owns the weights on the backend, the arena and the KV cache; runs steps."""

    def __init__(self, model: ModelDir, backend, max_rows: int, max_batch: int,
                 max_seq_len: int, num_kv_blocks: int, block_size: int,
                 expert_slots: int | None = None, slot_policy: str = "lru"):
        self.model, self.be, self.cfg = model, backend, model.config
        cfg = self.cfg
        self.max_rows, self.max_batch, self.max_seq_len = max_rows, max_batch, max_seq_len
        self.block_size = block_size
        self.pool = BlockPool(num_kv_blocks, block_size)
        self.max_blocks = -(-max_seq_len // block_size)
        self.top_k = cfg["experts_per_layer"] if cfg["router_mode"] == "gated" else cfg["top_k"]
        self.scale = cfg["head_dim"] ** -0.5
        self.slot_pool = None
        if expert_slots is not None:
            from .slots import SlotPool
            self.slot_pool = SlotPool(backend, model, expert_slots, slot_policy)
        self._upload_weights()
        self._alloc_arena()
        self.kv = backend.alloc_kv(cfg["num_hidden_layers"], num_kv_blocks * block_size,
                                   cfg["num_key_value_heads"], cfg["head_dim"])
        L, E = cfg["num_hidden_layers"], max(cfg["experts_per_layer"], 1)
        self.expert_counts = np.zeros((L, E), dtype=np.int64)   # tokens routed, per layer and expert
        self.steps = 0
        self.step_tokens = []            # tokens computed in each step (bounded window)
        self.observers = []              # callables(layer, ids[T,k], weights[T,k]): backend buffers,
                                         # valid during the call; use backend.download to keep them
        self.trace = None                # a trace.TraceRecorder while tracing
        self.graph_decode = True         # let a backend with graph_step capture/replay decode steps
        moe = [l["layer_id"] for l in cfg["layers"] if l["type"] != "dense"]
        self.next_moe = {a: b for a, b in zip(moe, moe[1:])}

    # -- setup ------------------------------------------------------------------------------
    def _upload_weights(self):
        m, be, cfg = self.model, self.be, self.cfg

        def w(name):
            if not m.has(name):
                return None
            if m.has(name + ".scales"):               # quantised: the row scales travel with it
                return be.upload(m.raw_tensor(name), m.tensor_dtype(name), scales=m.raw_tensor(name + ".scales"))
            return be.upload(m.raw_tensor(name), m.tensor_dtype(name))

        self.embed = w("embed_tokens")
        self.final_norm = w("norm")
        self.lm_head = self.embed if cfg["tie_word_embeddings"] else w("lm_head")
        self.layers = []
        from .backends.base import FFN
        for layer in cfg["layers"]:
            i, p = layer["layer_id"], f"layers.{layer['layer_id']}."
            lw = {n: w(p + n) for n in ("input_norm", "post_attention_norm", "attn.wq", "attn.wk", "attn.wv",
                                          "attn.wo", "attn.bq", "attn.bk", "attn.bv", "attn.bo",
                                          "attn.q_norm", "attn.k_norm", "router", "shared.gate_logit")}
            lw["type"] = layer["type"]
            if layer["type"] == "dense":
                lw["mlp"] = FFN(w(p + "mlp.gate"), w(p + "mlp.up"), w(p + "mlp.down"))
            elif self.slot_pool is None:
                H, I, wd = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["weight_dtype"]
                lw["experts"] = [be.upload_expert(m.expert_blob(i, j), H, I, wd)
                                 for j in range(layer["moe_num_experts"])]
            else:                                  # experts live in the slot pool only
                lw["experts"] = [None] * layer["moe_num_experts"]
            if layer["type"] == "moe_shared":
                lw["shared"] = FFN(w(p + "shared.gate"), w(p + "shared.up"), w(p + "shared.down"))
            self.layers.append(lw)

    def _alloc_arena(self):
        be, cfg, R = self.be, self.cfg, self.max_rows
        H, hd, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        E, k = max(cfg["experts_per_layer"], 1), self.top_k
        inter = max(cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["shared_expert_intermediate_size"])
        f32, i32 = np.float32, np.int32
        self.a = a = {
            "x": be.alloc((R, H), f32), "h": be.alloc((R, H), f32), "o": be.alloc((R, H), f32),
            "q": be.alloc((R, nh, hd), f32), "k": be.alloc((R, nkv, hd), f32), "v": be.alloc((R, nkv, hd), f32),
            "attn": be.alloc((R, nh, hd), f32), "router": be.alloc((R, E), f32),
            "ids": be.alloc((R, k), i32), "w": be.alloc((R, k), f32), "gate_logit": be.alloc((R, 1), f32),
            "y": be.alloc((R * k, H), f32), "scratch": be.alloc((R * k, 2 * inter), f32),
            "zeros": be.alloc((R, 1), i32), "pred_router": be.alloc((R, E), f32),
            "pred_ids": be.alloc((R, k), i32), "pred_w": be.alloc((R, k), f32), "logits": be.alloc((R, V), f32), "sel": be.alloc((R, H), f32),
            "tok": be.alloc((R,), i32), "pos": be.alloc((R,), i32), "seq": be.alloc((R,), i32),
            "slots": be.alloc((R,), i32), "rows": be.alloc((R,), i32),
            "tables": be.alloc((self.max_batch, self.max_blocks), i32),
        }
        # host-side step metadata, filled then uploaded once per step
        self.h = {n: np.zeros(a[n].shape, np.int32) for n in ("tok", "pos", "seq", "slots", "rows", "tables")}
        self.plan_bufs = be.alloc_plan(R * k, E) if hasattr(be, "alloc_plan") else None
        self.dense_plan_bufs = be.alloc_plan(R, 1) if hasattr(be, "alloc_plan") else None

    # -- KV ---------------------------------------------------------------------------------
    def new_sequence(self, seq_id) -> Sequence:
        return Sequence(seq_id)

    def reserve(self, seq: Sequence, new_tokens: int):
        total = seq.cached + new_tokens
        if total > self.max_seq_len:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"sequence of {total} tokens is longer than max_seq_len={self.max_seq_len}; "
                               "open the engine with a larger max_seq_len or shorten the input")
        self.pool.grow(seq.table, total, who=f"sequence {seq.seq_id}")

    def free(self, seq: Sequence):
        self.pool.release(seq.table)
        seq.cached = 0

    # -- the step ---------------------------------------------------------------------------
    def step(self, entries, all_logits=False):
        """entries: list of (Sequence, token ids) whose KV blocks are reserved.
        Returns logits [rows, V] (a view into the arena, valid until the next step): every token's
        when all_logits, else each entry's last token's, in entry order."""
        be, cfg, a, h = self.be, self.cfg, self.a, self.h
        T = sum(len(t) for _, t in entries)
        if T > self.max_rows or len(entries) > self.max_batch:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"step of {T} tokens / {len(entries)} sequences "
                               f"exceeds the arena ({self.max_rows} / {self.max_batch})")
        t, nrows = 0, 0
        B = self.block_size
        for s, (seq, toks) in enumerate(entries):
            n = len(toks)
            h["tok"][t:t + n] = toks
            pos = np.arange(seq.cached, seq.cached + n, dtype=np.int32) if n > 1 else seq.cached
            h["pos"][t:t + n] = pos
            h["seq"][t:t + n] = s
            tbl = seq.table
            h["tables"][s, :len(tbl)] = tbl
            tb = h["tables"][s]
            h["slots"][t:t + n] = tb[h["pos"][t:t + n] // B] * B + h["pos"][t:t + n] % B
            if all_logits:
                h["rows"][nrows:nrows + n] = np.arange(t, t + n) if n > 1 else t
                nrows += n
            else:
                h["rows"][nrows] = t + n - 1
                nrows += 1
            seq.cached += n
            t += n
        S = len(entries)
        if self.trace is not None:
            self.trace.begin_step(np.repeat([seq.seq_id for seq, _ in entries], [len(t) for _, t in entries]),
                                  h["pos"][:T])
        for n in ("tok", "pos", "seq", "slots", "rows"):
            be.upload_into(a[n][:T if n != "rows" else nrows], h[n][:T if n != "rows" else nrows])
        be.upload_into(a["tables"][:S], h["tables"][:S])
        decode = not all_logits and nrows == T        # one token per sequence
        if decode and self.graph_decode and hasattr(be, "graph_step") and not self.observers \
                and self.trace is None and self.slot_pool is None:
            # a GPU backend captures the decode step once per shape and replays it (CUDA graphs):
            # only when every expert is resident, since a slot-pool miss needs the host
            be.graph_step(("decode", T, nrows), lambda: self._forward(T, nrows))
        else:
            self._forward(T, nrows)
        if self.trace is not None:
            self.trace.end_step()
        self.steps += 1
        self.step_tokens.append(T)
        if len(self.step_tokens) > 4096:
            del self.step_tokens[:2048]
        return a["logits"][:nrows]

    def _forward(self, T, nrows):
        be, cfg, a = self.be, self.cfg, self.a
        eps = cfg["rms_norm_eps"]
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        x, hbuf, o = a["x"][:T], a["h"][:T], a["o"][:T]
        q, k, v, attn = a["q"][:T], a["k"][:T], a["v"][:T], a["attn"][:T]
        pos, seq, slots = a["pos"][:T], a["seq"][:T], a["slots"][:T]
        tables = a["tables"]
        dense_plan = None
        be.embed(x, self.embed, a["tok"][:T])
        for li, lw in enumerate(self.layers):
            be.rmsnorm(hbuf, x, lw["input_norm"], eps)
            be.matmul(q.reshape(T, nh * hd), hbuf, lw["attn.wq"], lw["attn.bq"])
            be.matmul(k.reshape(T, nkv * hd), hbuf, lw["attn.wk"], lw["attn.bk"])
            be.matmul(v.reshape(T, nkv * hd), hbuf, lw["attn.wv"], lw["attn.bv"])
            if cfg["qk_norm"] == "per_head":
                be.rmsnorm(q.reshape(T * nh, hd), q.reshape(T * nh, hd), lw["attn.q_norm"], eps)
                be.rmsnorm(k.reshape(T * nkv, hd), k.reshape(T * nkv, hd), lw["attn.k_norm"], eps)
            elif cfg["qk_norm"] == "full":
                be.rmsnorm(q.reshape(T, nh * hd), q.reshape(T, nh * hd), lw["attn.q_norm"], eps)
                be.rmsnorm(k.reshape(T, nkv * hd), k.reshape(T, nkv * hd), lw["attn.k_norm"], eps)
            be.rope(q, q, pos, cfg["rope_theta"])
            be.rope(k, k, pos, cfg["rope_theta"])
            be.kv_write(self.kv, li, k, v, slots)
            be.paged_attention(attn, q, self.kv, li, tables, seq, pos, self.block_size, self.scale)
            be.matmul(o, attn.reshape(T, nh * hd), lw["attn.wo"], lw["attn.bo"])
            be.add(x, x, o)
            be.rmsnorm(hbuf, x, lw["post_attention_norm"], eps)
            if lw["type"] == "dense":
                if dense_plan is None:
                    dense_plan = be.align(self.dense_plan_bufs, a["zeros"][:T], T, 1, 1)
                be.grouped_ffn(a["y"][:T], hbuf, [lw["mlp"]], dense_plan, a["scratch"][:T])
                be.add(x, x, a["y"][:T])
                continue
            kk, E = self.top_k, len(lw["experts"])
            ids, w = a["ids"][:T], a["w"][:T]
            be.matmul(a["router"][:T], hbuf, lw["router"])
            be.route(ids, w, a["router"][:T], kk, cfg["router_mode"], cfg["norm_topk_prob"])
            plan = be.align(self.plan_bufs, ids, T, E, kk)
            if plan.counts is not None:    # None: a GPU backend keeping counts on the device
                self.expert_counts[li] += plan.counts
            for obs in self.observers:
                obs(li, ids, w)
            if self.trace is not None:
                self.trace.record(li, be.download(ids), be.download(w))
            pool, prefetch = self.slot_pool, None
            if self.trace is not None or (pool is not None and pool.cache.policy == "prefetch"):
                nxt, pred = self._predict_next(li, hbuf, T)
                if nxt is not None and self.trace is not None:
                    self.trace.record_prediction(nxt, pred)
                if nxt is not None and pool is not None and pool.cache.policy == "prefetch":
                    prefetch = (nxt, np.unique(pred))
            y = a["y"][:T * kk]
            if pool is None:
                be.grouped_ffn(y, hbuf, lw["experts"], plan, a["scratch"][:T * kk])
            else:
                self._grouped_ffn_from_slots(li, lw, plan, y, hbuf, T, prefetch)
            be.combine(x, y, w, plan)
            if lw["type"] == "moe_shared":
                if dense_plan is None:
                    dense_plan = be.align(self.dense_plan_bufs, a["zeros"][:T], T, 1, 1)
                be.grouped_ffn(o, hbuf, [lw["shared"]], dense_plan, a["scratch"][:T])
                if lw["shared.gate_logit"] is not None:
                    be.matmul(a["gate_logit"][:T], hbuf, lw["shared.gate_logit"])
                    be.add(x, x, o, gate=a["gate_logit"][:T])
                else:
                    be.add(x, x, o)
        sel = a["sel"][:nrows]
        be.embed(sel, x, a["rows"][:nrows])            # gather the rows whose logits are wanted
        be.rmsnorm(sel, sel, self.final_norm, eps)
        be.matmul(a["logits"][:nrows], sel, self.lm_head)

    def _predict_next(self, li, hbuf, T):
        """Layer L+1's router applied to layer L's hidden state: the experts it will likely want."""
        nxt = self.next_moe.get(li)
        if nxt is None:
            return None, None
        be, a, kk = self.be, self.a, self.top_k
        be.matmul(a["pred_router"][:T], hbuf, self.layers[nxt]["router"])
        be.route(a["pred_ids"][:T], a["pred_w"][:T], a["pred_router"][:T], kk, self.cfg["router_mode"],
                 self.cfg["norm_topk_prob"])
        return nxt, be.download(a["pred_ids"][:T])

    def _grouped_ffn_from_slots(self, li, lw, plan, y, hbuf, T, prefetch):
        """Run the layer's experts from the slot pool, wave by wave (a wave = what fits in the slots)."""
        import dataclasses
        active = np.asarray(plan.experts_to_run())
        experts = list(lw["experts"])
        for wave in self.slot_pool.waves(li, active, prefetch):
            for e, ffn in wave:
                experts[e] = ffn
            sub = dataclasses.replace(plan, active=np.array([e for e, _ in wave], dtype=np.int64))
            self.be.grouped_ffn(y, hbuf, experts, sub, self.a["scratch"][:T * self.top_k])
