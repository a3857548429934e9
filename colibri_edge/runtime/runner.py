"""The backend-neutral scheduler: runs the layer program (program.py) over a step of tokens.

A step packs tokens of one or more sequences (prefill chunks, or one token per live sequence when
decoding):

    x = embed(tokens)
    for each layer:  h = norm(x); x += mixer(h, state);  h = norm(x); x += ffn parts(h)
    logits = lm_head @ norm(x[rows wanted])

The Runner owns the program's weights on the backend, the arena (arena.py, allocated once for the
largest step: the decode loop allocates nothing), the per-sequence state pools and their storage
(state.py), the expert slot pool when there is one (slots.py), and the routing hooks: tracing,
observers and prefetch prediction all see routing through `RoutingHook`. A decode step with no hook
and every expert resident goes through the backend's graph_step (a CUDA graph replay there).
"""
from __future__ import annotations

import math

import numpy as np

from . import arena, program
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY
from ..model.modeldir import ModelDir
from .hooks import RoutingHook  # noqa: F401  (re-exported: the hook interface)
from .slots import likely_experts
from .state import States, state_pools
from ..model.layerplan import geometries


def latent_widths(cfg: dict) -> list:
    """The matrix row widths latent attention adds (q_lora_rank, kv_lora_rank, heads x v_head_dim)."""
    la = cfg.get("latent_attention")
    return [la["q_lora_rank"], la["kv_lora_rank"], cfg["num_attention_heads"] * la["v_head_dim"]] if la else []


def linear_widths(cfg: dict) -> list:
    """The matrix row widths a gated delta-net adds (its q|k|v channels, Hv x dv)."""
    la = cfg.get("linear_attention")
    return [2 * la["num_key_heads"] * la["key_head_dim"] + la["num_value_heads"] * la["value_head_dim"],
            la["num_value_heads"] * la["value_head_dim"]] if la else []


def layout(cfg: dict, max_rows: int, max_batch: int, max_seq_len: int, num_kv_blocks: int, block_size: int,
           kv_dtype: str = "float32", snapshots: int = 0, snapshot_every: int = 0, mtp: bool = False):
    """The engine's limits and per-sequence state pools (the paged ones in kv_dtype): what the Runner
    allocates and what `colibri inspect` (analysis/sizing.py) sizes, from the one place. mtp: the
    model's MTP head runs (its layer's KV, its buffers)."""
    states = States(state_pools(cfg, num_kv_blocks, block_size, max_batch, kv_dtype, snapshots, snapshot_every,
                                mtp), max_seq_len)
    return arena.Limits(max_rows, max_batch, -(-max_seq_len // block_size), len(states.paged),
                        len(states.fixed), mtp), states


class AttnViews:
    """q, k, v, attn of one attention geometry (Hq, Hkv, D) over a step of T tokens: the first
    T * heads * D values of the arena's (widest-geometry) buffers, as [T, heads, D], [T, heads * D]
    and [T * heads, D] (per-head norms)."""

    def __init__(self, a: dict, T: int, geo: tuple):
        nh, nkv, hd = geo

        def cut(buf, heads):
            return buf.reshape(-1)[:T * heads * hd].reshape(T, heads, hd)
        self.q, self.k, self.v, self.attn = cut(a["q"], nh), cut(a["k"], nkv), cut(a["v"], nkv), cut(a["attn"], nh)
        self.q2, self.k2, self.v2 = self.q.reshape(T, nh * hd), self.k.reshape(T, nkv * hd), self.v.reshape(T, nkv * hd)
        self.q_heads, self.k_heads = self.q.reshape(T * nh, hd), self.k.reshape(T * nkv, hd)
        self.v_heads = self.v.reshape(T * nkv, hd)
        self.attn2 = self.attn.reshape(T, nh * hd)
        self.gate2 = a["attn_gate"].reshape(-1)[:T * nh * hd].reshape(T, nh * hd) if "attn_gate" in a else None


class StepViews:
    """The arena's buffers cut to a step of T tokens and `nrows` logit rows: made once per shape."""

    def __init__(self, a: dict, inputs: dict, cfg: dict, k: int, pools: int, T: int, nrows: int,
                 fixed: int = 0, nseq: int = 0):
        self.T, self.nrows = T, nrows
        self.x, self.h, self.o = a["x"][:T], a["h"][:T], a["o"][:T]
        self.geo = {g: AttnViews(a, T, g) for g in geometries(cfg)}
        self.tok, self.pos, self.seq = inputs["tok"][:T], inputs["pos"][:T], inputs["seq"][:T]
        self.slots = [inputs[f"slots{p}"][:T] for p in range(pools)]
        self.tables = [inputs[f"tables{p}"] for p in range(pools)]
        self.router, self.ids, self.w = a["router"][:T], a["ids"][:T], a["w"][:T]
        self.gate_logit = a["gate_logit"][:T]
        self.y, self.scratch = a["y"][:T * k], a["scratch"][:T * k]
        self.y_dense, self.scratch_dense, self.zeros = a["y"][:T], a["scratch"][:T], a["zeros"][:T]
        self.pred_router, self.pred_ids, self.pred_w = a["pred_router"][:T], a["pred_ids"][:T], a["pred_w"][:T]
        self.rows, self.sel, self.logits = inputs["rows"][:nrows], a["sel"][:nrows], a["logits"][:nrows]
        self.mtp_h = a["mtp_h"][:T] if "mtp_h" in a else None     # the model's final-normed rows (MTP input)
        self.hrows = inputs["hrows"][:T] if "hrows" in inputs else None   # MTP step: each token's mtp_h row
        self.stepwise = False           # recurrent layers run every token by the recurrence (drafts' verification)
        self.dense_plan = None          # the 1-expert plan of shared experts and dense MLPs, per step
        self.lora = None                # the step's adapters (runtime/lora.py StepLora), or None
        self.mla = LatentViews(a, cfg, T) if cfg.get("latent_attention") else None
        self.attn_gate = a["attn_gate"][:T] if "attn_gate" in a else None
        self.lin = LinearViews(a, cfg, T) if fixed and cfg.get("linear_attention") else None
        self.sc = ShortConvViews(a, T) if fixed and cfg.get("short_conv") else None
        self.ssm = MambaViews(a, T) if fixed and cfg.get("mamba") else None
        self.ones = a["ones"][:T] if "ones" in a else None   # [T, 1] of 1.0 (router_input_scale)
        self.starts = inputs["starts"][:nseq + 1] if fixed else None    # sequences' token ranges, their state
        self.fslots = [inputs[f"fslots{p}"][:nseq] for p in range(fixed)]   # slot in each fixed pool


class LinearViews:
    """The gated delta-net's step buffers (arena "lin.*") cut to T tokens: the q|k|v projection and its
    conv, the output gate z, the decay / rate inputs a and b, the delta rule's output (as [T*Hv, dv] rows
    for the per-head gated norm)."""

    def __init__(self, a: dict, cfg: dict, T: int):
        la = cfg["linear_attention"]
        Hv, dv = la["num_value_heads"], la["value_head_dim"]
        self.qkv, self.conv, self.z, self.a, self.b, self.core = (a[f"lin.{n}"][:T] for n in
                                                                  ("qkv", "conv", "z", "a", "b", "core"))
        self.core_heads, self.z_heads = self.core.reshape(T * Hv, dv), self.z.reshape(T * Hv, dv)


class ShortConvViews:
    """LFM2's short-convolution step buffers (arena "sc.*") cut to T tokens: in_proj's b, c and x thirds
    and the conv's output."""

    def __init__(self, a: dict, T: int):
        self.b, self.c, self.x, self.conv = (a[f"sc.{n}"][:T] for n in ("b", "c", "x", "conv"))


class MambaViews:
    """Mamba-2's step buffers (arena "ssm.*") cut to T tokens: in_proj's z, x|B|C and dt parts, the conv's
    output and the scan's."""

    def __init__(self, a: dict, T: int):
        self.z, self.xbc, self.conv, self.dt, self.y = (a[f"ssm.{n}"][:T] for n in ("z", "xbc", "conv", "dt", "y"))


class LatentViews:
    """Latent attention's step buffers (arena "mla.*", rows only), cut to T tokens: 2-D [T, width] and
    the per-head 3-D views the rope, head_matmul and latent_attention ops take."""

    def __init__(self, a: dict, cfg: dict, T: int):
        la, nh = cfg["latent_attention"], cfg["num_attention_heads"]
        r, dn, dr, dv = la["kv_lora_rank"], la["qk_nope_head_dim"], la["qk_rope_head_dim"], la["v_head_dim"]
        self.qa = a["mla.qa"][:T]
        self.q_nope, self.q_rope, self.c, self.r = (a[f"mla.{n}"][:T] for n in ("q_nope", "q_rope", "c", "r"))
        self.q_lat, self.o_lat, self.o_v = (a[f"mla.{n}"][:T] for n in ("q_lat", "o_lat", "o_v"))
        self.q_nope3, self.q_rope3 = self.q_nope.reshape(T, nh, dn), self.q_rope.reshape(T, nh, dr)
        self.c3, self.r3 = self.c.reshape(T, 1, r), self.r.reshape(T, 1, dr)
        self.q_lat = self.q_lat.reshape(T, nh, r)
        self.o_lat = self.o_lat.reshape(T, nh, r)
        self.o_v3 = self.o_v.reshape(T, nh, dv)


# expert_slots="auto" keeps this share of the memory free for the engine unused (at least the minimum):
# the allocator's and Python's own growth, the page cache the slot loads pass through, other processes'
# small allocations. The free memory is measured at open, after the interpreter and the libraries are
# loaded (in a cgroup they are already charged): measured 2026-12-07 in a 600 MiB cgroup, the process's
# anonymous memory beside the slots and the arena was 22 MiB. (The floor was 128 MiB: in that cgroup it
# left 4 of the 19 slots that fit unused.)
AUTO_HEADROOM = 0.10
AUTO_HEADROOM_MIN = 32 << 20


class Runner:
    """Owns the weights on the backend, the arena and the per-sequence state; runs steps."""

    def __init__(self, model: ModelDir, backend, max_rows: int, max_batch: int,
                 max_seq_len: int, num_kv_blocks: int, block_size: int,
                 expert_slots: int | None = None, slot_policy: str = "lru", memory_budget: int | None = None,
                 kv_dtype: str = "float32", snapshots: int = 0, snapshot_every: int = 0, draft_states: bool = False,
                 mtp: bool = False):
        self.model, self.be, self.cfg = model, backend, model.config
        # mtp: the model's multi-token-prediction head runs (mtp_step): its layer's KV and buffers allocated
        self.mtp = bool(mtp)
        if self.mtp and not model.config.get("mtp"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{model.path}: the model has no MTP head")
        # draft_states: a copy of each sequence's recurrent state, taken before a step verifies its drafts
        # (speculative decoding on models with recurrent layers: the state to roll back to)
        self.draft_states = bool(draft_states)
        cfg = self.cfg
        self.max_rows, self.max_batch, self.max_seq_len = max_rows, max_batch, max_seq_len
        self.block_size = block_size
        from ..backends import require_kv_dtype
        require_kv_dtype(backend, kv_dtype)
        self.limits, self.states = layout(cfg, max_rows, max_batch, max_seq_len, num_kv_blocks, block_size, kv_dtype,
                                          snapshots, snapshot_every, self.mtp)
        self.top_k = arena.fan(cfg)
        self.spec = arena.buffers(cfg, self.limits)
        self.slot_choice = None
        if expert_slots == "auto":
            expert_slots = self._auto_slots(memory_budget)
        self._check_memory(expert_slots, memory_budget)
        self.slot_pool = None
        try:
            if expert_slots is not None:
                from .slots import SlotPool
                self.slot_pool = SlotPool(backend, model, expert_slots, slot_policy, top_k=self.top_k)
            backend.prepare(model.formats, max([cfg["hidden_size"], cfg["moe_intermediate_size"],
                                                 cfg["intermediate_size"], cfg["shared_expert_intermediate_size"]] +
                                                [nh * hd for nh, _, hd in geometries(cfg)] + latent_widths(cfg) +
                                                linear_widths(cfg)),
                            max_rows)
            self.program = program.build(model, backend, self.states.paged, resident=self.slot_pool is None,
                                         fixed_pools=self.states.fixed, mtp=self.mtp, max_seq_len=max_seq_len)
            self._alloc()
        except MemoryError:                 # what the check could not see (another process took it)
            raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"allocating the engine's memory failed: "
                               f"{self.need_text}; open it with smaller limits") from None
        self.steps = 0
        self.step_tokens = []            # tokens computed in each step (bounded window)
        self.hooks: list = []            # RoutingHook: traces, observers, the prefetch policy
        if self.slot_pool is not None and self.slot_pool.prefetch_hook is not None:
            self.hooks.append(self.slot_pool.prefetch_hook)
        self.ffn_context = program.FFNContext(self.be, self.plan_bufs, self.dense_plan, self.slot_pool,
                                              self.hooks, self.on_route)
        # the MTP head's layer: no hooks (traces and prefetch see the model's layers), experts resident
        self.mtp_context = program.FFNContext(self.be, self.plan_bufs, self.dense_plan, None, [], self.on_route)
        self.row_of = {}                 # id(seq) -> its first row in the last step (the MTP head's source rows)
        self._views = {}
        self.adapters = None             # run-time LoRA adapters (lora.Adapters), made at the first load

    # -- setup ------------------------------------------------------------------------------
    def _auto_slots(self, budget=None):
        """expert_slots="auto": as many slots as the memory free for the engine holds, after the
        non-expert weights, the arena, the per-sequence state and a headroom of AUTO_HEADROOM of it (at
        least AUTO_HEADROOM_MIN); None (every expert resident, no pool) when all fit. Free: the smaller
        of what the backend reports (host: MemAvailable, the cgroup's limit, RLIMIT_AS) and the memory
        budget. Recorded in self.slot_choice, with the numbers."""
        from ..units import human
        avail, what = self.be.memory_available()
        if budget is not None and budget < avail:
            avail, what = budget, "the engine's memory budget"
        fixed = {"non-expert weights": self.resident_weight_bytes(),
                 "arena": arena.nbytes(self.spec),
                 "KV cache": self.states.nbytes()}
        headroom = max(int(AUTO_HEADROOM * avail), AUTO_HEADROOM_MIN)
        blob = max(e.weight_size for e in self.model.experts)
        n_all = len(self.model.experts)
        room = avail - sum(fixed.values()) - headroom
        n = max(room, 0) // blob
        text = (f"{human(avail)} free ({what}) - " + " - ".join(f"{k} {human(v)}" for k, v in fixed.items()) +
                f" - headroom {human(headroom)} = {human(max(room, 0))}, experts of {human(blob)}")
        if n >= n_all:
            self.slot_choice = {"slots": None, "why": f"all {n_all} experts fit: {text}"}
            return None
        if n < self.top_k:
            raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"expert_slots=auto: {text}: room for {n} expert slots, "
                               f"fewer than the {self.top_k} a token needs; free memory, lower max_batch / "
                               "prefill_chunk / kv_cache_tokens, or route fewer experts per token (top_k)")
        self.slot_choice = {"slots": int(n), "why": f"{n} of {n_all} experts: {text}"}
        return int(n)

    def resident_weight_bytes(self) -> int:
        """The non-expert weights a run keeps in memory. On a backend that reads them from the memmap
        (not copies_weights), an embedding table that is not also the output head is read a row per
        token: it counts as the rows of max_batch x max_seq_len tokens, not the whole table (a 32000 x
        1024 float16 table is 62.5 MiB, its rows for a 128-token context 0.25 MiB); the page cache holds
        only the rows read."""
        t = self.model.tensors
        total = sum(r["nbytes"] for r in t.values())
        emb = t.get("embed_tokens")
        if emb is not None and "lm_head" in t and not self.be.copies_weights:
            rows = int(emb["shape"][0])
            used = min(rows, self.max_batch * self.max_seq_len)
            total -= emb["nbytes"] - emb["nbytes"] * used // rows
        return total

    def _check_memory(self, expert_slots, budget=None):
        """Everything the engine allocates at open, against what the backend has and the engine's
        memory budget (when given), before any of it."""
        from ..units import human
        be = self.be
        need = {"arena (max_batch, prefill_chunk)": arena.nbytes(self.spec),
                "KV cache (kv_cache_tokens)": self.states.nbytes()}
        if self.draft_states and self.states.fixed:
            need["recurrent state copies (draft)"] = self._draft_bytes()
        if expert_slots is not None:
            need["expert slots (expert_slots)"] = int(expert_slots) * max(e.weight_size for e in self.model.experts)
        if be.copies_weights:
            need["weights"] = sum(r["nbytes"] for r in self.model.tensors.values()) + \
                (0 if expert_slots is not None else sum(e.weight_size for e in self.model.experts))
        total = sum(need.values())
        self.need_text = f"{human(total)} (" + ", ".join(f"{k} {human(v)}" for k, v in need.items()) + ")"
        self.memory_need = total
        if budget is not None and total > budget:
            raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY,
                               f"opening this engine needs {self.need_text}, over its memory budget of "
                               f"{human(budget)}; give it a larger budget, or open it with a smaller max_batch, "
                               "prefill_chunk, kv_cache_tokens or expert_slots")
        avail, what = be.memory_available()
        if total > avail:
            raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY,
                               f"opening this engine needs {self.need_text}, but {what} leaves {human(avail)} on "
                               f"the {be.name} backend; open it with a smaller max_batch, prefill_chunk, "
                               "kv_cache_tokens or expert_slots")

    def _alloc(self):
        """The arena and the state storage: every buffer of the engine's life, allocated now."""
        be, spec = self.be, self.spec
        self.a = a = {name: be.alloc(shape, dtype) for name, (shape, dtype) in spec.items()}
        self.arena_bytes = arena.nbytes(spec)
        layout = arena.input_layout(self.limits)
        flat, self.h_inputs = a["inputs"], np.zeros(a["inputs"].shape, np.int32)
        self.inputs = {n: flat[o:o + math.prod(s)].reshape(s) for n, (o, s) in layout.items()}
        self.h = {n: self.h_inputs[o:o + math.prod(s)].reshape(s) for n, (o, s) in layout.items()}
        self.h_slots = [self.h[f"slots{p}"] for p in range(len(self.states.paged))]
        self.h_tables = [self.h[f"tables{p}"] for p in range(len(self.states.paged))]
        self.h_fslots = [self.h[f"fslots{p}"] for p in range(len(self.states.fixed))]
        if "ones" in a:
            be.upload_into(a["ones"], np.ones(a["ones"].shape, np.float32))
        self.plan_bufs = {n[5:]: buf for n, buf in a.items() if n.startswith("plan.")}
        self.dense_plan_bufs = {n[11:]: buf for n, buf in a.items() if n.startswith("dense_plan.")}
        # the state pools' storage, as each declares it (state.py buffers): a paged pool's tensors in its
        # kv_dtype (a float32 buffer, or a backends.base.KVCache), a fixed pool's float32
        pools = self.states.pools
        self.state_storage = {key: be.alloc_kv(parts, pools[key[0]].kv_dtype) if pools[key[0]].kind == "paged"
                              else be.alloc(*parts["data"]) for key, parts in self.states.buffers().items()}
        self.state_bytes = self.states.nbytes()
        for layer in self.program.layers + ([self.program.mtp.layer] if self.program.mtp else []):
            layer.mixer.bind(self.state_storage, layer.index)
        self.state_bytes_per_seq = sum(p.bytes_per_seq() for p in self.states.fixed)
        # the drafts' rollback copies: the first fixed pool's tensors, one slot per state slot
        self.kept = {key: be.alloc(*self.states.buffers()[key]["data"]) for key in self._fixed_storage()} \
            if self.draft_states and self.states.fixed else None
        for moe in self.program.moe + self._mtp_moe():
            moe.tally = a["expert_counts"][moe.index]

    def _mtp_moe(self) -> list:
        head = self.program.mtp
        return [p for p in head.layer.ffns if isinstance(p, program.MoE)] if head is not None else []

    # -- per-sequence state -----------------------------------------------------------------
    def new_sequence(self, seq_id):
        return self.states.new(seq_id)

    def reserve(self, seq, new_tokens: int):
        self.states.reserve(seq, new_tokens)

    def free(self, seq):
        self.states.release(seq)

    def _fixed_keys(self):
        """(fixed pool's storage key, snapshot pool's storage key) of every recurrent tensor."""
        states = self.states
        fi, si = states.pools.index(states.fixed[0]), states.pools.index(states.snapshots)
        return [((fi, *k), (si, *k)) for k in states.fixed[0].storage()]

    def _fixed_storage(self) -> list:
        """The storage keys of the (first) fixed pool's tensors: the recurrent state a step updates."""
        fi = self.states.pools.index(self.states.fixed[0])
        return [(fi, *k) for k in self.states.fixed[0].storage()]

    def _draft_bytes(self) -> int:
        return self.states.fixed[0].nbytes()

    def keep_state(self, seq):
        """Copy seq's recurrent state aside (before a step that verifies drafts; restore_kept undoes it)."""
        if self.kept is None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "drafting on a model with recurrent layers needs the "
                               "engine opened with draft='ngram' or 'auto' (it keeps a copy of each state)")
        slot = seq.slots[0]
        for key, copy in self.kept.items():
            self.be.copy_into(copy[slot], self.state_storage[key][slot])

    def restore_kept(self, seq):
        """seq's recurrent state back to the copy keep_state took."""
        slot = seq.slots[0]
        for key, copy in self.kept.items():
            self.be.copy_into(self.state_storage[key][slot], copy[slot])

    def restore(self, seq):
        """seq (reserved) starts from the snapshot adopt_prefix chose: copied into its fixed slot."""
        if seq.restore >= 0:
            slot = seq.slots[0]
            for fk, sk in self._fixed_keys():
                self.be.copy_into(self.state_storage[fk][slot], self.state_storage[sk][seq.restore])
            seq.restore = -1

    def snapshot(self, seq, h):
        """Copy seq's recurrent state (after its positions so far) into a snapshot named h."""
        snap = self.states.snapshots.take(h)
        if snap >= 0:
            slot = seq.slots[0]
            for fk, sk in self._fixed_keys():
                self.be.copy_into(self.state_storage[sk][snap], self.state_storage[fk][slot])

    @property
    def pool(self):
        """The KV pool of the full-attention layers."""
        return self.states.paged[0]

    # -- introspection ----------------------------------------------------------------------
    def expert_counts(self) -> np.ndarray:
        """[num_layers, E] int64: tokens routed to each expert so far (counted on the backend)."""
        cfg = self.cfg
        out = np.zeros((cfg["num_hidden_layers"], max(cfg["experts_per_layer"], 1)), np.int64)
        moe = self.program.moe
        if moe:
            dev = self.be.download(self.a["expert_counts"])
            for m in moe:
                out[m.layer] = dev[m.index]
        return out

    # -- the step ---------------------------------------------------------------------------
    def views(self, T, nrows, nseq=0) -> StepViews:
        fixed = len(self.states.fixed)
        key = (T, nrows, nseq if fixed else 0)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 512:
                self._views.clear()
            v = self._views[key] = StepViews(self.a, self.inputs, self.cfg, self.top_k, len(self.states.paged), T,
                                             nrows, fixed, nseq)
        return v

    def step(self, entries, all_logits=False, stepwise=False):
        """entries: list of (SeqState, token ids) whose state is reserved.
        Returns logits [rows, V] (a view into the arena, valid until the next step): every token's
        when all_logits, else each entry's last token's, in entry order; all_logits may also be one
        bool per entry (a scoring request's chunk beside decode rows). stepwise: recurrent layers run
        each sequence's tokens one at a time, as decode does (a verification of drafted tokens)."""
        T = sum(len(t) for _, t in entries)
        if T > self.max_rows or len(entries) > self.max_batch:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"step of {T} tokens / {len(entries)} sequences "
                               f"exceeds the arena ({self.max_rows} / {self.max_batch})")
        h = self.h
        h_tok, h_pos, h_seq, h_rows = h["tok"], h["pos"], h["seq"], h["rows"]
        given, lora = entries, None
        if self.adapters is not None and any(seq.adapter is not None for seq, _ in entries):
            # the tokens laid out by adapter (the base model's first, then each adapter's run: lora.py);
            # logit rows still in entry order
            entries = sorted(entries, key=lambda e: (e[0].adapter is not None, e[0].adapter or ""))
        first = {}                      # entry -> its first token's row in the step
        t = nrows = 0
        for s, (seq, toks) in enumerate(entries):
            n = len(toks)
            h_tok[t:t + n] = toks
            h_pos[t:t + n] = np.arange(seq.cached, seq.cached + n, dtype=np.int32) if n > 1 else seq.cached
            h_seq[t:t + n] = s
            for pool, slots, tables, tbl in zip(self.states.paged, self.h_slots, self.h_tables, seq.tables):
                B, row = pool.block_size, tables[s]
                row[:len(tbl)] = tbl
                if n > 1:
                    p = h_pos[t:t + n]
                    slots[t:t + n] = row[p // B] * B + p % B
                else:
                    slots[t] = tbl[seq.cached // B] * B + seq.cached % B
            first[id(seq)] = t
            if self.h_fslots:
                h["starts"][s + 1] = t + n
                for slots, slot in zip(self.h_fslots, seq.slots):
                    slots[s] = slot
            seq.cached += n
            t += n
        for s, (seq, toks) in enumerate(given):              # logit rows in the order the entries came
            t0, n = first[id(seq)], len(toks)
            if all_logits is True or (all_logits is not False and all_logits[s]):
                h_rows[nrows:nrows + n] = np.arange(t0, t0 + n) if n > 1 else t0
                nrows += n
            else:
                h_rows[nrows] = t0 + n - 1
                nrows += 1
        if entries is not given:
            runs, t0 = [], 0
            for seq, toks in entries:
                if runs and runs[-1][0] == seq.adapter:
                    runs[-1][2] += len(toks)
                else:
                    runs.append([seq.adapter, t0, t0 + len(toks)])
                t0 += len(toks)
            lora = self.adapters.step(runs, T)
        for hook in self.hooks:
            hook.begin_step(entries, h_pos[:T])
        self.be.begin_step()
        self.be.upload_into(self.a["inputs"], self.h_inputs)
        s = self.views(T, nrows, len(entries))
        s.lora, s.stepwise = lora, bool(stepwise)
        if lora is None and all_logits is False and nrows == T and not self.hooks and self.slot_pool is None:
            # a decode step (one token per sequence): a GPU backend captures it once per shape and
            # replays it (CUDA graphs); only when nothing needs the host inside the step
            self.be.graph_step(("decode", T, nrows), self._forward, s)
        else:
            self._forward(s)
        for hook in self.hooks:
            hook.end_step()
        self.row_of = first
        self.hidden = s.sel         # the final-normed hidden rows behind those logits [nrows, H] (embeddings)
        self.steps += 1
        self.step_tokens.append(T)
        if len(self.step_tokens) > 4096:
            del self.step_tokens[:2048]
        return s.logits

    def _forward(self, s: StepViews):
        be, prog = self.be, self.program
        eps = prog.eps
        s.dense_plan = None
        be.embed(s.x, prog.embed, s.tok)
        if prog.embed_scale != 1.0:
            be.scale(s.x, s.x, prog.embed_scale)
        for layer in prog.layers:
            program.norm(be, s.h, s.x, layer.input_norm, layer.input_norm_bias, eps)
            layer.mixer.forward(be, s)
            program.norm(be, s.h, s.x, layer.post_norm, layer.post_norm_bias, eps)
            for part in layer.ffns:
                part.forward(self.ffn_context, s)
            if layer.scalar != 1.0:
                be.scale(s.x, s.x, layer.scalar)
        if s.mtp_h is not None:                 # every row final-normed: the MTP head's input
            be.rmsnorm(s.mtp_h, s.x, prog.final_norm, eps)
        be.embed(s.sel, s.x, s.rows)            # gather the rows whose logits are wanted
        program.norm(be, s.sel, s.sel, prog.final_norm, prog.final_norm_bias, eps)
        be.matmul(s.logits, s.sel, prog.lm_head, prog.lm_head_bias)
        if prog.softcap:
            be.scale(s.logits, s.logits, 1.0, prog.softcap)

    # -- the MTP head -------------------------------------------------------------------------
    def mtp_step(self, entries, all_logits=False):
        """The MTP head (program.MTPHead) over entries [(seq, first position p0, tokens, source rows)]:
        token j of an entry sits at position p0 + j and is t_{p0+j+1}, the token after the one the model
        saw there; source row j is the mtp_h row holding the model's final-normed hidden at p0 + j (the
        last step's rows: row_of[id(seq)] + offset; after an mtp_step, row e holds entry e's last h', the
        input of a chained draft). Writes the head's KV at those positions (reserved: the sequence's
        length is not changed). -> logits [rows, V] of each entry's last token (every token's when
        all_logits), predicting t_{p+2}; a view into the arena, valid until the next step."""
        if not self.mtp:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "the engine was opened without the MTP head")
        T = sum(len(t) for _, _, t, _ in entries)
        if T > self.max_rows or len(entries) > self.max_batch:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"MTP step of {T} tokens / {len(entries)} sequences "
                               f"exceeds the arena ({self.max_rows} / {self.max_batch})")
        h = self.h
        t = nrows = 0
        for e, (seq, p0, toks, src) in enumerate(entries):
            n = len(toks)
            h["tok"][t:t + n] = toks
            p = np.arange(p0, p0 + n, dtype=np.int32)
            h["pos"][t:t + n] = p
            h["seq"][t:t + n] = e
            h["hrows"][t:t + n] = src
            for pool, slots, tables, tbl in zip(self.states.paged, self.h_slots, self.h_tables, seq.tables):
                B, row = pool.block_size, tables[e]
                if (p0 + n - 1) // B >= len(tbl):
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"MTP step up to position {p0 + n - 1}: the "
                                       "sequence holds no block there (reserve first)")
                row[:len(tbl)] = tbl
                slots[t:t + n] = row[p // B] * B + p % B
            if all_logits:
                h["rows"][nrows:nrows + n] = np.arange(t, t + n)
                nrows += n
            else:
                h["rows"][nrows] = t + n - 1
                nrows += 1
            t += n
        self.be.begin_step()
        self.be.upload_into(self.a["inputs"], self.h_inputs)
        s = self.views(T, nrows, len(entries))
        s.lora, s.stepwise = None, False
        self._mtp_forward(s)
        return s.logits

    def _mtp_forward(self, s: StepViews):
        be, prog = self.be, self.program
        head, eps = prog.mtp, prog.eps
        s.dense_plan = None
        be.embed(s.x, head.embed, s.tok)
        if prog.embed_scale != 1.0:
            be.scale(s.x, s.x, prog.embed_scale)
        be.rmsnorm(s.h, s.x, head.enorm, eps)
        be.matmul(s.x, s.h, head.e_proj)             # x = e_proj enorm(e)
        be.embed(s.o, self.a["mtp_h"], s.hrows)      # the model's hidden rows
        be.rmsnorm(s.h, s.o, head.hnorm, eps)
        be.matmul(s.o, s.h, head.h_proj)
        be.add(s.x, s.x, s.o)                        #   + h_proj hnorm(h)
        layer = head.layer
        be.rmsnorm(s.h, s.x, layer.input_norm, eps)
        layer.mixer.forward(be, s)
        be.rmsnorm(s.h, s.x, layer.post_norm, eps)
        for part in layer.ffns:
            part.forward(self.mtp_context, s)
        if layer.scalar != 1.0:
            be.scale(s.x, s.x, layer.scalar)
        be.embed(s.sel, s.x, s.rows)
        be.rmsnorm(s.sel, s.sel, head.norm, eps)     # h' (a chained draft's input)
        be.matmul(s.logits, s.sel, head.head)
        if prog.softcap:
            be.scale(s.logits, s.logits, 1.0, prog.softcap)
        be.copy_into(self.a["mtp_h"][:s.nrows], s.sel)

    def dense_plan(self, s: StepViews):
        """The plan that sends every token to expert 0: how shared experts and dense MLPs run."""
        if s.dense_plan is None:
            s.dense_plan = self.be.align(self.dense_plan_bufs, s.zeros, s.T, 1, 1)
        return s.dense_plan

    # -- the routing hook -------------------------------------------------------------------
    def on_route(self, moe, s: StepViews):
        """Every hook sees this layer's routing; returns the prefetch prediction (next layer,
        unique host expert ids) when a hook asked for it, else None."""
        pred = None
        if moe.next_router is not None and any(hk.wants_prediction for hk in self.hooks):
            be = self.be
            be.matmul(s.pred_router, s.h, moe.next_router, moe.next_router_bias)
            moe.route(be, s.pred_ids, s.pred_w, s.pred_router, moe.next_choice_bias)
            pred, pred_w = be.download(s.pred_ids), be.download(s.pred_w)
            for hk in self.hooks:
                hk.on_prediction(moe.next_layer, pred, pred_w)
        for hk in self.hooks:
            hk.on_route(moe.layer, s.ids, s.w, moe.next_layer, pred)
        return None if pred is None else (moe.next_layer, likely_experts(pred, pred_w), np.unique(pred))
