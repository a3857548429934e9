"""A GGUF file is a model too: `Engine.open("FILE.gguf")`, `colibri run --model FILE.gguf` and
`colibri serve --model FILE.gguf` convert the file once (gguf_import.convert_gguf: every matrix kept in
its stored type, nothing requantised) into a model directory under the cache and reuse it after.

    where   $COLIBRI_CACHE_DIR/gguf, else $XDG_CACHE_HOME/colibri-edge/gguf, else ~/.cache/colibri-edge/gguf;
            one directory a file: <file stem>-<key>
    key     sha256 over the Colibri version, each part's name, size and mtime (a split model's parts
            -0000k-of-0000N all count) and the first MiB of the first part (its header): a file replaced,
            touched or converted by another Colibri version gets a new directory, and the old one of the
            same source path is removed once the new one is complete
    disk    the conversion needs about the file's size; convert_gguf refuses before writing anything, with
            both numbers, when the disk has less (COLIBRI_ERR_OUT_OF_MEMORY)
    races   built in <dir>.part-<pid> and renamed into place, so two processes opening the same file
            never read a half-written directory (the first rename wins; the other's copy is dropped)

Any other path (a model directory) is returned as it is.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

HEADER_BYTES = 1 << 20
SOURCE_FILE = "gguf_source.json"          # in each cached directory: the file it came from, and its key


def cache_base() -> str:
    """Colibri's cache: $COLIBRI_CACHE_DIR, else $XDG_CACHE_HOME/colibri-edge, else ~/.cache/colibri-edge."""
    root = os.environ.get("COLIBRI_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
                            "colibri-edge")
    return root


def cache_root() -> str:
    return os.path.join(cache_base(), "gguf")


def is_gguf(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(".gguf") and os.path.isfile(path)


def identity(path: str) -> str:
    """The cache key of a GGUF file (or of the split model whose part it is)."""
    from .. import __version__
    from .gguf_import import split_parts
    parts = split_parts(path)
    h = hashlib.sha256(f"colibri-edge {__version__}".encode())
    for p in parts:
        st = os.stat(p)
        h.update(f"|{os.path.basename(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(parts[0], "rb") as f:
        h.update(f.read(HEADER_BYTES))
    return h.hexdigest()[:20]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _say(msg: str, quiet: bool):
    if not quiet:
        print(f"[colibri] {msg}", file=sys.stderr, flush=True)


def model_source(path, progress: bool = True, quiet: bool = False):
    """A model directory for `path`: a GGUF file's cached conversion (made now if missing), else path."""
    if not is_gguf(path):
        return path
    from .gguf_import import SPLIT, convert_gguf
    src = os.path.realpath(path)
    key = identity(src)
    m = SPLIT.match(os.path.basename(src))
    stem = m["stem"] if m else os.path.basename(src)[:-len(".gguf")]
    root = cache_root()
    out = os.path.join(root, f"{stem}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(os.path.join(out, SOURCE_FILE)):
        _say(f"{path}: using its conversion in {out}", quiet)
        return out
    os.makedirs(root, exist_ok=True)
    part = f"{out}.part-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    _say(f"{path}: converting once into {out} (each matrix in its stored type)", quiet)
    try:
        convert_gguf(src, part, progress=progress)
        with open(os.path.join(part, SOURCE_FILE), "w") as f:
            json.dump({"source": src, "key": key}, f)
        try:
            os.rename(part, out)
        except OSError:                      # another process finished first: use its directory
            if not os.path.isfile(os.path.join(out, SOURCE_FILE)):
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
    for name in os.listdir(root):            # older conversions of the same file (replaced, or another version)
        old = os.path.join(root, name)
        if name.startswith(f"{stem}-") and old != out and ".part-" not in name:
            try:
                with open(os.path.join(old, SOURCE_FILE)) as f:
                    if json.load(f).get("source") == src:
                        shutil.rmtree(old, ignore_errors=True)
            except (OSError, ValueError):
                pass
    _say(f"{path}: converted into {out}, {_dir_bytes(out) / 2**30:.2f} GiB on disk; reused while the file "
         "is unchanged (delete the directory to free the space)", quiet)
    return out
