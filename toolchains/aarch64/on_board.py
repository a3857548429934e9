"""Runs inside the emulated board root through the bundle's launcher (bin/colibri-python on_board.py ...);
the host compares what it writes (toolchains/aarch64/check.py).

    parity DIR BACKENDS   DIR/model, DIR/ids.npy: Engine.infer on each backend -> DIR/<backend>.npy
    capi-ref MODEL OUT    the Engine's results for tests/capi_check.c's input (OUT/in.bin) -> OUT/ref_*.npy,
                          OUT/ref.json (greedy and seeded tokens, vocab)
    int8-dots DIR TAG FMTS  DIR/cases.npz (block-format weights and activations): the cpu backend's int8-
                          activation matmul of the cases of formats FMTS (comma list) -> DIR/out-TAG.npz,
                          and the int8 dot variant it used -> DIR/out-TAG.json
"""
import json
import os
import sys

import numpy as np

from colibri_edge import Engine


def parity(d, backends):
    ids = np.load(os.path.join(d, "ids.npy"))
    for b in backends.split(","):
        with Engine.open(os.path.join(d, "model"), backend=b) as eng:
            np.save(os.path.join(d, f"{b}.npy"), eng.infer(ids))
            print(f"{b}: {eng.backend.describe()}")


def capi_ref(model, out):
    raw = np.fromfile(os.path.join(out, "in.bin"), np.int32)
    ids = raw[2:].reshape(raw[0], raw[1])
    with Engine.open(model, backend="cpu") as eng:
        np.save(os.path.join(out, "ref_logits.npy"), eng.infer(ids))
        greedy = eng.generate(ids[0].tolist(), max_new_tokens=12)
        sampled = eng.generate(ids[0].tolist(), max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=7,
                               ignore_eos=True)
        vocab = eng.config["vocab_size"]
    with Engine.open(model, backend="cpu", top_k=1) as one:
        np.save(os.path.join(out, "ref_top1.npy"), one.infer(ids))
    with open(os.path.join(out, "ref.json"), "w") as f:
        json.dump({"greedy": greedy, "sampled": sampled, "vocab": vocab}, f)


def int8_dots(d, tag, formats):
    from colibri_edge.backends import create
    from colibri_edge.backends.cpu import qir
    be = create("cpu")
    cases = np.load(os.path.join(d, "cases.npz"))
    out = {}
    for name in sorted(k[:-2] for k in cases.files if k.endswith(".x")):
        fmt = name.split(":")[0]
        if fmt not in formats.split(","):
            continue
        raw, x = cases[name + ".w"], cases[name + ".x"]
        y = be.alloc((x.shape[0], raw.shape[0]))
        be.matmul(y, be.to_device(x, "float32"), be.upload(raw, fmt, shape=(raw.shape[0], x.shape[1])))
        out[name] = be.download(y)
    np.savez(os.path.join(d, f"out-{tag}.npz"), **out)
    with open(os.path.join(d, f"out-{tag}.json"), "w") as f:
        json.dump({"int8_dot": qir.INT8_DOT}, f)


if __name__ == "__main__":
    {"parity": parity, "capi-ref": capi_ref, "int8-dots": int8_dots}[sys.argv[1]](*sys.argv[2:])
