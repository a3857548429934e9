"""Chat requests with tools and reasoning: what a conversation becomes before the core sees it (prompt
ids and a grammar), and how its reply reads back (reasoning, content, tool calls).

    plan = ChatPlan(codec, messages, tools=..., tool_choice=..., parallel_tool_calls=..., response_format=...)
    plan.ids                 the prompt: the model's own chat template rendered with `tools` in its context
    plan.grammar             the grammar arguments for Engine._submit ({} when the output is free)
    reader = plan.reader()   reader.push(text_so_far) -> deltas; reader.message(text) -> the whole message

The reply's parts, by the template's markers:

    reasoning   "think": the text before </think> (Qwen3 / Qwen3.5, GLM, DeepSeek-R1-style templates;
                the prompt may already have opened <think>); "harmony": gpt-oss's analysis channel
    content     the rest, without the tool calls
    tool_calls  parsed by the template's tool-call format (toolcalls.py: Hermes, Qwen3-Coder XML, Llama 3
                JSON, Mistral, Harmony, DeepSeek, GLM, Gemma 4, Granite)

tool_choice "required" or a named function, and response_format, become a grammar (llguidance Lark) of
the reply: the reasoning the template allows first (free text up to </think>, or an analysis message),
then only the calls -- each one of the allowed functions, its arguments following the function's
parameters schema -- or only the JSON. The reasoning is never held to the schema. "auto" leaves the
reply free and reads calls out of it, as vLLM and llama-server do; "none" renders no tools.

A template that does not use `tools` (the demo's ChatML, FALLBACK_CHAT_TEMPLATE) gets the tools
described in its system message in Hermes' format (toolcalls.tools_system_prompt), and the reply is
read as Hermes'.
"""
from __future__ import annotations

import json

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from . import toolcalls
from .textio import HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_ENDS


def _bad(msg):
    return ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, msg)


def reasoning_kind(template: str | None, fmt) -> str | None:
    """"harmony" for gpt-oss's channels; "think" for a template that writes its format's reasoning block
    (fmt.think: <think>...</think>, Mistral's [THINK]...[/THINK], Gemma 4's thought channel); else None."""
    if not template:
        return None
    if HARMONY_CHANNEL in template:
        return "harmony"
    if fmt.think and fmt.think[1] in template:
        return "think"
    return None


def check_tools(tools, tool_choice, parallel_tool_calls):
    """tools as the OpenAI API gives them, checked: ([{"type": "function", "function": {...}}], the
    names the reply may call (all, one for a named choice, none for "none"), forced: a call must come)."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise _bad(f"tool_choice={tool_choice!r:.80} needs tools: give the functions in 'tools'")
        return None, [], False
    if not isinstance(tools, list) or not tools:
        raise _bad("tools: give a non-empty list of {'type': 'function', 'function': {'name': ..., 'parameters': "
                   "{...}}}")
    names = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{j}]: expected {{'type': 'function', 'function': {{'name': str, 'parameters': "
                       "{...}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{j}] ({fn['name']}): parameters must be a JSON schema object")
        if fn["name"] in names:
            raise _bad(f"tools[{j}]: the function name {fn['name']!r} is given twice")
        names.append(fn["name"])
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad(f"parallel_tool_calls={parallel_tool_calls!r:.40}: give true or false")
    if tool_choice in (None, "auto"):
        return tools, names, False
    if tool_choice == "none":
        return tools, [], False
    if tool_choice == "required":
        return tools, names, True
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name in names:
            return tools, [name], True
        raise _bad(f"tool_choice={json.dumps(tool_choice)[:120]}: name one of the tools "
                   f"({', '.join(names)}) as {{'type': 'function', 'function': {{'name': ...}}}}")
    raise _bad(f"tool_choice={tool_choice!r:.80}: use 'auto', 'none', 'required' or {{'type': 'function', "
               "'function': {'name': ...}}")


def special_tokens(codec) -> dict:
    """marker text -> id of the tokenizer's special tokens (a grammar names those by id: llguidance
    matches string literals against text, which a special token's bytes are not)."""
    return {t.content: i for i, t in codec.tok.get_added_tokens_decoder().items() if t.special}


class ChatPlan:
    """One chat request's prompt and grammar (module docstring). grammar: the caller's own
    (response_format / grammar / json_schema / regex / lark, constrain.grammar_spec's arguments);
    template_kwargs: extra template variables (enable_thinking, reasoning_effort, ...)."""

    def __init__(self, codec, messages, tools=None, tool_choice=None, parallel_tool_calls=None, grammar=None,
                 template_kwargs=None):
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise _bad("chat_template_kwargs: give a dict of template variables such as {'enable_thinking': false}")
        _check_messages(messages)
        template = codec.template()
        self.tools, names, forced = check_tools(tools, tool_choice, parallel_tool_calls)
        self.parallel = parallel_tool_calls is not False
        self.format = toolcalls.format_for(template)
        msgs = list(messages)
        if self.tools is not None and names and not toolcalls.renders_tools(template):
            msgs = _with_tool_prompt(msgs, self.tools, self.format)
        self.calls = bool(names)                 # the reply is read for tool calls
        self.text = codec.render_chat(msgs, tools=self.tools if names else None, **(template_kwargs or {}))
        self.ids = codec.encode(self.text, add_special_tokens=False)
        kind = reasoning_kind(template, self.format)
        self.marks = self.format.think           # the reasoning block's (opening, end)
        self.opened = kind == "think" and self.format.opens_reasoning(self.text)
        if kind == "think" and self.text.rstrip().endswith(self.marks[1]):
            kind = None                          # thinking switched off (enable_thinking=False)
        self.reasoning = kind
        self.grammar = dict(grammar or {})
        if forced:
            self.grammar = {"lark": self.format.lark(self.tools, names, self.parallel, special_tokens(codec),
                                                     in_reasoning=self.opened, reasoning=kind is not None)}
        elif kind is not None:
            from .constrain import grammar_spec
            spec = grammar_spec(**self.grammar)
            if spec is not None and spec[0] in ("json_schema", "json_object"):
                schema = spec[1] if isinstance(spec[1], (dict, bool)) else json.loads(spec[1])
                if isinstance(schema, dict) and "x-guidance" not in schema:
                    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
                self.grammar = {"lark": self._wrap(f"j: %json {json.dumps(schema)}", "j", codec)}

    def _wrap(self, body: str, rule: str, codec) -> str:
        """A Lark grammar: the reasoning this template lets the model write first, then `rule`."""
        if self.reasoning == "think":
            opening, end = self.marks
            think = (f"think[lazy]: /(?s:.*){_re(end)}/" if self.opened else
                     f"think[lazy]: /{_re(opening)}(?s:.*){_re(end)}/")
            head = "think /[ \\n]*/" if self.opened else "(think /[ \\n]*/)?"
            return f"start: {head} {rule}\n{think}\n{body}\n"
        if self.reasoning == "harmony":
            sp = special_tokens(codec)

            def tok(s):
                return f"<[{sp[s]}]>" if s in sp else json.dumps(s)
            ana = (f"analysis: {tok(HARMONY_CHANNEL)} \"analysis\" {tok(HARMONY_MESSAGE)} ANA {tok('<|end|>')} "
                   f"{tok('<|start|>')} \"assistant\"")
            anare = "ANA: /(?s:.*)/" if "<|end|>" in sp else "ANA[lazy]: /(?s:.*)<\\|end\\|>/"
            if rule == "j":
                final = f"{tok(HARMONY_CHANNEL)} \"final\" {tok(HARMONY_MESSAGE)} j"
                return f"start: analysis? {final}\n{ana}\n{anare}\n{body}\n"
            return f"start: analysis? {rule}\n{ana}\n{anare}\n{body}\n"
        return f"start: {rule}\n{body}\n"

    def reader(self) -> "ReplyReader":
        return ReplyReader(self)


def _check_messages(messages):
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{j}]: expected {{'role': str, 'content': str}}, got {m!r:.80}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and (m.get("tool_calls") or m["role"] != "user")):
            raise _bad(f"messages[{j}] ({m['role']}): content must be a string (null only beside tool_calls)")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls)):
            raise _bad(f"messages[{j}].tool_calls: expected [{{'id': str, 'type': 'function', 'function': "
                       "{'name': str, 'arguments': JSON text}}]")


def _re(s: str) -> str:
    """s as a Lark regex literal's text."""
    import re
    return re.escape(s).replace("/", "\\/")


def _with_tool_prompt(messages, tools, fmt):
    """The tools described in the system message (the first one, or a new one), with fmt's call form."""
    desc = toolcalls.tools_system_prompt(tools, fmt)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = (first.get("content") or "") + "\n\n" + desc
        return [first] + messages[1:]
    return [{"role": "system", "content": desc}] + messages


class ReplyReader:
    """A reply's text read into (reasoning, content, tool calls), whole (message) or as it grows
    (push: the deltas since the last push; what may still turn out to open a call or close the
    reasoning is held back). The streamed parts joined equal message()'s."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.sent_reasoning = self.sent_content = ""
        self.sent_calls = 0
        self.ids = []                            # tool-call ids, one per call as first seen

    def split(self, text: str, final: bool):
        """(reasoning or None, content, calls) of text; not final: the content cut before anything that
        may still become a marker."""
        p = self.plan
        reasoning, rest = None, text
        if p.reasoning == "think":
            opening, end = p.marks
            body = text if p.opened else None
            if body is None:
                lead = text.lstrip()
                if lead.startswith(opening):
                    body = lead[len(opening):]
                elif not final and lead and opening.startswith(lead):
                    return None, "", []
            if body is not None:
                head, sep, after = body.partition(end)
                if sep:
                    reasoning, rest = head.strip(), after.lstrip()
                else:
                    reasoning, rest = (head if final else _hold(head, end)).strip(), ""
        elif p.reasoning == "harmony":
            reasoning, rest = _harmony(text, final)
        if p.calls:
            if p.reasoning == "harmony":
                content, calls = p.format.parse(text, p.tools)
                content = content if final else _harmony(text, False)[1]
            else:
                content, calls = p.format.parse(rest, p.tools)
            if not final:
                start = rest.find(p.format.start)
                content = _hold(rest if start < 0 else rest[:start], p.format.start).rstrip()
                content = content.strip() if p.reasoning != "harmony" else content
        else:
            content, calls = (rest if final else rest.rstrip()), []
        return reasoning, content, calls

    def message(self, text: str) -> dict:
        """The whole reply as an OpenAI assistant message (reasoning_content only when there was any)."""
        reasoning, content, calls = self.split(text, final=True)
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            while len(self.ids) < len(calls):
                self.ids.append(toolcalls.call_id())
            msg["tool_calls"] = [_call(self.ids[k], c) for k, c in enumerate(calls)]
        return msg

    def push(self, text: str, final: bool = False) -> list:
        """The deltas (OpenAI chat.completion.chunk `delta`s) that text (the whole reply so far) adds."""
        reasoning, content, calls = self.split(text, final)
        out = []
        if reasoning and reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            out.append({"reasoning_content": reasoning[len(self.sent_reasoning):]})
            self.sent_reasoning = reasoning
        if content and content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out.append({"content": content[len(self.sent_content):]})
            self.sent_content = content
        for k in range(self.sent_calls, len(calls)):
            while len(self.ids) <= k:
                self.ids.append(toolcalls.call_id())
            out.append({"tool_calls": [{"index": k, **_call(self.ids[k], calls[k])}]})
        self.sent_calls = max(self.sent_calls, len(calls))
        return out


def _call(cid, c) -> dict:
    return {"id": cid, "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}


def _hold(text: str, marker: str) -> str:
    """text without a tail that could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


def _harmony(text: str, final: bool):
    """(analysis text or None, final channel's text) of a harmony reply (TextCodec.reply's reading, on
    text that keeps the special tokens); not final: an unfinished marker held back."""
    if HARMONY_CHANNEL not in text:
        return None, ("" if not final else text)
    content, reasoning = "", []
    for part in text.split(HARMONY_CHANNEL)[1:]:
        head, sep, body = part.partition(HARMONY_MESSAGE)
        if not sep:
            continue
        ended = False
        for end in HARMONY_ENDS:
            if end in body:
                body, ended = body.split(end, 1)[0], True
        if not final and not ended:                # an unfinished marker at the end: held back
            i = body.rfind("<|")
            body = body[:i] if i >= 0 and "|>" not in body[i:] else _hold(body, "<|")
        channel = head.split()[0] if head.split() else ""
        if channel == "final":
            content = body
        elif channel == "analysis":
            reasoning.append(body)
    return "".join(reasoning) or None, content
