"""Chat templates: the GGUF's own Jinja template, rendered in a sandbox (it is untrusted input),
with the globals Hugging Face templates expect; ChatML when the file has none.

The sandbox stops a template from reaching Python internals; the limits here stop it from
running forever or rendering gigabytes: compiling and rendering run under a deadline, strings and
lists a template builds are capped, and any failure inside is one FastrunError. The template is
compiled on first use, so a broken one stops only the chat path.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from fastrun.formats.errors import FastrunError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MAX_JSON_INDENT = 16
MAX_POWER_BITS = 1 << 16  # an integer power a template computes: at most this many bits


@dataclass(frozen=True)
class TemplateLimits:
    """How long compiling or rendering a template may take, and how many characters a rendered
    prompt (or any string or list the template builds) may have. The environment variables
    FASTRUN_TEMPLATE_SECONDS and FASTRUN_TEMPLATE_MAX_CHARS change the defaults."""

    seconds: float = 1.0
    max_chars: int = 4 << 20

    @classmethod
    def from_env(cls) -> TemplateLimits:
        def read(name: str, kind, default):
            text = os.environ.get(name)
            if text is None:
                return default
            try:
                value = kind(text)
            except ValueError:
                value = 0
            if not value > 0:
                raise FastrunError(f"{name}={text!r}: expected a number above 0")
            return value

        return cls(
            read("FASTRUN_TEMPLATE_SECONDS", float, cls.seconds),
            read("FASTRUN_TEMPLATE_MAX_CHARS", int, cls.max_chars),
        )


class _LimitExceeded(Exception):
    """A template ran past its deadline or built something too large."""


def _raise_exception(message):
    raise FastrunError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise ValueError(f"tojson indent {indent} is above {MAX_JSON_INDENT}")
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _sized(value) -> bool:
    return isinstance(value, str | list | tuple)


def _largest_number(text: str) -> int:
    """The largest run of digits in a format string: a width or precision bounds its output."""
    digits = "".join(c if c.isdigit() else " " for c in text).split()
    return max((int(d) if len(d) < 20 else 1 << 64 for d in digits), default=0)


def _replaced_length(text: str, old, new, count=-1) -> int:
    if not (isinstance(old, str) and isinstance(new, str) and isinstance(count, int)):
        return 0  # str.replace refuses these itself
    n = text.count(old) if old else len(text) + 1
    n = n if count < 0 else min(n, count)
    return len(text) + n * (len(new) - len(old))


def _expected_length(method: str, text: str, args: tuple, kwargs: dict) -> int:
    """How long the result of a string method that can grow its input will be (0: unknown or
    a method that cannot grow it), computed before running it."""
    first = args[0] if args else None
    if method in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        return first
    if method == "expandtabs":
        tabsize = kwargs.get("tabsize", first if first is not None else 8)
        return len(text) * tabsize if isinstance(tabsize, int) else 0
    if method == "replace" and len(args) >= 2:
        return _replaced_length(text, *args[:3])
    if method in ("format", "format_map", "__mod__"):
        return _largest_number(text)
    if method == "join" and _sized(first):
        return len(first) * len(text) + sum(len(x) for x in first if isinstance(x, str))
    return 0


def _guard(max_chars: int, what: str, length: int) -> None:
    if length > max_chars:
        raise _LimitExceeded(f"{what} would build {length} characters")


def _guarded_filters(env, max_chars: int) -> None:
    """Jinja's filters that can grow a string, checked before they run."""
    plain = {name: env.filters[name] for name in ("replace", "center", "indent", "format", "join")}

    def replace(eval_ctx, s, old, new, count=None):
        _guard(max_chars, "replace", _replaced_length(str(s), str(old), str(new), count or -1))
        return plain["replace"](eval_ctx, s, old, new, count)

    def center(value, width=80):
        _guard(max_chars, "center", width if isinstance(width, int) else 0)
        return plain["center"](value, width)

    def indent(s, width=4, *args, **kwargs):
        if isinstance(width, int):
            _guard(max_chars, "indent", width * (str(s).count("\n") + 1) + len(str(s)))
        return plain["indent"](s, width, *args, **kwargs)

    def format_(value, *args, **kwargs):
        _guard(max_chars, "format", _largest_number(str(value)))
        return plain["format"](value, *args, **kwargs)

    def join(eval_ctx, value, d="", attribute=None):
        if _sized(value):
            _guard(max_chars, "join", len(value) * len(str(d)))
        return plain["join"](eval_ctx, value, d, attribute)

    for f in (replace, join):
        f.jinja_pass_arg = plain[f.__name__].jinja_pass_arg  # they take the eval context
    env.filters.update(replace=replace, center=center, indent=indent, format=format_, join=join)


def _limited_environment(max_chars: int):
    """A Jinja sandbox whose `*`, `**`, `+` and `%` cannot build huge values: repetition and
    powers are refused before they run, every other result is measured."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if _sized(seq) and isinstance(times, int) and len(seq) * times > max_chars:
                        raise _LimitExceeded(f"a value of {len(seq)} x {times} items")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise _LimitExceeded(f"{left} ** {right}")
            elif operator == "%" and isinstance(left, str):
                _guard(max_chars, "%", _largest_number(left))
            result = super().call_binop(context, operator, left, right)
            if _sized(result) and len(result) > max_chars:
                raise _LimitExceeded(f"a value of {len(result)} items")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
            # str.format comes wrapped by the sandbox; the string is the wrapped method's
            target = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            if isinstance(target, str):
                method = getattr(__obj, "__name__", "")
                _guard(max_chars, method, _expected_length(method, target, args, kwargs))
            result = super().call(__context, __obj, *args, **kwargs)
            if _sized(result) and len(result) > max_chars:
                raise _LimitExceeded(f"a value of {len(result)} items")
            return result

    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    _guarded_filters(env, max_chars)
    return env


class _Deadline:
    """A trace function that raises once the time is up: Python-level loops in the compiled
    template (and Jinja's own parser) run line by line, so any of them stops in time. Per
    thread, so a server's threads each bound their own renders."""

    def __init__(self, seconds: float, lines: bool = True):
        self.seconds = seconds
        self.lines = lines  # False: check at function calls only, a third of the cost

    def __enter__(self):
        self.end = time.monotonic() + self.seconds
        self.previous = sys.gettrace()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self.previous)

    def _trace(self, frame, event, arg):
        if time.monotonic() > self.end:
            raise _LimitExceeded(f"took more than {self.seconds:g} s")
        return self._trace if self.lines else None


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
    ):
        self._source = source  # or a function that reads it, called when first needed
        self.bos_token, self.eos_token = bos_token, eos_token
        self.limits = limits or TemplateLimits.from_env()
        self._template = None

    @classmethod
    def for_model(cls, source, tokenizer, limits: TemplateLimits | None = None) -> ChatTemplate:
        """source: the template text, None for ChatML, or a function that reads it (the GGUF
        metadata is then read, and checked, only when the template is first used)."""

        def text(tid):
            return tokenizer.tokens[tid] if tid is not None and 0 <= tid < tokenizer.n_vocab else ""

        return cls(source, text(tokenizer.bos_id), text(tokenizer.eos_id), limits)

    @classmethod
    def for_file(cls, f, tokenizer, limits: TemplateLimits | None = None) -> ChatTemplate:
        """The template of an open GGUFFile, read from its metadata when first used."""
        from fastrun.formats import keys

        return cls.for_model(lambda: f.get(keys.CHAT_TEMPLATE), tokenizer, limits)

    @property
    def source(self) -> str:
        if callable(self._source):
            self._source = self._source()
        if self._source is not None and not isinstance(self._source, str):
            raise FastrunError(f"the chat template is {type(self._source).__name__}, not text")
        return self._source or CHATML

    @property
    def is_fallback(self) -> bool:
        return self.source is CHATML

    def _compiled(self):
        if self._template is None:
            source = self.source
            env = _limited_environment(self.limits.max_chars)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt)[:256])
            try:
                # Jinja's lexer and parser call a function per token: calls are checkpoints
                with _Deadline(self.limits.seconds, lines=False):
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
            with _Deadline(self.limits.seconds):
                for piece in template.generate(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    tools=tools,
                ):
                    size += len(piece)
                    if size > limit:
                        raise _LimitExceeded(f"rendered more than {limit} characters")
                    pieces.append(piece)
        except FastrunError:
            raise
        except _LimitExceeded as e:
            raise FastrunError(
                f"chat template stopped: {e} (limits: FASTRUN_TEMPLATE_SECONDS, "
                "FASTRUN_TEMPLATE_MAX_CHARS)"
            ) from None
        except Exception as e:  # TemplateError, and any Python error raised inside a filter
            raise FastrunError(f"chat template failed: {_one_line(e)}") from None
        return "".join(pieces)
