"""Run OpenCL work under Oclgrind and fail on what it finds.

Oclgrind exits 0 even when it reports errors, so this reads its log instead: any out-of-bounds
access ("Invalid read/write"), data race, uninitialized value or any other diagnostic fails.

    python oclgrind_check.py models            micro models: prefill + decode, every kernel variant
    python oclgrind_check.py ops               the recurrent mixers' kernels (causal_conv, delta_rule,
                                               gate_mul) on mixed steps, against the reference backend
    python oclgrind_check.py run -- CMD ...    any command (the test's planted out-of-bounds kernel)

The command runs as `oclgrind --data-races --uninitialized --log LOG CMD`: Oclgrind's wrapper
preloads its runtime, so PyOpenCL sees only the Oclgrind platform. A run must print the line
`COLIBRI_OCLGRIND_PLATFORM=<platform name>` naming Oclgrind, so that a run that silently fell back to
another platform (PoCL) cannot pass.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OCLGRIND_FLAGS = ("--data-races", "--uninitialized")
SENTINEL = "COLIBRI_OCLGRIND_PLATFORM="

# micro models: (case in tests/hf_models.py, overrides, stored weight dtype, engine options).
# hidden <= 64 (256 for the K-quants' blocks of 256), 2 layers.
MICRO = [
    ("mixtral", {}, None, {}),                               # GQA, head_dim 24, top-2 of 4
    ("qwen2_moe_norm", {}, None, {}),                        # shared expert with sigmoid gate
    ("qwen3_moe", {"num_hidden_layers": 2, "mlp_only_layers": [1]}, None, {}),   # qk norm, a dense layer
    ("qwen2_moe_norm", {}, "float16", {}),                   # half weights (vload_half kernels)
    ("mixtral", {}, "bfloat16",                              # bfloat16 weights (widened in-register),
     {"expert_slots": 3, "slot_policy": "prefetch"}),        # experts read from a 3-slot pool
    ("mixtral_top1_tied", {}, "int8", {"expert_slots": 2}),  # int8 rows + scales, tied int8 embedding,
                                                             # scales read from the slots' blobs
    # ggml blocks (rows K % 32 == 0), with float32 activations (int8_activations False) or int8 ones
    # (quantize_act, integer dots by the portable IDOT4; checked against the cpu backend's int8 path)
    ("mixtral", {"intermediate_size": 64}, "q4_0", {"int8_activations": False}),
    ("mixtral", {"intermediate_size": 64}, "q8_0", {"expert_slots": 2, "int8_activations": True}),
    ("mixtral", {"intermediate_size": 64}, "q4_1", {"int8_activations": True}),    # a block min (additive term)
    ("mixtral", {"intermediate_size": 64}, "q5_0", {"int8_activations": False}),   # fifth bits from a u32
    ("mixtral", {"intermediate_size": 64}, "q5_1", {"int8_activations": True}),
    ("mixtral", {"intermediate_size": 64}, "mxfp4", {"int8_activations": True}),   # 17-byte blocks: odd strides
    ("mixtral", {"hidden_size": 256, "intermediate_size": 256}, "q4_k_m",          # q4_k, q6_k, q5_k, q8_0 mix
     {"int8_activations": False}),
    ("mixtral", {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}, "q5_k",
     {"expert_slots": 2, "int8_activations": True}),
    # latent attention (kv_write of the latent and the rope key, head_matmul, latent_attention) and the
    # DeepSeek routers: softmax within the best groups by their maximum (V2), sigmoid + a choice bias
    # within the best groups by their top two (V3), with half per-head matrices
    ("deepseek_v2", {}, None, {}),
    ("deepseek_v3", {}, "float16", {}),
    # gated delta-net layers (Qwen3.5): causal_conv, delta_rule (chunked prefill continued across chunks,
    # then the decode recurrence), gate_mul, beside full attention layers with an output gate
    ("qwen3_5_moe", {}, None, {}),
]
PROMPT_TOKENS = 8      # <= 8 tokens: prefill in chunks of 5 (a chunk at position > 0), then decode
DECODE_TOKENS = 3


def classify(header: str) -> str:
    h = header.lower()
    if h.startswith("invalid read") or h.startswith("invalid write") or "out-of-bounds" in h \
            or "out of bounds" in h:
        return "out-of-bounds"
    if "data race" in h:
        return "data-race"
    if "uninitialized" in h or "uninitialised" in h:
        return "uninitialized"
    return "other"


def scan_log(text: str):
    """Oclgrind's log -> [(category, message, kernel)]: one entry per diagnostic. A diagnostic starts
    on a line with no leading white space; its details are indented below it."""
    problems = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip() or line[0].isspace():
            continue
        kernel = ""
        for nxt in lines[i + 1:i + 4]:
            m = re.match(r"\s+Kernel:\s*(\S+)", nxt)
            if m:
                kernel = m.group(1)
                break
        problems.append((classify(line.strip()), line.strip(), kernel))
    return problems


def summarize(problems) -> str:
    counts = {}
    for cat, msg, kernel in problems:
        key = (cat, kernel, re.sub(r"0x[0-9a-f]+", "ADDR", msg))
        counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"  {cat}: {msg} (kernel {kernel or '?'}) x{n}" for (cat, kernel, msg), n in sorted(counts.items()))


def oclgrind_path():
    return shutil.which("oclgrind")


def run_checked(cmd, log_path, env=None, timeout=1800):
    """Run cmd under Oclgrind. -> (ok, report, stdout). ok only when the command exited 0, printed
    the Oclgrind sentinel, and Oclgrind's log holds no diagnostic."""
    exe = oclgrind_path()
    if exe is None:
        return False, "oclgrind is not installed (`make -C toolchains/opencl setup`: apt-get install oclgrind)", ""
    if os.path.exists(log_path):
        os.remove(log_path)
    full = [exe, *OCLGRIND_FLAGS, "--log", log_path, *cmd]
    p = subprocess.run(full, capture_output=True, text=True, env=env, timeout=timeout)
    out = p.stdout + p.stderr
    log = open(log_path, encoding="utf-8", errors="replace").read() if os.path.exists(log_path) else ""
    problems = scan_log(log)
    report = []
    if p.returncode != 0:
        report.append(f"command exited {p.returncode}:\n{out[-4000:]}")
    plats = re.findall(re.escape(SENTINEL) + r"(.*)", out)
    if not plats or not all("oclgrind" in s.lower() for s in plats):
        report.append(f"the command did not run on the Oclgrind platform (saw {plats or 'no platform line'})")
    if problems:
        cats = sorted({c for c, _, _ in problems})
        report.append(f"Oclgrind reported {len(problems)} problem(s) [{', '.join(cats)}]:\n" + summarize(problems))
    return not report, "\n".join(report), out


# -- the micro-model run ---------------------------------------------------------------------------
def _child(model_dir, out_path, options="{}"):
    """Runs under Oclgrind: prefill + decode on the opencl backend; saves logits and tokens."""
    import json
    import numpy as np
    from colibri_edge import Engine
    # core_thread=False: the steps run on this (the main) thread; Oclgrind's --uninitialized plugin
    # crashes when kernels are enqueued from another thread (Oclgrind 21.10, reproduced with PyOpenCL alone)
    eng = Engine.open(model_dir, backend="opencl", max_seq_len=32, max_batch=2, prefill_chunk=5,
                      kv_block_size=4, kv_cache_tokens=64, num_streams=2, core_thread=False, **json.loads(options))
    print(SENTINEL + eng.backend.dev.platform.name.strip(), flush=True)
    V = eng.config["vocab_size"]
    ids = (np.arange(PROMPT_TOKENS) * 7 + 3) % V
    logits = eng.infer(ids)[0]
    gen = eng.generate(ids, max_new_tokens=DECODE_TOKENS)
    eng.close()
    np.savez(out_path, logits=logits, gen=np.array(gen, np.int64))


def _reference(model_dir, int8_activations=False):
    """The reference backend's logits and tokens; with int8 activations, the cpu backend's int8 path
    (the same arithmetic, quant.quantize_activations)."""
    import numpy as np
    from colibri_edge import Engine
    where = {"backend": "cpu", "int8_activations": True} if int8_activations else {"backend": "reference"}
    with Engine.open(model_dir, max_seq_len=32, max_batch=2, prefill_chunk=5, kv_block_size=4, kv_cache_tokens=64,
                     **where) as eng:
        V = eng.config["vocab_size"]
        ids = (np.arange(PROMPT_TOKENS) * 7 + 3) % V
        return eng.infer(ids)[0], eng.generate(ids, max_new_tokens=DECODE_TOKENS)


def _check_model(job):
    """One micro model: built, run by the reference backend, then under Oclgrind (a subprocess).
    -> (name, ok, report)."""
    workdir, case, overrides, out_dtype, options = job
    import numpy as np
    sys.path.insert(0, os.path.join(ROOT, "tests"))     # the tests' model builder (hf_models)
    import colibri_edge  # noqa: F401
    from hf_models import convert_case
    sub = os.path.join(workdir, f"{case}_{len(overrides)}_{out_dtype}")
    os.makedirs(sub, exist_ok=True)
    _, col = convert_case(sub, case, out_dtype=out_dtype, **overrides)
    want_logits, want_gen = _reference(col, options.get("int8_activations", False) and out_dtype != "int8")
    out_npz = os.path.join(sub, "oclgrind_out.npz")
    log = os.path.join(sub, "oclgrind.log")
    name = f"{case}{overrides or ''} ({out_dtype or 'float32'} weights{', ' if options else ''}" \
           f"{', '.join(f'{k}={v}' for k, v in options.items())})"
    ok, report, _ = run_checked([sys.executable, os.path.abspath(__file__), "_child", col, out_npz,
                                 json.dumps(options)], log)
    if ok:
        got = np.load(out_npz)
        err = np.abs(got["logits"] - want_logits).max() / max(1.0, np.abs(want_logits).max())
        # int8 activations against the cpu backend's int8 path: the two sum floats in different orders
        # before quantising, and one activation a hair from a rounding boundary then rounds apart and
        # moves what follows by a quantisation step (2026-12-07, an AVX-512 host, q5_k: exact at 9 of 11
        # positions, 0.0067 of max|logit| at one; PoCL's opencl backend gives the same logits as Oclgrind;
        # the float path itself is 0.017 away): 1e-2 there, well under what a wrong kernel gives
        int8 = options.get("int8_activations", False) and out_dtype != "int8"
        tol = 1e-4 if out_dtype is None else 1e-2 if int8 else 1e-3
        if not err <= tol:
            ok, report = False, f"logits under Oclgrind differ from the reference backend by {err:.3g}"
        elif got["gen"].tolist() != list(want_gen):
            ok, report = False, f"decode under Oclgrind gave {got['gen'].tolist()}, reference {want_gen}"
        else:
            report = f"clean; logits within {err:.2g} of the reference, decode agrees"
    return name, ok, report


def check_models(workdir):
    """Every micro model, one process a core (at most 4; each Oclgrind run is single-threaded: on 2 cores the
    16 models took 7 min one after another), reported in MICRO's order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    jobs = [(workdir, *m) for m in MICRO]
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    failures = []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for name, ok, report in ex.map(_check_model, jobs):
            print(f"[oclgrind] {name}: {'OK' if ok else 'FAIL'} - {report}", flush=True)
            if not ok:
                failures.append(name)
    return failures


# -- the recurrent mixers' kernels, op by op ------------------------------------------------------
# Steps as the scheduler packs them (sequence lengths, first positions): a prompt from position 0 across
# delta_rule's chunk boundary (16) with a short last chunk, a continued prefill chunk, decode tokens;
# then a decode-only step (delta_rule's recurrence). Odd widths: no work-group divides them.
OPS_STEPS = [([19, 3, 1], [0, 5, 9]), ([1, 1], [22, 0])]
OPS_DELTA_HEADS = [(2, 4, 16, 12), (1, 2, 8, 20, 1)]     # grouped key heads; tiled (GGUF's order)
OPS_CONV = (37, 4)                                        # channels, taps
OPS_SSM_HEADS = (3, 5, 1, 7)                              # Mamba-2: heads, head dim, groups, state size


def _ops_child(out_path):
    """Runs under Oclgrind: each op on the opencl backend and the reference; saves the largest error."""
    import numpy as np
    from colibri_edge.backends import create
    ref, be = create("reference"), create("opencl")
    print(SENTINEL + be.dev.platform.name.strip(), flush=True)
    rng = np.random.default_rng(0)

    def dev(b, host):
        buf = b.alloc(host.shape, host.dtype)
        b.upload_into(buf, np.ascontiguousarray(host))
        return buf

    errs = {}

    def err(name, got, want):
        e = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
        errs[name] = max(errs.get(name, 0.0), e)
    for lengths, at in OPS_STEPS:
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        pos = np.concatenate([np.arange(p, p + n) for n, p in zip(lengths, at)]).astype(np.int32)
        T, S = int(starts[-1]), len(lengths)
        slots = rng.permutation(S + 1)[:S].astype(np.int32)
        C, K = OPS_CONV
        x = rng.standard_normal((T, C)).astype(np.float32)
        w = rng.standard_normal((C, K)).astype(np.float32)
        st0 = rng.standard_normal((S + 1, K - 1, C)).astype(np.float32)
        got = []
        for b in (be, ref):
            out, st = b.alloc((T, C)), dev(b, st0)
            b.causal_conv(out, dev(b, x), b.upload(w), st, dev(b, starts), dev(b, slots), dev(b, pos))
            got.append((b.download(out), b.download(st)))
        err("causal_conv", got[0][0], got[1][0])
        err("causal_conv state", got[0][1], got[1][1])
        bias = rng.standard_normal(C).astype(np.float32)          # Mamba-2's conv: a bias inside the SiLU
        got = []
        for b in (be, ref):
            out = b.alloc((T, C))
            b.causal_conv(out, dev(b, x), b.upload(w), dev(b, st0), dev(b, starts), dev(b, slots), dev(b, pos),
                          True, b.upload(bias))
            got.append(b.download(out))
        err("causal_conv bias", got[0], got[1])
        nh, P, G, N = OPS_SSM_HEADS
        xbc = rng.standard_normal((T, nh * P + 2 * G * N)).astype(np.float32)
        dts = (2 * rng.standard_normal((T, nh))).astype(np.float32)
        a_neg = -np.exp(rng.uniform(-2, 1.5, nh)).astype(np.float32)
        d_skip, dt_bias = rng.standard_normal(nh).astype(np.float32), rng.standard_normal(nh).astype(np.float32)
        s0 = (0.3 * rng.standard_normal((S + 1, nh, P, N))).astype(np.float32)
        got = []
        for b in (be, ref):
            out, st = b.alloc((T, nh * P)), dev(b, s0)
            b.ssm_scan(out, dev(b, xbc), dev(b, dts), b.upload(a_neg), b.upload(d_skip), b.upload(dt_bias), st,
                       dev(b, starts), dev(b, slots), dev(b, pos), OPS_SSM_HEADS)
            got.append((b.download(out), b.download(st)))
        err("ssm_scan", got[0][0], got[1][0])
        err("ssm_scan state", got[0][1], got[1][1])
        for heads in OPS_DELTA_HEADS:
            Hk, Hv, dk, dv = heads[:4]
            qkv = rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(np.float32)
            a = rng.standard_normal((T, Hv)).astype(np.float32)
            bb = (2 * rng.standard_normal((T, Hv))).astype(np.float32)
            a_neg = -np.exp(rng.uniform(-2, 1.5, Hv)).astype(np.float32)
            dt = rng.standard_normal(Hv).astype(np.float32)
            s0 = (0.3 * rng.standard_normal((S + 1, Hv, dk, dv))).astype(np.float32)
            got = []
            for b in (be, ref):
                out, st = b.alloc((T, Hv * dv)), dev(b, s0)
                b.delta_rule(out, dev(b, qkv), dev(b, a), dev(b, bb), b.upload(a_neg), b.upload(dt), st,
                             dev(b, starts), dev(b, slots), dev(b, pos), heads)
                got.append((b.download(out), b.download(st)))
            err("delta_rule", got[0][0], got[1][0])
            err("delta_rule state", got[0][1], got[1][1])
    x = rng.standard_normal((5, 33)).astype(np.float32)
    g = (3 * rng.standard_normal((5, 33))).astype(np.float32)
    for act in ("silu", "sigmoid"):
        want = np.empty_like(x)
        ref.gate_mul(want, x, g, act)
        xb = dev(be, x)                                   # in place, as the engine runs it
        be.gate_mul(xb, xb, dev(be, g), act)
        err("gate_mul", be.download(xb), want)
    be.close()
    with open(out_path, "w") as f:
        json.dump(errs, f)


OPS_TOL = 1e-4


def check_ops(workdir):
    """The recurrent ops under Oclgrind: clean, and within OPS_TOL of the reference. -> failures."""
    out = os.path.join(workdir, "ops.json")
    ok, report, _ = run_checked([sys.executable, os.path.abspath(__file__), "_ops_child", out],
                                os.path.join(workdir, "oclgrind.log"))
    if ok:
        errs = json.load(open(out))
        bad = {k: v for k, v in errs.items() if not v <= OPS_TOL}
        if bad:
            ok, report = False, "differ from the reference: " + ", ".join(f"{k} {v:.3g}" for k, v in bad.items())
        else:
            report = "clean; within " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()) + " of the reference"
    print(f"[oclgrind] recurrent ops: {'OK' if ok else 'FAIL'} - {report}", flush=True)
    return [] if ok else ["recurrent ops"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["models", "ops", "run", "_child", "_ops_child"])
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.mode == "_child":
        _child(*a.rest)
        return 0
    if a.mode == "_ops_child":
        _ops_child(*a.rest)
        return 0
    if a.mode == "run":
        cmd = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
        with tempfile.TemporaryDirectory() as d:
            ok, report, out = run_checked(cmd, os.path.join(d, "oclgrind.log"))
        sys.stdout.write(out)
        print(f"[oclgrind] {'OK' if ok else 'FAIL'}" + (f" - {report}" if report else ""))
        return 0 if ok else 1
    if oclgrind_path() is None:
        print("[oclgrind] FAIL - oclgrind is not installed: run `make -C toolchains/opencl setup`")
        return 1
    with tempfile.TemporaryDirectory(prefix="colibri-oclgrind-") as d:
        failures = check_ops(d) if a.mode == "ops" else check_models(d)
    if failures:
        print(f"[oclgrind] FAILED: {', '.join(failures)}")
        return 1
    print("[oclgrind] " + ("the recurrent ops clean" if a.mode == "ops" else "all micro models clean"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
