"""Sessions on disk: a prompt's cached KV blocks saved to a file and loaded into another engine (after
a restart, say), so the conversation's next turn starts from them instead of prefilling it again.

The file is a safetensors file (the `safetensors` package writes and reads it): the token ids of the
saved prefix (`tokens`, int32 [n]) and, per paged pool, layer and tensor, the rows of those positions
in the cache's storage type (block after block, as kv_parts lays them out): `kv.{pool}.{layer}.{tensor}`
[n, *per_token] float32, float16 or int8 (q8_0's values), and for q8_0 its scales
`kv.{pool}.{layer}.{tensor}.scales` float16 [n, heads, groups] (a sliding-window pool's rows only from
the first block of the window after the prefix, what a continuation reads); for a model with recurrent
layers the state after position n (`state.{layer}.{tensor}`, float32 conv and delta-rule state, from
the snapshot that closes the prefix: a hybrid model's session ends at its last snapshot); with metadata:

    format        "colibri-session"
    version       "1" (SESSION_VERSION; another is refused)
    model         the model's fingerprint (model_fingerprint: its config as the engine runs it, its
                  tensors.json and the size and first and last MiB of its weights file)
    block_size    the KV block size the prefix was cut at
    kv_dtype      the cache's storage type: "float32", "float16" or "q8_0" (Engine.open kv_dtype); a file
                  of another kv_dtype than the engine's is refused (its rows are not this cache's bits)
    backend       the backend that computed it (information: another backend may load it)
    tokens        n, a multiple of block_size

Loading checks all of it and every tensor's name, dtype and shape against the engine's own pools
before anything is written: a truncated, foreign or mismatched file is COLIBRI_ERR_INVALID_ARGUMENT
naming what is wrong, never a wrong answer. The loaded blocks enter the prefix cache idle, named by
the hashes of the saved tokens, exactly as if this engine had computed them.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE
from ..runtime.state import block_hashes

SESSION_FORMAT, SESSION_VERSION = "colibri-session", "1"


def model_fingerprint(engine) -> str:
    """What KV values depend on: the config the engine runs (top_k overrides included), tensors.json,
    and the weights file's size and first and last MiB (a retrained model of the same shape differs
    there)."""
    m = getattr(engine.model, "_model", engine.model)
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(engine.config, sort_keys=True, default=str).encode())
    tj = os.path.join(m.path, "tensors.json")
    if os.path.exists(tj):
        with open(tj, "rb") as f:
            h.update(f.read())
    wpath = getattr(m, "weights_path", None)
    if wpath and os.path.exists(wpath):
        size = os.path.getsize(wpath)
        h.update(str(size).encode())
        with open(wpath, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def _cacheable(engine):
    states = engine.runner.states
    if not states.prefix_block:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "sessions need the prefix cache, which this engine does not "
                           "keep (opened with prefix_cache=False, or with state_snapshots=0 for a model with "
                           "recurrent layers)")
    return states


def _paged_keys(engine):
    """(storage key, its pool) of every paged pool's tensor, in a stable order."""
    runner = engine.runner
    return [(key, runner.states.pools[key[0]]) for key in sorted(runner.state_storage, key=str)
            if runner.states.pools[key[0]].kind == "paged"]


def _snapshot_keys(engine):
    """The snapshot pool's storage keys (recurrent layers' conv and delta-rule state), in a stable order."""
    states = engine.runner.states
    if not states.fixed:
        return []
    j = states.pools.index(states.snapshots)
    return [key for key in sorted(engine.runner.state_storage, key=str) if key[0] == j]


def _parts(engine, key) -> list:
    """[(file tensor name, the backend buffer, declared (shape, NumPy dtype))] of one cache tensor: its
    values, and q8_0's scales (backends.base.kv_parts; a KVCache's buffers may be seen as other bits of the
    same size: the cpu backend's half bits as uint16)."""
    from ..backends.base import KVCache
    buf = engine.runner.state_storage[key]
    decl = engine.runner.states.pools[key[0]].buffers()[key[1:]]
    name = "kv.%d.%d.%s" % key
    if not isinstance(buf, KVCache):
        return [(name, buf, decl["data"])]
    return [(name, buf.data, decl["data"])] + ([(name + ".scales", buf.scales, decl["scales"])] if "scales" in decl
                                               else [])


def save(engine, ids, path: str) -> int:
    """Write the cached whole blocks of `ids`' prefix to `path`; -> the positions saved."""
    from safetensors.numpy import save_file
    states = _cacheable(engine)
    B = states.prefix_block
    hashes = block_hashes(ids, B)

    def job():
        n = states.longest_prefix(hashes)                # a recurrent state is saved at a snapshot only
        if n == 0:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"none of this prompt's {len(ids)} tokens is in the KV "
                               f"cache (blocks of {B}{', at a recurrent-state snapshot' if states.fixed else ''}): "
                               "run a request with it first, then save the session")
        tensors = {"tokens": np.ascontiguousarray(np.asarray(ids[:n * B], np.int32))}
        for key, pool in _paged_keys(engine):
            lo = pool.needed_from(n)                     # a window pool: the last window's blocks only
            for name, buf, (_, dtype) in _parts(engine, key):
                host = np.asarray(engine.backend.download(buf)).view(dtype)     # the stored bits, as declared
                rows = [host[b * B:(b + 1) * B] for b in pool.blocks_of(hashes[lo:n])]
                tensors[name] = np.ascontiguousarray(np.concatenate(rows))
        if states.fixed:
            slot = states.snapshots.slot_of(hashes[n - 1])
            for key in _snapshot_keys(engine):
                tensors["state.%d.%s" % key[1:]] = np.ascontiguousarray(
                    engine.backend.download(engine.runner.state_storage[key][slot]), np.float32)
        return n, tensors
    n, tensors = engine._core.call(job)
    meta = {"format": SESSION_FORMAT, "version": SESSION_VERSION, "model": model_fingerprint(engine),
            "block_size": str(B), "kv_dtype": engine.runner.states.kv_dtype, "backend": engine.backend.name,
            "tokens": str(n * B)}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except OSError as e:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"cannot write the session to {path} ({e.strerror}); "
                           "give a writable path") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n * B


def _bad(path, what):
    return ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"session file {path}: {what}")


def load(engine, path: str) -> int:
    """Read a session file into the engine's prefix cache; -> the positions it holds (the tokens a
    request starting with them will not prefill)."""
    from safetensors import SafetensorError, safe_open
    states = _cacheable(engine)
    B = states.prefix_block
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != SESSION_FORMAT:
                raise _bad(path, f"not a Colibri session (format {meta.get('format')!r}); save one with "
                                 "Engine.save_session")
            if meta.get("version") != SESSION_VERSION:
                raise _bad(path, f"version {meta.get('version')!r}, this Colibri reads {SESSION_VERSION!r}; save "
                                 "it again")
            if meta.get("model") != model_fingerprint(engine):
                raise _bad(path, "saved from another model (or the same model with other weights or top_k): "
                                 "its KV values do not belong to this one; prefill the conversation instead")
            kv_dtype = engine.runner.states.kv_dtype
            if meta.get("kv_dtype") != kv_dtype:
                raise _bad(path, f"a {meta.get('kv_dtype')!r} KV cache; this engine keeps {kv_dtype} (open it with "
                                 f"kv_dtype={meta.get('kv_dtype')!r} to load this file, or prefill the conversation)")
            if meta.get("block_size") != str(B):
                raise _bad(path, f"blocks of {meta.get('block_size')} tokens; this engine's are {B} "
                                 "(open it with that kv_block_size)")
            keys = _paged_keys(engine)
            parts = {key: _parts(engine, key) for key, _ in keys}
            skeys = _snapshot_keys(engine)
            want = {"tokens"} | {name for key, _ in keys for name, _, _ in parts[key]} | \
                {"state.%d.%s" % k[1:] for k in skeys}
            if names != want:
                raise _bad(path, f"holds {sorted(names - want) or 'no extra'} tensors and lacks "
                                 f"{sorted(want - names) or 'none'}: not a session of this model's cache layout")
            tokens = f.get_tensor("tokens")
            n = len(tokens)
            if tokens.dtype != np.int32 or tokens.ndim != 1 or n == 0 or n % B or str(n) != meta.get("tokens"):
                raise _bad(path, "its token ids are not a whole number of blocks as its metadata says")
            if tokens.min() < 0 or tokens.max() >= engine.config["vocab_size"]:
                raise _bad(path, "holds token ids outside this model's vocabulary")
            rows = {}
            for key, pool in keys:
                for name, _, (decl, dtype) in parts[key]:
                    a = f.get_tensor(name)
                    shape = (n - pool.needed_from(n // B) * B, *decl[1:])
                    if a.dtype != dtype or a.shape != shape:
                        raise _bad(path, f"{name} is {a.dtype} {a.shape}, this engine's layout needs {dtype} {shape}")
                    if a.dtype.kind == "f" and not np.isfinite(a).all():
                        raise _bad(path, f"{name} holds non-finite values")
                    rows[name] = a
            shapes = engine.runner.states.storage()
            for key in skeys:
                name = "state.%d.%s" % key[1:]
                a = f.get_tensor(name)
                if a.dtype != np.float32 or a.shape != shapes[key][1:]:
                    raise _bad(path, f"{name} is {a.dtype} {a.shape}, this engine's layout needs float32 "
                                     f"{shapes[key][1:]}")
                if not np.isfinite(a).all():
                    raise _bad(path, f"{name} holds non-finite values")
                rows[key] = a
    except SafetensorError as e:
        raise _bad(path, f"unreadable ({e}): a truncated or damaged file? save it again") from None
    except OSError as e:
        raise _bad(path, f"cannot read it ({e.strerror})") from None
    if n > engine.max_seq_len:
        raise _bad(path, f"holds {n} tokens, longer than this engine's max_seq_len={engine.max_seq_len}")
    hashes = block_hashes(tokens, B)

    def job():
        # a window pool gets the blocks of the window after the prefix only (what a continuation reads)
        held = {id(p): hashes[p.needed_from(len(hashes)):] for p in states.paged}
        missing = [sum(h not in p._block_of for h in held[id(p)]) for p in states.paged]
        for p, need in zip(states.paged, missing):
            if need > p.free_blocks:
                raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"the session needs {need} blocks of the {p.name} pool, "
                                   f"{p.free_blocks} are free; load it when fewer requests run, or open the engine "
                                   "with a larger kv_cache_tokens")
        fills = {id(p): p.install(held[id(p)]) for p in states.paged}
        snap = states.snapshots.take(hashes[-1]) if skeys else -1
        for key in skeys if snap >= 0 else ():
            engine.backend.upload_into(engine.runner.state_storage[key][snap], rows[key])
        for key, pool in keys:
            todo = fills[id(pool)]
            if not todo:
                continue
            for name, buf, (_, dtype) in parts[key]:
                host = np.array(engine.backend.download(buf))
                view = host.view(dtype)                 # the stored bits as declared (host keeps the buffer's type)
                for j, b in todo:
                    view[b * B:(b + 1) * B] = rows[name][j * B:(j + 1) * B]
                engine.backend.upload_into(buf, host)
        return n
    return engine._core.call(job)
