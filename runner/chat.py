"""Chat templates: the GGUF's own Jinja template, rendered in a sandbox (it is untrusted input),
with the globals Hugging Face templates expect; when the file has none, its architecture
family's (Gemma's turns) or ChatML.

The sandbox (runner/sandbox.py) stops a template from reaching Python internals, running forever
or rendering gigabytes; any failure inside is one FastrunError. The template is compiled on first
use, so a broken one stops only the chat path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

from fastrun.formats.errors import FastrunError
from fastrun.runner.sandbox import Deadline, LimitExceeded, TemplateLimits, limited_environment

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turns, for gemma files without a template (Gemma 3 270M's has none): the model's
# role is "model", a system message opens the first user turn, and a turn ends with
# <end_of_turn> (an end-of-generation token: the reply stops there).
GEMMA = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system + message['content']) | trim"
    " + '<end_of_turn>\n' }}{% set ns.system = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# The template for a file without one, by architecture prefix; ChatML otherwise.
FALLBACKS = {"gemma": GEMMA}

MAX_JSON_INDENT = 16


def _raise_exception(message):
    lines = str(message).strip().splitlines() or [""]
    raise FastrunError(f"chat template: {lines[0][:200]}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise ValueError(f"tojson indent {indent} is above {MAX_JSON_INDENT}")
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


class ChatTemplate:
    """A chat template: messages in, prompt text out. Compiled on first render."""

    def __init__(
        self,
        source: str | None | Callable[[], str | None],
        bos_token: str = "",
        eos_token: str = "",
        limits: TemplateLimits | None = None,
        fallback: str = CHATML,
    ):
        self._source = source  # or a function that reads it, called when first needed
        self.fallback = fallback  # when the source is None
        self.bos_token, self.eos_token = bos_token, eos_token
        self.limits = limits or TemplateLimits.from_env()
        self._template = None

    @classmethod
    def for_model(
        cls, source, tokenizer, limits: TemplateLimits | None = None, fallback: str = CHATML
    ) -> ChatTemplate:
        """source: the template text, None for the fallback (ChatML), or a function that reads
        it (the GGUF metadata is then read, and checked, only when the template is first
        used)."""

        def text(tid):
            return tokenizer.tokens[tid] if tid is not None and 0 <= tid < tokenizer.n_vocab else ""

        return cls(source, text(tokenizer.bos_id), text(tokenizer.eos_id), limits, fallback)

    @classmethod
    def for_file(cls, f, tokenizer, limits: TemplateLimits | None = None) -> ChatTemplate:
        """The template of an open GGUFFile, read from its metadata when first used; without
        one, its architecture family's (FALLBACKS) or ChatML."""
        from fastrun.formats import keys

        arch = f.architecture or ""
        fallback = next((t for p, t in FALLBACKS.items() if arch.startswith(p)), CHATML)
        return cls.for_model(lambda: f.get(keys.CHAT_TEMPLATE), tokenizer, limits, fallback)

    @property
    def source(self) -> str:
        if callable(self._source):
            self._source = self._source()
        if self._source is not None and not isinstance(self._source, str):
            raise FastrunError(f"the chat template is {type(self._source).__name__}, not text")
        return self._source or self.fallback

    @property
    def is_fallback(self) -> bool:
        return self.source is self.fallback

    def _compiled(self):
        if self._template is None:
            source = self.source
            env = limited_environment(self.limits.max_chars)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt)[:256])
            try:
                # Jinja's lexer and parser call a function per token: calls are checkpoints
                with Deadline(self.limits.seconds, lines=False):
                    self._template = env.from_string(source)
            except FastrunError:
                raise
            except Exception as e:  # the template's own syntax, or too deep, slow or large
                raise FastrunError(f"chat template does not compile: {_one_line(e)}") from None
        return self._template

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """The prompt text for a conversation; ends with the assistant's turn opening."""
        template = self._compiled()
        limit = self.limits.max_chars
        pieces, size = [], 0
        try:
            with Deadline(self.limits.seconds):
                for piece in template.generate(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    tools=tools,
                ):
                    size += len(piece)
                    if size > limit:
                        raise LimitExceeded(f"rendered more than {limit} characters")
                    pieces.append(piece)
        except FastrunError:
            raise
        except LimitExceeded as e:
            raise FastrunError(
                f"chat template stopped: {e} (limits: FASTRUN_TEMPLATE_SECONDS, "
                "FASTRUN_TEMPLATE_MAX_CHARS)"
            ) from None
        except Exception as e:  # TemplateError, and any Python error raised inside a filter
            raise FastrunError(f"chat template failed: {_one_line(e)}") from None
        return "".join(pieces)
