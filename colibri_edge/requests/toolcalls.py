"""Tool calls in each model family's own format: the calls a reply makes, parsed out of its text, and a
grammar that holds a reply to calls (tool_choice "required" or a named function).

A model calls tools in the format its chat template shows it (in the tools' system text and in the
assistant turns it renders); `format_for(template)` picks the format by substrings of the template
(`markers`, tried in this table's order, most specific first; no template or no match: hermes).

| format        | templates (families)                              | a call, as the model writes it                        |
|---------------|---------------------------------------------------|-------------------------------------------------------|
| harmony       | gpt-oss                                           | <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS |
| deepseek_dsml | DeepSeek V3.2, V4                                 | <｜DSML｜invoke name="NAME"> then <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter> lines, in a <｜DSML｜function_calls> block (V4: tool_calls) |
| deepseek      | DeepSeek V3.1 (V3-0324, R1 distills)              | <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜> between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜> (V3: function<｜tool▁sep｜>NAME, ARGS in a ```json fence) |
| mistral       | Nemo, Small 3.2, Ministral 3, Devstral            | [TOOL_CALLS]NAME[ARGS]ARGS per call (Small 3.2's template: [CALL_ID]ID before [ARGS]); Nemo: [TOOL_CALLS][{"name", "arguments"}, ...] |
| gemma         | Gemma 4                                           | <|tool_call>call:NAME{k:V,...}<tool_call|>, strings between <|"|> marks |
| granite       | Granite 3.x                                       | <|tool_call|>[{"name", "arguments"}, ...]             |
| glm           | GLM-4.6, GLM-4.7 (Ling 3, Spark 2.5)              | <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call> |
| qwen3_coder   | Qwen3.5, Qwen3-Coder (Nemotron 3 Nano, Step 3.5)  | <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call> |
| llama3        | Llama 3.1, 3.2, 3.3                               | {"name", "parameters"}, or after <|python_tag|>, several joined by ";" |
| hermes        | Qwen2.5, Qwen3, Granite 4, Hermes 2/3; fallback   | <tool_call>\\n{"name", "arguments"}\\n</tool_call>     |

ARGS is the arguments' JSON object; V one value written as text: a string as it is, any other type as
JSON (qwen3_coder, glm, deepseek_dsml). The function's `parameters` schema says which, so
`parse(text, tools)` reads "3" as 3 where the parameter is an integer and keeps "3" where it is a
string (Qwen's templates write booleans as Python does, True/False: both spellings are read). A call
that does not parse stays in the content, as vLLM's parsers leave it. Where a template renders calls
otherwise than the model writes them (harmony's recipient before the channel, Small 3.2's [CALL_ID],
Nemo's ids), both are read.

Reasoning before the calls is not content: a leading reasoning block (`think`: <think>...</think>,
Mistral's [THINK]...[/THINK], Gemma's <|channel>thought...<channel|>; harmony's analysis channel) is
split off by `split_reasoning`, also when the generation prompt opened it (Qwen3.5, GLM-4.7, DeepSeek
thinking: the reply starts inside the block and only its end is in the text).

`lark(tools, names, parallel)` is an llguidance Lark grammar of a reply that is only calls (one, or
one or more) to the functions in `names`, each call's arguments held to the function's `parameters`
schema: %json where the format writes JSON (llguidance keeps an object's properties in the schema's
order, and takes \\u escapes for control characters only: other characters are written as they are;
zero or one space after "," and ":" passes, as json.dumps and compact writers emit), and where
it writes values as text one rule per parameter by its type (a string: any text up to the parameter's
end marker; integer, number, boolean by their spellings; objects and arrays %json), the parameters in
the schema's order (gemma: sorted, as its template writes them), the required ones present. Reasoning
may come first: the format's block, or the rest of one the prompt opened (in_reasoning =
opens_reasoning(prompt)). Markers that are special tokens of the model's tokenizer are given in
`special` (text -> id) and written as token references: plain text cannot spell a special token.
llguidance's lexemes are greedy (a literal never stops where a longer one could go on), so a grammar
here keeps a separator apart from a closing tag that starts with the same text.
"""
from __future__ import annotations

import json
import re
import secrets
import string

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

FORMATS: list = []

_ID_ALPHABET = string.ascii_letters + string.digits
_INT = r"-?(0|[1-9][0-9]*)"
_NUM = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_JSON_OPTIONS = {"whitespace_pattern": "[ ]?"}     # between JSON tokens: nothing or one space
_SP = '" "?'                                        # the same between the parts a format writes around JSON
_KEY = "/[A-Za-z_][A-Za-z0-9_.-]*/"                 # a bare key (gemma)


def register(cls):
    """Class decorator: adds an instance of the format to FORMATS (detection order = registration order)."""
    FORMATS.append(cls())
    return cls


def _bad(msg):
    return ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, msg)


def call_id() -> str:
    """A new tool-call id: 9 letters and digits (Mistral's templates refuse any other id)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


# ---------------------------------------------------------------------------------------------------
# tools and parameter types


def _function(entry):
    """The {"name", "parameters", ...} of one OpenAI tool entry (or a bare function dict), or None."""
    if not isinstance(entry, dict) or entry.get("type", "function") != "function":
        return None
    fn = entry.get("function", entry)
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] else None


def _schemas(tools) -> dict:
    """name -> parameters schema of the well-formed entries of tools (parse reads leniently)."""
    out = {}
    for entry in tools if isinstance(tools, list) else ():
        fn = _function(entry)
        if fn is not None:
            out[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    return out


def _functions(tools, names) -> list[tuple[str, dict]]:
    """(name, parameters) of each function in names, in order, checked against tools."""
    if not isinstance(tools, list) or not tools:
        raise _bad("tool calls need tools: give `tools` as a list of {'type': 'function', 'function': "
                   "{'name': ..., 'parameters': {...}}}")
    known = {}
    for i, entry in enumerate(tools):
        fn = _function(entry)
        if fn is None:
            raise _bad(f"tools[{i}] is not a function tool: give {{'type': 'function', 'function': "
                       "{'name': ..., 'parameters': {...}}}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise _bad(f"tool {fn['name']!r}: its parameters must be a JSON schema object")
        known[fn["name"]] = params
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise _bad("give the names of the functions a reply may call (a non-empty list of strings)")
    missing = [n for n in names if n not in known]
    if missing:
        raise _bad(f"tool_choice names {missing[0]!r}, which is not in tools ({', '.join(sorted(known))}); "
                   "name one of those")
    return [(n, known[n]) for n in dict.fromkeys(names)]


def _types(schema) -> set:
    """The JSON types a schema names (empty: unconstrained)."""
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _is_text(schema) -> bool:
    """Whether a value of this schema is written as raw text (a string, or of no declared type)."""
    types = _types(schema)
    return not types or "string" in types


def _typed(text: str, schema):
    """A parameter's value written as text, read by its schema: strings (and untyped values) kept,
    JSON for the other types, Python's True/False/None read as well (Qwen's templates write them)."""
    if _is_text(schema):
        return text
    python = {"True": True, "False": False, "None": None}
    if text in python:
        return python[text]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _arguments(value):
    """A call's arguments object: a dict, or a JSON object's text; None when neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _json_call(obj, key="arguments"):
    """{"name", "arguments"} of a decoded JSON call object (key: the format's arguments key), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(obj.get(key, obj.get("arguments", obj.get("parameters"))))
    return None if args is None else {"name": obj["name"], "arguments": args}


def _decode(text, pos):
    """(JSON value, end) decoded at text[pos:] after any whitespace; ValueError when there is none."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return json.JSONDecoder().raw_decode(text, pos)


# ---------------------------------------------------------------------------------------------------
# grammar building


def _re(text: str) -> str:
    """text as a literal inside an llguidance /regex/ (Rust regex syntax, where `\\<` is an assertion:
    only the metacharacters and the delimiter are escaped)."""
    out = []
    for ch in text:
        if ch in "\\.^$|?*+()[]{}/-&~#":
            out.append("\\" + ch)
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        else:
            out.append(ch)
    return "".join(out)


class _Lark:
    """A Lark grammar under construction: literals with special-token references, named rules."""

    def __init__(self, special):
        self.special = sorted(((k, int(v)) for k, v in (special or {}).items() if isinstance(k, str) and k),
                              key=lambda kv: -len(kv[0]))
        self.rules = {}
        self._made = {}

    def rule(self, prefix, body, options=""):
        """A new rule named prefix_N with this body; its name."""
        name = f"{prefix}_{len(self.rules)}"
        self.rules[name] = (options, body)
        return name

    def once(self, key, make):
        """What make() gives the first time key is asked for (rules shared within a grammar)."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def pieces(self, text):
        """text split into plain runs (str) and special tokens (int ids), the longest token first."""
        keys = [(k, v) for k, v in self.special if k in text]
        out, run, i = [], "", 0
        while i < len(text):
            for k, v in keys:
                if text.startswith(k, i):
                    out += [run, v] if run else [v]
                    run, i = "", i + len(k)
                    break
            else:
                run += text[i]
                i += 1
        return out + [run] if run else out

    def lit(self, text):
        """The literal text: quoted runs, <[id]> for its special tokens."""
        return " ".join(json.dumps(p, ensure_ascii=False) if isinstance(p, str) else f"<[{p}]>"
                        for p in self.pieces(text))

    def ws(self):
        """Up to four whitespace characters."""
        return self.once("ws", lambda: self.rule("ws", r"/[ \t\r\n]{0,4}/"))

    def until(self, delim):
        """Any text, then delim. A delimiter that starts with a special token follows free text (text
        cannot spell the token); one that starts with plain text ends a lazy lexeme, the shortest text
        that reaches it (so the text holds no earlier copy of that part)."""
        def make():
            first = self.pieces(delim)[0]
            if isinstance(first, int):
                text = self.once("text", lambda: self.rule("text", r"/(.|\n)*/"))
                return f"{text} {self.lit(delim)}"
            head = self.rule("until", f"/(.|\\n)*{_re(first)}/", "[lazy]")
            rest = delim[len(first):]
            return f"{head} {self.lit(rest)}" if rest else head
        return self.once(("until", delim), make)

    def json(self, schema, root=None):
        """%json of schema, with root's definitions kept so that its $refs resolve."""
        schema = dict(schema) if isinstance(schema, dict) else {}
        for key in ("$defs", "definitions"):
            if isinstance(root, dict) and key in root and key not in schema:
                schema[key] = root[key]
        schema["x-guidance"] = {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}
        return "%json " + json.dumps(schema, ensure_ascii=False)

    def text(self, start):
        lines = [f"start: {start}"] + [f"{name}{opts}: {body}" for name, (opts, body) in self.rules.items()]
        return "\n".join(lines) + "\n"


def _json_call_lark(g, name, key, params, extra=""):
    """{"name": "NAME", "<key>": ARGS<extra>} with an optional space after each ':' and ','."""
    parts = [g.lit("{"), _SP, g.lit('"name":'), _SP, g.lit(json.dumps(name, ensure_ascii=False) + ","), _SP,
             g.lit(json.dumps(key) + ":"), _SP, g.json(params), extra, _SP, g.lit("}")]
    return " ".join(p for p in parts if p)


def _text_value(g, schema, root, end):
    """A parameter's value written as text (qwen3_coder, glm, deepseek_dsml), then end."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(g.lit(e + end) for e in enum) + ")"
    types = _types(schema)
    if _is_text(schema) or not types & {"integer", "number", "boolean", "null", "object", "array"}:
        return g.until(end)
    alts = []
    if "integer" in types and "number" not in types:
        alts.append(f"/{_INT}/")
    if "number" in types:
        alts.append(f"/{_NUM}/")
    if "boolean" in types:
        alts.append('"true" | "false" | "True" | "False"')
    if "null" in types:
        alts.append('"null" | "None"')
    if types & {"object", "array"}:
        alts.append(g.json(schema, root))
    return f"({' | '.join(alts)}) {g.lit(end)}"


def _ordered_params(params, item):
    """The parameters of a text format, each `item(key, schema)`, in the schema's order, those not
    required optional; a schema without properties: any parameters, `item(None, None)` repeated."""
    props = params.get("properties")
    if not isinstance(props, dict) or not props:
        return f"({item(None, None)})*"
    required = set(params.get("required") or ())
    parts = []
    for key, schema in props.items():
        body = item(key, schema if isinstance(schema, dict) else {})
        parts.append(body if key in required else f"({body})?")
    return " ".join(parts)


def _comma_members(g, members):
    """Members (expr, required) joined by ',' in order, those not required may be absent; rules linear
    in the members: after_i is what may follow once a member before i was written ("," and member i,
    optional unless required, then after_i+1), first_i what may come while none was."""
    n = len(members)
    tails = [""] * (n + 1)                          # tails[i]: " after_i", "" past the last member
    for i in range(n - 1, 0, -1):
        expr, req = members[i]
        body = f'"," {expr}{tails[i + 1]}' if req else f'("," {expr})?{tails[i + 1]}'
        tails[i] = " " + g.rule("after", body)
    first = None
    for i in range(n - 1, -1, -1):
        expr, req = members[i]
        body = f"{expr}{tails[i + 1]}"
        if not req:
            body = f"({body})?" if first is None else f"{body} | {first}"
        first = g.rule("first", body)
    return first


# ---------------------------------------------------------------------------------------------------
# formats


class ToolFormat:
    """A tool-call format. A subclass gives name, markers, start, think, example, _spans (reading) and
    _call or _calls (the grammar)."""
    name: str = ""
    markers: tuple = ()
    start: str = ""
    think: tuple | None = ("<think>", "</think>")       # the reasoning block's (opening, end), or None
    example: str = ""                                     # a call, as tools_system_prompt teaches it

    # -- reading ---------------------------------------------------------------------------------

    def parse(self, text: str, tools: list | None = None) -> tuple[str, list[dict]]:
        """(content, calls) of a reply's text (decoded with special tokens kept, up to but not
        including the end-of-turn token): calls [{"name", "arguments": dict}] in order, content the
        text outside them and outside the leading reasoning, stripped. tools (the OpenAI list) give
        the parameter types of the formats that write values as text."""
        _, text = self.split_reasoning(text)
        content, calls, pos = [], [], 0
        for a, b, found in self._spans(text, _schemas(tools)):
            content.append(text[pos:a])
            calls += found
            pos = b
        content.append(text[pos:])
        return "".join(content).strip(), calls

    def _spans(self, text, schemas) -> list[tuple[int, int, list[dict]]]:
        """(start, end, calls) of each stretch of text that holds calls that parse, in order."""
        raise NotImplementedError

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """(reasoning, the rest) of a reply: its leading reasoning block (whose opening may have been
        the prompt's: then only its end is in the text), or (None, text) when there is none."""
        if not self.think:
            return None, text
        opening, end = self.think
        i = text.find(end)
        if i < 0:
            return None, text
        j = text.find(opening, 0, i)
        if text[:max(j, 0)].strip():                 # text before the opening: not a leading block
            return None, text
        return text[j + len(opening) if j >= 0 else 0:i].strip(), text[i + len(end):]

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether a prompt ends inside an open reasoning block (its generation prompt opened one):
        the reply then starts with reasoning text (give lark in_reasoning=True)."""
        return bool(self.think) and prompt.rfind(self.think[0]) > prompt.rfind(self.think[1])

    # -- grammar ---------------------------------------------------------------------------------

    def lark(self, tools: list, names: list[str], parallel: bool, special: dict[str, int] | None = None,
             in_reasoning: bool = False, reasoning: bool = True) -> str:
        """An llguidance Lark grammar of a reply that is only calls to the functions in names: one
        (parallel False) or one or more, each with arguments that follow the function's parameters
        schema, after optional reasoning (in_reasoning: the prompt opened the reasoning block, the
        reply starts inside it). special: marker text -> token id for the markers that are special
        tokens in the model's tokenizer; reasoning False: no reasoning block (the prompt switched
        thinking off, or the template never thinks). ColibriError (invalid argument) when names are not
        in tools."""
        fns = _functions(tools, names)
        g = _Lark(special)
        head = self._reasoning(g, in_reasoning) if reasoning or not self.think else g.ws()
        return g.text(f"{head} {self._calls(g, fns, parallel)} {g.ws()}")

    def _reasoning(self, g, in_reasoning):
        if not self.think:
            return g.ws()
        opening, end = self.think
        if in_reasoning:
            return f"({g.lit(opening)})? {g.until(end)} {g.ws()}"
        return f"{g.ws()} ({g.lit(opening)} {g.until(end)} {g.ws()})?"

    def _calls(self, g, fns, parallel):
        call = g.rule("call", " | ".join(self._call(g, n, p) for n, p in fns))
        return f"{call} ({self._separator(g)} {call})*" if parallel else call

    def _separator(self, g):
        return g.ws()

    def _call(self, g, name, params):
        raise NotImplementedError


@register
class Harmony(ToolFormat):
    """OpenAI's harmony (gpt-oss). A reply is messages, each `<|channel|>CHANNEL[ to=RECIPIENT]
    [<|constrain|>TYPE]<|message|>BODY` ending in <|end|> (then <|start|>assistant...), <|call|> or
    <|return|>; the reply's first message has no <|start|>assistant (the generation prompt wrote it).
    A call is a message to functions.NAME with a JSON body; the template renders the recipient before
    the channel. <|call|> ends the turn (an end-of-sequence token): one call per reply, so `parallel`
    has no effect. Content is the final channel's text, reasoning the analysis channel's."""
    name = "harmony"
    markers = ("<|channel|>",)
    start = "<|channel|>commentary to="
    think = None
    example = "<|channel|>commentary to=functions.FUNCTION_NAME <|constrain|>json<|message|>ARGUMENTS"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def _messages(self, text):
        """(header, body, raw) of each message of a reply (text before any message: header "")."""
        out = []
        for n, chunk in enumerate(text.split("<|start|>")):
            header, sep, body = chunk.partition("<|message|>")
            if not sep:
                if n == 0 and chunk.strip():
                    out.append(("", chunk, chunk))
                continue
            for end in self.ENDS:
                body = body.split(end, 1)[0]
            out.append((header, body, chunk))
        return out

    def parse(self, text, tools=None):
        content, calls = [], []
        for header, body, _ in self._messages(text):
            to = re.search(r"to=functions\.([^\s<]+)", header)
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            if to:
                try:
                    args = _arguments(json.loads(body))
                except ValueError:
                    args = None
                if args is not None:
                    calls.append({"name": to.group(1), "arguments": args})
                else:
                    content.append(body)
            elif not header or (channel and channel.group(1) == "final"):
                content.append(body)
        return "".join(content).strip(), calls

    def split_reasoning(self, text):
        reasoning, rest = [], []
        for header, body, raw in self._messages(text):
            if re.search(r"<\|channel\|>\s*analysis\b", header) and "to=" not in header:
                reasoning.append(body)
            else:
                rest.append(raw)
        return "".join(reasoning) or None, "<|start|>".join(rest)

    def opens_reasoning(self, prompt):
        return False

    def _reasoning(self, g, in_reasoning):
        analysis = f'{g.lit("<|channel|>analysis<|message|>")} {g.until("<|end|>")} {g.lit("<|start|>assistant")}'
        return f"({analysis})*"

    def _calls(self, g, fns, parallel):
        return g.rule("call", " | ".join(self._call(g, n, p) for n, p in fns))

    def _call(self, g, name, params):
        ctype = f'(" " ({g.lit("<|constrain|>")})? {g.lit("json")})?'
        model = f'{g.lit("<|channel|>commentary to=functions." + name)} {ctype}'
        rendered = f'{g.lit(" to=functions." + name + "<|channel|>commentary")} {ctype}'
        return f'({model} | {rendered}) {g.lit("<|message|>")} {g.json(params)}'


@register
class DeepSeekDSML(ToolFormat):
    """DeepSeek V3.2 / V4's DSML: a block <｜DSML｜function_calls> (V4: tool_calls) of invokes, one
    item a line, each parameter tagged string="true" (its text) or string="false" (JSON)."""
    name = "deepseek_dsml"
    markers = ("｜DSML｜",)
    start = "<｜DSML｜"
    D = "｜DSML｜"
    example = (f'<{D}function_calls>\n<{D}invoke name="FUNCTION_NAME">\n<{D}parameter name="PARAMETER" '
               f'string="true for a string, false for any other type">VALUE</{D}parameter>\n</{D}invoke>\n'
               f"</{D}function_calls>")

    def _spans(self, text, schemas):
        D = re.escape(self.D)
        out = []
        for block in re.finditer(rf"<{D}(function_calls|tool_calls)>(.*?)(?:</{D}\1>|\Z)", text, re.S):
            calls = []
            for inv in re.finditer(rf'<{D}invoke name="([^"]+)">(.*?)(?:</{D}invoke>|\Z)', block.group(2), re.S):
                args = {}
                for key, written, value in re.findall(
                        rf'<{D}parameter name="([^"]+)" string="(true|false)">(.*?)</{D}parameter>', inv.group(2), re.S):
                    if written == "false":                  # the format says JSON, whatever the schema
                        try:
                            value = json.loads(value)
                        except ValueError:
                            pass
                    args[key] = value
                calls.append({"name": inv.group(1), "arguments": args})
            if calls:
                out.append((block.start(), block.end(), calls))
        return out

    def _calls(self, g, fns, parallel):
        invoke = g.rule("call", " | ".join(self._call(g, n, p) for n, p in fns))
        nl = g.lit("\n")
        invokes = f"{invoke} ({nl} {invoke})*" if parallel else invoke
        # the newline before the closing tag is a literal of its own: a "\n</..." literal would take
        # the "\n<" that starts the next invoke (greedy lexemes)
        blocks = [f"{g.lit(f'<{self.D}{b}>' + chr(10))} {invokes} {nl} {g.lit(f'</{self.D}{b}>')}"
                  for b in ("function_calls", "tool_calls")]
        return "(" + " | ".join(blocks) + ")"

    def _call(self, g, name, params):
        end = f"</{self.D}parameter>\n"

        def item(key, schema):
            if key is None:
                return f"{g.lit(f'<{self.D}parameter name=')} " + r'/"[^"]+" string="(true|false)">/ ' + g.until(end)
            head = f'<{self.D}parameter name="{key}" string="{"true" if _is_text(schema) else "false"}">'
            return f"{g.lit(head)} {_text_value(g, schema, params, end)}"
        head = f"<{self.D}invoke name={json.dumps(name, ensure_ascii=False)}>\n"
        return f"{g.lit(head)} {_ordered_params(params, item)} {g.lit(f'</{self.D}invoke>')}"


@register
class DeepSeek(ToolFormat):
    """DeepSeek V3 / V3.1 / R1: calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>; V3.1
    writes NAME<｜tool▁sep｜>ARGS, V3-0324 and R1 function<｜tool▁sep｜>NAME then ARGS in a ```json
    fence (both read; the grammar allows both, a model keeps to its own). Their templates do not
    render tools: tools_system_prompt(tools, this format) teaches them."""
    name = "deepseek"
    markers = ("<｜tool▁calls▁begin｜>",)
    start = "<｜tool▁calls▁begin｜>"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    example = f"{BEGIN}{CALL}FUNCTION_NAME{SEP}ARGUMENTS{CALL_END}{END}"

    def _spans(self, text, schemas):
        out, pos = [], 0
        while (a := text.find(self.BEGIN, pos)) >= 0:
            e = text.find(self.END, a)
            b = len(text) if e < 0 else e + len(self.END)
            block = text[a + len(self.BEGIN):b - (len(self.END) if e >= 0 else 0)]
            calls = [self._one(c.split(self.CALL_END, 1)[0]) for c in block.split(self.CALL)[1:]]
            if calls and all(calls):
                out.append((a, b, calls))
            pos = b
        return out

    def _one(self, body):
        """The call in one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜>, or None."""
        head, sep, rest = body.partition(self.SEP)
        if not sep:
            return None
        fence = re.fullmatch(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*", rest, re.S)
        if head.strip() in ("function", "") and fence:
            name, args = fence.group(1), fence.group(2)
        else:
            name, args = head.strip(), rest
        args = _arguments(args.strip())
        return {"name": name, "arguments": args} if name and args is not None else None

    def _calls(self, g, fns, parallel):
        return f"{g.lit(self.BEGIN)} {super()._calls(g, fns, parallel)} {g.lit(self.END)}"

    def _separator(self, g):
        return '"\\n"?'

    def _call(self, g, name, params):
        v31 = f"{g.lit(self.CALL + name + self.SEP)} {g.json(params)}"
        v3 = f"{g.lit(f'{self.CALL}function{self.SEP}{name}' + chr(10) + '```json' + chr(10))} {g.json(params)} " \
             f"{g.lit(chr(10) + '```')}"
        return f"({v31} | {v3}) {g.lit(self.CALL_END)}"


@register
class Mistral(ToolFormat):
    """Mistral: from tokenizer v11 (Small 3.2, Ministral 3, Devstral) [TOOL_CALLS]NAME[ARGS]ARGS per
    call ([CALL_ID]ID before [ARGS] where the template renders ids); Nemo (v3): [TOOL_CALLS] and one
    JSON list of {"name", "arguments"[, "id"]}. Both are read and the grammar allows both. Call ids
    must be 9 letters and digits (call_id())."""
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    start = "[TOOL_CALLS]"
    think = ("[THINK]", "[/THINK]")
    MARK = "[TOOL_CALLS]"
    example = "[TOOL_CALLS]FUNCTION_NAME[ARGS]ARGUMENTS"

    def _spans(self, text, schemas):
        out, pos = [], 0
        while (a := text.find(self.MARK, pos)) >= 0:
            calls, end = self._after(text, a + len(self.MARK))
            if not calls:
                break
            out.append((a, end, calls))
            pos = end
        return out

    def _after(self, text, j):
        """(calls, end) of what follows a [TOOL_CALLS] ending at j, or ([], j)."""
        try:
            if text[j:].lstrip().startswith("["):
                items, end = _decode(text, j)
                calls = [_json_call(x) for x in items] if isinstance(items, list) else []
                return (calls, end) if calls and all(calls) else ([], j)
            head = re.match(r"\s*([^\[\]\s{]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]", text[j:])
            if not head:
                return [], j
            args, end = _decode(text, j + head.end())
        except ValueError:
            return [], j
        args = _arguments(args)
        return ([{"name": head.group(1), "arguments": args}], end) if args is not None else ([], j)

    def _calls(self, g, fns, parallel):
        v11 = g.rule("call", " | ".join(self._call(g, n, p) for n, p in fns))
        ident = f'("," {_SP} {g.lit(chr(34) + "id" + chr(34) + ":")} {_SP} /"[A-Za-z0-9]{{9}}"/)?'
        item = g.rule("item", " | ".join(_json_call_lark(g, n, "arguments", p, ident) for n, p in fns))
        items = f'{item} ("," {_SP} {item})*' if parallel else item
        nemo = f'{g.lit(self.MARK + "[")} {items} {g.lit("]")}'
        return f"({v11}{'+' if parallel else ''} | {nemo})"

    def _call(self, g, name, params):
        call_id = f'({g.lit("[CALL_ID]")} /[A-Za-z0-9]{{9}}/)?'
        return f'{g.lit(self.MARK + name)} {call_id} {g.lit("[ARGS]")} {g.json(params)}'


@register
class Gemma4(ToolFormat):
    """Gemma 4: <|tool_call>call:NAME{key:VALUE,...}<tool_call|> per call, keys bare and sorted (the
    template's dictsort), strings between <|"|> marks, numbers, true/false and null bare, objects
    {k:v,...} and lists [v,...] nested. Its reasoning: <|channel>thought...<channel|>."""
    name = "gemma"
    markers = ("<|tool_call>",)
    start = "<|tool_call>"
    think = ("<|channel>thought", "<channel|>")
    Q = '<|"|>'
    example = f"<|tool_call>call:FUNCTION_NAME{{PARAMETER:VALUE,...}}<tool_call|> (a string VALUE between {Q} marks)"

    def _spans(self, text, schemas):
        out = []
        for m in re.finditer(r"<\|tool_call>call:([^{\s<]+)\{", text):
            try:
                args, end = self._value(text, m.end() - 1)
            except (ValueError, IndexError):
                continue
            if text.startswith("<tool_call|>", end):
                end += len("<tool_call|>")
            elif text[end:].strip():
                continue
            out.append((m.start(), end, [{"name": m.group(1), "arguments": args}]))
        return out

    def _value(self, s, i):
        """(value, end) of the Gemma value at s[i] (ValueError or IndexError when it is not one)."""
        if s.startswith(self.Q, i):
            j = s.index(self.Q, i + len(self.Q))
            return s[i + len(self.Q):j], j + len(self.Q)
        if s[i] in "{[":
            close, out, i = "}" if s[i] == "{" else "]", {} if s[i] == "{" else [], i + 1
            while s[i] != close:
                if isinstance(out, dict):
                    if s.startswith(self.Q, i):
                        key, i = self._value(s, i)
                    else:
                        j = s.index(":", i)
                        key, i = s[i:j], j
                    if s[i] != ":":
                        raise ValueError("a key without ':'")
                    out[key], i = self._value(s, i + 1)
                else:
                    item, i = self._value(s, i)
                    out.append(item)
                if s[i] == ",":
                    i += 1
                elif s[i] != close:
                    raise ValueError("expected ',' or the closing bracket")
            return out, i + 1
        m = re.compile(r"[^,}\]<]+").match(s, i)
        if not m:
            raise ValueError("no value")
        word = m.group(0).strip()
        bare = {"true": True, "false": False, "null": None, "None": None, "True": True, "False": False}
        if word in bare:
            return bare[word], m.end()
        try:
            return json.loads(word), m.end()
        except ValueError:
            return word, m.end()

    def _separator(self, g):
        return ""

    def _call(self, g, name, params):
        return f'{g.lit("<|tool_call>call:" + name)} {self._object(g, params)} {g.lit("<tool_call|>")}'

    def _object(self, g, schema):
        """An object by its schema: its properties sorted, the required ones present."""
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            any_ = self._any(g)
            return g.once("gobj", lambda: g.rule("gobj", f'"{{" ({_KEY} ":" {any_} ("," {_KEY} ":" {any_})*)? "}}"'))
        required = set(schema.get("required") or ())
        members = [(f"{g.lit(k + ':')} {self._value_rule(g, props[k] if isinstance(props[k], dict) else {})}",
                    k in required) for k in sorted(props)]
        return f'"{{" {_comma_members(g, members)} "}}"'

    def _value_rule(self, g, schema):
        """A value following schema, in Gemma's notation."""
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            return "(" + " | ".join(g.lit(self.Q + e + self.Q) for e in enum) + ")"
        types = _types(schema)
        alts = []
        if "string" in types:
            alts.append(f"{g.lit(self.Q)} {g.until(self.Q)}")
        if "integer" in types and "number" not in types:
            alts.append(f"/{_INT}/")
        if "number" in types:
            alts.append(f"/{_NUM}/")
        if "boolean" in types:
            alts.append('"true" | "false"')
        if "null" in types:
            alts.append('"null"')
        if "object" in types:
            alts.append(self._object(g, schema))
        if "array" in types:
            items = schema.get("items")
            item = self._value_rule(g, items) if isinstance(items, dict) else self._any(g)
            alts.append(f'"[" ({item} ("," {item})*)? "]"')
        return "(" + " | ".join(alts) + ")" if alts else self._any(g)

    def _any(self, g):
        """Any Gemma value (a recursive rule, made once)."""
        def make():
            name = g.rule("gany", "")
            g.rules[name] = ("", " | ".join([
                f"{g.lit(self.Q)} {g.until(self.Q)}", f"/{_NUM}/", '"true"', '"false"', '"null"',
                f'"{{" ({_KEY} ":" {name} ("," {_KEY} ":" {name})*)? "}}"', f'"[" ({name} ("," {name})*)? "]"']))
            return name
        return g.once("gany", make)


@register
class Granite(ToolFormat):
    """Granite 3.x: <|tool_call|> then one JSON list of {"name", "arguments"} (Granite 4 writes
    hermes' <tool_call> blocks). Its template does not render an assistant's tool calls."""
    name = "granite"
    markers = ("<|tool_call|>",)
    start = "<|tool_call|>"
    think = None
    MARK = "<|tool_call|>"
    example = '<|tool_call|>[{"name": "FUNCTION_NAME", "arguments": ARGUMENTS}]'

    def _spans(self, text, schemas):
        a = text.find(self.MARK)
        if a < 0:
            return []
        try:
            value, end = _decode(text, a + len(self.MARK))
        except ValueError:
            return []
        calls = [_json_call(x) for x in (value if isinstance(value, list) else [value])]
        return [(a, end, calls)] if calls and all(calls) else []

    def _calls(self, g, fns, parallel):
        item = g.rule("call", " | ".join(_json_call_lark(g, n, "arguments", p) for n, p in fns))
        items = f'{item} ("," {_SP} {item})*' if parallel else item
        return f'{g.lit(self.MARK)} {g.ws()} {g.lit("[")} {items} {g.lit("]")}'


@register
class GLM(ToolFormat):
    """GLM-4.5 / 4.6 / 4.7: <tool_call>NAME, <arg_key>K</arg_key><arg_value>V</arg_value> per
    argument, </tool_call>; 4.5/4.6 put each on its own line, 4.7 writes no newlines."""
    name = "glm"
    markers = ("<arg_key>",)
    start = "<tool_call>"
    example = "<tool_call>FUNCTION_NAME\n<arg_key>PARAMETER</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"

    def _spans(self, text, schemas):
        out = []
        for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.S):
            body = m.group(1)
            name = body.split("<arg_key>", 1)[0].strip()
            if not name or "\n" in name or "<" in name:
                continue
            props = (schemas.get(name) or {}).get("properties") or {}
            pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.S)
            args = {k.strip(): _typed(v, props.get(k.strip())) for k, v in pairs}
            out.append((m.start(), m.end(), [{"name": name, "arguments": args}]))
        return out

    def _separator(self, g):
        return '"\\n"?'

    def _call(self, g, name, params):
        nl = '"\\n"?'

        def item(key, schema):
            if key is None:
                return f'{g.lit("<arg_key>")} {g.until("</arg_key>")} {nl} {g.lit("<arg_value>")} ' \
                       f'{g.until("</arg_value>")} {nl}'
            return f'{g.lit(f"<arg_key>{key}</arg_key>")} {nl} {g.lit("<arg_value>")} ' \
                   f'{_text_value(g, schema, params, "</arg_value>")} {nl}'
        return f'{g.lit("<tool_call>" + name)} {nl} {_ordered_params(params, item)} {g.lit("</tool_call>")}'


@register
class Qwen3Coder(ToolFormat):
    """Qwen3-Coder / Qwen3.5 (Nemotron 3 Nano, Step 3.5): XML-like calls, each parameter's value on
    lines of its own, a string as its text, another type as JSON (booleans as Python writes them, in
    Qwen's templates)."""
    name = "qwen3_coder"
    markers = ("<tool_call>\\n<function=", "<tool_call>\n<function=")      # as Jinja source, and as text
    start = "<tool_call>"
    example = "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER>\nVALUE\n</parameter>\n</function>\n</tool_call>"

    def _spans(self, text, schemas):
        out = []
        for m in re.finditer(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|\Z)", text, re.S):
            name = m.group(1).strip()
            props = (schemas.get(name) or {}).get("properties") or {}
            args = {}
            for key, value in re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", m.group(2), re.S):
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key.strip()] = _typed(value, props.get(key.strip()))
            out.append((m.start(), m.end(), [{"name": name, "arguments": args}]))
        return out

    def _call(self, g, name, params):
        end = "\n</parameter>\n"

        def item(key, schema):
            if key is None:
                return f'{g.lit("<parameter=")} /[^>\\n]+/ {g.lit(">" + chr(10))} {g.until(end)}'
            return f'{g.lit(f"<parameter={key}>" + chr(10))} {_text_value(g, schema, params, end)}'
        head = f"<tool_call>\n<function={name}>\n"
        return f'{g.lit(head)} {_ordered_params(params, item)} {g.lit("</function>" + chr(10) + "</tool_call>")}'


@register
class Llama3(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calling: {"name": ..., "parameters": {...}} as the whole reply
    (as the templates render it), or after <|python_tag|> (content may come before that), several
    joined by ';'. The templates render one call per message."""
    name = "llama3"
    markers = ("<|python_tag|>", "<|start_header_id|>ipython")
    start = '{"name"'
    think = None
    TAG = "<|python_tag|>"
    example = '{"name": "FUNCTION_NAME", "parameters": ARGUMENTS}'

    def _spans(self, text, schemas):
        a = text.find(self.TAG)
        if a >= 0:
            pos = a + len(self.TAG)
        elif text.lstrip().startswith("{"):
            a = pos = len(text) - len(text.lstrip())
        else:
            return []
        calls = []
        while True:
            try:
                obj, end = _decode(text, pos)
            except ValueError:
                return []
            call = _json_call(obj, "parameters")
            if call is None:
                return []
            calls.append(call)
            more = re.compile(r"\s*;").match(text, end)
            if not more:
                return [(a, end, calls)]
            pos = more.end()

    def _reasoning(self, g, in_reasoning):
        return f"{g.ws()} ({g.lit(self.TAG)})?"

    def _separator(self, g):
        return f'";" {_SP}'

    def _call(self, g, name, params):
        return _json_call_lark(g, name, "parameters", params)


@register
class Hermes(ToolFormat):
    """Hermes / Qwen2.5 / Qwen3 / Granite 4: a JSON object {"name", "arguments"} on a line of its own
    between <tool_call> and </tool_call>, one block per call. The fallback format, and the one
    tools_system_prompt teaches by default."""
    name = "hermes"
    markers = ("<tool_call>",)
    start = "<tool_call>"
    example = '<tool_call>\n{"name": "FUNCTION_NAME", "arguments": ARGUMENTS}\n</tool_call>'

    def _spans(self, text, schemas):
        out = []
        for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.S):
            try:
                call = _json_call(json.loads(m.group(1)))
            except ValueError:
                continue
            if call is not None:
                out.append((m.start(), m.end(), [call]))
        return out

    def _call(self, g, name, params):
        return f'{g.lit("<tool_call>")} {g.ws()} {_json_call_lark(g, name, "arguments", params)} {g.ws()} ' \
               f'{g.lit("</tool_call>")}'


_FALLBACK = next(f for f in FORMATS if f.name == "hermes")
_JINJA_CODE = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)


def format_for(template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches (the first in FORMATS whose marker it holds);
    hermes when there is no template or none matches."""
    if template:
        for f in FORMATS:
            if any(m in template for m in f.markers):
                return f
    return _FALLBACK


def renders_tools(template: str | None) -> bool:
    """Whether a chat template uses `tools` (in its Jinja code, not only in its text)."""
    return bool(template) and any(re.search(r"\btools\b", code) for code in _JINJA_CODE.findall(template))


def tools_system_prompt(tools: list, fmt: ToolFormat | None = None) -> str:
    """A system text that lists the tools and teaches a call format (fmt; hermes' <tool_call> blocks by
    default), for a template that renders no tools (DeepSeek V3.1's and R1's leave them to the system
    prompt: give their own format, format_for(template))."""
    fns = [_function(t) for t in tools or ()]
    if not fns or not all(fns):
        raise _bad("tools must be a list of {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    listing = "\n".join(json.dumps({"type": "function", "function": fn}, ensure_ascii=False) for fn in fns)
    return ("# Tools\n\nYou can call functions to answer the user. Their signatures, one JSON object a line, are "
            f"between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, write the call in "
            "this form, ARGUMENTS being the arguments' JSON object and VALUE one parameter's value (a string as it "
            "is, any other type as JSON); write one call after another to make several:\n"
            f"{(fmt or _FALLBACK).example}")
