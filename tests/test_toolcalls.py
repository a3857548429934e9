"""Tool-call formats (colibri_edge/requests/toolcalls.py) against the model vendors' own chat templates.

The templates are llama.cpp's models/templates (from llama-cpp-python's sdist, fetched by
tests/llamacpp_convert.py, read here at test time). For each (format, template): an assistant turn
with tool calls is rendered after [system, user], and the reply -- what follows the generation prompt
up to the end-of-turn marker -- must be detected as the format, parse back to exactly the calls, and
be accepted by the format's grammar (llguidance, on a byte-level tokenizer: markers as text, and again
with the markers as special tokens), while replies the template renders for a function outside the
named ones, with an argument of the wrong type or without a required one, are refused.
"""
import json

import llguidance
import pytest

import llamacpp_convert
from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from colibri_edge.model.demo import byte_level_tokenizer
from colibri_edge.requests import toolcalls
from colibri_edge.requests.textio import FALLBACK_CHAT_TEMPLATE, TextCodec

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "opts": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]},
                                                      "hours": {"type": "array", "items": {"type": "integer"}}}},
            "tags": {"type": "array", "items": {"type": "string"}},
            "exact": {"type": "boolean"}},
            "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]
NAMES = ["get_weather", "search"]
WEATHER = ("get_weather", {"city": 'Zürich 東京 "old town"', "days": 3, "opts": {"unit": "C", "hours": [6, 18]},
                           "tags": ["rain", "Ü"], "exact": True})
SEARCH = ("search", {"query": "Zürich\nnews"})
USER = "What is the weather in Zürich?"
BASE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": USER}]
CONTENT = "Let me check."
# the end of an assistant turn in these templates (harmony's <|end|> ends an analysis message inside a reply)
EOT = ("<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|call|>", "<|return|>",
       "<｜end▁of▁sentence｜>", "<|tool_response>", "<turn|>", "<|observation|>", "<|user|>", "<|role_end|>")
HAND = "hand"    # the template does not render an assistant's tool calls: the reply is written as the model does

# (format, template, renders several calls, where the reply starts when the rendering does not extend the
# generation prompt: the end of this text after the user's message)
CASES = [
    ("hermes", "Qwen-Qwen3-0.6B", True, None),
    ("hermes", "Qwen-Qwen2.5-7B-Instruct", True, None),
    ("hermes", "ibm-granite-granite-4.0", True, None),
    ("hermes", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", True, None),
    ("hermes", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", True, None),
    ("qwen3_coder", "Qwen3.5-4B", True, None),
    ("qwen3_coder", "Qwen3-Coder", True, None),
    ("qwen3_coder", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", True, "<|im_start|>assistant\n"),
    ("qwen3_coder", "StepFun3.5-Flash", True, None),
    ("llama3", "meta-llama-Llama-3.1-8B-Instruct", False, None),
    ("llama3", "meta-llama-Llama-3.2-3B-Instruct", False, None),
    ("llama3", "meta-llama-Llama-3.3-70B-Instruct", False, None),
    ("mistral", "mistralai-Mistral-Nemo-Instruct-2407", True, "[/INST]"),
    ("mistral", "Mistral-Small-3.2-24B-Instruct-2506", True, None),
    ("mistral", "mistralai-Ministral-3-14B-Reasoning-2512", True, None),
    ("mistral", "unsloth-mistral-Devstral-Small-2507", True, None),
    ("harmony", "openai-gpt-oss-120b", False, None),
    ("deepseek", "deepseek-ai-DeepSeek-V3.1", True, None),
    ("deepseek", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True, "<｜Assistant｜>"),
    ("deepseek_dsml", "deepseek-ai-DeepSeek-V3.2", True, "<｜Assistant｜></think>"),
    ("deepseek_dsml", "deepseek-ai-DeepSeek-V4", True, None),
    ("deepseek_dsml", "deepseek-ai-DeepSeek-V4-Flash-0731", True, None),
    ("glm", "GLM-4.6", True, None),
    ("glm", "GLM-4.7-Flash", True, "<|assistant|>"),
    ("glm", "inclusionai-ling-3.0-flash", True, None),
    ("glm", "Spark2.5", True, "<|Bot|>"),
    ("gemma", "google-gemma-4-31B-it", True, "<|turn>model\n"),
    ("gemma", "google-gemma-4-31B-it-interleaved", True, "<|turn>model\n"),
    ("granite", "ibm-granite-granite-3.3-2B-Instruct", True, HAND),
]
IDS = [c[1] for c in CASES]
# markers that are special tokens in these families' tokenizers (the grammar must reference them by id)
SPECIAL = {
    "hermes": ["<tool_call>", "</tool_call>", "<think>", "</think>"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<think>", "</think>"],
    "llama3": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"],
    "harmony": ["<|channel|>", "<|message|>", "<|constrain|>", "<|start|>", "<|end|>", "<|call|>"],
    "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>", "<think>", "</think>"],
    "deepseek_dsml": ["｜DSML｜", "<think>", "</think>"],
    "glm": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
            "</think>"],
    "gemma": ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"],
    "granite": ["<|tool_call|>"],
}


@pytest.fixture(scope="module")
def templates():
    return llamacpp_convert.fetch() / "models" / "templates"


def codec(text):
    c = TextCodec.__new__(TextCodec)
    c.config = {"chat_template": text, "bos_token": "<s>", "eos_token": "</s>"}
    c._warned = True
    return c


def message(calls, content=None):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": toolcalls.call_id(), "type": "function",
         "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for n, a in calls]}


RENDERED = {}


def render(case, templates, calls, content=None, tools=TOOLS):
    """(template text, generation prompt, reply) of an assistant turn making calls (kept: rendering
    compiles the template each time)."""
    key = (case[1], json.dumps([calls, content, tools]))
    if key not in RENDERED:
        RENDERED[key] = _render(case, templates, calls, content, tools)
    return RENDERED[key]


def _render(case, templates, calls, content, tools):
    fmt, name, _, anchor = case
    text = (templates / f"{name}.jinja").read_text()
    c = codec(text)
    prompt_key = (name, json.dumps(tools))
    if prompt_key not in RENDERED:
        RENDERED[prompt_key] = c.render_chat(BASE, True, tools=tools)
    prompt = RENDERED[prompt_key]
    if anchor == HAND:
        items = [{"name": n, "arguments": a} for n, a in calls]
        return text, prompt, (f"{content}\n" if content else "") + "<|tool_call|>" + json.dumps(items, ensure_ascii=False)
    full = c.render_chat(BASE + [message(calls, content)], False, tools=tools)
    if anchor is None:
        assert full.startswith(prompt), "the rendering does not extend the generation prompt"
        reply = full[len(prompt):]
    else:
        reply = full[full.index(anchor, full.rindex(USER)) + len(anchor):]
    cut = min([reply.find(e) for e in EOT if e in reply], default=len(reply))
    return text, prompt, reply[:cut]


def expect(calls):
    return [{"name": n, "arguments": a} for n, a in calls]


# -- parse -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_round_trip(case, templates):
    fmt, _, several, _ = case
    text, _, reply = render(case, templates, [WEATHER])
    f = toolcalls.format_for(text)
    assert f.name == fmt
    assert f.parse(reply, TOOLS) == ("", expect([WEATHER])), reply
    try:
        _, _, reply = render(case, templates, [WEATHER, SEARCH])
    except ColibriError:            # Llama 3's templates refuse a turn with two calls
        assert not several
        return
    if several:
        assert f.parse(reply, TOOLS) == ("", expect([WEATHER, SEARCH])), reply
    else:                           # gpt-oss's renders a turn's first call only
        assert f.parse(reply, TOOLS) == ("", expect([WEATHER])), reply


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_content_beside_calls(case, templates):
    fmt, _, _, _ = case
    text, _, reply = render(case, templates, [SEARCH], CONTENT)
    f = toolcalls.format_for(text)
    if fmt == "harmony":        # the template renders an assistant's content as its analysis (reasoning)
        assert f.parse(reply, TOOLS) == ("", expect([SEARCH]))
        assert f.split_reasoning(reply)[0] == CONTENT
        return
    if CONTENT not in reply:    # this template drops the content of a turn with calls: the model may still write it
        _, _, reply = render(case, templates, [SEARCH])
        reply = CONTENT + ("<|python_tag|>" if fmt == "llama3" else "\n") + reply
    assert f.parse(reply, TOOLS) == (CONTENT, expect([SEARCH])), reply


def test_model_written_forms():
    """Forms the models write that their templates do not render."""
    f = {x.name: x for x in toolcalls.FORMATS}
    args = json.dumps(WEATHER[1], ensure_ascii=False)
    harmony = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.get_weather <|constrain|>json<|message|>{args}")
    assert f["harmony"].parse(harmony, TOOLS) == ("", expect([WEATHER]))
    assert f["harmony"].split_reasoning(harmony)[0] == "Need the weather."
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    assert f["harmony"].parse(final) == ("Hello!", [])
    search = json.dumps({"name": "search", "parameters": SEARCH[1]})
    llama = f'Checking.<|python_tag|>{{"name": "get_weather", "parameters": {args}}}; {search}'
    assert f["llama3"].parse(llama, TOOLS) == ("Checking.", expect([WEATHER, SEARCH]))
    assert f["llama3"].parse("The answer is 4.") == ("The answer is 4.", [])
    nemo = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {args}}}, {{"name": "search", "arguments": ' \
           f'{json.dumps(SEARCH[1], ensure_ascii=False)}}}]'
    assert f["mistral"].parse(nemo, TOOLS) == ("", expect([WEATHER, SEARCH]))
    v11 = f"[THINK]Call it.[/THINK]Sure.[TOOL_CALLS]search[ARGS]{json.dumps(SEARCH[1], ensure_ascii=False)}"
    assert f["mistral"].parse(v11, TOOLS) == ("Sure.", expect([SEARCH]))
    assert f["mistral"].split_reasoning(v11)[0] == "Call it."
    coder = "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n<parameter=days>\n2\n" \
            "</parameter>\n<parameter=exact>\nfalse\n</parameter>\n</function>\n</tool_call>"
    assert f["qwen3_coder"].parse(coder, TOOLS)[1] == expect([("get_weather", {"city": "Bern", "days": 2,
                                                                              "exact": False})])
    # without tools, values written as text stay text
    assert f["qwen3_coder"].parse(coder)[1][0]["arguments"]["days"] == "2"
    think = "<think>\nThe user wants news.\n</think>\n\n<tool_call>\n" \
            f'{{"name": "search", "arguments": {json.dumps(SEARCH[1], ensure_ascii=False)}}}\n</tool_call>'
    assert f["hermes"].parse(think) == ("", expect([SEARCH]))
    assert f["hermes"].split_reasoning(think) == ("The user wants news.", think[think.index("\n\n<tool"):])
    assert f["qwen3_coder"].opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not f["qwen3_coder"].opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not f["llama3"].opens_reasoning("<think>")


def test_unparsable_call_stays_content():
    f = {x.name: x for x in toolcalls.FORMATS}
    broken = 'Try <tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>'
    assert f["hermes"].parse(broken) == (broken, [])
    dsv31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert f["deepseek"].parse(dsv31) == (dsv31, [])
    assert f["mistral"].parse("[TOOL_CALLS]search[ARGS]{") == ("[TOOL_CALLS]search[ARGS]{", [])
    assert f["gemma"].parse("<|tool_call>call:search{query:<|\"|>x}") == ("<|tool_call>call:search{query:<|\"|>x}", [])
    bad = "<|channel|>commentary to=functions.search <|constrain|>json<|message|>{not json"
    assert f["harmony"].parse(bad) == ("{not json", [])


# -- grammar -----------------------------------------------------------------------------------------


class Tok:
    """The byte-level test tokenizer (with extra special tokens), saved and read by llguidance."""

    def __init__(self, path, special=()):
        self.tok = byte_level_tokenizer()
        if special:
            self.tok.add_special_tokens(list(special))
        self.tok.save(str(path))
        eos = self.tok.token_to_id("<|endoftext|>")
        self.ll = llguidance.LLTokenizer(str(path), n_vocab=self.tok.get_vocab_size(), eos_token=[eos])
        self.special = {s: self.tok.token_to_id(s) for s in special}

    def accepts(self, lark, text):
        """Whether the grammar takes text's tokens one by one and accepts at the end."""
        src = llguidance.LLMatcher.grammar_from_lark(lark)
        assert llguidance.LLMatcher.validate_grammar(src, self.ll) == ""
        m = llguidance.LLMatcher(self.ll, src, log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in self.tok.encode(text).ids) and m.is_accepting()


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    made = {None: Tok(d / "plain.json")}
    for fmt, marks in SPECIAL.items():
        made[fmt] = Tok(d / f"{fmt}.json", marks)
    return made


BAD = {"an unknown function": [("delete_all", {"path": "/"})],
       "an argument of the wrong type": [("get_weather", {"city": "Bern", "days": "three"})],
       "no required argument": [("get_weather", {"city": "Bern"})]}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grammar(case, templates, toks):
    fmt, _, several, _ = case
    text, prompt, reply = render(case, templates, [WEATHER])
    f = toolcalls.format_for(text)
    opened = f.opens_reasoning(prompt)
    for tok in (toks[None], toks[fmt]):
        def lark(names, parallel=False):
            return f.lark(TOOLS, names, parallel, tok.special, in_reasoning=opened)
        assert tok.accepts(lark(NAMES), reply), reply
        assert tok.accepts(lark(["get_weather"]), reply), "a named choice refuses its own function"
        for what, calls in BAD.items():
            bad = render(case, templates, calls)[2]
            assert not tok.accepts(lark(NAMES), bad), f"accepts {what}: {bad}"
        for fewer in ({"city": "Bern", "days": 2}, {"city": "Bern", "days": 2, "tags": ["x"]}):
            sparse = render(case, templates, [("get_weather", fewer)])[2]
            assert tok.accepts(lark(NAMES), sparse), f"refuses optional arguments left out: {sparse}"
        other = render(case, templates, [SEARCH])[2]
        assert tok.accepts(lark(NAMES), other)
        assert not tok.accepts(lark(["get_weather"]), other), "a named choice accepts another function"
    if several:
        two = render(case, templates, [WEATHER, SEARCH])[2]
        tok = toks[None]
        assert tok.accepts(f.lark(TOOLS, NAMES, True, in_reasoning=opened), two), two
        assert not tok.accepts(f.lark(TOOLS, NAMES, False, in_reasoning=opened), two), "one call only, yet two pass"


FREE = [{"type": "function", "function": {"name": "free", "description": "Anything", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("case", [next(c for c in CASES if c[0] == f.name) for f in toolcalls.FORMATS],
                         ids=[f.name for f in toolcalls.FORMATS])
def test_grammar_without_properties(case, templates, toks):
    """A function whose parameters name no properties takes any arguments."""
    text, prompt, reply = render(case, templates, [("free", {"a": "x y", "n": 1})], tools=FREE)
    f = toolcalls.format_for(text)
    assert f.parse(reply, FREE)[1][0]["name"] == "free"
    assert toks[None].accepts(f.lark(FREE, ["free"], False, in_reasoning=f.opens_reasoning(prompt)), reply), reply


def test_grammar_model_written_forms(toks):
    f = {x.name: x for x in toolcalls.FORMATS}
    args = json.dumps(WEATHER[1], ensure_ascii=False, separators=(",", ":"))
    harmony = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.get_weather <|constrain|>json<|message|>{args}")
    for tok in (toks[None], toks["harmony"]):
        assert tok.accepts(f["harmony"].lark(TOOLS, NAMES, False, tok.special), harmony)
    search = json.dumps({"name": "search", "parameters": SEARCH[1]}, ensure_ascii=False)
    llama = f'<|python_tag|>{{"name": "get_weather", "parameters": {args}}}; {search}'
    for tok in (toks[None], toks["llama3"]):
        assert tok.accepts(f["llama3"].lark(TOOLS, NAMES, True, tok.special), llama)
        assert not tok.accepts(f["llama3"].lark(TOOLS, NAMES, False, tok.special), llama)
    think = "<think>\nThe user wants news.\n</think>\n\n<tool_call>\n" \
            f'{{"name": "search", "arguments": {json.dumps(SEARCH[1], ensure_ascii=False)}}}\n</tool_call>'
    assert toks[None].accepts(f["hermes"].lark(TOOLS, NAMES, False), think)
    assert not toks[None].accepts(f["hermes"].lark(TOOLS, NAMES, False), "Sure! " + think)


def test_lark_refuses_bad_requests():
    f = toolcalls.format_for(None)
    for tools, names in ((TOOLS, ["nope"]), (TOOLS, []), ([], ["search"]), ([{"type": "function"}], ["x"])):
        with pytest.raises(ColibriError) as e:
            f.lark(tools, names, False)
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT


# -- detection, system prompt, ids -------------------------------------------------------------------


# templates that leave the tools to the system prompt (DeepSeek's model cards give the text)
NO_TOOLS = {"deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"}


def test_detection(templates):
    for fmt, name, _, _ in CASES:
        text = (templates / f"{name}.jinja").read_text()
        assert toolcalls.format_for(text).name == fmt, name
        assert toolcalls.renders_tools(text) == (name not in NO_TOOLS), name
    assert toolcalls.format_for(FALLBACK_CHAT_TEMPLATE).name == "hermes"
    assert not toolcalls.renders_tools(FALLBACK_CHAT_TEMPLATE)
    assert toolcalls.format_for(None).name == "hermes" and not toolcalls.renders_tools(None)
    assert [f.name for f in toolcalls.FORMATS][-1] == "hermes"
    # "tools" in a template's text but not in its code does not count
    assert not toolcalls.renders_tools("You have no tools.{{ messages[0]['content'] }}")


def test_tools_system_prompt():
    text = toolcalls.tools_system_prompt(TOOLS)
    assert "<tool_call>" in text and "get_weather" in text and "search" in text
    # a reply in the taught format parses with the fallback format
    reply = f'<tool_call>\n{{"name": "search", "arguments": {json.dumps(SEARCH[1], ensure_ascii=False)}}}\n</tool_call>'
    assert toolcalls.format_for(FALLBACK_CHAT_TEMPLATE).parse(reply, TOOLS) == ("", expect([SEARCH]))
    for f in toolcalls.FORMATS:         # each format's own teaching opens with its start marker
        assert f.start.split("FUNCTION_NAME")[0][:12] in toolcalls.tools_system_prompt(TOOLS, f), f.name
    with pytest.raises(ColibriError):
        toolcalls.tools_system_prompt([{"nope": 1}])


def test_call_id():
    ids = {toolcalls.call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids)
