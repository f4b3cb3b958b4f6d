"""A Jinja sandbox with limits, for templates written by strangers (a GGUF's chat template).

Jinja's own sandbox stops a template from reaching Python internals; this adds what it lacks: a
deadline on compiling and rendering (a trace function, so any Python-level loop stops in time),
and caps on the strings and lists a template can build, checked before the operations that could
build huge ones in one C call (repetition, powers, padding, replace, join, format widths).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from fastrun.formats.errors import FastrunError

MAX_POWER_BITS = 1 << 16  # the most bits of an integer power a template may compute


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


class LimitExceeded(Exception):
    """A template ran past its deadline or built something too large."""


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
        raise LimitExceeded(f"{what} would build {length} characters")


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


def limited_environment(max_chars: int):
    """A Jinja sandbox whose `*`, `**`, `+` and `%` cannot build huge values: repetition and
    powers are refused before they run, every other result is measured."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if _sized(seq) and isinstance(times, int) and len(seq) * times > max_chars:
                        raise LimitExceeded(f"a value of {len(seq)} x {times} items")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise LimitExceeded(f"{left} ** {right}")
            elif operator == "%" and isinstance(left, str):
                _guard(max_chars, "%", _largest_number(left))
            result = super().call_binop(context, operator, left, right)
            if _sized(result) and len(result) > max_chars:
                raise LimitExceeded(f"a value of {len(result)} items")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
            # str.format comes wrapped by the sandbox; the string is the wrapped method's
            target = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            if isinstance(target, str):
                method = getattr(__obj, "__name__", "")
                _guard(max_chars, method, _expected_length(method, target, args, kwargs))
            result = super().call(__context, __obj, *args, **kwargs)
            if _sized(result) and len(result) > max_chars:
                raise LimitExceeded(f"a value of {len(result)} items")
            return result

    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    _guarded_filters(env, max_chars)
    return env


class Deadline:
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
            raise LimitExceeded(f"took more than {self.seconds:g} s")
        return self._trace if self.lines else None
