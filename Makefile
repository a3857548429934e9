# Colibri Edge — every set-up step lives here, so a fresh machine needs only Python 3.11, gcc and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
export PIP_DISABLE_PIP_VERSION_CHECK = 1
# pytest workers (pytest-xdist): one a core, at most 4 (each holds torch and a model or two in memory).
# A test file stays on one worker (--dist loadfile), so its module fixtures are built once.
NPROC   := $(shell nproc 2>/dev/null || echo 2)
WORKERS ?= $(shell n=$(NPROC); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: demo test test-fast lint bench fuzz toolchains gpu-check capi bundle-aarch64 clean help

help:
	@echo "make demo   - create .venv, install, run the embedded default model"
	@echo "make test   - install test dependencies, run ruff, the toolchain checks and the test suite"
	@echo "make test-fast - the inner loop: the suite without tests marked slow, stopping at the first failure"
	@echo "              (no toolchain checks, no CUDA emulator suite, no aarch64 bundle check)"
	@echo "make lint   - ruff check (pyproject.toml [tool.ruff])"
	@echo "make bench  - benchmarks against llama.cpp and transformers (installs llama-cpp-python)"
	@echo "make capi   - build/capi/libcolibri.so and colibri.h, the C interface, and build/capi/example"
	@echo "              (toolchains/capi/example.c); needs only the base install and the capi extra (cffi)"
	@echo "make bundle-aarch64 [CPU=cortex-a76] [MODEL=DIR] - build/bundle-aarch64(.tar.gz): an offline install"
	@echo "              for an aarch64 board, kernels precompiled under emulation (toolchains/aarch64; root)"
	@echo "make fuzz   - the whole fuzz campaign: 10,000 model-directory mutations on reference, 1,000 on cpu and opencl;"
	@echo "              5,000 GGUF-file mutations through colibri convert on reference, 1,000 on cpu"

$(VENV)/.base: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

# torch is pinned to the CPU build on the CI disk (see pyproject.toml [test])
# llama.cpp's converter (convert_hf_to_gguf.py, from llama-cpp-python's sdist on PyPI, sha256-pinned):
# the GGUF tests' files are made by it; fetched here so pytest itself never touches the network
# tmux: tests/test_cli_chat.py drives `colibri chat` in a real terminal (Debian's package; CI runs as root)
# chromium + chromium-driver: tests/test_dashboard.py drives colibri serve's /dashboard in headless Chromium
$(VENV)/.test: $(VENV)/.base
	command -v tmux >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux; }
	command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }
	$(PIP) install -q -e '.[test,opencl,cuda,gguf,serve,grammar,ray]'
	$(PY) tests/llamacpp_convert.py fetch
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/colibri run

# the suite's cpu kernels compile into a cache keyed by source content (backends/cpu/jitcache.py) outside
# the checkout, so a clean clone on a machine that ran the suite before compiles only what changed
# (Numba's default cache, stamped by file times, is cold in every clone: main suite 11.4 -> 5.9 min)
KERNEL_CACHE ?= $(HOME)/.cache/colibri/kernels-host
test: $(VENV)/.test
	$(MAKE) lint
	$(MAKE) toolchains
	COLIBRI_KERNEL_CACHE=$(KERNEL_CACHE) $(PY) -m pytest -q -ra -n $(WORKERS) --dist loadfile

test-fast: $(VENV)/.test
	COLIBRI_KERNEL_CACHE=$(KERNEL_CACHE) $(PY) -m pytest -q -ra -x -m "not slow" -n $(WORKERS) --dist loadfile

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

toolchains: $(VENV)/.test
	$(MAKE) -C toolchains all PY=$(abspath $(PY))

# the C interface needs the base install and the capi extra (cffi) only, never the test environment
$(VENV)/.capi: $(VENV)/.base
	$(PIP) install -q -e '.[capi]'
	touch $@

# the C interface: build/capi/libcolibri.so and build/capi/colibri.h (cffi's embedding mode; the
# library starts an interpreter and imports this venv's colibri_edge), and build/capi/example
# (toolchains/capi/example.c, run path $ORIGIN: it runs from any working directory)
capi: $(VENV)/.capi
	$(PY) toolchains/capi/build_capi.py --out build/capi

# an aarch64 board's deployment bundle (toolchains/aarch64/bundle.py: wheels, launcher, kernel cache for
# CPU and generic, libcolibri.so, optionally MODEL); needs root for the emulated build root
bundle-aarch64: $(VENV)/.test
	$(MAKE) -C toolchains/aarch64 bundle PY=$(abspath $(PY)) CPU=$(or $(CPU),cortex-a76) MODEL=$(MODEL)

.PHONY: demo-model
demo-model: $(VENV)/.test
	$(MAKE) -C toolchains/demo-model train PY=$(abspath $(PY))

# the benchmark's own dependencies, never `make test`'s: llama-cpp-python compiles llama.cpp at install
$(VENV)/.bench: $(VENV)/.test
	@echo "installing the bench extra (llama-cpp-python builds llama.cpp: 10-15 min on 2 cores)"
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} $(PIP) install -q -e '.[bench]'
	touch $@

bench: $(VENV)/.bench
	$(MAKE) -C benchmarks all PY=$(abspath $(PY))

# the whole campaign (`make test` runs a slice of it: tests/test_validation.py)
fuzz: $(VENV)/.test
	$(PY) tests/fuzz.py --cases 10000 --backend reference,cpu,opencl --cpu-cases 1000 --gguf-cases 5000 --report fuzz-report.md

gpu-check:
	bash toolchains/cuda/gpu-check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
