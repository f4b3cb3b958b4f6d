"""GGUF file access: the reader, the key/name tables and the project's error types (the
streaming writer is formats.writer)."""

from fastrun.formats.errors import FastrunError, GGUFError

__all__ = ["FastrunError", "GGUFError", "GGUFFile", "TensorInfo"]


def __getattr__(name):
    # Imported lazily: the reader needs quant's format table, which needs our error types.
    if name in ("GGUFFile", "TensorInfo"):
        from fastrun.formats import gguf

        return getattr(gguf, name)
    raise AttributeError(name)
