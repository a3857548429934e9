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
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: F401 -- Future: _submit's type
from dataclasses import dataclass

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL
from ..backends.base import PAGE, aligned_host  # noqa: F401 -- aligned_host: re-exported
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
    pinned: int = 0            # experts of the learned hot set loaded at open (never evicted; not misses)
    predicted: int = 0         # experts the lookahead predicted for a layer (every token's k, as a set)
    predicted_used: int = 0    # ... of which the layer then ran
    routed: int = 0            # experts run by layers that had a prediction

    def as_dict(self):
        d = dict(self.__dict__)
        total = self.hits + self.misses
        d["hit_rate"] = self.hits / total if total else 1.0
        # the lookahead predictor (layer L+1's router on layer L's MoE input): of the experts a layer
        # ran, the share predicted one layer ahead (recall), and of those predicted, the share run
        d["prediction_recall"] = self.predicted_used / self.routed if self.routed else None
        d["prediction_precision"] = self.predicted_used / self.predicted if self.predicted else None
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
        self.fixed: set = set()                      # the pinned hot set: never a victim
        self._predicted: dict = {}                   # layer -> the experts predicted for it (scored when it runs)

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
    def pin(self, keys) -> list:
        """The learned hot set: install `keys` (hottest first) into free slots for good -- never evicted,
        their accesses hits. At most n - 1 keys (one slot stays for everything else). -> [(key, slot)]
        to load."""
        out = []
        for key in keys:
            key = (int(key[0]), int(key[1]))
            if len(self.fixed) >= self.n - 1 or key in self.where:
                continue
            slot = self._victim(set())
            self._install(key, slot)
            self.c.bytes_loaded -= self.blob_bytes       # loaded at open: not a streaming cost
            self.fixed.add(key)
            self.c.pinned += 1
            out.append((key, slot))
        return out

    def drop(self, key):
        """Forget a key whose load failed: its slot holds nothing valid."""
        slot = self.where.pop(key, None)
        if slot is not None:
            self.key_of[slot] = None
            self.recency.pop(key, None)
            self.prefetched.discard(key)
            self.fixed.discard(key)
            self.loaded.discard(key)

    def _victim(self, pinned):
        free = [s for s, k in enumerate(self.key_of) if k is None]
        if free:
            return free[0]
        pinned = pinned | self.fixed if self.fixed else pinned
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
        pred = self._predicted.pop(layer, None)
        if pred is not None:                         # score the lookahead made for this layer
            run = {int(e) for e in experts}
            self.c.predicted += len(pred)
            self.c.predicted_used += len(pred & run)
            self.c.routed += len(run)
        if prefetch is not None:
            self._predicted[prefetch[0]] = {int(e) for e in (prefetch[2] if len(prefetch) > 2 else prefetch[1])}
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




def io_threads_knob(explicit=None) -> int:
    from ..knobs import resolve
    return resolve("COLIBRI_IO_THREADS", explicit)


def direct_io_choice(path: str, explicit=None) -> tuple[bool, str]:
    """COLIBRI_DIRECT_IO: on, off, or auto -- what `colibri probe-device` measured for the device holding
    `path` (its profile's "direct_io": {"device": st_dev, "use": bool, "why": ...}); off without a
    measurement. -> (use it, why)."""
    from ..knobs import resolve
    v = resolve("COLIBRI_DIRECT_IO", explicit)
    if v != "auto":
        return v == "on", f"COLIBRI_DIRECT_IO={v}"
    try:
        from ..knobs import device_profile_path
        import json
        d = json.load(open(device_profile_path())).get("direct_io") or {}
        if int(d.get("device", -1)) == os.stat(path).st_dev:
            return bool(d["use"]), f"probe-device: {d.get('why', '')}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return False, "buffered reads (no probe-device measurement of this drive)"


class SlotPool:
    """SlotCache + data: N slots of one expert blob each in the backend's memory.

    Reads: a miss is one positioned read of the expert's whole blob (gate, up, down and scales are
    adjacent in colibri_weights.bin) into its slot, on a bounded pool of I/O threads (io_threads;
    0: on the compute thread). A layer's misses are all issued at once (the union of the step's
    tokens' experts, each read once); while they load the layer computes the experts already resident,
    then each arriving expert as it lands. Each expert writes its own rows of y and the combine runs
    after the layer in a fixed order, so arrival order never changes the logits. Prefetch loads go
    through the same pool, after the layer's demand misses. With direct I/O (O_DIRECT, chosen by
    probe-device's measurement or COLIBRI_DIRECT_IO) reads bypass the page cache into PAGE-aligned slot
    rows; buffered reads drop their pages after the copy (posix_fadvise DONTNEED): the slots are the
    engine's copy either way."""

    def __init__(self, backend, model, num_slots: int, policy: str, io_threads=None, direct_io=None,
                 hot_fraction=None, top_k: int | None = None):
        cfg = model.config
        if policy not in ENGINE_POLICIES:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"slot policy {policy!r}: the engine runs "
                               f"{', '.join(ENGINE_POLICIES)} (belady needs the future: use `colibri simulate`)")
        self.be, self.model = backend, model
        self.H, self.I = cfg["hidden_size"], cfg["moe_intermediate_size"]
        # one slot holds any layer's expert: sized by the largest blob (layers may differ in formats)
        self.blob_bytes = max(e.weight_size for e in model.experts)
        self.row_bytes = -(-self.blob_bytes // PAGE) * PAGE      # a direct read is whole pages
        self.cache = SlotCache(num_slots, policy, self.blob_bytes)
        self.buf = backend.alloc_slots(num_slots, self.blob_bytes)   # host slots: page-aligned rows of row_bytes
        self._path = os.path.join(model.path, WEIGHTS_FILE)
        self._fd = os.open(self._path, os.O_RDONLY)
        self._dfd = None
        self.direct, self.direct_why = direct_io_choice(self._path, direct_io)
        if self.direct:
            try:
                self._dfd = os.open(self._path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError as err:
                self.direct, self.direct_why = False, f"O_DIRECT refused by the filesystem ({err.strerror})"
        self._tls = threading.local()               # per-thread staging buffers (device slots)
        self.reads = self.read_bytes = self.direct_reads = 0
        self.load_s = 0.0                           # seconds spent in loads, all threads
        self.stall_s = 0.0                          # seconds the compute thread waited for loads
        self.io_busy_s = 0.0                        # seconds with at least one read in flight
        self._inflight, self._busy_since = 0, 0.0
        self._lock = threading.Lock()
        self._copy_lock = threading.Lock()
        self.locked = _mlock(backend.slot_host_view(self.buf, 0) is not None and self.buf)
        self._views = {}                            # (slot, formats) -> the FFN viewing that slot
        self._pending: dict = {}                    # slot -> Future of a prefetch copy
        self.io_threads = io_threads_knob(io_threads)
        staged = backend.slot_host_view(self.buf, 0) is None
        # demand misses on the I/O threads: host slots, or a device backend whose copies may come from them
        self.parallel = self.io_threads > 0 and (not staged or backend.slot_loads_in_parallel)
        workers = self.io_threads if self.parallel else 1       # else: one thread, for prefetch alone
        self._pool = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="colibri-io") \
            if self.parallel or policy == "prefetch" else None
        self.prefetch_hook = PrefetchHook() if policy == "prefetch" else None
        self.heat_path = heat_file(model)
        self.hot_fraction = hot_fraction_knob(hot_fraction)
        # one decode token's experts across the MoE layers: fewer slots than this and no demand policy
        # keeps anything between tokens (HOT_SET_RULE)
        self.top_k = int(top_k or cfg.get("num_experts_per_tok") or 1)
        self.working_set = self.top_k * len({e.layer for e in model.experts})
        self.pinned_keys = []                       # the hot set pinned at open, hottest first
        self.hot_set = self._pin_hot_set()

    @property
    def counters(self) -> Counters:
        return self.cache.c

    def hot_set_size(self) -> int:
        """How many slots the hot set takes (HOT_SET_RULE)."""
        n, w = self.cache.n, self.working_set
        if self.hot_fraction <= 0:
            return 0
        return max(n - self.top_k, 0) if n < w else min(int(self.hot_fraction * n), n - w)

    def _pin_hot_set(self) -> int:
        """Load the learned hot set (the hottest experts of earlier runs, heat_file) into hot_set_size()
        slots, for good. -> how many."""
        heat = load_heat(self.heat_path, self.model) if self.hot_fraction > 0 else None
        if heat is None:
            return 0
        n = self.hot_set_size()
        order = sorted(heat, key=lambda k: (-heat[k], k))[:n]
        loads = self.cache.pin([k for k in order if heat[k] > 0])
        self.pinned_keys = [k for k, _ in loads]
        futs = [self._submit(k[0], k[1], slot) if self._pool else self._load(k[0], k[1], slot)
                for k, slot in loads]
        for f in futs:
            if isinstance(f, Future):
                f.result()
        return len(loads)

    def _read(self, fd, view, offset, n):
        done = 0
        while done < n:                             # pread may return short
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                return done
            done += got
        return done

    def _load(self, layer, e, slot):
        """A miss (or a prefetch): the expert's blob read from the weights file with one positioned read
        of its whole size, straight into the slot where the slot is host memory (cpu, reference), else
        into this thread's staging buffer and on to the device. Buffered: its pages then dropped from
        the page cache (posix_fadvise DONTNEED), so that streaming does not grow the page cache. Direct:
        whole pages into the PAGE-aligned slot row, no page cache at all. Not through the memmap: under
        memory pressure its page faults read 4 KiB at a time (measured on this machine's storage,
        README: 26 MB/s against 0.8-1 GB/s for large reads)."""
        import time
        t0 = time.perf_counter()
        with self._lock:                            # the drive's busy time: some read in flight
            if not self._inflight:
                self._busy_since = t0
            self._inflight += 1
        try:
            self._read_blob(layer, e, slot)
        finally:
            with self._lock:
                now = time.perf_counter()
                self.load_s += now - t0
                self._inflight -= 1
                if not self._inflight:
                    self.io_busy_s += now - self._busy_since

    def _read_blob(self, layer, e, slot):
        rec = self.model.expert_record(layer, e)
        dst = self.be.slot_host_view(self.buf, slot)
        staged = dst is None
        if staged:
            dst = getattr(self._tls, "staging", None)
            if dst is None:                         # the backend's (CUDA: page-locked), a page-aligned view
                raw = self.be.alloc_staging(self.row_bytes + PAGE)
                off = (-raw.ctypes.data) % PAGE
                dst = self._tls.staging = raw[off:off + self.row_bytes]
        n = rec.weight_size
        span = -(-n // PAGE) * PAGE                 # a direct read is whole pages
        direct = self._dfd is not None and dst.ctypes.data % PAGE == 0 and rec.weight_offset % PAGE == 0 and \
            dst.size >= span
        if direct:                                  # whole pages; past the end of the file it reads short
            got = self._read(self._dfd, memoryview(dst)[:span], rec.weight_offset, n)
        else:
            got = self._read(self._fd, memoryview(dst)[:n], rec.weight_offset, n)
        if got < n:
            raise ColibriError(COLIBRI_ERR_INVALID_MODEL, f"{self._path}: expert {e} of layer {layer} ends "
                               f"past the end of the file (offset {rec.weight_offset}, {n} bytes)")
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, rec.weight_offset, n, os.POSIX_FADV_DONTNEED)
        self._landed(dst, n, staged, slot, direct)

    def _landed(self, dst, n, staged, slot, direct):
        """A whole blob is in: the slot's tail cleared, a staged blob copied to the device, counted."""
        if n < self.blob_bytes:                     # a smaller layer's expert: the slot's tail is unused
            dst[n:self.blob_bytes] = 0
        if staged:                                  # one device copy at a time: a runtime may not take
            with self._copy_lock:                   # copies enqueued from several threads at once (Oclgrind
                self.be.load_slot(self.buf, slot, dst[:self.blob_bytes])   # 21.10 crashes)
        with self._lock:
            self.reads += 1
            self.read_bytes += n
            self.direct_reads += direct

    def _submit(self, layer, e, slot) -> Future:
        """A load on the I/O pool -> its Future. One read per blob: splitting a blob into parts read by
        several threads together was slower here (pressure benchmark, uniform router, 25% memory, 5
        slots, direct reads: 11.6 tok/s with 4 MiB parts against 14.4 whole), the drive already has a
        layer's misses in flight together."""
        return self._pool.submit(self._load, layer, e, slot)

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

    def _settle(self, layer, futs: dict, err=None):
        """Wait for every load in futs ({slot: (expert, future)}); a failed load's key is forgotten (its
        slot holds nothing valid) and the first error raised once nothing is in flight."""
        for slot, (e, fut) in futs.items():
            try:
                fut.result()
            except Exception as x:                  # noqa: BLE001 -- re-raised below, after the rest land
                self.cache.drop((layer, e))
                err = err or x
        if err is not None:
            raise err

    def run_layer(self, moe, plan, s, prefetch):
        """grouped_ffn of one MoE layer from the slots, wave by wave (a wave = what fits in the slots);
        in a wave the resident experts first, then the loaded ones as they land (class docstring).
        prefetch=(next_layer, likely experts, every predicted one): loaded on the I/O pool after this
        layer's misses (only when the layer fits in one wave: then no slot of this layer is touched)."""
        import dataclasses
        import time
        from concurrent.futures import FIRST_COMPLETED, wait
        if self.prefetch_hook is None:
            prefetch = None                          # a trace's prediction, but no prefetch policy
        layer = moe.layer
        experts = list(moe.experts)
        plan_waves, loads = self.cache.access_layer(layer, np.asarray(plan.experts_to_run()), prefetch)

        def run(ids):
            for e, slot in ids:
                experts[e] = self.ffn(slot, layer)
            sub = dataclasses.replace(plan, active=np.array(sorted(e for e, _ in ids), dtype=np.int64))
            self.be.grouped_ffn(s.y, s.h, experts, sub, s.scratch, moe.act)

        for i, wave in enumerate(plan_waves):
            ready, flying = [], {}                   # flying: slot -> (expert, future)
            try:
                for e, slot, hit in wave:
                    fut = self._pending.pop(slot, None)
                    if not hit:
                        if fut is not None:          # an earlier prefetch into this slot lands first
                            fut.result()
                        if not self.parallel:
                            t0 = time.perf_counter()
                            self._load(layer, e, slot)
                            self.stall_s += time.perf_counter() - t0
                            ready.append((e, slot))
                        else:
                            flying[slot] = (e, self._submit(layer, e, slot))
                    elif fut is not None and not fut.done():
                        flying[slot] = (e, fut)      # a prefetch of this expert still in flight
                    else:
                        if fut is not None:
                            fut.result()
                        ready.append((e, slot))
                if i == 0:
                    for e, slot in loads:            # the next layer's loads queue behind this one's
                        self._wait(slot)
                        self._pending[slot] = self._submit(prefetch[0], e, slot)
                if ready:
                    run(ready)
                while flying:
                    t0 = time.perf_counter()
                    done, _ = wait([f for _, f in flying.values()], return_when=FIRST_COMPLETED)
                    self.stall_s += time.perf_counter() - t0
                    landed = [(e, slot) for slot, (e, f) in flying.items() if f in done]
                    for e, slot in landed:
                        flying.pop(slot)[1].result()
                    run(landed)
            except BaseException as err:
                self._settle(layer, flying, err)
                raise

    def resident_bytes(self) -> int:
        return sum(k is not None for k in self.cache.key_of) * self.blob_bytes

    def stats(self) -> dict:
        """Counters, reads and how much of the load time the compute hid."""
        d = self.counters.as_dict()
        d.update(slots=self.cache.n, policy=self.cache.policy, resident_bytes=self.resident_bytes(),
                 read_bytes=self.read_bytes, memory=self.locked, io_threads=self.io_threads,
                 parallel_reads=self.parallel,
                 direct_io=self.direct, direct_io_why=self.direct_why, direct_reads=self.direct_reads,
                 load_seconds=self.load_s, stall_seconds=self.stall_s, io_busy_seconds=self.io_busy_s,
                 observed_read_gbs=self.read_bytes / self.io_busy_s / 1e9 if self.io_busy_s > 0 else None,
                 hidden_fraction=(1.0 - min(self.stall_s / self.load_s, 1.0)) if self.load_s > 0 else None,
                 hot_set=self.hot_set, hot_set_file=self.heat_path,
                 pinned_keys=[list(k) for k in self.pinned_keys])
        return d

    def save_heat(self, counts):
        """Add this run's routing counts (int [moe layers, E], the engine's tallies) to the heat file."""
        if self.heat_path is not None:
            save_heat(self.heat_path, self.model, counts)

    def close(self):
        for s in list(self._pending):
            try:
                self._wait(s)
            except Exception:                         # noqa: BLE001 -- closing: a failed prefetch is moot
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in (self._fd, self._dfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dfd = None


# -- the learned hot set --------------------------------------------------------------------------
# Routing heat (tokens routed to each expert, summed over runs with the older runs' counts halved each
# time: a workload that moves is followed within a few runs) is kept per model in the cache
# ($COLIBRI_CACHE_DIR, else $XDG_CACHE_HOME/colibri-edge, else ~/.cache/colibri-edge)/heat/<key>.json,
# key = sha256 of the model directory's real path and its weights file's size and mtime (a rewritten
# model starts cold). At open the pool pins the hottest experts into hot_fraction of its slots.
HEAT_DECAY = 0.5
# HOT_SET_RULE: how many slots the hot set takes, for N slots, top-k and a decode token's working set W
# (top-k x MoE layers) -- N - k when N < W (every demand policy then thrashes: a token's accesses evict
# each other before the next token comes back to them, so only pinned experts ever hit; k slots stay
# so that a layer's misses still load together, in one wave), else min(COLIBRI_HOT_SET% of N, N - W)
# (the pins never take the slots a token's own working set needs). Measured with `colibri simulate` on
# the pressure benchmark's skewed trace (heat from 3 prompts, replayed on 3 others, 48 tokens each;
# misses): 5 slots lru 2340 unpinned, 1908 with 3 pinned; 8 slots 2340 -> 1590 with 6; 16 slots (= W)
# 276 unpinned against 740 with 25% pinned (the rule pins none); 20 slots 145 unpinned and with 4.


def hot_fraction_knob(explicit=None) -> float:
    from ..knobs import resolve
    return resolve("COLIBRI_HOT_SET", explicit) / 100.0


def heat_file(model) -> str | None:
    import hashlib
    from ..model.gguf_cache import cache_base
    try:
        st = os.stat(os.path.join(model.path, WEIGHTS_FILE))
    except OSError:
        return None
    key = hashlib.sha256(f"{os.path.realpath(model.path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return os.path.join(cache_base(), "heat", key + ".json")


def load_heat(path, model) -> dict | None:
    """{(layer, expert): heat} from the heat file, or None (none yet, or not this model's shape)."""
    import json
    if path is None or not os.path.exists(path):
        return None
    try:
        d = json.load(open(path))
        layers, heat = [int(x) for x in d["layers"]], np.asarray(d["heat"], np.float64)
        E = int(model.config["experts_per_layer"])
        if heat.shape != (len(layers), E) or not np.isfinite(heat).all():
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None                                  # a damaged heat file: start cold, it is rewritten at close
    return {(l, e): float(heat[j, e]) for j, l in enumerate(layers) for e in range(E)}


def save_heat(path, model, counts):
    import json
    moe_layers = sorted({int(e.layer) for e in model.experts})
    counts = np.asarray(counts, np.float64)          # [num_hidden_layers, E]: the MoE layers' rows
    if counts.ndim != 2 or counts.shape[0] <= max(moe_layers):
        return
    counts = counts[moe_layers]
    if not counts.sum():
        return
    old = load_heat(path, model)
    heat = counts.copy()
    if old is not None:
        heat += HEAT_DECAY * np.array([[old.get((l, e), 0.0) for e in range(counts.shape[1])] for l in moe_layers])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"model": os.path.realpath(model.path), "layers": moe_layers, "heat": heat.tolist()}, f)
    os.replace(tmp, path)
