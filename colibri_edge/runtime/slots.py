"""The expert slot pool (DESIGN.md, "Memory"): N expert slots shared by all layers, keyed by
(layer, expert). The kernels read expert weights from the slots only.

Two halves, so the simulator replays a trace through exactly the engine's decisions:
  SlotCache  policy and accounting only (no data): which slot each access gets, what it evicts,
             hits / misses / prefetch hits / bytes / evictions.  `colibri simulate` runs it alone.
  SlotPool   SlotCache + the data movement on a backend (copy a blob into a slot, asynchronously
             for prefetch).

Access order, in both: step by step, within a step the MoE layers in order, within a layer the union
of the step's experts in ascending id. A layer's experts stay pinned while it runs; when it needs
more experts than there are slots it runs in waves of at most N experts.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL
from .hooks import RoutingHook
from ..model.modeldir import WEIGHTS_FILE

POLICIES = ("lru", "lfu", "prefetch", "belady")
ENGINE_POLICIES = ("lru", "lfu", "prefetch")


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0            # demand misses: the step waits for the load (they stall)
    cold_misses: int = 0       # demand misses of an expert never loaded before (its first read from storage;
                               # the others re-read a blob that was in a slot once: a cache under the page
                               # cache, a VM host's or a drive's, may still hold it)
    prefetch_hits: int = 0     # hits on an expert that prefetch brought in
    bytes_loaded: int = 0
    evictions: int = 0
    prefetches: int = 0        # loads issued by prefetch

    def as_dict(self):
        d = dict(self.__dict__)
        total = self.hits + self.misses
        d["hit_rate"] = self.hits / total if total else 1.0
        return d


class SlotCache:
    """Policy and accounting for N slots. Keys are (layer, expert) tuples.

    lru: evict the least recently used; lfu: the least frequently used (ties: least recent);
    prefetch: lru plus `prefetch()`; belady: evict the key whose next use is farthest (needs the
    future: `set_future(keys)` with the whole access sequence; offline, for the simulator)."""

    def __init__(self, num_slots: int, policy: str, blob_bytes: int):
        if policy not in POLICIES:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"slot policy {policy!r}: use one of {', '.join(POLICIES)}")
        if num_slots < 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"expert_slots={num_slots}: must be at least 1")
        self.n, self.policy, self.blob_bytes = num_slots, policy, blob_bytes
        self.where: dict = {}                        # key -> slot
        self.key_of = [None] * num_slots             # slot -> key
        self.recency: OrderedDict = OrderedDict()    # key -> None, least recent first
        self.freq: dict = {}
        self.prefetched: set = set()                 # resident because prefetch loaded them, not yet used
        self.c = Counters()
        self.loaded: set = set()                     # every key ever loaded (cold_misses)
        self._future = None                          # belady: key -> sorted positions of its uses
        self._t = 0                                  # belady: index into the access sequence

    # -- belady ---------------------------------------------------------------------------------
    def set_future(self, keys):
        self._future = {}
        for i, k in enumerate(keys):
            self._future.setdefault(k, []).append(i)
        self._ptr = {k: 0 for k in self._future}

    def _next_use(self, key):
        uses, p = self._future.get(key, []), self._ptr.get(key, 0)
        while p < len(uses) and uses[p] < self._t:
            p += 1
        self._ptr[key] = p
        return uses[p] if p < len(uses) else float("inf")

    # -- core -----------------------------------------------------------------------------------
    def _victim(self, pinned):
        free = [s for s, k in enumerate(self.key_of) if k is None]
        if free:
            return free[0]
        cands = [k for k in self.recency if k not in pinned]   # least recent first
        if not cands:
            return None
        if self.policy == "lfu":
            key = min(cands, key=lambda k: self.freq.get(k, 0))   # min keeps the least recent on ties
        elif self.policy == "belady":
            key = max(cands, key=self._next_use)                 # max keeps the least recent on ties
        else:
            key = cands[0]
        return self.where[key]

    def _install(self, key, slot):
        old = self.key_of[slot]
        if old is not None:
            del self.where[old]
            self.recency.pop(old, None)
            self.prefetched.discard(old)
            self.c.evictions += 1
        self.key_of[slot] = key
        self.where[key] = slot
        self.loaded.add(key)
        self.recency[key] = None
        self.c.bytes_loaded += self.blob_bytes

    def _touch(self, key):
        self.recency.move_to_end(key)
        self.freq[key] = self.freq.get(key, 0) + 1

    def plan_layer(self, layer: int, experts, protect=frozenset()):
        """Experts of one layer (ascending) -> waves: lists of (expert, slot, hit). Every expert of a
        wave is resident together; misses of a wave must be loaded before it runs. protect: keys a miss
        evicts only when nothing else can go (the next layer's predicted experts, under prefetch)."""
        # the layer's resident experts are pinned from the start: a miss earlier in the layer must not
        # evict one that the layer is about to use (that would cost it a second load)
        waves, wave = [], []
        pinned = {(layer, int(e)) for e in experts if (layer, int(e)) in self.where}
        for e in experts:
            key = (layer, int(e))
            if key in self.where:
                self.c.hits += 1
                if key in self.prefetched:
                    self.c.prefetch_hits += 1
                    self.prefetched.discard(key)
                slot, hit = self.where[key], True
            else:
                slot = self._victim(pinned | protect) if protect else None
                if slot is None:
                    slot = self._victim(pinned)
                if slot is None:                  # every slot holds this wave: run it, start another
                    waves.append(wave)
                    wave, pinned = [], set()
                    slot = self._victim(pinned)
                self.c.misses += 1
                if key not in self.loaded:
                    self.c.cold_misses += 1
                self._install(key, slot)
                hit = False
            self._touch(key)
            self._t += 1
            pinned.add(key)
            wave.append((int(e), slot, hit))
        if wave:
            waves.append(wave)
        return waves

    def prefetch(self, layer: int, experts, pinned_layer: int, protect=()):
        """Bring `layer`'s likely experts in, never evicting experts of `pinned_layer` (running) nor any
        expert of `layer` in `protect` (every predicted one, also those not worth a load: evicting a
        resident expert the next layer will use costs a load the demand path would not have).
        -> list of (expert, slot) to load."""
        pinned = {k for k in self.where if k[0] == pinned_layer} | {(layer, int(x)) for x in experts} | \
            {(layer, int(x)) for x in protect}
        loads = []
        for e in experts:
            key = (layer, int(e))
            if key in self.where:
                continue
            slot = self._victim(pinned)
            if slot is None:
                break
            self._install(key, slot)
            # least recent: if the next layer does not use it after all, it is the first to go (a wrong
            # guess then costs its own load only); the next layer pins it while it runs
            self.recency.move_to_end(key, last=False)
            self.prefetched.add(key)
            self.c.prefetches += 1
            loads.append((int(e), slot))
        return loads

    def access_layer(self, layer: int, experts, prefetch=None):
        """One MoE layer of one step, the unit both the engine and the simulator replay:
        demand accesses for `experts` (ascending), then, when the layer fits in one wave, prefetch of
        prefetch=(next_layer, likely experts[, every predicted expert]). -> (waves, prefetch loads)."""
        protect = frozenset((prefetch[0], int(e)) for e in (prefetch[2] if len(prefetch) > 2 else prefetch[1])) \
            if prefetch is not None else frozenset()
        waves = self.plan_layer(layer, experts, protect)
        loads = self.prefetch(prefetch[0], prefetch[1], layer, prefetch[2] if len(prefetch) > 2 else ()) \
            if prefetch is not None and len(waves) == 1 else []
        return waves, loads


# Prefetch (policy "prefetch") uses layer L+1's predicted experts twice: while layer L loads its
# misses it evicts none of them when anything else can go (free, and it keeps experts about to be
# used), and after layer L it loads those that some token of the step is predicted to route to with
# weight >= PREFETCH_MIN_P. Measured on the demo model's trace (8 prompts + 64 tokens each, 32 experts,
# `colibri simulate`, bytes moved / stalled misses): lru 1.312 GiB / 2388 at 12 slots; loading every
# predicted expert, unprotected, 1.680 GiB / 1200 (each wrong guess is a load plus an eviction);
# protected, min_p 0.5: 1.343 / 1616, 0.6: 1.315 / 1698, 0.7: 1.290 / 1769, 0.8: 1.280 / 1868.
# 0.7 is the lowest threshold that moves no more bytes than lru at 12, 16 and 24 slots (16: 0.889 vs
# 0.901 GiB, 1199 vs 1640 stalls; 24: 0.349 vs 0.353, 460 vs 642); at 8 slots, the decode working
# set itself, prefetch still moves more (1.505 vs 1.438 GiB) for 2109 vs 2618 stalls.
PREFETCH_MIN_P = 0.7


def likely_experts(pred_ids: np.ndarray, pred_w: np.ndarray | None, min_p: float = PREFETCH_MIN_P) -> np.ndarray:
    """The experts worth prefetching, ascending: those some token of the step is predicted to route to
    with weight >= min_p (pred_ids / pred_w [T,k]). pred_w None (a trace without weights): all."""
    ids = np.asarray(pred_ids, np.int64).reshape(-1)
    if pred_w is None:
        return np.unique(ids)
    w = np.asarray(pred_w, np.float32).reshape(-1)
    return np.unique(ids[w >= np.float32(min_p)])


class PrefetchHook(RoutingHook):
    """The prefetch policy's hook: asks for layer L+1's predicted experts (the scheduler hands the
    prediction to run_layer)."""
    wants_prediction = True


def _mlock(arr) -> str:
    """Lock a host slot buffer in memory (mlock), so that the kernel cannot page hot experts out behind
    the pool's back. -> "locked", or why not (no host buffer; the limit: RLIMIT_MEMLOCK / CAP_IPC_LOCK)."""
    if arr is None or arr is False:
        return "not locked: the slots are device memory"
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.mlock(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(arr.nbytes)) == 0:
            return "locked"
        return f"not locked: mlock failed ({os.strerror(ctypes.get_errno())}; raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK)"
    except (OSError, AttributeError) as err:
        return f"not locked: {err}"


class SlotPool:
    """SlotCache + data: N slots of one expert blob each in the backend's memory."""

    def __init__(self, backend, model, num_slots: int, policy: str):
        cfg = model.config
        if policy not in ENGINE_POLICIES:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"slot policy {policy!r}: the engine runs "
                               f"{', '.join(ENGINE_POLICIES)} (belady needs the future: use `colibri simulate`)")
        self.be, self.model = backend, model
        self.H, self.I = cfg["hidden_size"], cfg["moe_intermediate_size"]
        # one slot holds any layer's expert: sized by the largest blob (layers may differ in formats)
        self.blob_bytes = max(e.weight_size for e in model.experts)
        self.cache = SlotCache(num_slots, policy, self.blob_bytes)
        self.buf = backend.alloc_slots(num_slots, self.blob_bytes)
        self._path = os.path.join(model.path, WEIGHTS_FILE)
        self._fd = os.open(self._path, os.O_RDONLY)
        self._tls = threading.local()               # per-thread staging buffers (device slots)
        self.reads = self.read_bytes = 0
        self.locked = _mlock(backend.slot_host_view(self.buf, 0) is not None and self.buf)
        self._views = {}                            # (slot, formats) -> the FFN viewing that slot
        self._pending: dict = {}                    # slot -> Future of a prefetch copy
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-prefetch") \
            if policy == "prefetch" else None
        self.prefetch_hook = PrefetchHook() if policy == "prefetch" else None

    @property
    def counters(self) -> Counters:
        return self.cache.c

    def _load(self, layer, e, slot):
        """A miss (or a prefetch): the expert's blob read from the weights file with one positioned read
        of its whole size, straight into the slot where the slot is host memory (cpu, reference), else
        into this thread's staging buffer and on to the device; its pages then dropped from the page
        cache (posix_fadvise DONTNEED), so that streaming does not grow the page cache: the slots are
        the engine's copy. Not through the memmap: under memory pressure its page faults read 4 KiB at
        a time (measured on this machine's storage, README: 26 MB/s against 0.8-1 GB/s for large
        reads)."""
        rec = self.model.expert_record(layer, e)
        dst = self.be.slot_host_view(self.buf, slot)
        staged = dst is None
        if staged:
            dst = getattr(self._tls, "staging", None)
            if dst is None:
                dst = self._tls.staging = self.be.alloc_staging(self.blob_bytes)
        n = rec.weight_size
        view = memoryview(dst)[:n]
        done = 0
        while done < n:                             # pread may return short
            got = os.preadv(self._fd, [view[done:]], rec.weight_offset + done)
            if got <= 0:
                raise ColibriError(COLIBRI_ERR_INVALID_MODEL, f"{self._path}: expert {e} of layer {layer} ends "
                                   f"past the end of the file (offset {rec.weight_offset}, {n} bytes)")
            done += got
        if n < self.blob_bytes:                     # a smaller layer's expert: the slot's tail is unused
            dst[n:] = 0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, rec.weight_offset, n, os.POSIX_FADV_DONTNEED)
        self.reads += 1
        self.read_bytes += n
        if staged:
            self.be.load_slot(self.buf, slot, dst)

    def ffn(self, slot, layer):
        """The FFN reading slot `slot` as an expert of `layer` (its formats)."""
        fm = self.model.layer_formats[layer]
        v = self._views.get((slot, fm))
        if v is None:
            v = self._views[(slot, fm)] = self.be.slot_ffn(self.buf, slot, self.H, self.I, fm)
        return v

    def _wait(self, slot):
        fut = self._pending.pop(slot, None)
        if fut is not None:
            fut.result()

    def waves(self, layer, experts, prefetch=None):
        """Yields waves, each a list of (expert, FFN in its slot), after loading the wave's misses.
        A generator: a later wave may reuse an earlier wave's slots, so run each before the next.
        prefetch=(next_layer, likely experts): loaded on the prefetch thread while this layer runs
        (only when the layer fits in one wave: then no slot of this layer is touched)."""
        plan, loads = self.cache.access_layer(layer, experts, prefetch)
        for i, wave in enumerate(plan):
            for e, slot, hit in wave:
                self._wait(slot)                    # a prefetch into this slot must land first
                if not hit:
                    self._load(layer, e, slot)
            if i == 0:
                for e, slot in loads:               # overlap the next layer's loads with this one
                    self._wait(slot)
                    self._pending[slot] = self._pool.submit(self._load, prefetch[0], e, slot)
            yield [(e, self.ffn(slot, layer)) for e, slot, _ in wave]

    def run_layer(self, moe, plan, s, prefetch):
        """grouped_ffn of one MoE layer from the slots, wave by wave (a wave = what fits in the slots)."""
        import dataclasses
        if self._pool is None:
            prefetch = None                          # a trace's prediction, but no prefetch policy
        active = np.asarray(plan.experts_to_run())
        experts = list(moe.experts)
        for wave in self.waves(moe.layer, active, prefetch):
            for e, ffn in wave:
                experts[e] = ffn
            sub = dataclasses.replace(plan, active=np.array([e for e, _ in wave], dtype=np.int64))
            self.be.grouped_ffn(s.y, s.h, experts, sub, s.scratch, moe.act)

    def resident_bytes(self) -> int:
        return sum(k is not None for k in self.cache.key_of) * self.blob_bytes

    def close(self):
        for s in list(self._pending):
            self._wait(s)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
