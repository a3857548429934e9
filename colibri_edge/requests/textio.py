"""Tokenizer, chat template and incremental detokenisation (never a split UTF-8 character)."""
from __future__ import annotations

import os

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, invalid_model


HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"
# The template of a model that ships none: ChatML, as llama.cpp falls back to it (its
# llm_chat_template "chatml"); used with a warning on stderr, once per codec
FALLBACK_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def load_chat_template(spec: str) -> str:
    """--chat-template / Engine.open(chat_template=...): a Jinja file's path, or the template text itself
    (anything holding '{%' or '{{'), as llama-server's --chat-template-file and transformers'
    chat_template= take them."""
    if not isinstance(spec, str) or not spec.strip():
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"chat_template={spec!r:.60}: give a Jinja file's path "
                           "or the template text")
    if "{%" in spec or "{{" in spec:
        text = spec
    else:
        try:
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"chat template {spec}: cannot read it "
                               f"({type(e).__name__}: {e}); give a readable UTF-8 Jinja file") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"chat template {spec if text is not spec else ''}"
                           f"is not valid Jinja (line {e.lineno}: {e.message}); fix the template") from None
    return text
HARMONY_ENDS = ("<|return|>", "<|end|>", "<|call|>", "<|start|>")


class TextCodec:
    """chat_template: a template over the model's (load_chat_template's text); a model with neither
    renders chats with FALLBACK_CHAT_TEMPLATE (ChatML) and says so once on stderr."""

    def __init__(self, model_dir: str, tokenizer_config: dict, chat_template: str | None = None):
        from tokenizers import Tokenizer
        path = os.path.join(model_dir, "tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:                  # tokenizers raises plain Exception for a bad file
            raise invalid_model(path, "(file)", f"not a tokenizers file ({e}); copy the model's tokenizer.json "
                                "again or re-run `colibri convert`") from None
        self.config = dict(tokenizer_config or {})
        if chat_template is not None:
            self.config["chat_template"] = chat_template
        self.template_source = "given" if chat_template is not None else (
            "model" if self.config.get("chat_template") else "fallback")
        self._warned = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        if not isinstance(text, str):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"text to encode must be a string, got "
                               f"{type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the text is not valid Unicode ({e.reason} at "
                               f"character {e.start}: a lone surrogate); send UTF-8 text") from None
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def reply(self, ids) -> tuple[str, str | None]:
        """A chat reply's (content, reasoning). In OpenAI's harmony format (gpt-oss: the model writes
        <|channel|>analysis<|message|>... <|end|><|start|>assistant<|channel|>final<|message|>...), the
        content is the last final channel's message (up to <|return|>, <|end|> or <|call|>) and the
        reasoning the analysis channels' text; a reply that never reached a final channel has empty
        content. Any other reply is its decoded text, with no reasoning."""
        raw = self.decode(ids, skip_special_tokens=False)
        if HARMONY_CHANNEL not in raw:
            return self.decode(ids), None
        content, reasoning = "", []
        for part in raw.split(HARMONY_CHANNEL)[1:]:
            head, sep, body = part.partition(HARMONY_MESSAGE)
            if not sep:
                continue
            for end in HARMONY_ENDS:
                body = body.split(end, 1)[0]
            channel = head.split()[0] if head.split() else ""
            if channel == "final":
                content = body
            elif channel == "analysis":
                reasoning.append(body)
        return content, "".join(reasoning) or None

    def render_chat(self, messages, add_generation_prompt=True, tools=None, **extra) -> str:
        """Render with the chat template of tokenizer_config.json, as transformers'
        apply_chat_template does (sandboxed Jinja2, trim_blocks, lstrip_blocks, its `tojson` filter
        and `strftime_now` / `raise_exception` globals): tools (OpenAI's list of {"type": "function",
        "function": {...}}) and extra (enable_thinking, reasoning_effort, ...) go into the context as
        transformers passes them. An assistant message's tool_calls arguments given as a JSON string
        (as the OpenAI API sends them) are given to the template parsed, as vLLM does: templates
        write them with `| tojson`."""
        template = self.template()
        if not template:
            template = FALLBACK_CHAT_TEMPLATE
            if not self._warned:
                self._warned = True
                import sys
                print("[colibri] this model has no chat template (tokenizer_config.json / chat_template.jinja): "
                      "chats are rendered as ChatML; give the model's own with --chat-template FILE "
                      "(Engine.open(chat_template=...))", file=sys.stderr)
        from jinja2 import TemplateError
        special = {k: (v if isinstance(v, str) else (v or {}).get("content"))
                   for k, v in self.config.items() if k.endswith("_token")}
        context = {**special, **extra, "messages": _parsed_arguments(messages),
                   "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            context["tools"] = tools
        try:
            return _jinja().from_string(template).render(context)
        except TemplateError as e:
            raise invalid_model("tokenizer_config.json", "chat_template", f"the template fails on these messages "
                                f"({type(e).__name__}: {e})") from None

    def template(self) -> str | None:
        """The chat template's text (the "default" of named templates), or None."""
        template = self.config.get("chat_template")
        if isinstance(template, list):       # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        return template or None


def _parsed_arguments(messages):
    """messages with each tool call's arguments a dict where they came as a JSON object's text, and an
    assistant's content None (beside its tool_calls) as "" (templates test `'<x>' in content`)."""
    import json
    out = []
    for m in messages:
        if isinstance(m, dict) and "content" in m and m["content"] is None:
            m = {**m, "content": ""}
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except ValueError:
                        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"tool call {fn.get('name')!r}: its "
                                           "arguments are not JSON; give them as a JSON object's text") from None
                    c = {**c, "function": {**fn, "arguments": args}}
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


_ENV = None


def _jinja():
    """The sandboxed Jinja environment chat templates render in (transformers' own settings)."""
    global _ENV
    if _ENV is None:
        import json
        from datetime import datetime
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"chat template: {msg}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


class StreamDecoder:
    """Turns a growing list of ids into text pieces with tokenizers' DecodeStream: a piece is given
    only once no UTF-8 character in it is incomplete; special tokens are skipped, as decode() skips
    them. DecodeStream has no flush: the ids it still holds back are always the bytes of an
    unfinished character (byte-level symbols or <0xNN> fallback tokens), and flush() gives them as
    decode() renders them alone (U+FFFD), so a tail cut off by max_new_tokens still comes out."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream
        self.codec, self.ids, self.read = codec, [], 0
        self.skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        piece = self._stream.step(self.codec.tok, int(token_id))
        if piece is None:
            return ""
        self.read = len(self.ids)
        return piece

    def flush(self) -> str:
        tail = self.codec.decode(self.ids[self.read:], self.skip) if self.read < len(self.ids) else ""
        self.read = len(self.ids)
        return tail


# -- stop strings: the OpenAI API's semantics (the text ends before the first stop string) -----------

def stop_strings(stop) -> list:
    """A stop= argument (None, a string or a list of strings; sampling.check_generation checks it) as a
    list."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def cut_at_stop(text: str, stop) -> str:
    """text up to, not including, the earliest stop string in it (text itself when it holds none): the
    OpenAI API's stop semantics, as Engine.chat / stream and AsyncEngine's return text and colibri serve
    answers (stop: None, a string or a list of strings)."""
    found = [i for i in (text.find(s) for s in stop_strings(stop)) if i >= 0]
    return text[:min(found)] if found else text


class StopCutter:
    """cut_at_stop for streamed text: push(piece) returns what can be shown now, holding back the last
    len(longest stop) - 1 characters until they can no longer start a stop string; once a stop string
    appears, the text before it and nothing after (stopped is then True); finish() returns what was held
    back. The pieces joined are cut_at_stop of the whole text."""

    def __init__(self, stop):
        self.stops = stop_strings(stop)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tail = ""              # pushed, not yet returned (at most hold characters between pushes)
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        # the text before this piece held no stop string: a new one ends in the piece, so starts at or
        # after len(tail) - hold
        start = max(0, len(self.tail) - self.hold)
        self.tail += piece
        found = [i for i in (self.tail.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.tail = self.tail[:min(found)], ""
            return out
        n = max(0, len(self.tail) - self.hold)
        out, self.tail = self.tail[:n], self.tail[n:]
        return out

    def finish(self) -> str:
        out, self.tail = ("" if self.stopped else self.tail), ""
        return out
