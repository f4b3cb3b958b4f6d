"""Every architecture against an independent implementation: tiny random-weight models made in
Hugging Face transformers, converted by llama.cpp's convert_hf_to_gguf.py, with transformers'
float32 logits (tests/fixtures/arch; scripts/make_arch_fixtures.py regenerates them)."""

from pathlib import Path

import numpy as np
import pytest

from fastrun.backends import get_backend
from fastrun.formats.gguf import GGUFFile
from fastrun.quant.pipeline import quantize_model
from fastrun.runner.models import ARCHITECTURES, model_class

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "arch"
NAMES = ["qwen3", "gemma2", "gemma3", "phi3", "llama3"]


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


@pytest.mark.parametrize("name", NAMES)
def test_f32_weights_match_transformers(name):
    ref = np.load(FIXTURES / f"{name}.npz")
    expect = ref["logits"]
    got = fixture_logits(FIXTURES / f"{name}.gguf", ref["ids"])
    scale = np.abs(expect).max()
    print(f"{name}: max |d| {np.abs(got - expect).max():.2e} of logits up to {scale:.2f}")
    assert np.abs(got - expect).max() <= 1e-3 * scale


@pytest.mark.parametrize("name", NAMES)
def test_q8_0_weights_stay_close(name, tmp_path):
    ref = np.load(FIXTURES / f"{name}.npz")
    expect = ref["logits"]
    quantized = tmp_path / f"{name}.q8_0.gguf"
    quantize_model(FIXTURES / f"{name}.gguf", quantized, "Q8_0", threads=1)
    got = fixture_logits(quantized, ref["ids"])
    p_ref = log_softmax(expect)
    kl = (np.exp(p_ref) * (p_ref - log_softmax(got))).sum(axis=1).mean()
    print(f"{name}: Q8_0 mean KL {kl:.2e}")
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
