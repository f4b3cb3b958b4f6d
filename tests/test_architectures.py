"""Every architecture against an independent implementation: tiny random-weight models made in
Hugging Face transformers, converted by llama.cpp's convert_hf_to_gguf.py, with transformers'
float32 logits (tests/fixtures/arch; scripts/make_arch_fixtures.py regenerates them)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fastrun.backends import get_backend
from fastrun.formats.gguf import GGUFFile
from fastrun.quant.pipeline import quantize_model
from fastrun.runner.models import ARCHITECTURES, model_class

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "arch"
NAMES = ["qwen3", "gemma2", "gemma3", "phi3", "llama3"]
# (fixture, npz key prefix) of every token sequence; phi3's second one is longer than its
# original context (32), where LongRoPE takes its long factors
SEQUENCES = [(name, "") for name in NAMES] + [("phi3", "long_")]


def fixture_logits(path: Path, ids: np.ndarray, backend_name: str = "cpu") -> np.ndarray:
    """Logits [n, vocab] of token ids, all in one pass, in a context of just these tokens:
    transformers picks phi3's LongRoPE factors by the sequence's length, fastrun (as
    llama.cpp) by the context's."""
    f = GGUFFile(path)
    model = model_class(f.architecture)(f, get_backend(backend_name))
    return model.forward(ids, model.new_cache(len(ids)), all_logits=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("name, prefix", SEQUENCES)
def test_f32_weights_match_transformers(name, prefix):
    ref = np.load(FIXTURES / f"{name}.npz")
    ids, expect = ref[f"{prefix}ids"], ref[f"{prefix}logits"]
    got = fixture_logits(FIXTURES / f"{name}.gguf", ids)
    scale, diff = np.abs(expect).max(), np.abs(got - expect).max()
    print(f"{name} ({len(ids)} tokens): max |d| {diff:.2e} of logits up to {scale:.2f}")
    assert diff <= 1e-3 * scale


@pytest.mark.parametrize("name, prefix", SEQUENCES)
def test_q8_0_weights_stay_close(name, prefix, tmp_path):
    ref = np.load(FIXTURES / f"{name}.npz")
    ids, expect = ref[f"{prefix}ids"], ref[f"{prefix}logits"]
    quantized = tmp_path / f"{name}.q8_0.gguf"
    quantize_model(FIXTURES / f"{name}.gguf", quantized, "Q8_0", threads=1)
    got = fixture_logits(quantized, ids)
    p_ref = log_softmax(expect)
    kl = (np.exp(p_ref) * (p_ref - log_softmax(got))).sum(axis=1).mean()
    print(f"{name} ({len(ids)} tokens): Q8_0 mean KL {kl:.2e}")
    assert kl <= 1e-3


def test_every_fixture_architecture_is_registered():
    for name in NAMES:
        assert GGUFFile(FIXTURES / f"{name}.gguf").architecture in ARCHITECTURES


def test_a_backend_lacking_a_feature_refuses_the_model_in_one_line():
    from fastrun.backends.reference import ReferenceBackend
    from fastrun.formats.errors import FastrunError

    class LlamaOnly(ReferenceBackend):
        name = "llama-only"
        features = frozenset()

    f = GGUFFile(FIXTURES / "gemma2.gguf")
    with pytest.raises(FastrunError) as refused:
        model_class(f.architecture)(f, LlamaOnly())
    message = str(refused.value)
    assert "\n" not in message and "gemma2" in message and "soft-capping" in message
    f = GGUFFile(FIXTURES / "llama3.gguf")  # the llama block needs no feature
    model_class(f.architecture)(f, LlamaOnly())


def test_context_shift_rotates_keys_by_the_layers_rope():
    """After a shift, the moved keys of layer 0 (which depend only on token and position) are
    those of their new positions: re-rotated with that layer's RoPE (gemma3's fixture layers
    are local: base 10000, not the file's 1e6)."""
    f = GGUFFile(FIXTURES / "gemma3.gguf")
    model = model_class(f.architecture)(f, get_backend("cpu"))
    ids = np.load(FIXTURES / "gemma3.npz")["ids"].tolist()
    shifted, fresh = model.new_cache(64), model.new_cache(64)
    model.forward(ids[:20], shifted)
    shifted.shift(4, 8, [at.rope for at in model.block.layers])
    assert shifted.tokens == ids[:4] + ids[12:20]
    model.forward(shifted.tokens, fresh)
    np.testing.assert_allclose(shifted.k[0, :12], fresh.k[0, :12], atol=2e-3)


def test_phi3_takes_the_long_rope_factors_past_the_original_context():
    """As llama.cpp: a context of more tokens per sequence than the original 32 rotates with
    rope_factors_long, any other with rope_factors_short (the Q8_0 check runs them through
    the compiled CPU stack), and a context shift re-rotates keys with the cells' RoPE."""
    f = GGUFFile(FIXTURES / "phi3.gguf")
    short = np.frombuffer(f.tensor_bytes("rope_factors_short.weight").tobytes(), np.float32)
    long = np.frombuffer(f.tensor_bytes("rope_factors_long.weight").tobytes(), np.float32)
    model = model_class(f.architecture)(f, get_backend("cpu"))
    for n_ctx, factors in ((24, short), (32, short), (33, long), (4096, long)):
        cells = model.new_cells(1, n_ctx)
        for rope in model.layer_ropes(cells):
            np.testing.assert_array_equal(rope.freq_factors, factors)
    block, stack = model.described(33)
    assert model.described(4096)[0] is block and model.described(4096)[1] is stack  # built once


def test_phi3_refuses_malformed_long_rope_factors_in_one_line(tmp_path):
    from fastrun.formats.errors import FastrunError
    from fastrun.formats.writer import GGUFWriter, TensorSpec, metadata_of

    src = GGUFFile(FIXTURES / "phi3.gguf")
    bad = tmp_path / "phi3.bad.gguf"
    specs = [TensorSpec(name, info.shape, info.format) for name, info in src.tensors.items()]
    long = "rope_factors_long.weight"
    specs = [replace(s, shape=(s.shape[0] * 2,)) if s.name == long else s for s in specs]
    with GGUFWriter(bad, metadata_of(src), specs) as w:
        for s in specs:
            raw = src.tensor_bytes(s.name)
            w.write_tensor(s.name, np.concatenate([raw, raw]) if s.name == long else raw)
    f = GGUFFile(bad)
    with pytest.raises(FastrunError) as refused:
        model_class(f.architecture)(f, get_backend("cpu"))
    message = str(refused.value)
    assert "\n" not in message and long in message and "expected F32 [8]" in message
