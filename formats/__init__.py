"""GGUF file access: the reader, the key/name tables and the project's error types."""

from fastrun.formats.errors import FastrunError, GGUFError
from fastrun.formats.gguf import GGUFFile, TensorInfo

__all__ = ["FastrunError", "GGUFError", "GGUFFile", "TensorInfo"]
