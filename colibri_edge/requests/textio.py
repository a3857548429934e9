"""Tokenizer, chat template and incremental detokenisation (never a split UTF-8 character)."""
from __future__ import annotations

import os

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, invalid_model


HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|return|>", "<|end|>", "<|call|>", "<|start|>")


class TextCodec:
    def __init__(self, model_dir: str, tokenizer_config: dict):
        from tokenizers import Tokenizer
        path = os.path.join(model_dir, "tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:                  # tokenizers raises plain Exception for a bad file
            raise invalid_model(path, "(file)", f"not a tokenizers file ({e}); copy the model's tokenizer.json "
                                "again or re-run `colibri convert`") from None
        self.config = tokenizer_config or {}

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

    def render_chat(self, messages, add_generation_prompt=True) -> str:
        """Render with the chat template of tokenizer_config.json, as transformers'
        apply_chat_template does (sandboxed Jinja2, trim_blocks, lstrip_blocks)."""
        template = self.config.get("chat_template")
        if isinstance(template, list):       # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        if not template:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "this model has no chat_template in "
                               "tokenizer_config.json; pass a plain prompt instead of messages")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2 import ext

        def raise_exception(msg):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"chat template: {msg}")

        from jinja2 import TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
        env.globals["raise_exception"] = raise_exception
        special = {k: (v if isinstance(v, str) else (v or {}).get("content"))
                   for k, v in self.config.items() if k.endswith("_token")}
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **special)
        except TemplateError as e:
            raise invalid_model("tokenizer_config.json", "chat_template", f"the template fails on these messages "
                                f"({type(e).__name__}: {e})") from None


class StreamDecoder:
    """Turns a growing list of ids into text pieces with tokenizers' DecodeStream: a piece is given
    only once no UTF-8 character in it is incomplete; special tokens are skipped, as decode() skips
    them. DecodeStream has no flush: the ids it still holds back are always the bytes of an
    unfinished character (byte-level symbols or <0xNN> fallback tokens), and flush() gives them as
    decode() renders them alone (U+FFFD), so a tail cut off by max_new_tokens still comes out."""

    def __init__(self, codec: TextCodec):
        from tokenizers.decoders import DecodeStream
        self.codec, self.ids, self.read = codec, [], 0
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        piece = self._stream.step(self.codec.tok, int(token_id))
        if piece is None:
            return ""
        self.read = len(self.ids)
        return piece

    def flush(self) -> str:
        tail = self.codec.decode(self.ids[self.read:]) if self.read < len(self.ids) else ""
        self.read = len(self.ids)
        return tail
