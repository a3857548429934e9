"""Build every OpenCL kernel variant, on the devices present and offline with clang.

    python build_kernels.py device    every variant the backend builds, -cl-std=CL1.2, on every
                                      OpenCL device present (PoCL in CI, the Mali GPU on a board);
                                      a build log with a warning fails
    python build_kernels.py offline   clang, OpenCL C 1.2, target spir, -Werror, no cl_khr_fp64
                                      (Mali has none): every variant, and the half-arithmetic ones
                                      (COLIBRI_HALF_MATH=1) for a device with cl_khr_fp16, the
                                      ones PoCL on a CPU and Oclgrind never compile; and the
                                      half-arithmetic variant must be refused without cl_khr_fp16

The fp32, half-storage and block-format (q8_0 ... q6_k, mxfp4, q2_k, q3_k, iq4_nl, iq4_xs, tq1_0, tq2_0, nvfp4,
the lattice i-quants iq2_xxs ... iq1_m) variants are proven to need no cl_khr_fp16 by the device build (PoCL's
CPU device and Oclgrind report none). Offline, clang 14's builtin declarations hide vload_half
when cl_khr_fp16 is disabled (a clang bug: vload_half is core OpenCL C 1.2), so the offline
builds of those variants keep the spir target's default extensions, fp64 removed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from colibri_edge.backends.opencl import runtime as ocl

KERNELS = {
    "dense.cl": ["embed", "matmul1", "matmul4", "matmul3", "quantize_act", "rmsnorm", "rope", "add", "scale", "zero"],
    "attention.cl": ["kv_write", "paged_attention", "latent_attention"],
    "moe.cl": ["route", "align", "ffn_gate_up", "ffn_gate_up_grouped", "ffn_down_grouped", "combine"],
    "recurrent.cl": ["causal_conv", "delta_rule", "gate_mul"],
}
# kernels built only in the float weight types' variants (float32, half, bfloat16: -DWF16=..., -DWBF16=1)
FLOAT_KERNELS = {"dense.cl": ["head_matmul"]}


def expected_kernels(name, opts):
    """The kernels the variant (file, build options) must hold."""
    floats = "-DWF16=" in opts or "-DWBF16=1" in opts
    return KERNELS[name] + (FLOAT_KERNELS.get(name, []) if floats else [])


def device_builds():
    import pyopencl as cl
    devs = ocl._all_devices(cl)
    if not devs:
        print(f"[opencl build] FAIL - {ocl.INSTALL_HINT}")
        return 1
    failures = built = 0
    for plat, dev in devs:
        if not ocl._compiles(cl, dev):          # a second ICD whose compiler builds nothing on this CPU
            print(f"[opencl build] skip {dev.name.strip()} ({plat.name.strip()} {plat.version.strip()}): its "
                  "compiler builds no kernel on this CPU (pip's PoCL 3.0 on a CPU newer than its LLVM 14); "
                  "the backend never picks it by default")
            continue
        built += 1
        ctx = cl.Context([dev])
        fp16 = "cl_khr_fp16" in dev.extensions.split()
        variants = ocl.build_variants(fp16) + ([] if not fp16 else
                                               [(f, o) for f, o in ocl.build_variants(True, disable_fp16=True)
                                                if "HALF_MATH=0" in o and "WF16=1" in o])
        for name, opts in variants:
            where = f"{dev.name.strip()} ({plat.name.strip()}): {name} {opts}"
            try:
                prg = cl.Program(ctx, ocl.kernel_source(name)).build(options=opts.split())
                log = prg.get_build_info(dev, cl.program_build_info.LOG).strip()
                names = set(prg.get_info(cl.program_info.KERNEL_NAMES).split(";"))
                missing = [k for k in expected_kernels(name, opts) if k not in names]
                if missing:
                    raise RuntimeError(f"kernels missing: {missing}")
                if "warning" in log.lower() or "error" in log.lower():
                    raise RuntimeError(f"build log not clean:\n{log}")
                print(f"[opencl build] ok   {where}")
            except Exception as e:       # noqa: BLE001 - report every variant, then fail
                failures += 1
                print(f"[opencl build] FAIL {where}: {e}")
    if not built:
        print("[opencl build] FAIL - no OpenCL device here builds a kernel: install Debian's pocl-opencl-icd "
              "(`make -C toolchains/opencl setup`)")
    return 1 if failures or not built else 0


def offline_builds(clang):
    exe = shutil.which(clang)
    if exe is None:
        print(f"[opencl offline] FAIL - {clang} not found (`make -C toolchains/opencl setup` installs clang)")
        return 1
    base = [exe, "-cl-std=CL1.2", "-Xclang", "-finclude-default-header", "-target", "spir",
            "-Werror", "-c", "-emit-llvm", "-o", os.devnull]
    no_fp64 = ["-Xclang", "-cl-ext=-cl_khr_fp64"]
    no_ext = ["-Xclang", "-cl-ext=-cl_khr_fp16,-cl_khr_fp64"]
    fp16 = ["-Xclang", "-cl-ext=+cl_khr_fp16,-cl_khr_fp64"]
    jobs = []
    for name in KERNELS:
        if name in ocl.WEIGHT_PROGRAMS:
            jobs += [(name, ["-DWF16=0"], no_ext, "no fp16/fp64 device"),
                     (name, ["-DWBF16=1"], no_ext, "no fp16/fp64 device"),
                     (name, ["-DWI8=1"], no_ext, "no fp16/fp64 device"),
                     # block formats (scales read with vload_half, as WF16), float32 and int8 activations
                     *[(name, [f"-DW{f.upper()}=1"], no_fp64, "no fp64 device") for f in ocl.BLOCK_DTYPES],
                     *[(name, [f"-DW{f.upper()}=1", "-DWACT8=1", "-DCOLIBRI_IDOT=0"], no_fp64,
                        "int8 activations, portable dot") for f in ocl.BLOCK_DTYPES],
                     # the integer dot extensions' variants (COLIBRI_REQUIRE_IDOT: no silent portable fallback)
                     (name, ["-DWQ4_K=1", "-DWACT8=1", "-DCOLIBRI_IDOT=2", "-DCOLIBRI_REQUIRE_IDOT=1"],
                      ["-Xclang", "-cl-ext=-cl_khr_fp64,+cl_arm_integer_dot_product_int8"],
                      "cl_arm_integer_dot_product_int8 device"),
                     (name, ["-cl-std=CL3.0", "-DWQ4_K=1", "-DWACT8=1", "-DCOLIBRI_IDOT=1", "-DCOLIBRI_REQUIRE_IDOT=1"],
                      ["-Xclang", "-cl-ext=-cl_khr_fp64,-__opencl_c_fp64,+cl_khr_integer_dot_product,"
                       "+__opencl_c_integer_dot_product_input_4x8bit"], "cl_khr_integer_dot_product device"),
                     (name, ["-DWF16=1", "-DCOLIBRI_HALF_MATH=0"], no_fp64, "no fp64 device"),
                     (name, ["-DWF16=1", "-DCOLIBRI_HALF_MATH=1"], fp16, "cl_khr_fp16 device")]
        else:
            jobs += [(name, [], no_ext, "no fp16/fp64 device")]
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        for name, defs, ext, what in jobs:
            src = os.path.join(d, name)
            with open(src, "w") as f:
                f.write(ocl.kernel_source(name))
            p = subprocess.run(base + ext + ocl.DEFINES.split() + defs + [src], capture_output=True, text=True)
            tag = f"{name} {' '.join(defs)} ({what})"
            if p.returncode != 0:
                failures += 1
                print(f"[opencl offline] FAIL {tag}:\n{p.stderr}")
            else:
                print(f"[opencl offline] ok   {tag}")
        # the half variant must really need cl_khr_fp16: without it, it must not compile
        src = os.path.join(d, "dense.cl")
        p = subprocess.run(base + no_ext + ["-DWF16=1", "-DCOLIBRI_HALF_MATH=1", src], capture_output=True, text=True)
        if p.returncode == 0:
            failures += 1
            print("[opencl offline] FAIL the half-arithmetic variant compiled without cl_khr_fp16: it uses no half math")
        else:
            print("[opencl offline] ok   the half-arithmetic variant needs cl_khr_fp16 (refused without it)")
    return 1 if failures else 0


def main(argv):
    mode = argv[1] if len(argv) > 1 else "device"
    if mode == "device":
        return device_builds()
    if mode == "offline":
        return offline_builds(os.environ.get("CLANG", "clang"))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
