"""The project's error types: a FastrunError reaches the user as one line, never a traceback."""


class FastrunError(Exception):
    """A user-facing failure: bad input, missing model, unsupported feature."""


class GGUFError(FastrunError):
    """A GGUF file is malformed, truncated or uses something fastrun does not support."""
