"""The ARM64 check (run by `make test` through `make -C toolchains aarch64`): build the bundle, install it
offline into a fresh arm64 root at another path, and run it there under qemu-user emulation.

    python toolchains/aarch64/check.py [--keep]

What it proves, in the fresh root, through the bundle's launcher:
  1. `colibri run` on the demo model (float16 weights) prints the text the host prints (greedy), and
     its first run compiles 0 kernels -- counted by Numba's compile event, for the CPU the launcher
     picks by itself (generic under qemu) and for the bundle's named CPU (COLIBRI_CPU=cortex-a76);
  2. `colibri backends` finds the cpu backend and the root's PoCL (OpenCL) platform;
  3. the cpu and the opencl backend (on PoCL) match transformers' logits, computed on the host, on a
     tiny float16 Mixtral (relative error < 1e-4, tests/test_parity.py's bound);
  4. the int8-activation dots of the cpu backend equal the NumPy emulation bit for bit (dyadic data,
     tests/test_kernels.int8_dot_cases) in the sdot variant (COLIBRI_CPU=cortex-a76: the dot
     product extension, qemu's 'max' CPU runs it; q8_0, q4_k, iq4_xs) and in the generic one
     (COLIBRI_CPU=generic, ARMv8.0; q4_k, mxfp4), the two side by side;
  5. the aarch64 libcolibri.so from the bundle, called from tests/capi_check.c (cross-compiled with
     aarch64-linux-gnu-gcc) and from Python ctypes, gives the Engine's logits bit for bit, its greedy
     and seeded tokens, and each mistake's code and message (tests/capi_expect.py, as on x86-64).
The install runs with no network (`unshare --net`, pip --no-index). Needs root: without it the check
skips and says why, unless COLIBRI_REQUIRE_AARCH64=1 (.ci/run sets it: CI runs as root), then fails.
binfmt_misc and every mount are restored on the way out, also on failure.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
import bundle  # noqa: E402
import emuroot  # noqa: E402

PREFIX = "/srv/colibri-edge"              # the board's install path (the build root used another)
RUN = ["run", "--backend", "cpu", "--temperature", "0", "--max-new-tokens", "24"]
TOL = 1e-4
CC = os.environ.get("AARCH64_CC", "aarch64-linux-gnu-gcc")
# the int8 dot's branches on ARM64, per variant: signed bytes (q8_0, mxfp4, iq4_xs), unsigned nibbles with
# K-quant mins (q4_k), 16-entry tables (iq4_xs, mxfp4: tbl, the same in both variants); the per-256
# activations' integer scales (q4_k, iq4_xs) with the stored values' offset (q6_k, q3_k: per-16 sums)
BOARD_FORMATS = {"cortex-a76": ("q8_0", "q4_k", "iq4_xs", "q6_k"), "generic": ("q4_k", "mxfp4", "q3_k")}


def log(msg):
    print(f"[aarch64 check] {msg}", flush=True)


def rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def host_references(d: str) -> dict:
    """On the host: the greedy text of `colibri run`, and a tiny float16 Mixtral with transformers' logits."""
    from hf_models import build_hf, hf_logits
    from colibri_edge.model.convert import convert
    os.makedirs(d, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("COLIBRI_BACKEND",)}
    text = subprocess.run([sys.executable, "-m", "colibri_edge", *RUN], capture_output=True, text=True, check=True,
                          env=env).stdout
    hf = build_hf(os.path.join(d, "hf"), "mixtral", "float16")
    convert(hf, os.path.join(d, "parity", "model"), dtype=None, progress=False)
    ids = np.array([[3, 17, 5, 60, 2, 9, 44], [8, 1, 90, 33, 7, 12, 4]], np.int64)
    np.save(os.path.join(d, "parity", "ids.npy"), ids.astype(np.int32))
    # the int8 dots' cases: weights of each format, activations, and the emulation's exact results
    from test_kernels import int8_dot_cases
    os.makedirs(os.path.join(d, "int8"), exist_ok=True)
    rng, cases, want = np.random.default_rng(7), {}, {}
    for fmt in sorted({f for fs in BOARD_FORMATS.values() for f in fs}):
        for K, T, raw, x, w in int8_dot_cases(rng, fmt):
            cases[f"{fmt}:{K}:{T}.w"], cases[f"{fmt}:{K}:{T}.x"], want[f"{fmt}:{K}:{T}"] = raw, x, w
    np.savez(os.path.join(d, "int8", "cases.npz"), **cases)
    np.savez(os.path.join(d, "int8", "want.npz"), **want)
    return {"text": text, "logits": hf_logits(hf, ids)}


def board_run(root, argv, **kw):
    return emuroot.run(root, argv, offline=True, **kw)


def kernels_compiled(stderr: str) -> int:
    m = re.search(r"kernels: (\d+) compiled, (\d+) loaded", stderr)
    assert m, f"no kernel count in --stats output:\n{stderr[-2000:]}"
    return int(m.group(1))


def check_board(root: str, bundle_dir: str, refs: dict, host: str) -> dict:
    out = {}
    t = time.time()
    tgz = bundle_dir.rstrip("/") + ".tar.gz"
    shutil.copy(tgz, os.path.join(root, "tmp"))
    name = os.path.basename(bundle_dir.rstrip("/"))
    board_run(root, ["tar", "-xzf", f"/tmp/{os.path.basename(tgz)}", "-C", "/tmp"])
    board_run(root, ["sh", f"/tmp/{name}/install.sh", PREFIX])
    out["install_s"] = round(time.time() - t, 1)
    log(f"installed offline in the fresh root at {PREFIX} in {out['install_s']} s")
    colibri = f"{PREFIX}/bin/colibri"

    # 1. the first run: the host's text, nothing compiled; then the named CPU's kernels
    for label, env in (("auto-picked CPU", {}), ("COLIBRI_CPU=cortex-a76", {"COLIBRI_CPU": "cortex-a76"})):
        t = time.time()
        p = board_run(root, [colibri, *RUN, "--stats"], env={**env, "COLIBRI_LAUNCH_VERBOSE": "1"})
        n = kernels_compiled(p.stderr)
        launch = re.search(r"\[colibri\] bundle .*", p.stderr).group(0)
        speed = re.search(r"decode \d+ tok at ([\d.]+) tok/s", p.stderr).group(1)
        log(f"colibri run ({label}): {n} kernels compiled, decode {speed} tok/s emulated, "
            f"{time.time() - t:.1f} s in all; {launch}")
        assert p.stdout == refs["text"], f"the board printed\n{p.stdout!r}\nthe host printed\n{refs['text']!r}"
        assert n == 0, f"the first run compiled {n} kernels ({label}): the bundle's cache missed\n{p.stderr[-3000:]}"
        out[f"decode_tok_s[{label}]"] = float(speed)
    log("colibri run prints the host's greedy text, compiling nothing")

    # 2. the backends the board's root offers
    p = board_run(root, [colibri, "backends"])
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln and not ln.startswith(" ")}
    assert lines["cpu"].split()[1] == "present:", p.stdout
    assert lines["opencl"].split()[1] == "present:" and "Portable Computing Language" in lines["opencl"], p.stdout
    log("colibri backends: " + lines["opencl"][:200])

    # 3. parity against transformers (host) on cpu and opencl
    t = time.time()
    shutil.copytree(os.path.join(host, "parity"), os.path.join(root, "tmp", "parity"))
    shutil.copy(os.path.join(HERE, "on_board.py"), os.path.join(root, "tmp", "on_board.py"))
    board_run(root, [f"{PREFIX}/bin/colibri-python", "/tmp/on_board.py", "parity", "/tmp/parity", "cpu,opencl"])
    for b in ("cpu", "opencl"):
        err = rel_err(np.load(os.path.join(root, "tmp", "parity", f"{b}.npy")), refs["logits"])
        out[f"parity_rel_err[{b}]"] = err
        assert err < TOL, f"{b} on the board: relative error {err:.2e} against transformers (bound {TOL})"
    log(f"parity vs transformers (float16 Mixtral): cpu {out['parity_rel_err[cpu]']:.1e}, "
        f"opencl {out['parity_rel_err[opencl]']:.1e} ({time.time() - t:.0f} s)")

    # 4. the int8 dots: the sdot variant (a named CPU with the dot product extension) and the generic one,
    # each bit for bit the NumPy emulation on dyadic data (tests/test_kernels.int8_dot_cases)
    t = time.time()
    shutil.copytree(os.path.join(host, "int8"), os.path.join(root, "tmp", "int8"))
    want = np.load(os.path.join(host, "int8", "want.npz"))

    def dots(cpu, fmts):        # each format's kernels compile under emulation (~40 s a format)
        return board_run(root, [f"{PREFIX}/bin/colibri-python", "/tmp/on_board.py", "int8-dots", "/tmp/int8", cpu,
                                ",".join(fmts)], env={"COLIBRI_CPU": cpu})
    with ThreadPoolExecutor(len(BOARD_FORMATS)) as pool:      # one core each: Numba compiles on one thread
        list(pool.map(lambda kv: dots(*kv), BOARD_FORMATS.items()))
    for cpu, fmts in BOARD_FORMATS.items():
        variant = "sdot" if cpu != "generic" else "generic"
        used = json.load(open(os.path.join(root, "tmp", "int8", f"out-{cpu}.json")))["int8_dot"]
        assert used.startswith(variant), f"COLIBRI_CPU={cpu}: the kernels used {used!r}, not the {variant} variant"
        got = np.load(os.path.join(root, "tmp", "int8", f"out-{cpu}.npz"))
        mine = sorted(k for k in want.files if k.split(":")[0] in fmts)
        assert sorted(got.files) == mine, (got.files, mine)
        for k in mine:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{cpu} ({used}) {k}")
        out[f"int8_dots[{cpu}]"] = f"{used}: {len(mine)} cases of {', '.join(fmts)}"
    log(f"int8 dots equal the emulation bit for bit: cortex-a76 {out['int8_dots[cortex-a76]']}; generic "
        f"{out['int8_dots[generic]']} ({time.time() - t:.0f} s)")

    # 5. the C interface from the bundle: a C program and ctypes
    t = time.time()
    from capi_expect import capi_ids, check_c_output, write_input
    from test_capi import CTYPES
    capi = os.path.join(root, "tmp", "capi")
    os.makedirs(capi)
    exe = os.path.join(capi, "capi_check")
    subprocess.run([CC, "-O1", "-Wall", "-Werror", "-o", exe, os.path.join(REPO, "tests", "capi_check.c"),
                    f"-I{bundle_dir}/include", f"-L{bundle_dir}/lib", "-lcolibri", "-lpthread",
                    f"-Wl,-rpath,{PREFIX}/lib", "-Wl,--unresolved-symbols=ignore-in-shared-libs"], check=True)
    demo = f"{PREFIX}/site-packages/colibri_edge/default_model"
    with open(os.path.join(REPO, "colibri_edge", "default_model", "config.json")) as f:
        V = json.load(f)["vocab_size"]
    write_input(capi_ids(V), os.path.join(capi, "in.bin"))
    p = board_run(root, ["/tmp/capi/capi_check", demo, "cpu", "/tmp/capi/in.bin", "/tmp/capi"])
    board_run(root, [f"{PREFIX}/bin/colibri-python", "/tmp/on_board.py", "capi-ref", demo, "/tmp/capi"])
    with open(os.path.join(capi, "ref.json")) as f:
        ref = json.load(f)
    lines = check_c_output(p.stdout, capi, np.load(os.path.join(capi, "ref_logits.npy")),
                           np.load(os.path.join(capi, "ref_top1.npy")), ref["greedy"], ref["sampled"], V)
    with open(os.path.join(capi, "via_ctypes.py"), "w") as f:
        f.write(CTYPES)
    q = board_run(root, [f"{PREFIX}/bin/colibri-python", "/tmp/capi/via_ctypes.py", f"{PREFIX}/lib/libcolibri.so",
                         demo])
    assert f"ctypes ok {V}" in q.stdout, q.stdout + q.stderr
    out["capi_infer_us"] = float(lines["infer_us"])
    log(f"libcolibri.so (aarch64) from C and from ctypes: the Engine's logits bit for bit, tokens, error codes; "
        f"colibri_infer of 1 token {out['capi_infer_us'] / 1e3:.1f} ms emulated ({time.time() - t:.0f} s)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the roots (build/aarch64) for a look")
    ap.add_argument("--no-memo", action="store_true", help="compile every kernel under emulation")
    a = ap.parse_args(argv)
    why = emuroot.need_root()
    if why:
        if os.environ.get("COLIBRI_REQUIRE_AARCH64"):
            raise SystemExit(f"aarch64 check: FAILED -- {why}, and COLIBRI_REQUIRE_AARCH64 is set")
        print(f"aarch64 check: SKIPPED -- {why}")
        return 0
    t0 = time.time()
    work = os.path.join(REPO, "build", "aarch64")
    host = os.path.join(work, "host")
    shutil.rmtree(host, ignore_errors=True)
    refs = host_references(host)
    log(f"host references (greedy text, transformers' logits) in {time.time() - t0:.0f} s")
    board = os.path.join(work, "board")
    with emuroot.binfmt():
        info = bundle.build(os.path.join(work, "colibri-bundle-aarch64"), work, None, "cortex-a76",
                            use_memo=not a.no_memo)
        emuroot.make_root(board, emuroot.BOARD_PACKAGES)
        try:
            with emuroot.mounted(board):
                res = check_board(board, info["path"], refs, host)
        finally:
            if not a.keep:
                emuroot.remove_root(board)
                shutil.rmtree(host, ignore_errors=True)
    log(f"PASSED in {time.time() - t0:.0f} s: bundle {info['bytes'] / 2**20:.0f} MiB "
        f"({info['tarball_bytes'] / 2**20:.0f} MiB as .tar.gz, built in {info['seconds']:.0f} s; kernels compiled "
        f"under emulation {info['kernels_compiled']}), {json.dumps(res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
