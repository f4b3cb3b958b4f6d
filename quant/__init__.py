"""Block formats: the format table, the NumPy reference (the spec) and fast dequantization."""

from __future__ import annotations

import numpy as np

from fastrun.quant.formats import BY_ID, BY_NAME, QK_K, BlockFormat, block_format

__all__ = ["BY_ID", "BY_NAME", "QK_K", "BlockFormat", "block_format", "dequantize", "quantize"]


def dequantize(data: np.ndarray, qtype: str | int, n: int) -> np.ndarray:
    """Dequantize the first n values of raw block bytes (uint8) to float32 (Numba kernels)."""
    from fastrun.quant.fast import dequantize as fast_dequantize

    return fast_dequantize(data, qtype, n)


def quantize(x: np.ndarray, qtype: str | int) -> np.ndarray:
    """Quantize float values (a whole number of blocks) to raw block bytes, as llama.cpp does."""
    from fastrun.quant.reference import quantize_ref

    return quantize_ref(x, qtype)
