"""Chat templates: the GGUF's own Jinja template, rendered in a sandbox (it is untrusted input),
with the globals Hugging Face templates expect; ChatML when the file has none."""

from __future__ import annotations

import json
from datetime import datetime

from fastrun.formats.errors import FastrunError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message):
    raise FastrunError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled chat template: messages in, prompt text out."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source or CHATML
        self.is_fallback = source is None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise FastrunError(f"chat template does not compile: {e}") from None

    @classmethod
    def for_model(cls, source: str | None, tokenizer) -> ChatTemplate:
        def text(tid):
            return tokenizer.tokens[tid] if tid is not None and 0 <= tid < tokenizer.n_vocab else ""

        return cls(source, text(tokenizer.bos_id), text(tokenizer.eos_id))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """The prompt text for a conversation; ends with the assistant's turn opening."""
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=tools,
            )
        except TemplateError as e:
            raise FastrunError(f"chat template failed: {e}") from None
