"""Damaged GGUF files through the whole load path and one generated token: each ends in a
result or a FastrunError, never another exception. scripts/fuzz_gguf.py runs thousands more
through the CLI."""

import time

import numpy as np
import pytest
from helpers import write_tiny_model
from mutants import mutants

from fastrun.formats.errors import FastrunError
from fastrun.runner.api import Model

SECONDS = 75  # the whole test, on a loaded 2-core machine; about 500 files


def _load_and_generate(path) -> str:
    """What a user would do with the file: load it, generate a token, chat a token."""
    m = Model(path, backend="cpu", n_ctx=32)
    try:
        c = m.config
        # every vector the kernels read without bounds checks has the model's width
        assert len(m.transformer.output_norm) == c.n_embd
        for layer in m.transformer.layers:
            assert len(layer.attn_norm) == len(layer.ffn_norm) == c.n_embd
            if layer.bq is not None:
                assert len(layer.bk) == len(layer.bv) == c.n_head_kv * c.head_dim
        m.complete("hi", max_tokens=1, temperature=0.0)
        try:
            m.complete(m.chat_prompt([{"role": "user", "content": "hi"}]), max_tokens=1)
        except FastrunError:
            return "chat refused"
        return "ran"
    finally:
        m.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mutated_models_load_cleanly_or_fail_in_one_line(tmp_path, arch):
    original = write_tiny_model(tmp_path / "base.gguf", arch=arch, n_embd=64, n_ff=128,
                                n_head=4, n_head_kv=2).read_bytes()  # fmt: skip
    path = tmp_path / "mutant.gguf"
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + SECONDS / 2
    for n, (what, data) in enumerate(mutants(original, seed=15 if arch == "llama" else 16)):
        if time.monotonic() > deadline:
            break
        path.write_bytes(data)
        try:
            outcome = _load_and_generate(path)
        except FastrunError:
            outcome = "refused"
        except Exception as e:
            raise AssertionError(f"mutant {n} ({what}): {type(e).__name__}: {e}") from e
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(arch, outcomes)
    assert sum(outcomes.values()) >= 50, outcomes
    assert outcomes.get("refused", 0) and outcomes.get("ran", 0), outcomes


def test_short_norm_is_refused_before_any_kernel(tmp_path):
    """The out-of-bounds read of the issue: a norm of 1 or 32 values in a 64-wide model."""
    from mutants import parse, serialize

    original = write_tiny_model(tmp_path / "base.gguf", n_embd=64, n_ff=128).read_bytes()
    for name, length in [("output_norm.weight", 1), ("blk.1.ffn_norm.weight", 32)]:
        m = parse(original)
        next(t for t in m.tensors if t.name == name).dims = [length]
        path = tmp_path / "short.gguf"
        path.write_bytes(serialize(m))
        with pytest.raises(FastrunError, match=rf"{name}: shape \[{length}\], expected \[64\]"):
            Model(path, backend="cpu", n_ctx=32)


def test_metadata_of_the_wrong_kind_names_the_key(tmp_path):
    from mutants import STRING, Nested, Value, parse, serialize

    original = write_tiny_model(tmp_path / "base.gguf", n_embd=64, n_ff=128).read_bytes()
    cases = [
        ("llama.embedding_length", Value(STRING, "64"), "is str '64', expected an integer"),
        ("llama.block_count", Value(12, float("inf")), "expected an integer"),
        ("llama.attention.layer_norm_rms_epsilon", Value(6, float("inf")), "finite"),
        ("llama.attention.head_count", Value(4, 0), "outside 1.."),
        ("tokenizer.ggml.eos_token_id", Value(6, 2.0), "expected an integer"),
        ("tokenizer.ggml.tokens", Value(9, (5, [1, 2, 3])), "expected an array of strings"),
        ("tokenizer.ggml.bos_token_id", Value(4, 300), "outside the vocabulary"),
        ("llama.context_length", Value(9, Nested(2000)), "nested more than 16 deep"),
        ("general.architecture", Value(STRING, "x" * 100), "has length 100, expected 1..64"),
    ]
    for key, value, message in cases:
        m = parse(original)
        m.set(key, value)
        path = tmp_path / "bad.gguf"
        path.write_bytes(serialize(m))
        with pytest.raises(FastrunError, match=message):
            Model(path, backend="cpu", n_ctx=32)


def test_broken_template_stops_only_chat(tmp_path):
    from mutants import STRING, Value, parse, serialize

    original = write_tiny_model(tmp_path / "base.gguf", n_embd=64, n_ff=128).read_bytes()
    for template in [Value(STRING, "{% for %}"), Value(5, 7)]:
        m = parse(original)
        m.set("tokenizer.chat_template", template)
        path = tmp_path / "tpl.gguf"
        path.write_bytes(serialize(m))
        model = Model(path, backend="cpu", n_ctx=32)
        assert model.complete("hi", max_tokens=1).tokens
        with pytest.raises(FastrunError, match="chat.template"):
            model.chat_prompt([{"role": "user", "content": "hi"}])


def test_mutants_are_reproducible(tmp_path):
    original = write_tiny_model(tmp_path / "base.gguf", n_embd=64, n_ff=128).read_bytes()
    a, b = mutants(original, seed=3), mutants(original, seed=3)
    assert all(next(a) == next(b) for _ in range(20))
    assert np.mean([len(next(a)[1]) > 0 for _ in range(20)]) > 0.5
