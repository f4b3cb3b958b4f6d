"""The project's error types: a FastrunError reaches the user as one line, never a traceback."""


class FastrunError(Exception):
    """A user-facing failure: bad input, missing model, unsupported feature."""


class GGUFError(FastrunError):
    """A GGUF file is malformed, truncated or uses something fastrun does not support."""


def shown(text: str, limit: int = 80) -> str:
    """Untrusted text (a key or a name read from a file) as it may appear in an error line: on
    one line, control characters escaped, and short."""
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return escaped[:limit] + "..." if len(text) > limit or len(escaped) > limit else escaped
