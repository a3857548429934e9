#!/usr/bin/env bash
# `make gpu-check`: the CUDA backend on a real GPU, in under 8 minutes, on a machine with no
# network whose Python already has CuPy (cupy-cuda12x or -13x), numpy, pytest, torch, transformers,
# tokenizers, safetensors and setuptools. Downloads nothing: the working tree is installed (pip,
# offline, no dependencies) into a scratch folder, and the machine's own pytest runs the suites.
#
#   1. environment: Python, GPU, the cuda backend's probe (stop here if it fails)
#   2. NVRTC: every kernel file compiles with the NVRTC CuPy loads (sm_90 and the GPU's own arch)
#   3. tests: the cuda cases of the shared suites (kernels, whole-model parity, generation, weight
#      types, slots) and tests/test_cuda.py; COLIBRI_REQUIRE_BACKENDS=cuda, so a GPU test can fail
#      but never skip for want of the backend
#   4. benchmark: decode tok/s (stream and graph mode, batch 1 and 8), the device time and GB/s of
#      one decode step, prefill tok/s (toolchains/cuda/bench.py)
#   5. decode GEMV GB/s per weight format (float32 ... q6_k, mxfp4) against float16's, each format
#      checked against the reference backend before it is timed (toolchains/cuda/gemv_formats.py)
# Everything lands in $OUT (or ./gpu-check-out): summary.md, env.txt, install.log, nvrtc.log,
# tests.log, junit.xml, bench.json, bench.log, gemv.json, gemv.log. Exit status: 0 only if the probe, NVRTC and every
# test passed.
#   PYTHON=python3.12 ...  picks the interpreter;  GPU_CHECK_QUICK=1 skips the whole-model tests;
#   GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT / GPU_CHECK_GEMV_TIMEOUT (270 / 75 / 60 s; with
#   NVRTC's 60 s, under 8 minutes in all), GPU_CHECK_BENCH_ARGS (bench.py options).
set -u
cd "$(dirname "$0")/../.."
REPO="$(pwd)"
OUTDIR="${OUT:-$REPO/gpu-check-out}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
STAGE="${TMPDIR:-/tmp}/colibri-gpu-check-site"
rm -rf "$STAGE"
# the package as setuptools lays it out (backends/ -> colibri_edge.backends), from this tree, offline
if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$STAGE" "$REPO" \
        > "$OUTDIR/install.log" 2>&1; then
    echo "installing the working tree into $STAGE failed (needs pip and setuptools):"; tail -n 20 "$OUTDIR/install.log"
    exit 1
fi
rm -rf "$REPO/build/lib" "$REPO"/build/bdist.* "$REPO"/*.egg-info     # what the in-tree build left
export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
PYP=("$PY" -P)          # -P: the source folder colibri_edge/ (no backends/ inside) never shadows the install
export COLIBRI_REQUIRE_BACKENDS=cuda
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/colibri-cupy-cache}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
START=$(date +%s)
T() { echo $(( $(date +%s) - START )); }
have_timeout=$(command -v timeout >/dev/null 2>&1 && echo 1 || echo 0)
run_limited() {   # seconds, command...
    local s=$1; shift
    if [ "$have_timeout" = 1 ]; then timeout --kill-after=10 "$s" "$@"; else "$@"; fi
}

status_probe=FAIL; status_nvrtc=SKIP; status_tests=SKIP; status_bench=SKIP; status_gemv=SKIP

# -- 1. environment ------------------------------------------------------------------------------
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)' 2>&1)"
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
        --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
    "${PYP[@]}" - <<'EOF' 2>&1
import importlib
for m in ("numpy", "cupy", "torch", "transformers", "tokenizers", "safetensors", "numba", "pytest"):
    try:
        print(f"{m}: {importlib.import_module(m).__version__}")
    except Exception as e:
        print(f"{m}: absent ({type(e).__name__})")
try:
    import cupy
    print("cupy cuda runtime:", cupy.cuda.runtime.runtimeGetVersion(), "driver:", cupy.cuda.runtime.driverGetVersion())
    print("nvrtc:", cupy.cuda.nvrtc.getVersion())
except Exception as e:
    print("cupy details:", type(e).__name__, e)
import colibri_edge
from colibri_edge.backends import probe
ok, detail = probe("cuda")
print(f"probe cuda: {ok} {detail}")
EOF
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"
grep -q "^probe cuda: True" "$OUTDIR/env.txt" && status_probe=PASS

if [ "$status_probe" = PASS ]; then
    # -- 2. NVRTC ------------------------------------------------------------------------------------
    ARCH=$("$PY" -c 'import cupy; d = cupy.cuda.Device(0); print("sm_" + d.compute_capability)' 2>/dev/null || echo sm_90)
    ARCHS="--arch sm_90"; [ "$ARCH" != sm_90 ] && ARCHS="$ARCHS --arch $ARCH"
    echo "== [$(T)s] NVRTC ($ARCHS)"
    if run_limited 60 "${PYP[@]}" toolchains/cuda/nvrtc_check.py $ARCHS > "$OUTDIR/nvrtc.log" 2>&1; then
        status_nvrtc=PASS; else status_nvrtc=FAIL; fi
    tail -n 3 "$OUTDIR/nvrtc.log"

    # -- 3. tests --------------------------------------------------------------------------------------
    echo "== [$(T)s] tests"
    KSEL="cuda"
    [ "${GPU_CHECK_QUICK:-0}" = 1 ] && KSEL="cuda and not parity and not greedy and not teacher and not graph_and"
    if run_limited "${GPU_CHECK_TEST_TIMEOUT:-270}" "${PYP[@]}" -m pytest -q -ra -p no:cacheprovider \
            --junitxml "$OUTDIR/junit.xml" -k "$KSEL" tests/test_cuda.py tests/test_kernels.py tests/test_parity.py \
            tests/test_generation.py tests/test_weight_types.py tests/test_slots.py tests/test_block_formats.py \
            > "$OUTDIR/tests.log" 2>&1; then
        status_tests=PASS; else status_tests=FAIL; fi
    tail -n 25 "$OUTDIR/tests.log"

    # -- 4. benchmark ----------------------------------------------------------------------------------
    echo "== [$(T)s] benchmark"
    # shellcheck disable=SC2086  (GPU_CHECK_BENCH_ARGS: extra bench.py options, word-split on purpose)
    if run_limited "${GPU_CHECK_BENCH_TIMEOUT:-75}" "${PYP[@]}" toolchains/cuda/bench.py --out "$OUTDIR/bench.json" \
            ${GPU_CHECK_BENCH_ARGS:-} > "$OUTDIR/bench.log" 2>&1; then
        status_bench=PASS; else status_bench=FAIL; fi
    tail -n 40 "$OUTDIR/bench.log"

    # -- 5. decode GEMV per weight format (each checked against the reference first) -----------------
    echo "== [$(T)s] GEMV per format"
    if run_limited "${GPU_CHECK_GEMV_TIMEOUT:-60}" "${PYP[@]}" toolchains/cuda/gemv_formats.py --out "$OUTDIR/gemv.json" \
            > "$OUTDIR/gemv.log" 2>&1; then
        status_gemv=PASS; else status_gemv=FAIL; fi
    tail -n 16 "$OUTDIR/gemv.log"
fi

# -- summary -------------------------------------------------------------------------------------------
{
    echo "# Colibri Edge gpu-check ($(T)s)"
    echo
    echo "| step | result |"
    echo "|---|---|"
    echo "| probe | $status_probe |"
    echo "| NVRTC compile | $status_nvrtc |"
    echo "| tests | $status_tests: $(grep -E '(passed|failed|skipped|error)' "$OUTDIR/tests.log" 2>/dev/null | tail -n 1) |"
    echo "| benchmark | $status_bench |"
    echo "| GEMV per format | $status_gemv |"
    echo
    echo '## environment'
    echo '```'
    cat "$OUTDIR/env.txt"
    echo '```'
    if [ -s "$OUTDIR/bench.json" ]; then
        echo '## benchmark'
        echo '```'
        "${PYP[@]}" - "$OUTDIR/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
m = r["model"]
print(f"model: {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts x {m['inter']} (top-{m['top_k']}), "
      f"vocab {m['vocab']}, {m['dtype']}, {m['file_gib']} GiB")
for k, v in r.get("decode_tok_s", {}).items():
    print(f"decode {k}: {v} tok/s")
for k, v in r.get("step_ms_b1", {}).items():
    print(f"decode step (batch 1, device) {k}: {v} ms = {r['gb_s_b1'][k]} GB/s of {r['bytes_per_step_b1'] / 1e6:.1f} MB")
print(f"prefill: {r.get('prefill_tok_s')} tok/s")
for k, v in r.get("describe", {}).items():
    print(f"{k}: {v}")
EOF
        echo '```'
    fi
    if [ "$status_tests" = FAIL ]; then
        echo '## failing tests'
        echo '```'
        grep -E "^(FAILED|ERROR|FAIL )" "$OUTDIR/tests.log" | head -n 40
        echo '```'
    fi
    if [ -s "$OUTDIR/gemv.log" ]; then
        echo '## decode GEMV per format (one token; stored bytes / kernel time)'
        echo '```'
        cat "$OUTDIR/gemv.log"
        echo '```'
    fi
} > "$OUTDIR/summary.md"
echo
cat "$OUTDIR/summary.md"
[ "$status_probe" = PASS ] && [ "$status_nvrtc" = PASS ] && [ "$status_tests" = PASS ]
