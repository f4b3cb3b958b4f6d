"""Shared fixtures: real models from models.toml and tiny synthetic GGUF files."""

from pathlib import Path

import pytest
from helpers import real_model, write_tiny_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama-q4_0.gguf")
