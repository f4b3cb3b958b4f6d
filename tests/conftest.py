"""Shared fixtures: real models from models.toml and tiny synthetic GGUF files."""

import os
import tempfile
from pathlib import Path

import pytest
from helpers import real_model, write_tiny_model

# the CPU backend's tile cache (backends/cpu/tile_cache.py) of the tests' models, not the user's
os.environ.setdefault("FASTRUN_TILE_CACHE", tempfile.mkdtemp(prefix="fastrun-tiles-"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama-q4_0.gguf")
