"""The C interface (toolchains/capi: colibri.h, libcolibri.so built with cffi's embedding mode), from
a C program compiled with gcc and from Python ctypes, against the Python Engine on the demo model:
logits bit for bit on cpu, the same greedy and seeded tokens, the right code and message for each
mistake a caller can make, handles checked after destroy, two engines on two threads."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.errors import COLIBRI_ERR_INVALID_ARGUMENT

from capi_expect import capi_ids, check_c_output, write_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "colibri_edge", "default_model")
with open(os.path.join(DEMO, "config.json")) as _f:
    DEMO_VOCAB = json.load(_f)["vocab_size"]           # 4098 since the chat tokens (b1e7be4)
CAPI = os.path.join(ROOT, "toolchains", "capi")


def _build_capi():
    sys.path.insert(0, CAPI)
    try:
        import build_capi
    finally:
        sys.path.remove(CAPI)
    return build_capi


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _build_capi().build(str(tmp_path_factory.mktemp("capi")))


def _gcc(lib, src, exe):
    out = os.path.dirname(lib)
    subprocess.run([shutil.which("gcc") or "gcc", "-O1", "-Wall", "-Werror", "-o", exe, src, f"-I{out}", f"-L{out}",
                    "-lcolibri", "-lpthread", f"-Wl,-rpath,{out}"], check=True)
    return exe


def test_c_program_matches_the_engine(lib, tmp_path):
    exe = _gcc(lib, os.path.join(ROOT, "tests", "capi_check.c"), str(tmp_path / "capi_check"))
    with Engine.open(DEMO, backend="cpu") as eng:
        V = eng.config["vocab_size"]
        ids = capi_ids(V)
        want = eng.infer(ids)
        greedy = eng.generate(ids[0].tolist(), max_new_tokens=12)
        sampled = eng.generate(ids[0].tolist(), max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=7,
                               ignore_eos=True)
    write_input(ids, tmp_path / "in.bin")
    run = subprocess.run([exe, DEMO, "cpu", str(tmp_path / "in.bin"), str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    with Engine.open(DEMO, backend="cpu", top_k=1) as one:                # top_k: an override
        top1 = one.infer(ids)
    lines = check_c_output(run.stdout, str(tmp_path), want, top1, greedy, sampled, V)
    print(f"colibri_infer, 1 token, from C: {float(lines['infer_us']):.0f} us a call")


def _check_example_output(stdout):
    """example.c's lines: the Engine's argmax after 1 2 3 4 and its greedy tokens (the demo model, cpu)."""
    with Engine.open(DEMO, backend="cpu", max_seq_len=256) as eng:
        last = eng.infer(np.array([[1, 2, 3, 4]], np.int32))[0, 3]
        gen = eng.generate([1, 2, 3, 4], max_new_tokens=16)
    assert f"next token after 1 2 3 4: {int(last.argmax())} (logit {last.max():.4f})" in stdout
    assert "generated: " + " ".join(map(str, gen)) in stdout


def test_example_program(lib, tmp_path):
    """toolchains/capi/example.c, the README's C example, prints the Engine's argmax and tokens."""
    exe = _gcc(lib, os.path.join(CAPI, "example.c"), str(tmp_path / "example"))
    run = subprocess.run([exe, DEMO], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    _check_example_output(run.stdout)


def test_built_example_runs_from_any_directory(lib, tmp_path):
    """The example `make capi` builds (build_capi.build_example: run path $ORIGIN, the installed demo
    model as its default) runs with no argument from a working directory that is neither the
    repository nor the library's, and again moved together with libcolibri.so, with no
    LD_LIBRARY_PATH: the Engine's argmax and tokens."""
    exe = _build_capi().build_example(os.path.dirname(lib))
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in (exe, lib):
        shutil.copy2(f, moved / os.path.basename(f))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    for prog in (exe, str(moved / "example")):
        run = subprocess.run([prog], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        _check_example_output(run.stdout)


CTYPES = textwrap.dedent('''
    import ctypes, sys
    import numpy as np
    lib = ctypes.CDLL(sys.argv[1])

    class Config(ctypes.Structure):
        _fields_ = [("model_path", ctypes.c_char_p), ("backend", ctypes.c_char_p), ("max_seq_len", ctypes.c_int),
                    ("max_batch", ctypes.c_int), ("num_experts", ctypes.c_int), ("top_k", ctypes.c_int)]
    lib.colibri_init.restype = ctypes.c_void_p
    lib.colibri_init.argtypes = [ctypes.POINTER(Config)]
    lib.colibri_vocab_size.argtypes = [ctypes.c_void_p]
    lib.colibri_infer.argtypes = [ctypes.c_void_p, np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS"),
                                  np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS"), ctypes.c_int, ctypes.c_int]
    lib.colibri_destroy.argtypes = [ctypes.c_void_p]
    lib.colibri_last_error.restype = ctypes.c_char_p
    engine = lib.colibri_init(ctypes.byref(Config(sys.argv[2].encode(), b"cpu", 0, 0, 8, 2)))
    assert engine, lib.colibri_last_error()
    V = lib.colibri_vocab_size(engine)
    ids = np.array([[5, 9, 13, 2]], np.int32)
    logits = np.zeros((1, 4, V), np.float32)
    assert lib.colibri_infer(engine, ids, logits, 1, 4) == 0, lib.colibri_last_error()
    from colibri_edge import Engine
    with Engine.open(sys.argv[2], backend="cpu") as eng:
        np.testing.assert_array_equal(logits, eng.infer(ids))
    bad = np.array([[V]], np.int32)
    assert lib.colibri_infer(engine, bad, logits, 1, 1) == -1 and b"out of range" in lib.colibri_last_error()
    assert lib.colibri_destroy(engine) == 0 and lib.colibri_destroy(engine) == -1
    print("ctypes ok", V)
''')


def test_python_ctypes(lib, tmp_path):
    """The write-up's Python use: ctypes.CDLL, a config struct, ndpointer arguments (in a process of
    its own: there the library finds the interpreter already running and uses it)."""
    (tmp_path / "via_ctypes.py").write_text(CTYPES)
    run = subprocess.run([sys.executable, str(tmp_path / "via_ctypes.py"), lib, DEMO], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"ctypes ok {DEMO_VOCAB}" in run.stdout


def test_python_half_checks_handles_and_pointers():
    """colibri_edge.serving.capi alone (what every exported function calls): handles are table entries, never
    dereferenced; sizes are checked before any view is made."""
    from colibri_edge.serving import capi
    assert capi.vocab_size(0) == COLIBRI_ERR_INVALID_ARGUMENT and "not open" in capi.last_error()[1]
    h = capi.init(DEMO, "reference", 0, 0, 0, 0)
    assert h > 0 and capi.vocab_size(h) == DEMO_VOCAB
    made = []
    assert capi.infer(h, lambda n: made.append(n), None, 0, 3) == COLIBRI_ERR_INVALID_ARGUMENT
    assert made == [] and "batch=0" in capi.last_error()[1]
    assert capi.init(DEMO, "reference", -1, 0, 0, 0) == COLIBRI_ERR_INVALID_ARGUMENT
    assert "max_seq_len=-1" in capi.last_error()[1]
    assert capi.init(DEMO, "reference", 0, 0, 7, 0) == COLIBRI_ERR_INVALID_ARGUMENT
    assert "num_experts=7" in capi.last_error()[1] and "num_experts=8" in capi.last_error()[1]
    assert capi.init(DEMO, "reference", 0, 0, 0, 9) == COLIBRI_ERR_INVALID_ARGUMENT and "1..8" in capi.last_error()[1]
    assert capi.destroy(h) == 0 and capi.destroy(h) == COLIBRI_ERR_INVALID_ARGUMENT
