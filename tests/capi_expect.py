"""What tests/capi_check.c must print and write, given the Python Engine's results for the same input:
shared by tests/test_capi.py (x86-64) and the ARM64 check (toolchains/aarch64/check.py, where the C
program and the references both run in the emulated root)."""
from __future__ import annotations

import os

import numpy as np

from colibri_edge.errors import COLIBRI_ERR_INVALID_ARGUMENT as BAD, COLIBRI_ERR_INVALID_MODEL


def capi_ids(V: int, batch: int = 2, seq: int = 5) -> np.ndarray:
    return np.array([[(7 * (b * seq + i) + 3) % V for i in range(seq)] for b in range(batch)], np.int32)


def write_input(ids: np.ndarray, path) -> None:
    """capi_check's INPUT: int32 batch, seq, then the ids."""
    np.concatenate([list(ids.shape), ids.ravel()]).astype(np.int32).tofile(path)


def check_c_output(stdout: str, out_dir: str, want, top1, greedy, sampled, V: int) -> dict:
    """Assert capi_check's output against the Engine's: logits bit for bit (infer, top_k=1 override, two
    engines on two threads), greedy and seeded tokens, and each mistake's code and message. -> its lines."""
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in stdout.splitlines()}

    def check(name, rc, code, *words):
        r, c, msg = (lines[name].split(" ", 2) + [""])[:3]
        assert (int(r), int(c)) == (rc, code), lines[name]
        assert all(w in msg for w in words), lines[name]

    def blob(name):
        return np.fromfile(os.path.join(out_dir, name), np.float32).reshape(want.shape)

    assert int(lines["vocab"]) == V
    np.testing.assert_array_equal(blob("logits.bin"), want)            # bit for bit: the same cpu kernels
    for t in ("thread0.bin", "thread1.bin"):                           # two engines on two threads
        np.testing.assert_array_equal(blob(t), want)
    assert lines["threads"] == "0 0"
    assert [int(x) for x in lines["generated"].split()] == [len(greedy)] + list(greedy)
    assert [int(x) for x in lines["sampled_ids"].split()] == [len(sampled)] + list(sampled)
    assert lines["infer"].startswith("0 ") and lines["generate"].startswith("0 ")
    check("bad_path", 0, COLIBRI_ERR_INVALID_MODEL, "/nonexistent/model", "colibri convert")
    check("null_config", 0, BAD, "config is NULL")
    check("wrong_top_k", 0, BAD, "top_k=99", "1..8")
    check("wrong_num_experts", 0, BAD, "num_experts=7", "num_experts=8")
    np.testing.assert_array_equal(blob("top1.bin"), top1)              # top_k: an override
    assert lines["infer_top1"].startswith("0 ")
    check("bad_token", BAD, BAD, f"{V}", "out of range")
    check("zero_batch", BAD, BAD, "batch=0")
    check("zero_seq", BAD, BAD, "seq=0")
    check("null_logits", BAD, BAD, "logits is NULL")
    check("small_capacity", BAD, BAD, "out_capacity=4")
    check("null_handle", BAD, BAD, "0x0 is not open")
    check("forged_handle", BAD, BAD, "0x7 is not open")
    assert lines["ok_after_errors"].startswith("0 ")                   # the engine serves on after each mistake
    assert lines["destroy"].startswith("0 ")
    check("after_destroy", BAD, BAD, "is not open")
    check("destroy_twice", BAD, BAD, "is not open")
    return lines
