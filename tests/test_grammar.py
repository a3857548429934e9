"""Constrained output (requests/constrain.py, llguidance): JSON schema, JSON object, regex, Lark and
GBNF grammars held as a token mask at the sampler, per request, inside continuous batching, in the
engine and through `colibri serve` with the real OpenAI client."""
import json
import re

import numpy as np
import pytest

from colibri_edge import COLIBRI_ERR_INVALID_ARGUMENT, ColibriError, Engine
from colibri_edge.model.demo import ensure_default_model
from colibri_edge.requests.scheduler import TOKEN

jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs it")
pytest.importorskip("llguidance", reason="make test installs the grammar extra")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def demo():
    eng = Engine.open(ensure_default_model()[0], backend="cpu", max_seq_len=1024, max_batch=4)
    yield eng
    eng.close()


def test_json_schema_outputs_validate_for_every_seed_and_temperature(demo):
    """20 seeds at temperatures 0 to 1.3: every reply is JSON that validates against the schema and ends
    because the grammar is complete (finish_reason stop), never cut."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(20):
        t = 1.3 * seed / 19
        gen = demo.generate(ASK, max_new_tokens=120, temperature=t, seed=seed, response_format=fmt)
        assert gen.finish_reason == "stop", (seed, demo.codec.decode(gen))
        jsonschema.validate(json.loads(demo.codec.decode(gen)), PERSON)


def test_regex_lark_gbnf_and_json_object(demo):
    """A regex, a Lark and a GBNF grammar: the text matches; json_object: any JSON object."""
    for seed in range(4):
        digits = demo.codec.decode(demo.generate("The year was", max_new_tokens=12, temperature=1.0, seed=seed,
                                                 regex=r"1[89][0-9]{2}"))
        assert re.fullmatch(r"1[89][0-9]{2}", digits), digits
        yes_no = demo.codec.decode(demo.generate("Is it raining?", max_new_tokens=8, temperature=1.0, seed=seed,
                                                 lark='start: "yes" | "no" | "maybe"'))
        assert yes_no in ("yes", "no", "maybe")
        color = demo.codec.decode(demo.generate("Pick a colour:", max_new_tokens=8, temperature=1.0, seed=seed,
                                                grammar='root ::= ("red" | "green" | "blue") "!"'))
        assert color in ("red!", "green!", "blue!")
        gen = demo.generate(ASK, max_new_tokens=300, temperature=0.5, seed=seed, response_format={"type": "json_object"})
        assert gen.finish_reason == "stop" and isinstance(json.loads(demo.codec.decode(gen)), dict)


def test_constrained_beside_unconstrained_in_one_batch(demo):
    """A constrained and an unconstrained request submitted together share steps, and each gives what
    it gives alone (greedy and seeded)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def tokens(reqs):
        return [[ev.token for ev in r.iter_events(timeout=120) if ev.kind == TOKEN] for r in reqs]
    alone_c = tokens([demo.submit(ASK, max_new_tokens=60, temperature=0.9, seed=5, response_format=fmt)])[0]
    alone_u = tokens([demo.submit(ASK, max_new_tokens=30, temperature=0.9, seed=5)])[0]
    both = tokens([demo.submit(ASK, max_new_tokens=60, temperature=0.9, seed=5, response_format=fmt),
                   demo.submit(ASK, max_new_tokens=30, temperature=0.9, seed=5)])
    assert both == [alone_c, alone_u] and alone_c != alone_u[:len(alone_c)]
    n = demo.submit_n(ASK, 3, max_new_tokens=80, temperature=1.0, seed=9, response_format=fmt)
    for r in n:                      # each sample its own matcher
        jsonschema.validate(json.loads(demo.codec.decode(tokens([r])[0])), PERSON)


@pytest.mark.parametrize("kw,words", [
    (dict(response_format={"type": "xml"}), "response_format type 'xml'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}), "json_schema"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="root ::= undefined_rule"), "gbnf"),
    (dict(regex="a", lark='start: "a"'), "not several")])
def test_a_grammar_that_does_not_compile_is_refused_at_submission(demo, kw, words):
    with pytest.raises(ColibriError) as e:
        demo.submit([1, 2, 3], max_new_tokens=4, **kw)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and words in e.value.message, e.value.message
    assert not demo._core.busy


def test_through_the_openai_client(demo):
    """colibri serve: json_schema (strict) on chat for 20 seeds, json_object on completions, llama-server's
    grammar field, a streamed reply equal to the whole one for the same seed, and a schema that does
    not compile is a 400 that names the problem."""
    import openai
    from colibri_edge.serving.serve import create_app
    from helpers import Server
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with Server(create_app({"demo": demo})) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for seed in range(20):
            a = client.chat.completions.create(model="demo", messages=ASK, max_tokens=120, seed=seed,
                                               temperature=1.3 * seed / 19, response_format=fmt)
            assert a.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(a.choices[0].message.content), PERSON)
        c = client.completions.create(model="demo", prompt="A JSON object:", max_tokens=100, temperature=0.8,
                                      seed=3, extra_body={"response_format": {"type": "json_object"}})
        assert isinstance(json.loads(c.choices[0].text), dict)
        g = client.completions.create(model="demo", prompt="Pick:", max_tokens=8, temperature=1.0, seed=1,
                                      extra_body={"grammar": 'root ::= "left" | "right"'})
        assert g.choices[0].text in ("left", "right")
        whole = client.chat.completions.create(model="demo", messages=ASK, max_tokens=120, seed=7, temperature=0.9,
                                               response_format=fmt).choices[0].message.content
        parts = client.chat.completions.create(model="demo", messages=ASK, max_tokens=120, seed=7, temperature=0.9,
                                               response_format=fmt, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices) == whole
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=ASK, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
        assert "does not compile" in str(e.value)


def test_the_mask_is_exact(demo):
    """The mask the sampler applies forbids exactly the tokens llguidance's own numpy helper forbids."""
    import llguidance.numpy as lnp
    c = demo._grammars().matcher(("json_schema", PERSON))
    rng = np.random.default_rng(0)
    V = demo.config["vocab_size"]
    for tok in demo.codec.encode('{"name":"Al","age":4', add_special_tokens=False):
        logits = rng.standard_normal(V).astype(np.float32)
        got = c.masked(logits).copy()
        want = logits.copy()
        bits = lnp.allocate_token_bitmask(1, V)
        lnp.fill_next_token_bitmask(c.m, bits, 0)
        lnp.apply_token_bitmask_inplace(want, bits)
        assert np.array_equal(np.isinf(got), np.isinf(want)) and np.isfinite(got).sum() > 0
        c.consume(tok)


@pytest.mark.parametrize("backend", ["reference", "cpu", "opencl", "cuda"])
def test_every_backend_masks_inside_one_batch(backend):
    """On each backend a JSON-schema request, a forced tool call and a free request run in one batch and
    each gives what it gives alone; the schema's output and the call's arguments validate."""
    from helpers import need
    from colibri_edge.requests.chat import ChatPlan
    need(backend)
    weather = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 12}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with Engine.open(ensure_default_model()[0], backend=backend, max_seq_len=1024, max_batch=4) as eng:
        plan = ChatPlan(eng.codec, ASK, tools, "required", False)

        asks = [(ASK, dict(max_new_tokens=120, response_format=fmt)),
                 (plan.ids, dict(max_new_tokens=120, **plan.grammar)), (ASK, dict(max_new_tokens=24))]

        def tokens(reqs):
            return [[ev.token for ev in r.iter_events(timeout=600) if ev.kind == TOKEN] for r in reqs]
        alone = [tokens([eng.submit(p, temperature=0.8, seed=3, **kw)])[0] for p, kw in asks]
        assert tokens([eng.submit(p, temperature=0.8, seed=3, **kw) for p, kw in asks]) == alone
    jsonschema.validate(json.loads(eng.codec.decode(alone[0])), PERSON)
    (call,) = plan.reader().message(eng._reply_text(alone[1]))["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), weather)
