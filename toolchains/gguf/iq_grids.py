"""Writes colibri_edge/model/iq_grids.npz: the lattice grids of ggml's IQ1-IQ3 formats (data of the
format, as ggml-common.h defines them), taken from gguf-py (the format's own Python package), which
stores them packed. Run once when a grid changes upstream; tests/test_quant.py checks the file against
gguf-py's dequantisation, so a stale or damaged copy fails there.

    iq2xxs [256, 8] u8   values 8, 25, 43        iq3xxs [256, 4] u8   values 4 .. 62
    iq2xs  [512, 8] u8                           iq3s   [512, 4] u8   values 1 .. 15
    iq2s   [1024, 8] u8                          iq1s   [2048, 8] i8  values -1, 0, 1
"""
import os
import sys

import numpy as np
from gguf import quants

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "colibri_edge", "model", "iq_grids.npz")
SOURCES = {"iq2xxs": quants.IQ2_XXS, "iq2xs": quants.IQ2_XS, "iq2s": quants.IQ2_S, "iq3xxs": quants.IQ3_XXS,
           "iq3s": quants.IQ3_S, "iq1s": quants.IQ1_S}


def main():
    grids = {}
    for name, cls in SOURCES.items():
        cls.init_grid()
        g = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
        dt = np.int8 if name == "iq1s" else np.uint8
        grids[name] = g.astype(dt)
        assert np.array_equal(grids[name].astype(np.float32), g), name
    np.savez_compressed(OUT, **grids)
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
