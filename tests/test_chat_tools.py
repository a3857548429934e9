"""Tool calls and reasoning through `colibri serve` with the real OpenAI client (requests/chat.py,
requests/toolcalls.py): on the demo model (ChatML, tools described in its system message) and on two
tiny families wearing their vendors' own chat templates -- Qwen3 (Hermes <tool_call>, <think>) and
Mistral Nemo ([TOOL_CALLS]) -- read at test time from llama-cpp-python's sdist (`make test` fetches
it; tests/llamacpp_convert.py). json_schema outputs validate for 20 seeds at temperatures 0-1.3, forced
tool calls validate against their functions' schemas, a tool result in the history continues the
conversation, streaming equals the whole reply, and the reply's reasoning stays out of its content."""
import json

import pytest

from colibri_edge import COLIBRI_ERR_INVALID_ARGUMENT, ColibriError, Engine
from colibri_edge.model.demo import ensure_default_model
from colibri_edge.requests.chat import ChatPlan

jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs it")
pytest.importorskip("llguidance", reason="make test installs the grammar extra")
openai = pytest.importorskip("openai", reason="the test extra installs it")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}}}
CONVERT = {"type": "object", "required": ["amount", "to"], "additionalProperties": False,
           "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1000}, "to": {"enum": ["EUR", "USD", "JPY"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "convert", "description": "Convert an amount",
                                           "parameters": CONVERT}}]
SCHEMAS = {"get_weather": WEATHER, "convert": CONVERT}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 150}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": json.dumps({"temp_c": 21, "sky": "clear"})}]


def _template(name):
    import llamacpp_convert
    with open(llamacpp_convert.fetch() / "models" / "templates" / f"{name}.jinja", encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """name -> (engine, extra request fields): the demo, qwen3_moe with Qwen3's template (thinking off:
    a random model never closes it), mixtral with Mistral Nemo's."""
    from hf_models import build_text_model
    root = tmp_path_factory.mktemp("tools")
    qwen = build_text_model(root / "qwen3", "qwen3_moe", max_position_embeddings=2048)[1]
    mix = build_text_model(root / "mixtral", "mixtral", max_position_embeddings=2048)[1]
    engs = {"demo": (Engine.open(ensure_default_model()[0], backend="cpu", max_seq_len=2048, max_batch=4), {}),
            "qwen3": (Engine.open(qwen, backend="cpu", max_seq_len=2048, max_batch=4,
                                  chat_template=_template("Qwen-Qwen3-0.6B")),
                      {"chat_template_kwargs": {"enable_thinking": False}}),
            "mistral": (Engine.open(mix, backend="cpu", max_seq_len=2048, max_batch=4,
                                    chat_template=_template("mistralai-Mistral-Nemo-Instruct-2407")), {})}
    yield engs
    for e, _ in engs.values():
        e.close()


@pytest.fixture(scope="module")
def client(engines):
    from colibri_edge.serving.serve import create_app
    from helpers import Server
    with Server(create_app({k: e for k, (e, _) in engines.items()})) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=180)


MODELS = ["demo", "qwen3", "mistral"]


def _calls(msg):
    return [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_validates_for_20_seeds_and_temperatures(client, engines, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    extra = engines[model][1]
    for seed in range(20):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A person."}],
                                           max_tokens=100, seed=seed, temperature=1.3 * seed / 19,
                                           response_format=fmt, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # completions: json_object on the demo (a random model's free keys may never close: a schema bounds them)
    obj = {"type": "json_object"} if model == "demo" else fmt
    c = client.completions.create(model=model, prompt="JSON:", max_tokens=300, temperature=0.3, seed=4,
                                  extra_body={"response_format": obj})
    assert c.choices[0].finish_reason == "stop", c.choices[0]
    assert isinstance(json.loads(c.choices[0].text), dict)
    if model != "demo":
        jsonschema.validate(json.loads(c.choices[0].text), PERSON)


@pytest.mark.parametrize("model", MODELS)
def test_required_and_named_tool_calls_validate(client, engines, model):
    """tool_choice "required" (one call, or several with parallel_tool_calls) and a named function:
    each call names an allowed function and its arguments validate against that function's schema;
    finish_reason tool_calls; the streamed reply equals the whole one (names, arguments, content)."""
    extra = engines[model][1]
    for seed in range(6):
        for choice, parallel in (("required", False), ("required", True),
                                 ({"type": "function", "function": {"name": "convert"}}, False)):
            kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                      max_tokens=160, seed=seed, temperature=0.3 + 0.2 * seed, extra_body=extra)
            r = client.chat.completions.create(**kw)
            ch = r.choices[0]
            calls = _calls(ch.message)
            assert ch.finish_reason == "tool_calls" and calls, (model, seed, ch.message)
            assert parallel or len(calls) == 1
            for name, args in calls:
                assert name in (SCHEMAS if choice == "required" else ("convert",))
                jsonschema.validate(args, SCHEMAS[name])
            assert all(len(c.id) == 9 and c.id.isalnum() for c in ch.message.tool_calls)
            if seed < 2:
                parts = list(client.chat.completions.create(**kw, stream=True))
                streamed = [(d.function.name, json.loads(d.function.arguments))
                            for p in parts if p.choices for d in (p.choices[0].delta.tool_calls or [])]
                assert streamed == calls
                assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == \
                    (ch.message.content or "")
                assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "tool_calls"


@pytest.mark.parametrize("model", MODELS)
def test_auto_with_a_tool_result_continues_the_conversation(client, engines, model):
    """The history's call and result are rendered by the model's template (the prompt holds the result)
    and the reply continues after them; auto's reply, streamed, equals the whole one."""
    e, extra = engines[model]
    kw = dict(model=model, messages=HISTORY, tools=TOOLS, tool_choice="auto", max_tokens=24, seed=3,
              temperature=0.8, extra_body=extra)
    r = client.chat.completions.create(**kw)
    plan = ChatPlan(e.codec, HISTORY, TOOLS, "auto", None, None, extra.get("chat_template_kwargs"))
    assert "clear" in plan.text and r.usage.prompt_tokens == len(plan.ids)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    msg = r.choices[0].message
    parts = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == (msg.content or "")
    assert [(d.function.name, d.function.arguments) for p in parts if p.choices
            for d in (p.choices[0].delta.tool_calls or [])] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]


def test_tools_reach_a_template_that_does_not_render_them(engines):
    """The demo's ChatML template never reads `tools`: they are described in the system message, and
    the reply is read as Hermes' <tool_call> JSON."""
    e = engines["demo"][0]
    plan = ChatPlan(e.codec, ASK, TOOLS, "auto", None)
    assert plan.format.name == "hermes" and "get_weather" in plan.text and "<tool_call>" in plan.text
    assert "get_weather" not in ChatPlan(e.codec, ASK, TOOLS, "none", None).text


def test_forced_call_beside_a_free_request_in_one_batch(engines):
    """A request held to a tool call and an unconstrained one share steps, each giving what it gives alone."""
    from colibri_edge.requests.scheduler import TOKEN
    e = engines["qwen3"][0]

    def run(reqs):
        return [[ev.token for ev in r.iter_events(timeout=120) if ev.kind == TOKEN] for r in reqs]
    kwt = {"enable_thinking": False}
    forced = ChatPlan(e.codec, ASK, TOOLS, "required", False, None, kwt)
    alone_f = run([e.submit(forced.ids, max_new_tokens=200, temperature=0.9, seed=2, **forced.grammar)])[0]
    alone_u = run([e.submit(ASK, max_new_tokens=20, temperature=0.9, seed=2)])[0]
    both = run([e.submit(forced.ids, max_new_tokens=200, temperature=0.9, seed=2, **forced.grammar),
                e.submit(ASK, max_new_tokens=20, temperature=0.9, seed=2)])
    assert both == [alone_f, alone_u]
    msg = forced.reader().message(e._reply_text(alone_f))
    assert len(msg["tool_calls"]) == 1


def test_engine_chat_message(engines):
    e = engines["mistral"][0]
    msg = e.chat_message(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         max_new_tokens=120, temperature=0.7, seed=1)
    assert msg["finish_reason"] == "tool_calls" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


@pytest.mark.parametrize("kw,words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "name one of the tools"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
    (dict(tools=TOOLS + TOOLS[:1]), "given twice"),
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice='sometimes'"),
    (dict(tools=TOOLS, parallel_tool_calls="maybe"), "parallel_tool_calls")])
def test_bad_tool_arguments_are_refused(engines, client, kw, words):
    e = engines["demo"][0]
    with pytest.raises(ColibriError) as err:
        e.chat_message(ASK, max_new_tokens=4, **kw)
    assert err.value.code == COLIBRI_ERR_INVALID_ARGUMENT and words in err.value.message, err.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="demo", messages=ASK, max_tokens=4, **kw)
    assert words in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body={"tools": TOOLS})
    assert "/v1/chat/completions" in str(bad.value)


# -- reasoning: the reply read into reasoning_content and content ------------------------------------

def _codec(template):
    """A TextCodec of the byte-level test tokenizer and a given template (no model needed)."""
    from colibri_edge.model.demo import byte_level_tokenizer
    from colibri_edge.requests.textio import TextCodec
    c = TextCodec.__new__(TextCodec)
    c.config, c._warned, c.tok = {"chat_template": template}, True, byte_level_tokenizer()
    return c


@pytest.mark.parametrize("template,kwargs,reply,want", [
    ("Qwen-Qwen3-0.6B", {}, "<think>\nthe user wants JSON\n</think>\n\n{\"a\": 1}",
     ("the user wants JSON", '{"a": 1}')),
    ("Qwen-Qwen3-0.6B", {}, "plain answer", (None, "plain answer")),
    ("Qwen3.5-4B", {}, "still thinking\n</think>\n\nthe answer", ("still thinking", "the answer")),
    ("Qwen3.5-4B", {"enable_thinking": False}, "the answer", (None, "the answer")),
    ("openai-gpt-oss-120b", {}, "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final"
     "<|message|>done<|return|>", ("hmm", "done"))])
def test_reasoning_is_kept_out_of_content(template, kwargs, reply, want):
    """Whole and streamed (pushed a character at a time), the reply splits into the same
    reasoning_content and content."""
    plan = ChatPlan(_codec(_template(template)), ASK, template_kwargs=kwargs)
    msg = plan.reader().message(reply)
    assert (msg.get("reasoning_content"), msg["content"]) == want
    reader, got = plan.reader(), {"reasoning_content": "", "content": ""}
    for k in range(1, len(reply) + 1):
        for d in reader.push(reply[:k], final=k == len(reply)):
            for key, v in d.items():
                got[key] += v
    assert (got["reasoning_content"] or None, got["content"]) == want


def test_schema_after_thinking():
    """On a thinking template the JSON schema holds what follows </think>, never the thinking: the grammar
    takes free thinking, then only the schema."""
    import llguidance as ll
    import tempfile
    import os
    plan = ChatPlan(_codec(_template("Qwen3.5-4B")), ASK,
                    grammar={"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}})
    assert plan.opened and "lark" in plan.grammar
    tok = _codec("").tok
    with tempfile.TemporaryDirectory() as d:
        tok.save(os.path.join(d, "t.json"))
        lt = ll.LLTokenizer(open(os.path.join(d, "t.json")).read(), n_vocab=tok.get_vocab_size(), eos_token=[0])
    src = ll.LLMatcher.grammar_from_lark(plan.grammar["lark"])

    def accepts(text):
        m = ll.LLMatcher(lt, src)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()
    assert accepts('free {not json} text\n</think>\n\n{"name":"Al","age":3}')
    assert not accepts('free text</think>{"name":"Al"}')             # age is required
    assert not accepts('{"name":"Al","age":3}')                        # the thinking must close first
