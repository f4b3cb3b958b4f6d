"""Block formats: the NumPy reference against gguf.quants on real tensors, Numba against the
reference, and reference quantize -> dequantize error bounds."""

import gguf.quants
import numpy as np
import pytest
from helpers import GOLDEN_MODELS, random_blocks, real_model

from fastrun.formats import GGUFFile
from fastrun.quant import block_format, dequantize, quantize
from fastrun.quant.reference import dequantize_ref, quantize_ref

MAX_ROWS = 64  # a slice of each tensor keeps the test quick


def _real_tensors():
    """(model, tensor name) for the first tensor of every type in each real model."""
    cases = []
    for model in GOLDEN_MODELS:
        cases.append(pytest.param(model, id=model))
    return cases


@pytest.mark.parametrize("model", _real_tensors())
def test_dequantize_matches_gguf_package(model):
    path = real_model(model)
    seen = set()
    with GGUFFile(path) as f:
        for info in f.tensors.values():
            if info.format.name in seen:
                continue
            seen.add(info.format.name)
            raw = f.tensor_bytes(info.name)[:MAX_ROWS]
            n = raw.shape[0] * info.shape[0]
            expect = gguf.quants.dequantize(np.array(raw), info.format.id).reshape(-1)
            scale = max(float(np.abs(expect).max()), 1e-30)
            ref = dequantize_ref(raw, info.format.name, n)
            fast = dequantize(raw, info.format.name, n)
            assert np.abs(ref - expect).max() / scale <= 1e-6, info.format.name
            assert np.abs(fast - expect).max() / scale <= 1e-6, info.format.name
    assert seen  # every model has at least F32 and one quantized type


@pytest.mark.parametrize(
    "qtype", ["F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
)
def test_fast_dequantize_matches_reference(qtype):
    rng = np.random.default_rng(0)
    raw = random_blocks(qtype, 8, 512, rng)
    ref = dequantize_ref(raw, qtype, 8 * 512)
    np.testing.assert_array_equal(dequantize(raw, qtype, 8 * 512), ref)
    np.testing.assert_allclose(
        ref, gguf.quants.dequantize(raw, block_format(qtype).id).reshape(-1), rtol=0, atol=1e-7
    )


# Bound on the max abs error relative to a block's absolute max, from each format's step size.
# Q4_0/Q5_0 reach one full step on the side opposite the signed max (it maps to -8d, +7d).
ERROR_BOUNDS = {"Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31, "Q8_0": 1 / 254}


@pytest.mark.parametrize("qtype", sorted(ERROR_BOUNDS))
def test_quantize_roundtrip_error(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(32 * 1000).astype(np.float32)
    y = dequantize_ref(quantize(x, qtype), qtype, x.size)
    err = np.abs(x - y).reshape(-1, 32).max(axis=1)
    amax = np.abs(x).reshape(-1, 32).max(axis=1)
    # plus the fp16 rounding of the scales, up to 2**-11 relative over the whole range
    assert np.all(err <= (ERROR_BOUNDS[qtype] + 2**-10) * amax)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantize_matches_gguf_package_bytes(qtype):
    """llama.cpp's rounding, byte for byte (gguf-py ports quantize_row_*_ref)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[3] = 0  # all-zero blocks take the d == 0 path
    ours = quantize_ref(x, qtype).reshape(16, -1)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(ours, theirs)


def test_activation_formats_roundtrip():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1024).astype(np.float32)
    for qtype, bound in (("Q8_1", 1 / 250), ("Q8_K", 1 / 250)):
        y = dequantize_ref(quantize_ref(x, qtype), qtype, x.size)
        assert np.abs(x - y).max() <= bound * np.abs(x).max() * 1.01
