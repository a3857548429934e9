"""Multi-token-prediction heads (program.MTPHead, Runner.mtp_step, draft.MtpDrafter): the head's logits
equal the published module computed outside Colibri, and drafting with it changes no token.

The oracle of the head: the module of the DeepSeek-V3 report (section 2.2) as vLLM and llama.cpp run
it, in torch on the checkpoint's own tensors, its decoder layer transformers' own layer class (a copy
of the model's last layer, loaded with the head's weights, called with the model's rope and causal
mask): h = the model's final-normed hidden state at position i (transformers' last_hidden_state),
    logits(t_{i+2}) = head @ norm(layer(eh_proj [enorm(embed(t_{i+1})); hnorm(h_i)]))
Checkpoints: a Mixtral and DeepSeek-V3 (latent attention) with a nextn layer after the decoder's, and
Qwen3.5 (hybrid: recurrent layers; zero-centred norms) with its mtp.* tensors."""
import copy
import os

import numpy as np
import pytest

from colibri_edge.errors import ColibriError, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.requests.engine import Engine
from helpers import fp32
from hf_models import checkpoint_class, convert_case

CASES = ["mixtral_mtp", "deepseek_v3_mtp", "qwen3_5_moe_mtp"]


def reference_mtp_logits(hf: str, ids: np.ndarray, tmp: str) -> np.ndarray:
    """[T-1, V]: row i the head's logits at position i (token ids[i+1], the model's hidden at i). The
    head's decoder layer is transformers' own: the checkpoint loaded with one more layer (Qwen3.5's
    mtp.layers.0 renamed to that layer, a full-attention one), so transformers reads its weights."""
    import json
    import shutil
    import torch
    from safetensors.numpy import load_file, save_file
    cls = checkpoint_class(hf)
    model = cls.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    L = cfg.num_hidden_layers
    raw = load_file(os.path.join(hf, "model.safetensors"))
    extra = {"num_hidden_layers": L + 1}
    if any(k.startswith("mtp.") for k in raw):                 # Qwen3.5's names
        pre = "mtp."
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "norm": "norm"}
        os.makedirs(tmp, exist_ok=True)
        for f in os.listdir(hf):
            if f != "model.safetensors":
                shutil.copy(os.path.join(hf, f), tmp)
        save_file({(f"model.layers.{L}." + k[len("mtp.layers.0."):] if k.startswith("mtp.layers.0.") else k): v
                   for k, v in raw.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        extra["layer_types"] = list(json.load(open(os.path.join(hf, "config.json")))["layer_types"]) + \
            ["full_attention"]
        longer = tmp
    else:                                                      # DeepSeek-V3's
        pre = f"model.layers.{L}."
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
        longer = hf
    w = {k: torch.from_numpy(raw[pre + v + ".weight"].astype(np.float32)) for k, v in names.items()}
    layer = cls.from_pretrained(longer, dtype=torch.float32, attn_implementation="eager", **extra).model.layers[L]
    base = model.model
    seen = {}
    hook = base.layers[L - 1].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    x = torch.as_tensor(ids[None, :-1], dtype=torch.long)
    with torch.no_grad():
        h = base(x, use_cache=False).last_hidden_state                          # final-normed, positions 0..T-2
        hook.remove()

        def norm(v, weight):
            n = copy.deepcopy(base.norm)
            n.weight.copy_(weight)
            return n(v)
        e = base.embed_tokens(torch.as_tensor(ids[None, 1:], dtype=torch.long))
        y = torch.cat([norm(e, w["enorm"]), norm(h, w["hnorm"])], dim=-1) @ w["eh_proj"].T
        y = layer(y, **{k: v for k, v in seen.items() if k not in ("hidden_states", "cache", "past_key_values",
                                                                   "use_cache")})
        y = y[0] if isinstance(y, tuple) else y
        return model.lm_head(norm(y, w["norm"]))[0].numpy()


@pytest.mark.parametrize("case", CASES)
def test_mtp_head_equals_the_published_module(backend_name, case, model_cache):
    hf, col = convert_case(model_cache, case)
    ids = np.random.default_rng(3).integers(3, 80, 12).astype(np.int32)
    want = reference_mtp_logits(hf, ids, os.path.join(model_cache, f"mtp_ref_{case}"))
    with Engine.open(col, backend=backend_name, draft="mtp", max_seq_len=64, **fp32(backend_name)) as eng:
        runner = eng.runner
        seq = runner.new_sequence(0)
        runner.reserve(seq, len(ids))
        runner.step([(seq, ids[:-1])])
        rows = runner.row_of[id(seq)] + np.arange(len(ids) - 1)
        got = np.array(eng.backend.host_view(runner.mtp_step([(seq, 0, ids[1:], rows)], all_logits=True)))
        runner.free(seq)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert np.abs(want).max() > 0.5                            # logits of a size that tests something


@pytest.mark.parametrize("case", CASES)
def test_mtp_drafting_changes_no_token(backend_name, case, model_cache):
    """Greedy tokens with the head drafting equal the undrafted ones, in a batch of three requests (one
    not drafting); on the batch-invariant backends the logprobs too; the head proposed drafts, and the
    model verified them."""
    _, col = convert_case(model_cache, case)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in (9, 17, 5)]
    opts = dict(backend=backend_name, max_batch=4, max_seq_len=96, **fp32(backend_name))

    def run(eng, **kw):
        reqs = [eng.submit(p, max_new_tokens=20, ignore_eos=True, logprobs=True, **(kw if i < 2 else {}))
                for i, p in enumerate(prompts)]
        return [[(ev.token, ev.logprob) for ev in r.iter_events() if ev.kind == "token"] for r in reqs]
    with Engine.open(col, **opts) as eng:
        want = run(eng)
    with Engine.open(col, draft="mtp", draft_tokens=3, **opts) as eng:
        got = run(eng, draft="mtp")
        last = run(eng, draft="off")
        st = eng.stats
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
    assert [[t for t, _ in g] for g in last] == [[t for t, _ in w] for w in want]
    if backend_name in ("reference", "cpu"):
        assert got == want
    assert st.draft_proposed > 0 and st.draft_steps > 0


def test_mtp_needs_a_head_and_an_engine_that_runs_it(model_cache):
    _, plain = convert_case(model_cache, "mixtral")
    with pytest.raises(ColibriError) as e:
        Engine.open(plain, backend="cpu", draft="mtp")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "no multi-token-prediction head" in e.value.message
    _, col = convert_case(model_cache, "mixtral_mtp")
    with Engine.open(col, backend="cpu", max_seq_len=64) as eng:
        assert eng.runner.mtp is False                          # off: the head is not loaded
        with pytest.raises(ColibriError) as e:
            eng.generate([5, 6, 7], max_new_tokens=2, draft="mtp")
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "draft='mtp'" in e.value.message
    with pytest.raises(ColibriError) as e:
        Engine.open(col, backend="cpu", draft="mtp", expert_slots=6)
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE
