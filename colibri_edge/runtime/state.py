"""Per-sequence state (DESIGN.md, "Memory"): one abstraction, with pool kinds.

    PagedPool   blocks of B token positions for a group of layers that share one block table per
                sequence (the full-attention layers; the sliding-window layers of one window W,
                latent-attention groups next). A token at position p lives in slot
                table[p // B] * B + p % B of every layer of the group. Blocks are handed out as a
                sequence grows and returned when it ends; a window pool also returns, before each
                step, the blocks wholly below the window of the step's first token (a token at p
                reads positions p-W+1..p), their table entries set to EVICTED: after a decode step
                a sequence holds at most ceil(W / B) + 1 blocks there, however long it grows.
    FixedPool   one fixed-size slot per sequence for a group of layers (recurrent state: conv and
                SSM / delta-rule state), taken when the sequence starts, returned when it ends.
    SnapshotPool  copies of a FixedPool's slot at whole-block prefix boundaries, named by the prefix
                hash of the block they close (prefix caching for recurrent layers: a recurrent state
                cannot be rewound, so a request resumes from the last snapshot at or before its match).
    States      an engine's pools: a sequence reserves in all of them at once (all or nothing), and
                running out of any is COLIBRI_ERR_OUT_OF_MEMORY for that sequence alone.
    SeqState    one sequence's place: its cached positions, a block table per paged pool, a slot per
                fixed pool.

A pool holds bookkeeping only; the storage is declared by the pool (`storage`: name -> shape per
layer; `buffers`: the buffers and element types that shape takes in the pool's kv_dtype, float32,
float16 or q8_0, backends.base.kv_parts) and allocated by the runner on the backend, so `colibri
inspect` sizes it from the same declaration (`nbytes`, `bytes_per_token`). Adding a kind means a
class with reserve / release / storage / buffers, and touches neither the other kinds nor the
request layer.
"""
from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import check_kv_dtype, kv_parts, kv_row_bytes
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY
from ..model.layerplan import geometry, is_linear, mtp_layers


@dataclass
class SeqState:
    seq_id: int
    cached: int = 0                                  # positions written (in every pool)
    tables: list = field(default_factory=list)       # per paged pool: block ids, in position order
    slots: list = field(default_factory=list)        # per fixed pool: the slot, or -1
    restore: int = -1                                # a snapshot to copy into its fixed slot once reserved
    owner: object = None                             # the request holding it (set at admission; traces)
    adapter: str | None = None                       # its LoRA adapter's name (runtime/lora.py), or None


class FreeList:
    """Free ids 0..n-1 as a stack, lowest id on top: reuse is deterministic and recently freed ids stay
    warm. Ids never handed out are implied (a high-water mark), so a pool of any size costs nothing
    until it is used."""

    def __init__(self, n: int):
        self.n, self._next, self._back = n, 0, []

    def __len__(self):
        return len(self._back) + self.n - self._next

    def __bool__(self):
        return len(self) > 0

    def pop(self) -> int:
        if self._back:
            return self._back.pop()
        self._next += 1
        return self._next - 1

    def append(self, i: int):
        self._back.append(i)


EVICTED = -1            # a window pool's table entry whose block was returned (never read again)


def block_hashes(tokens, block_size: int, prev: list | None = None, upto: int | None = None,
                 seed: bytes = b"colibri-kv") -> list:
    """The prefix hashes of the whole blocks of `tokens` (prefix caching): block j's hash covers its
    block_size token ids and, through the previous block's hash, every token before it, so equal
    hashes mean equal prefixes (BLAKE2b, 128 bits). prev: hashes already known for the first blocks
    (extended, not recomputed); upto: at most this many blocks; seed: what the first block's hash
    starts from (a LoRA adapter's own, so that its blocks are never another adapter's or the base's)."""
    out = list(prev or [])
    n = len(tokens) // block_size if upto is None else min(upto, len(tokens) // block_size)
    for j in range(len(out), n):
        h = hashlib.blake2b(out[-1] if out else seed, digest_size=16)
        h.update(np.asarray(tokens[j * block_size:(j + 1) * block_size], dtype=np.int32).tobytes())
        out.append(h.digest())
    return out


class PagedPool:
    """Blocks of `block_size` positions for `layers`, each layer storing `per_token` values per
    position and per tensor (`tensors`, e.g. ("k", "v"), each [num_blocks * B, *per_token]), or
    tensors of their own shapes (`shapes`: name -> per-token shape; latent attention's c and r), in
    `kv_dtype` (float32, float16 or q8_0: backends.base.kv_parts; each row of the last dimension, one
    position's head row, quantised on its own).
    window > 0: the layers attend to their last `window` positions only (blocks below are returned)."""
    kind = "paged"

    def __init__(self, name: str, layers, num_blocks: int, block_size: int, per_token: tuple = (),
                 tensors=("k", "v"), hint: str = "kv_cache_tokens", window: int = 0, shapes: dict | None = None,
                 kv_dtype: str = "float32"):
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.name, self.layers = name, tuple(layers)
        self.num_blocks, self.block_size, self.window = int(num_blocks), int(block_size), int(window)
        self.per_token, self.hint = tuple(per_token), hint
        self.shapes = dict(shapes) if shapes else {t: self.per_token for t in tensors}
        self.tensors = tuple(self.shapes)
        self._free = FreeList(self.num_blocks)
        self._refs = {}                 # block -> sequences holding it, for blocks held by more than one
        # prefix cache (States.publish / adopt_prefix): whole blocks named by the hash of their prefix;
        # a named block no sequence holds is idle: kept, and taken back (least recently used first)
        # only when the pool has no free block left
        self._block_of = {}             # prefix hash -> block
        self._hash_of = {}              # block -> prefix hash
        self._idle = collections.OrderedDict()     # idle named blocks, least recently used first
        self.evictions = 0

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take: free ones and idle cached ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        return len(self._block_of)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        b, _ = self._idle.popitem(last=False)          # the least recently used idle cached block
        del self._block_of[self._hash_of.pop(b)]
        self.evictions += 1
        return b

    def need(self, seq: SeqState, index: int, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(seq.tables[index]))

    def _stale(self, seq: SeqState, index: int) -> range:
        """Table indices of the blocks a window pool can return before the next step: wholly below
        the window of the position the step starts at (seq.cached), not already returned."""
        if not self.window:
            return range(0)
        lo = max(0, seq.cached - self.window + 1) // self.block_size
        table = seq.tables[index]
        end = first = min(lo, len(table))
        while first > 0 and table[first - 1] != EVICTED:     # returned blocks are a prefix of the table
            first -= 1
        return range(first, end)

    def held(self, seq: SeqState, index: int) -> int:
        """Blocks this sequence holds in the pool (shared ones included)."""
        return sum(b != EVICTED for b in seq.tables[index])

    def shortfall(self, seq, index, tokens) -> str | None:
        need = self.need(seq, index, tokens)
        if need <= self.free_blocks + len(self._stale(seq, index)):
            return None
        return (f"{self.name} pool exhausted: sequence {seq.seq_id} needs {need} more block(s) of "
                f"{self.block_size} tokens, {self.free_blocks} free of {self.num_blocks}; open the engine "
                f"with a larger {self.hint} or run fewer sequences at once")

    def grow(self, seq, index, tokens):
        table = seq.tables[index]
        for j in self._stale(seq, index):
            self._put(table[j])
            table[j] = EVICTED
        for _ in range(self.need(seq, index, tokens)):
            table.append(self._take())

    def release(self, seq, index):
        table = seq.tables[index]
        while table:
            self._put(table.pop())

    def _put(self, b):
        """Return block b (a holder let go of it): to the free list when it was the last."""
        if b != EVICTED:
            n = self._refs.pop(b, 1) - 1
            if n > 0:
                if n > 1:
                    self._refs[b] = n
            elif b in self._hash_of:
                self._idle[b] = None                   # kept for a later prefix match
            else:
                self._free.append(b)

    def publish(self, seq, index, hashes, start: int, replace: bool = False):
        """Name seq's whole blocks start..len(hashes)-1 by their prefix hashes (their positions are
        written and never written again). A hash already naming another block keeps that one, unless
        `replace`: then seq's block takes the name, and the other one, idle, goes back to the free list
        (a reply re-prefilled: its blocks as a prefill computes them replace decode's)."""
        table = seq.tables[index]
        for j in range(start, len(hashes)):
            b, h = table[j], hashes[j]
            if b == EVICTED or b in self._hash_of:
                continue
            old = self._block_of.get(h)
            if old is not None and replace:
                del self._hash_of[old]
                if old in self._idle:
                    del self._idle[old]
                    self._free.append(old)
                old = None
            if old is None:
                self._block_of[h] = b
                self._hash_of[b] = h

    def cached_prefix(self, hashes) -> int:
        """How many of the leading hashes name blocks this pool holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self._block_of:
            n += 1
        return n

    def blocks_of(self, hashes) -> list:
        """The blocks the (cached) hashes name."""
        return [self._block_of[h] for h in hashes]

    def install(self, hashes) -> list:
        """Name blocks for the hashes not cached here yet (sessions loaded from disk): each takes a
        free block (or evicts an idle one) and is left idle, named, for the caller to fill before the
        next step. -> [(position in hashes, block)] of the blocks to fill. The caller checks room
        first (free_blocks)."""
        out = []
        for j, h in enumerate(hashes):
            if h in self._block_of:
                b = self._block_of[h]
                if b in self._idle:
                    self._idle.move_to_end(b)           # used again: the most recently used
                continue
            b = self._take()
            self._block_of[h], self._hash_of[b] = b, h
            self._idle[b] = None
            out.append((j, b))
        return out

    def needed_from(self, n: int) -> int:
        """The first of n whole blocks a sequence continuing after them reads: 0, or for a window pool
        the first block of the window of position n * block_size (the ones below were returned)."""
        if not self.window:
            return 0
        return max(0, n * self.block_size - self.window + 1) // self.block_size

    def holds(self, hashes, n: int) -> bool:
        """Whether this pool holds what a continuation after the first n hashed blocks reads."""
        return all(h in self._block_of for h in hashes[self.needed_from(n):n])

    def adopt(self, dst, index, hashes):
        """dst (empty) holds the named blocks of `hashes` (those it reads cached here; a window pool's
        below the window are EVICTED in its table): an idle one becomes dst's, a held one is shared
        (read-only, as share() does)."""
        lo = self.needed_from(len(hashes))
        dst.tables[index].extend([EVICTED] * lo)
        for h in hashes[lo:]:
            b = self._block_of[h]
            if b in self._idle:
                del self._idle[b]
            else:
                self._refs[b] = self._refs.get(b, 1) + 1
            dst.tables[index].append(b)

    def can_share(self, src, index, tokens) -> bool:
        """Whether src still holds what a sequence continuing at position `tokens` reads (a window
        pool may have returned it)."""
        lo = max(0, tokens - self.window + 1) // self.block_size if self.window else 0
        return all(b != EVICTED for b in src.tables[index][lo:tokens // self.block_size])

    def share(self, src, dst, index, tokens):
        """dst (empty) holds src's first tokens // block_size blocks too (read-only: positions below
        `tokens` are never written again); each shared block goes back to the pool when its last
        holder releases it."""
        n = tokens // self.block_size
        shared = src.tables[index][:n]
        for b in shared:
            if b != EVICTED:
                self._refs[b] = self._refs.get(b, 1) + 1
        dst.tables[index][:] = list(shared)

    def storage(self) -> dict:
        """(layer, tensor) -> the logical shape [rows, *per_token] of the storage this pool needs."""
        rows = self.num_blocks * self.block_size
        return {(l, t): (rows, *shape) for l in self.layers for t, shape in self.shapes.items()}

    def buffers(self) -> dict:
        """(layer, tensor) -> its buffers in the pool's kv_dtype, name -> (shape, NumPy dtype)
        (backends.base.kv_parts): what the runner allocates."""
        return {key: kv_parts(shape, self.kv_dtype) for key, shape in self.storage().items()}

    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for parts in self.buffers().values() for s, d in parts.values())

    def bytes_per_token(self) -> int:
        """What one position costs in every layer of the pool: per tensor its rows (the per-token shape's
        leading dims) times kv_row_bytes of a row: 4 n (float32), 2 n (float16), n + 2 n / g (q8_0)."""
        return len(self.layers) * sum(math.prod(s[:-1]) * kv_row_bytes(s[-1], self.kv_dtype)
                                      for s in self.shapes.values())

    def usage(self) -> dict:
        u = {"kind": self.kind, "blocks": self.num_blocks, "free": self.free_blocks, "block_size": self.block_size,
             "cached": self.cached_blocks, "idle": len(self._idle)}
        if self.window:
            u["window"] = self.window
        return u


class FixedPool:
    """`num_slots` slots for `layers`, each layer storing tensors of the shapes in `per_seq`
    (name -> shape) per slot: [num_slots, *shape] float32."""
    kind = "fixed"

    def __init__(self, name: str, layers, num_slots: int, per_seq: dict, hint: str = "max_batch"):
        self.name, self.layers, self.num_slots = name, tuple(layers), int(num_slots)
        self.per_seq, self.hint = dict(per_seq), hint
        self._free = FreeList(self.num_slots)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def shortfall(self, seq, index, tokens) -> str | None:
        if seq.slots[index] >= 0 or self._free:
            return None
        return (f"{self.name} pool exhausted: sequence {seq.seq_id} needs a state slot, 0 free of "
                f"{self.num_slots}; open the engine with a larger {self.hint} or run fewer sequences at once")

    def grow(self, seq, index, tokens):
        if seq.slots[index] < 0:
            seq.slots[index] = self._free.pop()

    def release(self, seq, index):
        if seq.slots[index] >= 0:
            self._free.append(seq.slots[index])
            seq.slots[index] = -1

    def storage(self) -> dict:
        return {(l, t): (self.num_slots, *shape) for l in self.layers for t, shape in self.per_seq.items()}

    def buffers(self) -> dict:
        """(layer, tensor) -> {"data": (shape, float32)}: recurrent state stays float32."""
        return {key: {"data": (shape, np.dtype(np.float32))} for key, shape in self.storage().items()}

    def nbytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.storage().values())

    def bytes_per_seq(self) -> int:
        return 4 * len(self.layers) * sum(math.prod(s) for s in self.per_seq.values())

    def usage(self) -> dict:
        return {"kind": self.kind, "slots": self.num_slots, "free": self.free_slots}


# the chunked delta rule's chunk (every backend's prefill form: reference.DELTA_CHUNK, the cuda DEFINES):
# a prefill that starts at a multiple of it cuts the same chunks as one from position 0, so snapshots
# are taken at multiples of lcm(block, DELTA_CHUNK) and a resumed prefill equals a fresh one bit for bit
DELTA_CHUNK = 16


class SnapshotPool:
    """`num_slots` snapshots of the recurrent state (the FixedPool `of`'s per-sequence tensors, for its
    layers): [num_slots, *shape] float32 per layer and tensor, each snapshot named by the prefix hash of
    the whole block its position closes (block_hashes), taken back least recently used first.

    Where snapshots are taken (Core, requests/scheduler.py): during prefill, at every multiple of
    `every` tokens and at the last multiple of `align` (lcm of the block size and DELTA_CHUNK) before
    a prompt's last token (the prefill is cut there), so the next turn of a conversation, whose
    prompt extends this one, resumes from it. Only
    prefill writes them: a state computed token by token (decode) differs in rounding from the chunked
    form a fresh prefill uses, and a resumed request must equal a fresh one bit for bit.
    A snapshot costs bytes_per_snapshot() (the same as a sequence's slot): Qwen3.5-35B-A3B's shape,
    30 gated delta-net layers x (conv 3 x 8192 + state 32 x 128 x 128) float32 = 65.9 MB."""
    kind = "snapshot"

    def __init__(self, name: str, of: FixedPool, num_slots: int, every: int, align: int):
        self.name, self.layers, self.per_seq = name, of.layers, dict(of.per_seq)
        self.num_slots, self.every, self.align = int(num_slots), int(every), int(align)
        self._free = FreeList(self.num_slots)
        self._slot_of = {}                               # prefix hash -> slot
        self._lru = collections.OrderedDict()            # slot -> its hash, least recently used first
        self.taken = self.restored = self.evictions = 0

    def find(self, hashes, n: int) -> int:
        """The largest m <= n whose prefix hashes[:m] closes at a snapshot (0: none)."""
        while n and hashes[n - 1] not in self._slot_of:
            n -= 1
        return n

    def slot_of(self, h) -> int:
        slot = self._slot_of[h]
        self._lru.move_to_end(slot)                      # used again: the most recently used
        return slot

    def take(self, h) -> int:
        """A slot for the snapshot named h, to be written now; -1 when h is held already."""
        if h in self._slot_of or not self.num_slots:
            return -1
        if self._free:
            slot = self._free.pop()
        else:
            slot, old = self._lru.popitem(last=False)
            del self._slot_of[old]
            self.evictions += 1
        self._slot_of[h], self._lru[slot] = slot, h
        self.taken += 1
        return slot

    def storage(self) -> dict:
        return {(l, t): (self.num_slots, *shape) for l in self.layers for t, shape in self.per_seq.items()}

    def buffers(self) -> dict:
        """(layer, tensor) -> {"data": (shape, float32)}, as the FixedPool it copies."""
        return {key: {"data": (shape, np.dtype(np.float32))} for key, shape in self.storage().items()}

    def nbytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.storage().values())

    def bytes_per_snapshot(self) -> int:
        return 4 * len(self.layers) * sum(math.prod(s) for s in self.per_seq.values())

    def usage(self) -> dict:
        return {"kind": self.kind, "slots": self.num_slots, "held": len(self._slot_of), "every": self.every,
                "taken": self.taken, "restored": self.restored, "evictions": self.evictions}


class States:
    """The per-sequence state pools of one engine."""

    def __init__(self, pools, max_seq_len: int, prefix_cache: bool = True):
        self.pools = list(pools)
        self.paged = [p for p in self.pools if p.kind == "paged"]
        self.fixed = [p for p in self.pools if p.kind == "fixed"]
        snaps = [p for p in self.pools if p.kind == "snapshot" and p.num_slots]
        self.snapshots = snaps[0] if snaps else None
        self.max_seq_len = max_seq_len
        kinds = {p.kv_dtype for p in self.paged}
        if len(kinds) > 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"paged pools of several kv_dtypes {sorted(kinds)}")
        self.kv_dtype = kinds.pop() if kinds else "float32"      # the paged pools' storage type
        # prefix caching: whole blocks of every paged pool named by their prefix hash (a sliding-window
        # pool's only while they are in some sequence's window, or idle since); fixed per-sequence
        # state (recurrent layers) only through snapshots (SnapshotPool)
        sizes = {p.block_size for p in self.paged}
        ok = len(sizes) == 1 and (not self.fixed or (len(self.fixed) == 1 and self.snapshots is not None))
        self.prefix_block = sizes.pop() if prefix_cache and ok else 0

    def longest_prefix(self, hashes) -> int:
        """How many leading blocks of `hashes` a new sequence can start from: every full pool holds
        them, every window pool what a continuation after them reads, and (recurrent layers) a
        snapshot closes them."""
        full = [p for p in self.paged if not p.window]
        n = min(p.cached_prefix(hashes) for p in full) if full else len(hashes)
        snap = self.snapshots if self.fixed else None
        while n:
            if snap is not None:
                n = snap.find(hashes, n)        # a recurrent state resumes from a snapshot only
            if not n or all(p.holds(hashes, n) for p in self.paged if p.window):
                break
            n -= 1                              # a window pool lacks what a continuation there reads
        return n

    def adopt_prefix(self, dst: SeqState, hashes) -> int:
        """dst (new, empty) starts with the longest prefix of `hashes` every paged pool holds: its
        blocks, shared, not recomputed. Returns the positions dst now holds."""
        if not self.prefix_block or dst.cached or not hashes:
            return 0
        n = self.longest_prefix(hashes)
        if not n:
            return 0
        for i, p in enumerate(self.paged):
            p.adopt(dst, i, hashes[:n])
        snap = self.snapshots if self.fixed else None
        if snap is not None:
            dst.restore = snap.slot_of(hashes[n - 1])
            snap.restored += 1
        dst.cached = n * self.prefix_block
        return dst.cached

    def snapshot_point(self, pos: int, end: int) -> int:
        """The first position after pos where a prefill of positions up to `end` stops for a snapshot
        (a multiple of the pool's `every`, or the last multiple of its `align` short of end, the
        prompt's last token), or 0 when none comes before end."""
        snap = self.snapshots
        if snap is None or not self.fixed or not self.prefix_block:
            return 0
        cut = (end - 1) // snap.align * snap.align
        nxt = (pos // snap.every + 1) * snap.every if snap.every else cut
        p = min(nxt, cut) if cut > pos else nxt
        return p if pos < p < end else 0

    def publish(self, seq: SeqState, hashes, start: int = 0, replace: bool = False):
        """seq's whole blocks start.. (written, final) named by `hashes` in every paged pool."""
        if self.prefix_block:
            for i, p in enumerate(self.paged):
                p.publish(seq, i, hashes, start, replace)

    def new(self, seq_id: int) -> SeqState:
        return SeqState(seq_id, tables=[[] for _ in self.paged], slots=[-1] * len(self.fixed))

    def reserve(self, seq: SeqState, new_tokens: int):
        """Make room for `new_tokens` more positions in every pool, all or nothing."""
        total = seq.cached + new_tokens
        if total > self.max_seq_len:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"sequence of {total} tokens is longer than max_seq_len={self.max_seq_len}; "
                               "open the engine with a larger max_seq_len or shorten the input")
        kinds = [(p, i) for i, p in enumerate(self.paged)] + [(p, i) for i, p in enumerate(self.fixed)]
        for p, i in kinds:
            why = p.shortfall(seq, i, total)
            if why is not None:
                raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, why)
        for p, i in kinds:
            p.grow(seq, i, total)

    def share_prefix(self, src: SeqState, dst: SeqState, tokens: int) -> int:
        """dst (new, empty) starts with src's cached prefix: the whole blocks of its first `tokens`
        positions, shared, not copied. Returns the positions dst now holds (a multiple of every paged
        pool's block size), 0 when a pool cannot share (fixed per-sequence state: recurrent layers)."""
        if self.fixed or dst.cached or tokens > src.cached:
            return 0
        step = math.lcm(*[p.block_size for p in self.paged]) if self.paged else 0
        n = tokens // step * step if step else 0
        if n == 0 or not all(p.can_share(src, i, n) for i, p in enumerate(self.paged)):
            return 0
        for i, p in enumerate(self.paged):
            p.share(src, dst, i, n)
        dst.cached = n
        return n

    def release(self, seq: SeqState):
        for i, p in enumerate(self.paged):
            p.release(seq, i)
        for i, p in enumerate(self.fixed):
            p.release(seq, i)
        seq.cached, seq.restore = 0, -1

    def storage(self) -> dict:
        """(pool index, layer, tensor) -> shape, for every pool."""
        return {(j, *key): shape for j, p in enumerate(self.pools) for key, shape in p.storage().items()}

    def buffers(self) -> dict:
        """(pool index, layer, tensor) -> its buffers, name -> (shape, dtype), for every pool."""
        return {(j, *key): parts for j, p in enumerate(self.pools) for key, parts in p.buffers().items()}

    def nbytes(self) -> int:
        """Bytes of every pool's storage: what the runner allocates for them."""
        return sum(p.nbytes() for p in self.pools)

    def usage(self) -> dict:
        return {p.name: p.usage() for p in self.pools}


def attention_pools(cfg: dict, num_blocks: int, block_size: int, kv_dtype: str = "float32", mtp: bool = False) -> list:
    """The pools a model's layer plan needs: a paged KV cache of K and V [Hkv, D] per position for
    the full-attention layers (first: the engine's `pool`), and one for the sliding-window layers
    (config layer_types, sliding_window) when there are any; layers of another attention geometry
    (Gemma 4's full layers: their own head_dim and KV heads) get a pool of their own. Each has
    num_blocks blocks: a window pool's sequences hold at most ceil(W / B) + 1 of them between steps.
    Latent attention (every layer): one pool of the latent c [1, kv_lora_rank] and the rope key r
    [1, qk_rope_head_dim] per position: (kv_lora_rank + qk_rope_head_dim) values per token and layer,
    not heads x (k + v) dims. Every pool stores kv_dtype (PagedPool). mtp: the MTP head's layer (a full
    attention layer) has its KV in the full-attention pool too, at the same positions as the model's."""
    la = cfg.get("latent_attention")
    specs = list(cfg["layers"]) + (mtp_layers(cfg) if mtp else [])
    if la:
        return [PagedPool("latent KV cache", [l["layer_id"] for l in specs], num_blocks, block_size,
                          shapes={"c": (1, la["kv_lora_rank"]), "r": (1, la["qk_rope_head_dim"])}, kv_dtype=kv_dtype)]
    types = cfg.get("layer_types") or ["full_attention"] * len(cfg["layers"])
    groups = {}                                     # (window, per-token shape) -> layers, full layers first
    for full in (True, False):
        for l in specs:
            if is_linear(cfg, l):
                continue
            if (l["layer_id"] >= len(types) or types[l["layer_id"]] in ("full_attention", "chunked_attention")) == full:
                _, nkv, hd = geometry(cfg, l)
                groups.setdefault((0 if full else cfg["sliding_window"], (nkv, hd)), []).append(l["layer_id"])
    pools = []
    for (W, per), layers in groups.items():
        name = "KV cache" + (f" (window {W})" if W else "") + (f" [{per[0]}x{per[1]}]" if pools and
                                                            any(p.window == W for p in pools) else "")
        pools.append(PagedPool(name, layers, num_blocks, block_size, per, window=W, kv_dtype=kv_dtype))
    return pools


def recurrent_pool(cfg: dict, num_slots: int) -> FixedPool | None:
    """The fixed-size state of the recurrent layers (layer_types "linear_attention": gated delta-nets), one
    slot per sequence for all of them: per layer the conv's last K-1 inputs [K-1, C] (C = 2 Hk dk + Hv dv
    channels) and the delta rule's state [Hv, dk, dv]; LFM2's short convolutions (layer_types "short_conv")
    keep only their conv's last K-1 inputs [K-1, H]; Mamba-2 layers (layer_types "mamba") the conv's last K-1
    inputs [K-1, nh P + 2 G N] and the scan's state [nh, P, N]. None when the model has no recurrent layer."""
    la, mb = cfg.get("linear_attention"), cfg.get("mamba")
    layers = [l["layer_id"] for l in cfg["layers"] if is_linear(cfg, l)]
    if mb and layers:
        nh, P, G, N = (mb[k] for k in ("num_heads", "head_dim", "n_groups", "state_size"))
        return FixedPool("recurrent state", layers, num_slots,
                         {"conv": (mb["conv_kernel"] - 1, nh * P + 2 * G * N), "ssm": (nh, P, N)})
    if cfg.get("short_conv") and layers:
        return FixedPool("recurrent state", layers, num_slots,
                         {"conv": (cfg["short_conv"]["conv_kernel"] - 1, cfg["hidden_size"])})
    if not la or not layers:
        return None
    Hk, Hv, dk, dv = (la[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    return FixedPool("recurrent state", layers, num_slots,
                     {"conv": (la["conv_kernel"] - 1, 2 * Hk * dk + Hv * dv), "ssm": (Hv, dk, dv)})


def state_pools(cfg: dict, num_blocks: int, block_size: int, num_slots: int, kv_dtype: str = "float32",
                snapshots: int = 0, snapshot_every: int = 0, mtp: bool = False) -> list:
    """Every per-sequence state pool of a model: the paged KV pools (attention_pools, in kv_dtype), then
    the recurrent layers' fixed slots (num_slots of them: the engine gives max_batch, the sequences that
    run at once; float32) and `snapshots` snapshots of them for prefix caching (SnapshotPool: at every
    snapshot_every tokens of a prefill, rounded up to a multiple of lcm(block_size, DELTA_CHUNK);
    0: only at prompts' last such boundaries)."""
    pools = attention_pools(cfg, num_blocks, block_size, kv_dtype, mtp)
    fixed = recurrent_pool(cfg, num_slots)
    if fixed is None:
        return pools
    align = math.lcm(block_size, DELTA_CHUNK)
    return pools + [fixed] + ([SnapshotPool("recurrent snapshots", fixed, snapshots,
                                            -(-snapshot_every // align) * align, align)] if snapshots else [])
