"""llama.cpp's `llama-server`, built once for `make bench` from the llama.cpp sources inside
llama-cpp-python's source distribution on PyPI (the wheel ships no server binary), with CMake.

    python benchmarks/llama_server.py          # prints the binary's path, building it if needed

The sdist is the one tests/llamacpp_convert.py pins (same version, same sha256), so the server and
the converter come from one llama.cpp. The build lives outside the repository, in
~/.cache/colibri/llama-server-VERSION/ (COLIBRI_CACHE overrides ~/.cache/colibri), and is reused:
10-15 minutes on 2 cores the first time. CPU only (no CUDA, no curl), native instructions, as
llama-cpp-python's own build.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from llamacpp_convert import PACKAGE, SDIST_ROOT, SDIST_SHA256, VERSION  # noqa: E402


def cache_dir() -> str:
    root = os.environ.get("COLIBRI_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "colibri")
    return os.path.join(root, f"llama-server-{VERSION}")


def binary(log=print) -> str:
    """The llama-server binary, built if it is not there yet."""
    root = cache_dir()
    exe = os.path.join(root, "build", "bin", "llama-server")
    if os.path.exists(exe):
        return exe
    src = os.path.join(root, "src")
    if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
        with tempfile.TemporaryDirectory() as tmp:
            log(f"downloading the {PACKAGE} {VERSION} source distribution (llama.cpp inside) ...")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"{PACKAGE}=={VERSION}", "-d", tmp, "-q"], check=True)
            (name,) = [n for n in os.listdir(tmp) if n.endswith(".tar.gz")]
            path = os.path.join(tmp, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            if digest != SDIST_SHA256:
                raise SystemExit(f"{name}: sha256 {digest}, expected {SDIST_SHA256}")
            shutil.rmtree(src, ignore_errors=True)
            with tarfile.open(path) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(SDIST_ROOT)]
                for m in members:
                    m.name = m.name[len(SDIST_ROOT):]
                tar.extractall(src, members=[m for m in members if m.name], filter="data")
    build = os.path.join(root, "build")
    log(f"building llama-server with CMake in {build} (10-15 min on 2 cores, once) ...")
    subprocess.run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    if not os.path.exists(exe):
        raise SystemExit(f"the build finished without {exe}")
    return exe


if __name__ == "__main__":
    print(binary(log=lambda s: print(s, file=sys.stderr, flush=True)))
