"""The fuzz campaign: seeded, repeatable mutations of a converted model directory, each opened and
run in a persistent worker process, and a battery of bad API arguments against an open engine.

    python tests/fuzz.py --cases 10000 --backend reference [--seed 0] [--report FILE.md]
    make fuzz                      10,000 cases on reference and 1,000 on cpu, then the battery

Every case ends in one of: "ok" (a result), "coded" (a ColibriError with its code), "escape" (any
other exception: a defect), "crash" (the worker died: a defect), "hang" (no answer within the
watchdog's time: a defect). The worker runs under an address-space limit (RLIMIT_AS, 4 GiB), so a
huge allocation fails instead of exhausting the machine; it is restarted after a crash or a hang.

Stages a case can reach: parse (the JSON files load), validate (ModelDir), open (Engine.open),
forward (infer, generate, and with a tokenizer stream and chat). Mutation kinds: json_value,
json_key, json_list, json_raw, json_deep, weights_truncate, weights_extend, weights_overwrite,
file_to_dir, file_to_link, file_remove.

The GGUF campaign (--gguf-cases) mutates a GGUF file llama.cpp's converter wrote (tests/gguf_models.py)
and runs `colibri convert FILE.gguf`, then opens and runs what it wrote (stages convert, open,
forward). Kinds: gguf_truncate, gguf_header_bytes (random bytes anywhere before the tensor data),
gguf_kv_value (a metadata value's bytes), gguf_tensor_dims, gguf_tensor_type, gguf_tensor_offset,
gguf_data (tensor data bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("json_value", "json_key", "json_list", "json_raw", "json_deep", "weights_truncate", "weights_extend",
         "weights_overwrite", "file_to_dir", "file_to_link", "file_remove")
JSON_FILES = ("config.json", "tensors.json", "experts.json", "generation_config.json", "tokenizer_config.json")
ALL_FILES = JSON_FILES + ("colibri_weights.bin", "tokenizer.json")
STAGES = ("parse", "validate", "convert", "open", "forward")
GGUF_KINDS = ("gguf_truncate", "gguf_header_bytes", "gguf_kv_value", "gguf_tensor_dims", "gguf_tensor_type",
              "gguf_tensor_offset", "gguf_data")
ADDRESS_SPACE = 4 << 30
WATCHDOG_S = 60.0
# the unmutated bases run once first, unwatched by WATCHDOG_S: a cold kernel cache compiles the backend's
# kernels for the base's formats there (minutes on a 2-core host), not inside a case's 60 s
WARMUP_S = 1200.0


# -- the base model: dense, MoE and MoE-with-shared-expert layers, a tokenizer and a chat template -----
def build_base(path: str) -> str:
    from colibri_edge.model.demo import byte_level_tokenizer
    from colibri_edge.model.modeldir import ModelWriter, expected_tensors
    tok = byte_level_tokenizer()
    V = tok.get_vocab_size()
    H, I, E = 32, 24, 4
    cfg = {"format_version": 1, "model_type": "qwen2_moe", "num_hidden_layers": 3, "hidden_size": H,
           "intermediate_size": 40, "moe_intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "vocab_size": V, "max_position_embeddings": 64, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "experts_per_layer": E, "top_k": 2,
           "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": False,
           "shared_expert_intermediate_size": 16, "shared_expert_gate": True, "attention_bias": True,
           "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": [V - 1], "bos_token_id": None,
           "weight_dtype": "float32",
           "layers": [{"layer_id": 0, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0},
                      {"layer_id": 1, "type": "moe_shared", "moe_expert_start": 0, "moe_num_experts": E},
                      {"layer_id": 2, "type": "moe", "moe_expert_start": E, "moe_num_experts": E}]}
    rng = np.random.default_rng(0)
    os.makedirs(path, exist_ok=True)
    w = ModelWriter(path, cfg)
    for name, (shape, dtype) in expected_tensors(cfg).items():
        arr = (1 + 0.1 * rng.standard_normal(shape)) if len(shape) == 1 else rng.standard_normal(shape) / np.sqrt(shape[-1])
        w.add_tensor(name, arr.astype(np.float32), dtype)
    for layer in (1, 2):
        for j in range(E):
            w.add_expert(layer, j, *(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1])
                                     for s in ((I, H), (I, H), (H, I))), "float32")
    w.finish({"generation_config.json": {"eos_token_id": V - 1, "bos_token_id": 0},
              "tokenizer_config.json": {"eos_token": "<|endoftext|>", "chat_template":
                                        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                        "{% if add_generation_prompt %}<|assistant|>{% endif %}"}})
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


# -- mutations (in the parent: never where the case runs) ----------------------------------------------
POOL = [None, True, False, 0, -1, 1, 3, 2 ** 31, 2 ** 63, -2 ** 63, 10 ** 30, 1e308, -1e-9, 0.5, float("nan"),
        float("inf"), float("-inf"), "", "x", "float16", "moe", "swiglu", [], {}, [1, 2], [[1]], {"a": 1}, [None]]


def _paths(obj, prefix=()):
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _set(obj, path, value):
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


def _value_for(rng, old):
    r = rng.random()
    if isinstance(old, bool) or old is None or r < 0.5:
        return POOL[rng.integers(len(POOL))]
    if isinstance(old, (int, float)):
        return [old + 1, old - 1, old * 2, -old, old * 4096, str(old), float(old) + 0.5][rng.integers(7)]
    if isinstance(old, str):
        return [old + "x", old[:-1], old.upper(), old * 2, 7][rng.integers(5)]
    if isinstance(old, list):
        return [old[:-1], old + old[-1:], old[::-1], {"list": old}][rng.integers(4)] if old else [1]
    return [list(old.values()), {}, {"x": old}][rng.integers(3)]


def mutate(base: str, work: str, rng) -> dict:
    """Copy base into work (hard links for the files the mutation leaves alone) and mutate it."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    kind = KINDS[rng.integers(len(KINDS))]
    files = JSON_FILES if kind.startswith("json") else ("colibri_weights.bin",) if kind.startswith("weights") \
        else ALL_FILES
    target = files[rng.integers(len(files))]
    if kind in ("json_raw", "json_value") and rng.random() < 0.1:
        target = "tokenizer.json"
    for f in os.listdir(base):
        src, dst = os.path.join(base, f), os.path.join(work, f)
        if f == target and kind not in ("file_to_dir", "file_to_link", "file_remove"):
            shutil.copyfile(src, dst)
        else:
            os.link(src, dst)
    path = os.path.join(work, target)
    what = {"kind": kind, "file": target}
    if kind in ("json_value", "json_key", "json_list"):
        obj = json.load(open(path))
        paths = _paths(obj)
        if kind == "json_value":
            p = paths[rng.integers(len(paths))]
            new = _value_for(rng, _get(obj, p))
            obj = _set(obj, p, new)
            what.update(path=list(p), value=repr(new)[:60])
        elif kind == "json_key":
            dicts = [p for p in paths if isinstance(_get(obj, p), dict) and _get(obj, p)]
            p = dicts[rng.integers(len(dicts))]
            d = _get(obj, p)
            key = list(d)[rng.integers(len(d))]
            op = ["delete", "rename", "add"][rng.integers(3)]
            if op == "delete":
                del d[key]
            elif op == "rename":
                d[key + "_x"] = d.pop(key)
            else:
                d["unknown_field"] = 1
            what.update(path=list(p), key=key, op=op)
        else:
            lists = [p for p in paths if isinstance(_get(obj, p), list)]
            if not lists:
                obj, op = [obj], "wrap"
            else:
                p = lists[rng.integers(len(lists))]
                lst = _get(obj, p)
                op = ["drop", "duplicate", "swap", "truncate", "reverse", "empty"][rng.integers(6)]
                if op == "drop" and lst:
                    lst.pop(rng.integers(len(lst)))
                elif op == "duplicate" and lst:
                    lst.insert(rng.integers(len(lst)), lst[rng.integers(len(lst))])
                elif op == "swap" and len(lst) > 1:
                    i, j = rng.choice(len(lst), 2, replace=False)
                    lst[i], lst[j] = lst[j], lst[i]
                elif op == "truncate":
                    del lst[len(lst) // 2:]
                elif op == "reverse":
                    lst.reverse()
                else:
                    lst.clear()
                what.update(path=list(p))
            what.update(op=op)
        with open(path, "w") as f:
            json.dump(obj, f)
    elif kind == "json_raw":
        data = bytearray(open(path, "rb").read())
        op = ["delete", "insert", "flip", "truncate"][rng.integers(4)]
        at = int(rng.integers(max(len(data), 1)))
        if op == "delete":
            del data[at:at + int(rng.integers(1, 64))]
        elif op == "insert":
            data[at:at] = bytes(rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8))
        elif op == "flip":
            for _ in range(int(rng.integers(1, 8))):
                data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        else:
            del data[at:]
        open(path, "wb").write(bytes(data))
        what.update(op=op, at=at)
    elif kind == "json_deep":
        depth = int(rng.choice([40, 1000, 100000]))
        open(path, "w").write("[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth)
        what.update(depth=depth)
    elif kind == "weights_truncate":
        size = os.path.getsize(path)
        new = int(rng.integers(0, size))
        os.truncate(path, new)
        what.update(size=new)
    elif kind == "weights_extend":
        n = int(rng.integers(1, 1 << 16))
        with open(path, "ab") as f:
            f.write(bytes(rng.integers(0, 256, n, dtype=np.uint8)))
        what.update(extra=n)
    elif kind == "weights_overwrite":
        size = os.path.getsize(path)
        at, n = int(rng.integers(0, size)), int(rng.integers(4, 4096))
        pattern = ["random", "nan", "inf", "zero", "huge"][rng.integers(5)]
        word = {"nan": np.float32(np.nan), "inf": np.float32(np.inf), "zero": np.float32(0),
                "huge": np.float32(3e38)}.get(pattern)
        data = bytes(rng.integers(0, 256, n, dtype=np.uint8)) if word is None else np.full(n // 4, word).tobytes()
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(data[:max(0, size - at)])
        what.update(at=at, bytes=n, pattern=pattern)
    elif kind == "file_to_dir":
        os.remove(path)
        os.mkdir(path)
    elif kind == "file_to_link":
        os.remove(path)
        dest = [os.path.join(work, ALL_FILES[rng.integers(len(ALL_FILES))]), "/dev/zero",
                os.path.join(work, "nowhere")][rng.integers(3)]
        os.symlink(dest, path)
        what.update(to=dest)
    else:
        os.remove(path)
    return what


# -- GGUF mutations --------------------------------------------------------------------------------------
def gguf_layout(path: str) -> dict:
    """Byte extents of a GGUF's parts, from gguf-py's own parse: each metadata value, each tensor
    info's dims / type / offset fields, where the data starts."""
    import gguf
    r = gguf.GGUFReader(path)
    values = []
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        pos = f.offset
        for i, part in enumerate(f.parts):
            if i in f.data:
                values.append((pos, int(part.nbytes)))
            pos += int(part.nbytes)
    tensors = []
    for t in r.tensors:
        n = [int(p.nbytes) for p in t.field.parts]
        o = t.field.offset
        tensors.append({"dims": (o + sum(n[:3]), n[3]), "type": (o + sum(n[:4]), n[4]), "offset": (o + sum(n[:5]), n[5]),
                        "data": (int(t.data_offset), int(t.n_bytes))})
    return {"values": values, "tensors": tensors, "data_start": int(r.data_offset), "size": int(r.data.shape[0])}


def mutate_gguf(base: bytes, layout: dict, out: str, rng) -> dict:
    b = bytearray(base)
    kind = GGUF_KINDS[int(rng.integers(len(GGUF_KINDS)))]
    what = {"kind": kind}

    def put(pos, n):
        """overwrite n bytes at pos: random bytes, or an extreme integer of that width"""
        if n in (1, 2, 4, 8) and rng.random() < 0.6:
            v = [0, 1, 2 ** (8 * n) - 1, 2 ** (8 * n - 1), int(rng.integers(0, 2 ** min(8 * n, 62)))][int(rng.integers(5))]
            b[pos:pos + n] = int(v).to_bytes(n, "little")
        else:
            b[pos:pos + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        what.update(at=pos, n=n)
    if kind == "gguf_truncate":
        cut = int(rng.integers(0, len(b)))
        del b[cut:]
        what.update(at=cut)
    elif kind == "gguf_header_bytes":
        for _ in range(int(rng.integers(1, 4))):
            put(int(rng.integers(0, layout["data_start"])), int(rng.integers(1, 9)))
    elif kind == "gguf_kv_value":
        pos, n = layout["values"][int(rng.integers(len(layout["values"])))]
        put(pos + int(rng.integers(0, max(1, n - 7))) if n > 8 else pos, min(n, 8))
    elif kind in ("gguf_tensor_dims", "gguf_tensor_type", "gguf_tensor_offset"):
        t = layout["tensors"][int(rng.integers(len(layout["tensors"])))]
        pos, n = t[kind.split("_")[-1]]
        if kind == "gguf_tensor_type" and rng.random() < 0.7:        # another real type id
            b[pos:pos + 4] = int(rng.integers(0, 42)).to_bytes(4, "little")
            what.update(at=pos, n=4)
        else:
            w = 8 if n >= 8 else n
            put(pos + 8 * int(rng.integers(0, max(1, n // 8))) if n >= 8 else pos, w)
    else:
        t = layout["tensors"][int(rng.integers(len(layout["tensors"])))]
        pos, n = t["data"]
        k = int(rng.integers(1, 17))
        put(pos + int(rng.integers(0, max(1, n - k))), min(k, n))
    with open(out, "wb") as f:
        f.write(b)
    return what


# -- the case (in the worker) ---------------------------------------------------------------------------
def run_case(path: str, backend: str) -> tuple:
    """-> (outcome, stage, detail): stage is the last one entered."""
    from colibri_edge import ColibriError, Engine
    from colibri_edge.model import validate
    from colibri_edge.model.modeldir import ModelDir
    stage = "parse"
    try:
        for name in JSON_FILES[:3]:
            validate.load_json(os.path.join(path, name), name)
        stage = "validate"
        ModelDir(path)
        stage = "open"
        with Engine.open(path, backend=backend, max_seq_len=32, max_batch=2, prefill_chunk=8,
                         kv_cache_tokens=64, kv_block_size=4) as eng:
            stage = "forward"
            V = eng.config["vocab_size"]
            eng.infer([np.arange(5) % V, np.arange(9) % V])
            eng.generate([1 % V, 2 % V, 3 % V], max_new_tokens=4, ignore_eos=True)
            if os.path.exists(os.path.join(path, "tokenizer.json")):
                "".join(eng.stream("hi", max_new_tokens=3, ignore_eos=True))
                eng.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, ignore_eos=True)
        return "ok", stage, ""
    except ColibriError as e:
        return "coded", stage, e.name
    except Exception as e:  # noqa: BLE001  (this is what the campaign counts)
        return "escape", stage, f"{type(e).__name__}: {str(e)[:200]}"


def run_gguf_case(path: str, backend: str) -> tuple:
    from colibri_edge import ColibriError, Engine
    from colibri_edge.model.convert import convert
    stage = "convert"
    out = path + ".colibri"
    try:
        convert(path, out, progress=False)
        stage = "open"
        with Engine.open(out, backend=backend, max_seq_len=32, max_batch=2, prefill_chunk=8, kv_cache_tokens=64,
                         kv_block_size=4) as eng:
            stage = "forward"
            V = eng.config["vocab_size"]
            eng.infer([np.arange(5) % V, np.arange(9) % V])
            eng.generate("hi", max_new_tokens=3, ignore_eos=True)
        return "ok", stage, ""
    except ColibriError as e:
        return "coded", stage, e.name
    except Exception as e:  # noqa: BLE001
        return "escape", stage, f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        shutil.rmtree(out, ignore_errors=True)


def worker_main(backend: str):
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    import colibri_edge  # noqa: F401  (imports before the first case)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("plant") == "crash":          # the harness's own test: a case that kills the process
            os._exit(3)
        if job.get("plant") == "hang":           # ... or never answers
            time.sleep(1e9)
        t0 = time.perf_counter()
        outcome, stage, detail = (run_gguf_case if job.get("gguf") else run_case)(job["path"], backend)
        print(json.dumps({"outcome": outcome, "stage": stage, "detail": detail,
                          "seconds": time.perf_counter() - t0}), flush=True)


class Worker:
    """A persistent worker process; restarted after a crash or a hang."""

    def __init__(self, backend):
        self.backend, self.p = backend, None
        self.restarts = 0

    def _start(self):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", self.backend],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError("fuzz worker did not start")

    def run(self, path, timeout, plant=None, gguf=False):
        import selectors
        if self.p is None or self.p.poll() is not None:
            self._start()
        self.p.stdin.write(json.dumps({"path": path, "plant": plant, "gguf": gguf}) + "\n")
        self.p.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        t0 = time.perf_counter()
        if not sel.select(timeout):
            self.kill()
            return {"outcome": "hang", "stage": "?", "detail": f"no answer in {timeout:.0f}s",
                    "seconds": time.perf_counter() - t0}
        line = self.p.stdout.readline()
        if not line:
            code = self.p.wait()
            self.p, self.restarts = None, self.restarts + 1
            return {"outcome": "crash", "stage": "?", "detail": f"worker exited {code}", "seconds": time.perf_counter() - t0}
        return json.loads(line)

    def kill(self):
        if self.p is not None:
            self.p.kill()
            self.p.wait()
            self.p, self.restarts = None, self.restarts + 1

    def close(self):
        if self.p is not None:
            self.p.stdin.close()
            self.p.wait(timeout=30)
            self.p = None


GGUF_BASES = (("qwen2_moe", "q8_0"), ("mixtral_k", "ud_mix"), ("mixtral_k", "iq_mix"))


def base_ggufs(workdir: str) -> list:
    """The GGUFs the campaign mutates, in turn: a tiny qwen2_moe (shared experts) written by llama.cpp's
    converter, q8_0 (its blocks and float32 tensors both); and two per-matrix type mixes of a tiny
    mixtral (gguf_models: ud_mix, the K-quants, IQ4, ternary and NVFP4 blocks; iq_mix, the lattice
    i-quants), so that block contents, types and row lengths of every format meet the mutations."""
    sys.path.insert(0, HERE)
    import gguf_models
    # built once per process (gguf_models' own temporary folder), copied into this campaign's
    # workdir, which the campaign removes when it ends
    out = []
    for case, kind in GGUF_BASES:
        dst = os.path.join(workdir, f"base-{case}-{kind}.gguf")
        shutil.copyfile(gguf_models.gguf_case(case, kind).gguf, dst)
        out.append(dst)
    return out


def campaign(cases: int, backend: str, seed: int = 0, workdir: str | None = None, log=None,
             gguf: bool = False) -> dict:
    """Run `cases` mutations on `backend` (of the model directory, or with gguf of a GGUF file);
    -> the tally."""
    tmp = workdir or tempfile.mkdtemp(prefix="colibri-fuzz-")
    if gguf:
        srcs = base_ggufs(tmp)
        bases = [(open(src, "rb").read(), gguf_layout(src), os.path.basename(src)) for src in srcs]
        case_dir = os.path.join(tmp, "case.gguf")
    else:
        base = build_base(os.path.join(tmp, "base"))
        srcs = [base]
        case_dir = os.path.join(tmp, "case")
    w = Worker(backend)
    for src in srcs:                    # the kernels compiled outside the watchdog (WARMUP_S)
        r = w.run(src, WARMUP_S, gguf=gguf)
        if r["outcome"] != "ok":
            w.close()
            raise RuntimeError(f"the unmutated base {src} does not run on {backend}: {r}")
    tally = {"cases": 0, "by_outcome": Counter(), "by_kind": defaultdict(Counter), "by_stage": defaultdict(Counter),
             "codes": Counter(), "defects": [], "slowest": (0.0, None), "backend": backend, "seed": seed,
             "target": "gguf" if gguf else "model directory", "kinds": GGUF_KINDS if gguf else KINDS}
    t0 = time.perf_counter()
    try:
        for i in range(cases):
            rng = np.random.default_rng([seed, i])
            if gguf:
                base_bytes, layout, name = bases[i % len(bases)]
                what = {**mutate_gguf(base_bytes, layout, case_dir, rng), "base": name}
            else:
                what = mutate(base, case_dir, rng)
            r = w.run(case_dir, WATCHDOG_S, gguf=gguf)
            o = r["outcome"]
            tally["cases"] += 1
            tally["by_outcome"][o] += 1
            tally["by_kind"][what["kind"]][o] += 1
            tally["by_stage"][r["stage"]][o] += 1
            if o == "coded":
                tally["codes"][r["detail"]] += 1
            if o in ("escape", "crash", "hang"):
                tally["defects"].append({"case": i, **what, **r})
            if r["seconds"] > tally["slowest"][0]:
                tally["slowest"] = (r["seconds"], {"case": i, **what})
            if log and (i + 1) % 500 == 0:
                log(f"[fuzz {backend}] {i + 1}/{cases}: {dict(tally['by_outcome'])}")
    finally:
        w.close()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    tally["seconds"] = time.perf_counter() - t0
    tally["restarts"] = w.restarts
    return tally


def report(tallies) -> str:
    lines = []
    for t in tallies:
        o = t["by_outcome"]
        lines += [f"## {t['cases']} {t['target']} mutations on {t['backend']} (seed {t['seed']}, {t['seconds']:.0f} s, slowest case "
                  f"{t['slowest'][0] * 1e3:.0f} ms: {t['slowest'][1]})", "",
                  f"outcomes: ok {o['ok']}, coded {o['coded']}, escape {o['escape']}, crash {o['crash']}, hang {o['hang']}; "
                  f"worker restarts {t['restarts']}", "",
                  "| mutation kind | ok | coded | escape | crash | hang |", "|---|---:|---:|---:|---:|---:|"]
        for k in t["kinds"]:
            c = t["by_kind"].get(k, Counter())
            lines.append(f"| {k} | {c['ok']} | {c['coded']} | {c['escape']} | {c['crash']} | {c['hang']} |")
        lines += ["", "| stage reached | ok | coded | escape | crash | hang |", "|---|---:|---:|---:|---:|---:|"]
        for s in STAGES + ("?",):
            c = t["by_stage"].get(s)
            if c:
                lines.append(f"| {s} | {c['ok']} | {c['coded']} | {c['escape']} | {c['crash']} | {c['hang']} |")
        lines += ["", "codes: " + ", ".join(f"{k} {v}" for k, v in t["codes"].most_common()), ""]
        for d in t["defects"][:20]:
            lines.append(f"- defect: {d}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--backend", default="reference", help="comma list, e.g. reference,cpu")
    ap.add_argument("--cpu-cases", type=int, default=None, help="cases for backends other than reference")
    ap.add_argument("--gguf-cases", type=int, default=0, help="GGUF-file mutations (reference and cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None)
    a = ap.parse_args(argv)
    tallies = []
    for b in a.backend.split(","):
        n = a.cases if b == "reference" or a.cpu_cases is None else a.cpu_cases
        tallies.append(campaign(n, b, a.seed, log=lambda m: print(m, flush=True)))
    for b in ("reference", "cpu") if a.gguf_cases else ():
        tallies.append(campaign(a.gguf_cases if b == "reference" else max(1, a.gguf_cases // 5), b, a.seed,
                                log=lambda m: print(m, flush=True), gguf=True))
    text = report(tallies)
    print(text)
    if a.report:
        open(a.report, "w").write(text)
    return 0 if all(not t["defects"] for t in tallies) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
    else:
        sys.exit(main())
