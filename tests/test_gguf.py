"""`colibri convert MODEL.gguf` on files made by llama.cpp's own converter (convert_hf_to_gguf.py, from
tiny random Hugging Face models; tests/gguf_models.py), re-encoded to every block format by gguf-py
(32-blocks) or our quantisers (K-quants). The oracle of a file is the file itself: its tensors
dequantised by gguf.quants.dequantize, mapped back to the checkpoint's names (q/k un-permuted for
arch llama) and run by transformers, so Colibri must agree within float32 rounding on every backend
that runs the formats. The tokenizer against AutoTokenizer.from_pretrained(..., gguf_file=...), and
every malformed file a coded error naming the field."""
import os
import shutil
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf extra is part of make test's install")

from colibri_edge import (ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL,  # noqa: E402
                          COLIBRI_ERR_INVALID_MODEL_TYPE, COLIBRI_ERR_UNAVAILABLE, Engine)
from colibri_edge.backends import backend_class  # noqa: E402
from colibri_edge.model.convert import _q4_k_m, convert  # noqa: E402
from colibri_edge.model.gguf_import import EOG_TEXTS, gguf_names  # noqa: E402
from colibri_edge.model.modeldir import ModelDir  # noqa: E402
import gguf_models as gm  # noqa: E402
from gguf_models import gguf_cases  # noqa: E402,F401  (the session fixture)
from helpers import activation_runs, close  # noqa: E402

TOL = 1e-4
# every architecture as the converter writes it, and each block format on a K-quant-sized model of
# some architecture (each format once, each architecture at least twice)
CASES = [(c, "f32") for c in gm.ARCHS] + [(c, "q8_0") for c in gm.ARCHS] + [("olmoe", "bf16"), ("qwen3_moe", "f16")] + [
    ("mixtral_k", "q4_k"), ("mixtral_k", "q5_0"), ("qwen2_moe_k", "q6_k"), ("qwen2_moe_k", "q4_1"),
    ("qwen3_moe_k", "q5_k"), ("qwen3_moe_k", "mxfp4"), ("olmoe_k", "q4_0"), ("olmoe_k", "q5_1"),
    ("mixtral8_k", "q4_k_m"), ("qwen2_moe_k", "q4_k_m"), ("mixtral_k", "ud_mix"), ("qwen2_moe_k", "ud_mix"),
    ("olmoe_k", "iq4_nl"), ("qwen3_moe_k", "iq_mix"), ("qwen3_moe_k", "iq_mix_pairs")]
_done = {}


def _q4_k_m_file(cases, case):
    """A Q4_K_M file: llama.cpp's per-tensor rule (convert._q4_k_m, itself tested against llama.cpp's
    table in test_block_formats.py) applied to the converter's f32 file."""
    f32 = cases(case, "f32")
    col = _import(cases, case, "f32")
    cfg = ModelDir(col).config
    ours = {v: k for k, v in gguf_names(cfg).items()}
    Q = gguf.GGMLQuantizationType
    names = {"float16": Q.F16, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "q5_0": Q.Q5_0,
             "q5_1": Q.Q5_1}

    def type_of(name, shape):
        if name.endswith("_exps.weight"):
            i, part = name.split(".")[1], name.split(".")[2].split("_")[1]
            mine = f"layers.{i}.experts.{part}"
        else:
            mine = ours.get(name)
        roles = {"embed_tokens", "lm_head"}
        if mine is None or not (mine in roles or mine.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "gate", "up",
                                                                            "down")):
            return None
        return names[_q4_k_m(cfg, mine, shape[-1])]
    out = f32.gguf.with_name(f"{case}-q4_k_m.gguf")
    if not out.exists():
        gm.requantize(f32.gguf, out, type_of, file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)
    return out


def _file(cases, case, outtype):
    return _q4_k_m_file(cases, case) if outtype == "q4_k_m" else cases(case, outtype).gguf


def _import(cases, case, outtype):
    key = (case, outtype)
    if key not in _done:
        path = _file(cases, case, outtype)
        out = str(path.with_name(path.stem + "-colibri"))
        convert(str(path), out, progress=False)
        _done[key] = out
    return _done[key]


def _oracle(cases, case, outtype):
    path = _file(cases, case, outtype)
    d = path.with_name(path.stem + "-oracle")
    if not (d / "config.json").exists():
        gm.oracle_checkpoint(path, cases(case, "f32").hf_dir, d)
    return d


@pytest.mark.parametrize("case,outtype", CASES, ids=[f"{c}-{o}" for c, o in CASES])
def test_gguf_matches_transformers_on_the_file(engine_variant, case, outtype, gguf_cases):
    name, opts = engine_variant
    col = _import(gguf_cases, case, outtype)
    m = ModelDir(col)
    cls = backend_class(name)
    if outtype == "iq_mix_pairs":       # every lattice type, an FFN's gate and up alike: every backend runs it
        assert {t.lower() for t in gm.IQ_MIX} <= m.formats and not m.gate_up_splits
    if not m.formats <= set(cls.weight_dtypes) or m.gate_up_splits and not cls.mixed_gate_up:
        with pytest.raises(ColibriError) as e:          # not (yet) on this backend: said at open
            Engine.open(col, backend=name)
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE
        if m.formats <= set(cls.weight_dtypes):        # the formats run, apart: said so, naming an FFN
            assert "gate as" in str(e.value) and "cpu" in str(e.value)
        return
    if outtype not in ("f32", "f16", "bf16"):
        assert m.formats - {"float32"}, "the file was not quantised"
    ids = np.random.default_rng(5).integers(0, m.config["vocab_size"], (2, 12))
    want = gm.hf_logits(_oracle(gguf_cases, case, outtype), ids)
    assert np.abs(want).max() > 1.0
    for o, tol in activation_runs(name, opts, TOL):
        with Engine.open(col, backend=name, max_seq_len=64, **o) as eng:
            got = eng.infer(ids)
            steps = eng.infer([ids[1][:2]])[0]            # the decode path
        assert close(got, want, tol) and close(steps, want[1, :2], tol), o
        if tol == TOL:
            assert (got.argmax(-1) == want.argmax(-1)).all()         # teacher-forced greedy agreement


@pytest.mark.parametrize("case,outtype", [("mixtral_k", "q4_k"), ("qwen2_moe_k", "q6_k"), ("mixtral8_k", "q4_k_m"),
                                          ("mixtral_k", "ud_mix")])
def test_gguf_blocks_are_copied_not_requantised(case, outtype, gguf_cases):
    """Every matrix lands in the directory byte for byte as the file stores it (q/k rows moved only)."""
    path = _file(gguf_cases, case, outtype)
    m = ModelDir(_import(gguf_cases, case, outtype))
    r = gguf.GGUFReader(str(path))
    by = {t.name: t for t in r.tensors}
    names = gguf_names(m.config)
    for ours, g in names.items():
        if ours not in m.tensors or ours.rsplit(".", 1)[-1] in ("wq", "wk", "bq", "bk"):
            continue
        t = by[g]
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        assert m.tensor_dtype(ours) == t.tensor_type.name.lower(), ours
        np.testing.assert_array_equal(m.raw_tensor(ours).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))
    t = by["blk.0.ffn_down_exps.weight"]
    E = m.config["experts_per_layer"]
    from colibri_edge.model.modeldir import split_expert_blob_scaled
    for j in range(E):
        blob = m.expert_blob(0, j)
        down = split_expert_blob_scaled(blob, m.config["hidden_size"], m.config["moe_intermediate_size"],
                                        m.layer_formats[0])[2][0]
        np.testing.assert_array_equal(down, np.asarray(t.data)[j])
        assert m.expert_record(0, j).weight_offset % 4096 == 0


@pytest.mark.parametrize("case,outtype,types", [
    ("mixtral_k", "ud_mix", {"q2_k", "q3_k", "iq4_xs", "iq4_nl", "tq2_0", "tq1_0", "nvfp4"}),
    ("mixtral_k", "iq_mix", {"iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"})])
def test_a_dynamic_mix_of_types_runs_from_the_slot_pool(gguf_cases, case, outtype, types):
    """An unsloth-style file (every matrix its own type: Q2_K, Q3_K, IQ4_XS, IQ4_NL, TQ2_0, TQ1_0, NVFP4,
    Q4_K, Q6_K; or the lattice i-quants, random valid blocks; gate, up and down of a layer differing):
    the experts' blobs hold each matrix as stored, and two expert slots with real misses give the
    file's logits, as the resident engine does."""
    col = _import(gguf_cases, case, outtype)
    m = ModelDir(col)
    assert types <= m.formats
    assert any(len(set(f)) > 1 for f in m.layer_formats.values() if f)
    ids = np.random.default_rng(6).integers(0, m.config["vocab_size"], (1, 10))
    want = gm.hf_logits(_oracle(gguf_cases, case, outtype), ids)
    for b in ("reference", "cpu"):
        for o, tol in activation_runs(b, {}, TOL):
            with Engine.open(col, backend=b, max_seq_len=32, expert_slots=2, **o) as eng:
                got = eng.infer(ids)
                assert eng.slot_stats["misses"] > 0
            assert close(got, want, tol), (b, o)


def test_q4_k_m_file_mixes_formats_across_layers(gguf_cases):
    m = ModelDir(_import(gguf_cases, "mixtral8_k", "q4_k_m"))
    assert m.config["weight_dtype"] == "q4_k_m"
    assert {"q4_k", "q6_k", "q8_0", "q5_k"} <= m.formats
    assert m.layer_formats[0] != m.layer_formats[1]                # ffn_down: q4_k in one, q6_k in the other
    assert len({m.layer_blob_bytes(0), m.layer_blob_bytes(1)}) == 2


# -- the tokenizer -------------------------------------------------------------------------------

TEXTS = ["Hello world", "the quick brown fox", "日本語のテキスト 中文 한국어", "emoji 🤗🎉🐦 ok", "Café naïve über",
         "def f(x):\n    return x**2  # code\n", "<|im_start|>user\nhi<|im_end|>", "<s> bos and </s> eos",
         "  leading spaces\t\ttabs\n\nnewlines ", "", "a" * 300, "numbers 0 1 2 3 100 1000 and + - * / = ( )"]


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_gguf_tokenizer_is_transformers(case, gguf_cases):
    """The same ids as AutoTokenizer.from_pretrained(dir, gguf_file=...), the same rendered chat
    template (transformers 5.24 cannot build OLMoE's from a GGUF: see the next test)."""
    from transformers import AutoTokenizer
    path = gguf_cases(case, "q8_0").gguf
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    col = _import(gguf_cases, case, "q8_0")
    with Engine.open(col, backend="reference") as eng:
        for t in TEXTS:
            assert eng.codec.encode(t) == ref.encode(t), t
            assert eng.codec.decode(ref.encode(t)) == ref.decode(ref.encode(t), skip_special_tokens=True), t
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🐦"}]
        assert eng.codec.render_chat(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert eng.chat(msgs, max_new_tokens=3, ignore_eos=True) is not None


def test_gguf_tokenizer_of_olmoe_is_the_original(gguf_cases):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(gguf_cases("olmoe", "f32").hf_dir))
    with Engine.open(_import(gguf_cases, "olmoe", "f32"), backend="reference") as eng:
        for t in TEXTS:
            assert eng.codec.encode(t) == ref.encode(t), t


def test_gguf_end_of_generation_ids(gguf_cases, tmp_path):
    """Every id llama.cpp ends generation at (eos from the metadata, and the end-of-turn spellings it
    recognises: </s>, <|im_end|>, <|eot_id|>, <|endoftext|>), and generation stops at each: the
    lm_head rows of a token the model emits and of the end id swapped, greedy decoding then emits
    the end id at that step and stops there."""
    case = "qwen2_moe"
    path = gguf_cases(case, "f32").gguf
    r = gguf.GGUFReader(str(path))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    want = {tokens.index(t) for t in ("</s>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")}
    want |= {r.fields["tokenizer.ggml.eos_token_id"].contents()}
    src = _import(gguf_cases, case, "f32")
    assert set(ModelDir(src).config["eos_token_ids"]) == want
    assert all(tokens[i] in EOG_TEXTS or tokens[i] == "</s>" for i in want)
    prompt = [7, 40, 41, 42]
    with Engine.open(src, backend="reference") as eng:
        first = eng.generate(prompt, max_new_tokens=1, ignore_eos=True)[0]
    for e in sorted(want):
        d = tmp_path / f"eog{e}"
        shutil.copytree(src, d)
        m = ModelDir(str(d))
        rec = m.tensors["lm_head"]
        V, H = rec["shape"]
        w = np.memmap(d / "colibri_weights.bin", np.float32, "r+", rec["offset"], V * H).reshape(V, H)
        w[[first, e]] = w[[e, first]]               # the end id now wins where `first` did
        w.flush()
        del w, m
        for b in ("reference", "cpu"):
            with Engine.open(str(d), backend=b) as eng:
                assert eng.generate(prompt, max_new_tokens=8) == [e], (b, e)
                assert len(eng.generate(prompt, max_new_tokens=8, ignore_eos=True)) == 8


# -- malformed files -----------------------------------------------------------------------------

def _bad(tmp_path, data, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(ColibriError) as e:
        convert(str(p), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out" / "config.json").exists()
    return e.value


def _tensor_info_offset(path, index=0):
    """Byte offset of tensor `index`'s info (name) record and its fields, from gguf-py's own parse."""
    r = gguf.GGUFReader(str(path))
    f = r.tensors[index].field
    return r.tensors[index].name, f.offset, [int(p.nbytes) for p in f.parts]


def test_bad_gguf_files_are_coded_errors_naming_the_field(tmp_path, gguf_cases):
    path = gguf_cases("mixtral", "q8_0").gguf
    data = path.read_bytes()
    e = _bad(tmp_path, data[:100])
    assert e.code == COLIBRI_ERR_INVALID_MODEL and "(header)" in str(e)
    e = _bad(tmp_path, data[:len(data) - 4000])
    assert e.code == COLIBRI_ERR_INVALID_MODEL and "past the end of the file" in str(e) and "blk." in str(e)
    e = _bad(tmp_path, b"GGUX" + data[4:])
    assert e.code == COLIBRI_ERR_INVALID_MODEL and "'magic'" in str(e)
    name, off, parts = _tensor_info_offset(path)
    type_at = off + sum(parts[:4])                      # name_len, name, n_dims, dims, | type |, offset
    for tid, what in ((250, "not a GGML type"), (int(gguf.GGMLQuantizationType.Q8_K), "Q8_K")):
        b = bytearray(data)
        b[type_at:type_at + 4] = struct.pack("<I", tid)
        e = _bad(tmp_path, bytes(b))
        assert e.code == COLIBRI_ERR_INVALID_MODEL and name in str(e) and what in str(e), str(e)
    dims_at = off + sum(parts[:3])
    b = bytearray(data)
    d0 = struct.unpack_from("<Q", b, dims_at)[0]
    struct.pack_into("<Q", b, dims_at, d0 // 2)          # half the row: no longer what the metadata implies
    e = _bad(tmp_path, bytes(b))
    assert e.code == COLIBRI_ERR_INVALID_MODEL and name in str(e) and "metadata implies" in str(e)
    i = data.find(b"llama.embedding_length")
    b = bytearray(data)
    b[i:i + 5] = b"xlama"
    e = _bad(tmp_path, bytes(b))
    assert e.code == COLIBRI_ERR_INVALID_MODEL and "llama.embedding_length" in str(e) and "missing" in str(e)
    i = data.find(b"llama.expert_used_count")
    b = bytearray(data)
    b[i:i + 5] = b"xlama"
    e = _bad(tmp_path, bytes(b))
    assert "llama.expert_used_count" in str(e)


def test_unsupported_gguf_architectures_and_features(tmp_path, gguf_cases):
    path = gguf_cases("mixtral", "f32").gguf
    data = path.read_bytes()
    i = data.find(b"llama.expert_count")
    b = bytearray(data)
    b[i:i + 5] = b"xlama"                                     # no experts: a dense llama
    e = _bad(tmp_path, bytes(b))
    assert e.code == COLIBRI_ERR_INVALID_MODEL_TYPE and "expert_count" in str(e)
    src = gguf.GGUFReader(str(path))
    arch = src.fields["general.architecture"]
    at = arch.offset + sum(int(p.nbytes) for p in arch.parts[:-1])
    b = bytearray(data)
    b[at:at + 5] = b"gemma"                                   # same length: llama -> gemma
    e = _bad(tmp_path, bytes(b))
    assert e.code == COLIBRI_ERR_INVALID_MODEL_TYPE and "gemma" in str(e)
    with pytest.raises(ColibriError) as e2:
        convert(str(path), str(tmp_path / "o2"), dtype="q4_k", progress=False)
    assert e2.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "no requantisation" in str(e2.value)


def test_split_gguf(tmp_path, gguf_cases):
    src = gguf_cases("qwen3_moe", "q8_0").gguf
    gm.rewrite_gguf(src, tmp_path / "m.gguf", split_max_tensors=7)
    parts = sorted(p.name for p in tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    convert(str(tmp_path / parts[0]), str(tmp_path / "split"), progress=False)
    whole = _import(gguf_cases, "qwen3_moe", "q8_0")
    ids = np.arange(3, 13)
    with Engine.open(str(tmp_path / "split"), backend="reference") as a, Engine.open(whole, backend="reference") as b:
        np.testing.assert_array_equal(a.infer(ids), b.infer(ids))
    os.remove(tmp_path / parts[-1])
    with pytest.raises(ColibriError) as e:
        convert(str(tmp_path / parts[0]), str(tmp_path / "split2"), progress=False)
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and parts[-1] in str(e.value)


def test_general_alignment_is_honoured(tmp_path, gguf_cases):
    """A file written with general.alignment 256 (the converter's default is 32)."""
    src = gguf_cases("olmoe", "q8_0").gguf
    gm.rewrite_gguf(src, tmp_path / "a.gguf", alignment=256)
    back = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    assert back.alignment == 256 and all(t.data_offset % 256 == 0 for t in back.tensors)
    convert(str(tmp_path / "a.gguf"), str(tmp_path / "out"), progress=False)
    ids = np.arange(2, 9)
    with Engine.open(str(tmp_path / "out"), backend="cpu") as a, \
            Engine.open(_import(gguf_cases, "olmoe", "q8_0"), backend="cpu") as b:
        np.testing.assert_array_equal(a.infer(ids), b.infer(ids))


def test_convert_refuses_without_disk_space(tmp_path, gguf_cases, monkeypatch):
    import shutil as sh
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(ColibriError) as e:
        convert(str(gguf_cases("olmoe", "f32").gguf), str(tmp_path / "out"), progress=False)
    assert "GiB free" in str(e.value)
    assert not (tmp_path / "out" / "colibri_weights.bin").exists()
    with pytest.raises(ColibriError):
        convert(str(gguf_cases("olmoe", "f32").hf_dir), str(tmp_path / "out2"), progress=False)


def test_a_gguf_file_opens_as_a_model_through_the_cache(tmp_path, gguf_cases, monkeypatch, capsys):
    """Engine.open("FILE.gguf") converts once into $COLIBRI_CACHE_DIR/gguf/<stem>-<key> (saying where and
    how much disk it took), reuses it after, converts again when the file changes (dropping the old
    copy), takes a split model by any part, and refuses with the numbers when the disk is too small."""
    from colibri_edge.model.gguf_cache import cache_root, model_source
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    shutil.copy(gguf_cases("qwen3_moe", "q8_0").gguf, src)
    ids = np.arange(3, 11)
    with Engine.open(_import(gguf_cases, "qwen3_moe", "q8_0"), backend="reference") as eng:
        want = eng.infer(ids)
    with Engine.open(str(src), backend="reference") as eng:
        np.testing.assert_array_equal(eng.infer(ids), want)
        first = eng.path
    err = capsys.readouterr().err
    assert os.path.dirname(first) == cache_root() and os.path.basename(first).startswith("m-")
    assert "converted into" in err and "GiB on disk" in err
    assert model_source(str(src)) == first and "using its conversion" in capsys.readouterr().err
    from colibri_edge.serving.cli import main          # colibri run FILE.gguf: the same directory
    main(["run", str(src), "--backend", "reference", "--ids", "--prompt", "3 4 5", "--max-new-tokens", "2",
          "--temperature", "0"])
    assert f"using its conversion in {first}" in capsys.readouterr().err
    os.utime(src, ns=(1, 1))                                       # the file changed: a new key
    second = model_source(str(src), progress=False)
    assert second != first and not os.path.exists(first) and os.path.exists(os.path.join(second, "config.json"))
    gm.rewrite_gguf(gguf_cases("qwen3_moe", "q8_0").gguf, tmp_path / "s.gguf", split_max_tensors=9)
    parts = sorted(tmp_path.glob("s-*-of-*.gguf"))
    split = model_source(str(parts[-1]), progress=False)         # any part names the model
    with Engine.open(split, backend="reference") as eng:
        np.testing.assert_array_equal(eng.infer(ids), want)
    assert model_source(str(tmp_path / "dir"), quiet=True) == str(tmp_path / "dir")   # not a GGUF file: as given
    import shutil as sh
    from collections import namedtuple
    monkeypatch.setattr(sh, "disk_usage", lambda p: namedtuple("u", "total used free")(1 << 30, 1 << 30, 4096))
    os.utime(src, ns=(2, 2))
    with pytest.raises(ColibriError) as e:
        model_source(str(src), progress=False)
    assert "GiB free" in str(e.value) and "needs" in str(e.value)
    assert not [p for p in os.listdir(cache_root()) if ".part-" in p]
