"""Model architectures, one file each, chosen by the GGUF's general.architecture."""

from __future__ import annotations

import importlib

from fastrun.formats.errors import FastrunError

ARCHITECTURES = {name: name for name in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")}


def model_class(arch: str):
    """The Transformer class for an architecture name; one clear error when unsupported."""
    module = ARCHITECTURES.get(arch)
    if module is None:
        raise FastrunError(
            f"unsupported architecture {arch!r} (fastrun runs: {', '.join(sorted(ARCHITECTURES))})"
        )
    return importlib.import_module(f"fastrun.runner.models.{module}").Model
