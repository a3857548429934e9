"""The Python API as README.md documents it (issue 47, item 9), on the shipped demo model (a tokenizer,
a chat template, readable ASCII text) with the reference backend: infer's return type, where
generation past the context ends and how the caller sees it, stop strings cut from text results, the
events' top_logprobs, and closing an AsyncEngine with `with` and `async with`."""
import asyncio

import numpy as np
import pytest

from colibri_edge import AsyncEngine, ColibriError, Engine, COLIBRI_ERR_INVALID_ARGUMENT
from colibri_edge.model.demo import SHIPPED
from colibri_edge.requests.scheduler import TOKEN

CHAT = [{"role": "user", "content": "Write a function that adds two numbers"}]
PROMPT = "Return a new list"


@pytest.fixture(scope="module")
def eng():
    with Engine.open(SHIPPED, backend="reference", max_seq_len=256) as e:
        yield e


def _stop_inside(text: str, at: int, n: int = 4) -> str:
    """A stop string of n characters from text at `at` or after, starting with a letter, whose first
    occurrence is there."""
    for i in range(at, len(text) - n):
        s = text[i:i + n]
        if text.find(s) == i and s[0].isalpha():
            return s
    raise AssertionError(f"no fresh {n}-character string in {text!r}")


def test_infer_returns_the_documented_float32_array(eng):
    """README: `engine.infer([[1, 2, 3, 4]])` -> float32 [batch, seq, vocab], nested lists as an
    array; only sequences of different lengths come back as a list, one [len, vocab] array each."""
    V = eng.config["vocab_size"]
    one = eng.infer([[1, 2, 3, 4]])
    assert isinstance(one, np.ndarray) and one.dtype == np.float32 and one.shape == (1, 4, V)
    two = eng.infer([[1, 2, 3, 4], (9, 8, 7, 6)])
    assert isinstance(two, np.ndarray) and two.dtype == np.float32 and two.shape == (2, 4, V)
    arr = eng.infer(np.array([[1, 2, 3, 4], [9, 8, 7, 6]], np.int32))
    np.testing.assert_array_equal(two, arr)              # reference: a row's logits are batch invariant
    np.testing.assert_array_equal(one[0], arr[0])
    ragged = eng.infer([[1, 2, 3], [9, 8, 7, 6]])
    assert isinstance(ragged, list) and [(r.dtype, r.shape) for r in ragged] == [(np.float32, (3, V)),
                                                                                (np.float32, (4, V))]
    np.testing.assert_array_equal(ragged[1], arr[1])
    np.testing.assert_array_equal(ragged[0], arr[0, :3])  # causal: a prefix's logits are the prefix's rows


def test_generation_past_the_context_ends_with_finish_reason_length(eng):
    """generate(max_new_tokens=600, ignore_eos=True) on a 48-token context: it ends where the context is
    full (48 positions hold the prompt and all but the last id), with finish_reason "length", as colibri
    serve does; the ids are those a large context gives. Finished by max_new_tokens: "length"; by an
    end-of-sequence id or a stop string (even on the last token allowed): "stop"."""
    prompt = eng.codec.encode(PROMPT)
    with Engine.open(SHIPPED, backend="reference", max_seq_len=48) as small:
        ids = small.generate(prompt, max_new_tokens=600, ignore_eos=True)
        batch = small.generate_batch([prompt], max_new_tokens=600, ignore_eos=True)
    assert ids.finish_reason == "length" and len(ids) == 48 - len(prompt) + 1
    assert ids == eng.generate(prompt, max_new_tokens=len(ids), ignore_eos=True)
    assert batch == [ids] and batch[0].finish_reason == "length"
    full = eng.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert full.finish_reason == "length" and len(full) == 12
    old = eng.eos_token_ids
    try:
        eng.eos_token_ids = [full[5]]
        eos = eng.generate(prompt, max_new_tokens=12)
    finally:
        eng.eos_token_ids = old
    assert eos == full[:full.index(full[5]) + 1] and eos.finish_reason == "stop"
    for k in range(4, 12):           # a stop string that token k completes: the text it adds, and one more
        before, now = eng.codec.decode(full[:k - 1]), eng.codec.decode(full[:k])
        stop = now[len(before) - 1:]
        if now.startswith(before) and len(stop) > 1 and stop not in before:
            break
    else:
        raise AssertionError(f"no token of {eng.codec.decode(full)!r} completes a fresh stop string")
    at_limit = eng.generate(prompt, max_new_tokens=k, stop=stop, ignore_eos=True)
    assert at_limit == full[:k] and at_limit.finish_reason == "stop", (now, stop)


def test_stop_strings_are_cut_from_text_results(eng):
    """chat() and stream() return the text up to, not including, the first stop string (the OpenAI
    API's stop, as colibri serve cuts it): the same text as the unstopped reply cut by hand."""
    free = eng.chat(CHAT, max_new_tokens=40)
    stop = _stop_inside(free, 10)
    want = free[:free.index(stop)]
    assert want and stop not in want
    assert eng.chat(CHAT, max_new_tokens=40, stop=stop) == want
    assert eng.chat(CHAT, max_new_tokens=40, stop=["never in this text: ~~~~~~", stop]) == want
    pieces = list(eng.stream(CHAT, max_new_tokens=40, stop=[stop, "never in this text: ~~~~~~"]))
    assert "".join(pieces) == want and pieces                 # held back pieces come out at the end
    ids = eng.generate(CHAT, max_new_tokens=40, stop=stop)
    assert ids.finish_reason == "stop" and stop in eng.codec.decode(ids)   # ids keep the completing token
    from colibri_edge.requests.textio import StopCutter, cut_at_stop   # (the helper colibri serve can share)
    # the helper the stream uses, piece by piece: it holds back len("bcx") - 1 = 2 characters, then
    # gives what cut_at_stop gives on the text seen so far
    c = StopCutter(["cd", "bcx"])
    assert [c.push(p) for p in ("ab", "c", "x", "yz")] + [c.finish()] == ["", "a", "", "", ""]
    c = StopCutter(["cd", "bcx"])
    assert [c.push(p) for p in ("ab", "c", "y")] + [c.finish()] == ["", "a", "b", "cy"]
    assert cut_at_stop("abcx", ["cd", "bcx"]) == "a" and cut_at_stop("abc", None) == "abc"


def test_stream_events_carry_top_logprobs(eng):
    """README's `top_logprobs`: a TOKEN event carries ev.top_logprobs, [(token, logprob)] best first,
    the log-softmax of the model's logits at that position (checked against infer's logits)."""
    prompt = eng.codec.encode(PROMPT)
    req = eng.submit(prompt, max_new_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True)
    evs = [ev for ev in req.iter_events() if ev.kind == TOKEN]
    logits = eng.infer(prompt + [ev.token for ev in evs[:-1]])[0].astype(np.float64)
    assert len(evs) == 4
    for k, ev in enumerate(evs):
        x = logits[len(prompt) - 1 + k]
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        best = np.argsort(-lp, kind="stable")[:3]
        assert [t for t, _ in ev.top_logprobs] == best.tolist()
        assert [v for _, v in ev.top_logprobs] == pytest.approx(lp[best].tolist(), abs=1e-4)
        assert ev.token == best[0] and ev.logprob == pytest.approx(lp[ev.token], abs=1e-4)


def test_async_engine_closes_with_with_and_async_with(eng):
    """AsyncEngine: `with` (close()) around asyncio.run, and `async with` (aclose()) in a coroutine, both
    close the engine (a later call is refused, closing again does nothing); its chat cuts stop strings
    and its generate gives the finish_reason, as Engine's."""
    free = eng.chat(CHAT, max_new_tokens=40)
    stop = _stop_inside(free, 10)
    with AsyncEngine.open(SHIPPED, backend="reference", max_seq_len=256) as ae:
        text = asyncio.run(ae.chat(CHAT, max_new_tokens=40, stop=stop))
        ids = asyncio.run(ae.generate(CHAT, max_new_tokens=40, stop=stop))
        assert not ae.closed
    assert text == free[:free.index(stop)] and ids.finish_reason == "stop"
    assert ae.closed and ae.engine.closed
    with pytest.raises(ColibriError) as ei:
        ae.engine.generate([1, 2, 3], max_new_tokens=2)
    assert ei.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "closed" in ei.value.message
    ae.close()                                               # again: nothing

    async def main():
        async with AsyncEngine.open(SHIPPED, backend="reference", max_seq_len=256) as ae2:
            out = await ae2.generate(CHAT, max_new_tokens=5, ignore_eos=True)
        await ae2.aclose()                                   # again: nothing
        return ae2, out
    ae2, out = asyncio.run(main())
    assert ae2.closed and out == eng.generate(CHAT, max_new_tokens=5, ignore_eos=True)
