"""llama.cpp's own Hugging Face -> GGUF converter, fetched from PyPI and run in a subprocess.

`convert_hf_to_gguf.py`, its `conversion/` package and the vendored `gguf-py/` ship inside
llama-cpp-python's source distribution (vendor/llama.cpp/). `fetch()` downloads that sdist once
(sha256-checked), keeps only the converter's subtree in a cache and returns its directory;
`convert()` runs the converter on a checkpoint in a subprocess, because the vendored gguf-py is
newer than the venv's `gguf` package and shadows it (it must never be imported into the test process).

    python tests/llamacpp_convert.py fetch                          # set-up step: the only network access
    python tests/llamacpp_convert.py convert HF_DIR OUT.gguf [OUTTYPE [PRE]]

Monkeypatches make the converter work offline on a home-made tokenizer (see run_convert in
/work/notes/gguf-research-scripts/): the BPE pre-tokenizer hash check is bypassed (it only knows
published tokenizers) and returns PRE, a pre-tokenizer name llama.cpp knows ("gpt-2" matches
`tokenizers`' ByteLevel(use_regex=True)); and a missing sentencepiece makes the llama vocab path fall
through to the BPE path instead of crashing (LlamaModel tries sentencepiece first); ERNIE-4.5's
and Phi-3's (sentencepiece) and Hunyuan-MoE's (tiktoken) set_vocab take the BPE path on a tokenizer.json.

Standard library only in this process (the converter subprocess needs torch, numpy, transformers).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
# pinned: PyPI's JSON API must report the same digest, and the download must match it
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# what the converter needs (at import time and for our archs); models/templates holds chat templates
# a few converters (not ours) embed at run time: small, kept so every arch can convert
KEEP_FILES = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "LICENSE")
KEEP_DIRS = ("conversion/", "gguf-py/", "models/templates/")
STAMP = ".complete"
PYPI_JSON = f"https://pypi.org/pypi/{PACKAGE}/{VERSION}/json"
PYPI_PROJECT_JSON = f"https://pypi.org/pypi/{PACKAGE}/json"
CONVERT_TIMEOUT_S = 600


def cache_root(cache_dir=None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    env = os.environ.get("COLIBRI_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "colibri"


def converter_dir(cache_dir=None) -> pathlib.Path:
    """Where fetch() puts the converter (whether or not it is there yet)."""
    return cache_root(cache_dir) / f"llama.cpp-{VERSION}"


def is_fetched(cache_dir=None) -> bool:
    d = converter_dir(cache_dir)
    return (d / STAMP).is_file() and all((d / f).is_file() for f in KEEP_FILES)


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def _sdist_url() -> tuple[str, str]:
    """(url, sha256) of the sdist, from PyPI's JSON API (the per-version endpoint; some mirrors only
    serve the per-project one, whose releases[VERSION] has the same entries)."""
    try:
        base, files = PYPI_JSON, _get_json(PYPI_JSON)["urls"]
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        base, files = PYPI_PROJECT_JSON, _get_json(PYPI_PROJECT_JSON)["releases"][VERSION]
    for f in files:
        if f.get("packagetype") == "sdist":
            return urllib.parse.urljoin(base, f["url"]), f["digests"]["sha256"]
    raise RuntimeError(f"no sdist of {PACKAGE} {VERSION} on PyPI")


def _download(url: str, dest: pathlib.Path, sha256: str) -> None:
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as r, open(dest, "wb") as f:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != sha256:
        raise RuntimeError(f"sha256 mismatch for {url}: got {h.hexdigest()}, expected {sha256}")


def _wanted(rel: str) -> bool:
    return rel in KEEP_FILES or any(rel.startswith(d) for d in KEEP_DIRS)


def _extract(tarball: pathlib.Path, dest: pathlib.Path) -> int:
    n = 0
    with tarfile.open(tarball, "r:gz") as tf:
        for m in tf:                       # streaming: one pass over the 76 MB archive
            if not m.name.startswith(SDIST_ROOT) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(SDIST_ROOT):]
            if not rel or not _wanted(rel if m.isfile() else rel.rstrip("/") + "/"):
                continue
            if any(part in ("", "..") for part in rel.rstrip("/").split("/")):
                raise RuntimeError(f"unsafe member name {m.name!r}")
            m.name = rel
            tf.extract(m, dest, filter="data")
            n += m.isfile()
    return n


def fetch(cache_dir=None) -> pathlib.Path:
    """The directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (downloaded on first use).

    The tree is extracted into a temporary sibling and renamed into place once complete (with a
    stamp file inside), so a killed or failed download never looks finished; a second call is free."""
    final = converter_dir(cache_dir)
    if is_fetched(cache_dir):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    url, sha = _sdist_url()
    if sha != SDIST_SHA256:
        raise RuntimeError(f"PyPI reports sha256 {sha} for {PACKAGE} {VERSION}, pinned {SDIST_SHA256}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        tarball = tmp / "sdist.tar.gz"
        _download(url, tarball, SDIST_SHA256)
        tree = tmp / "tree"
        tree.mkdir()
        n = _extract(tarball, tree)
        if not (tree / "convert_hf_to_gguf.py").is_file() or not (tree / "gguf-py" / "gguf").is_dir():
            raise RuntimeError(f"the sdist lacks {SDIST_ROOT}convert_hf_to_gguf.py or gguf-py/ ({n} files kept)")
        (tree / STAMP).write_text(json.dumps({"package": PACKAGE, "version": VERSION, "sha256": SDIST_SHA256,
                                              "url": url, "files": n}) + "\n")
        if final.exists():                 # a stale, incomplete tree (no stamp): replace it
            if is_fetched(cache_dir):      # another process finished first
                return final
            shutil.rmtree(final)
        try:
            os.rename(tree, final)
        except OSError:
            if not is_fetched(cache_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _part(out_path: pathlib.Path) -> pathlib.Path:
    return out_path.with_name(out_path.name + ".part")


def convert_many(jobs, cache_dir=None) -> list:
    """Run several conversions in one converter subprocess (torch + transformers are imported once).
    jobs: iterable of (hf_dir, out_path[, outtype[, pre]]). Each GGUF is written to OUT.part and renamed
    into place when complete. Returns the out paths; raises with the converter's stderr on failure.
    Fetches the converter first if it is not cached yet (the only network access)."""
    jobs = [(str(j[0]), str(j[1]), *(str(x) for x in j[2:])) for j in jobs]
    if not jobs:
        return []
    fetch(cache_dir)
    env = dict(os.environ)
    if cache_dir is not None:
        env["COLIBRI_CACHE"] = str(cache_dir)
    outs = [pathlib.Path(j[1]) for j in jobs]
    for o in outs:                  # never mistake a stale file for this run's output
        o.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="llamacpp-convert-") as tmp:
        spec = pathlib.Path(tmp) / "jobs.json"
        spec.write_text(json.dumps(jobs))
        cmd = [sys.executable, os.path.abspath(__file__), "convert-many", str(spec)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CONVERT_TIMEOUT_S * len(jobs))
    missing = [str(o) for o in outs if not o.is_file()]
    if p.returncode != 0 or missing:
        names = ", ".join(j[0] for j in jobs)
        raise RuntimeError(f"llama.cpp convert_hf_to_gguf failed (rc={p.returncode}) on {names}; missing {missing}:\n"
                           f"{p.stderr[-8000:]}\n{p.stdout[-2000:]}")
    return outs


def convert(hf_dir, out_path, outtype: str = "f32", pre: str = "gpt-2", cache_dir=None) -> pathlib.Path:
    """Run llama.cpp's convert_hf_to_gguf on `hf_dir` into `out_path` (a subprocess); returns out_path.
    outtype: f32, f16, bf16, q8_0, tq1_0 or tq2_0 (the converter's own choices). pre: the
    tokenizer.ggml.pre name written (the hash check is bypassed)."""
    return convert_many([(hf_dir, out_path, outtype, pre)], cache_dir=cache_dir)[0]


def convert_lora(hf_dir, lora_dir, out_path, outtype: str = "f32", cache_dir=None) -> pathlib.Path:
    """llama.cpp's convert_lora_to_gguf.py on a PEFT adapter of the checkpoint at hf_dir (--base: only its
    config is read) into out_path, in a subprocess; returns out_path."""
    fetch(cache_dir)
    root = converter_dir(cache_dir)
    out = pathlib.Path(out_path)
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(root / "convert_lora_to_gguf.py"), "--base", str(hf_dir), "--outfile",
                        str(out), "--outtype", outtype, str(lora_dir)], cwd=str(root), env=env, capture_output=True,
                       text=True, timeout=CONVERT_TIMEOUT_S)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_lora_to_gguf failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return out


def _import_converter():
    """In the subprocess only: the vendored converter on sys.path, patched; returns its module."""
    if not is_fetched():
        raise SystemExit(f"llama.cpp converter not fetched into {converter_dir()}: "
                         f"run `python {os.path.basename(__file__)} fetch` first")
    root = str(converter_dir())
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]     # nothing of tests/ shadows
    sys.path.insert(0, os.path.join(root, "gguf-py"))      # vendored gguf-py before the venv's gguf
    sys.path.insert(0, root)                                # `conversion` and `convert_hf_to_gguf`
    if "gguf" in sys.modules:
        raise RuntimeError("a gguf package was imported before the vendored one")

    import conversion.base as cb
    import gguf
    if not os.path.abspath(gguf.__file__).startswith(os.path.abspath(root)):
        raise RuntimeError(f"imported {gguf.__file__}, not the vendored gguf-py")

    # 1) our tokenizers are not in the table of known pre-tokenizer hashes: the name comes from _PRE
    cb.TextModel.get_vocab_base_pre = lambda self, tokenizer: _PRE[0]
    # 2) sentencepiece is not installed: without a tokenizer.model, fall through to the BPE path
    orig_spm = cb.TextModel._create_vocab_sentencepiece

    def _spm(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")
        return orig_spm(self)
    cb.TextModel._create_vocab_sentencepiece = _spm
    # 3) ERNIE-4.5's set_vocab is sentencepiece only: without a tokenizer.model, the BPE path
    import conversion.ernie as ce
    orig_ernie = ce.Ernie4_5Model.set_vocab

    def _ernie_vocab(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            return self._set_vocab_gpt2()
        return orig_ernie(self)
    ce.Ernie4_5Model.set_vocab = _ernie_vocab
    # 4) Hunyuan-MoE's set_vocab reads a tiktoken tokenizer (mergeable_ranks) and writes Hunyuan-A13B's
    #    <|bos|> id (127959): a tokenizers BPE tokenizer takes the BPE path, its own special tokens kept
    import conversion.hunyuan as ch
    orig_hunyuan = ch.HunYuanMoEModel.set_vocab

    def _hunyuan_vocab(self):
        if not (self.dir_model / "tokenizer.json").is_file():
            return orig_hunyuan(self)
        return self._set_vocab_gpt2()
    ch.HunYuanMoEModel.set_vocab = _hunyuan_vocab
    # 5) Phi-3's (and PhiMoE's) set_vocab is sentencepiece unless tokenizer_config names GPT2Tokenizer
    import conversion.phi as cp
    orig_phi3 = cp.Phi3MiniModel.set_vocab

    def _phi3_vocab(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            return self._set_vocab_gpt2()
        return orig_phi3(self)
    cp.Phi3MiniModel.set_vocab = _phi3_vocab

    import convert_hf_to_gguf
    return convert_hf_to_gguf


_PRE = ["gpt-2"]


def _run_converter(jobs) -> None:
    c = _import_converter()
    for hf_dir, out_path, *rest in jobs:
        outtype = rest[0] if rest else "f32"
        _PRE[0] = rest[1] if len(rest) > 1 else "gpt-2"
        out = pathlib.Path(out_path)
        part = _part(out)
        sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(part), "--outtype", outtype]
        c.main()
        if not part.is_file():
            raise RuntimeError(f"the converter wrote no {part}")
        os.replace(part, out)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (f"usage: {os.path.basename(__file__)} fetch [CACHE_DIR]\n"
             f"       {os.path.basename(__file__)} convert HF_DIR OUT.gguf [OUTTYPE [PRE]]\n"
             f"       {os.path.basename(__file__)} convert-many JOBS.json   # [[HF_DIR, OUT, OUTTYPE, PRE], ...]")
    if argv[:1] == ["fetch"] and len(argv) <= 2:
        print(fetch(argv[1] if len(argv) > 1 else None))
        return 0
    if argv[:1] == ["convert"] and 3 <= len(argv) <= 5:
        _run_converter([argv[1:]])
        return 0
    if argv[:1] == ["convert-many"] and len(argv) == 2:
        with open(argv[1], encoding="utf-8") as f:
            _run_converter(json.load(f))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
