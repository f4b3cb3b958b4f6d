"""The float tensor types (F32, F16, BF16) to and from float32, with NumPy alone.

A conversion to a float type needs no compiled kernel, so a `fastrun quantize --type F16` run
(or BF16, F32) never imports Numba or loads cached kernels, which on a small model costs more
than the conversion itself. The 32-blocks (Q8_0, Q4_0, ...) are NumPy too (quant/numpy_quantize.py);
only the K-quants' searches need quant/fast_quantize.py's Numba kernels.
"""

from __future__ import annotations

import numpy as np

FLOAT_TYPES = ("F32", "F16", "BF16")

# F16 bits shifted into a float32's place, sign-extended: clearing the three copies of the sign
# between sign and exponent leaves the float32 whose value is the half's times 2**-112
_SIGN_AND_MAGNITUDE = np.int32(-0x70000001)  # 0x8FFFFFFF
_REBIAS = np.float32(2.0**112)
_F16_OVERFLOW = np.float32(65536)  # a half of exponent 31 (inf, NaN) widens to at least this


def widen_f16(h: np.ndarray, out: np.ndarray) -> np.ndarray:
    """F16 values h (float16, any shape) into float32 out (same shape), exactly as NumPy's cast,
    about seven times faster: three integer and float passes, the rebias a multiplication by
    2**112 (exact, subnormal halves included) instead of NumPy's value-by-value conversion.
    Infinities and NaNs would come out finite: an input holding any is cast by NumPy."""
    bits = out.view(np.int32)
    np.left_shift(h.view(np.int16), np.int32(13), out=bits, dtype=np.int32)
    np.bitwise_and(bits, _SIGN_AND_MAGNITUDE, out=bits)
    np.multiply(out, _REBIAS, out=out)
    if out.size and (out.max() >= _F16_OVERFLOW or out.min() <= -_F16_OVERFLOW):
        np.copyto(out, h)
    return out


def float_values(raw: np.ndarray, name: str, widen: bool = True) -> np.ndarray:
    """Raw bytes of an F32, F16 or BF16 tensor as a flat array of its values, widened to
    float32 when `widen` (exact for all three: BF16 is the high half of a float32); without
    `widen` F16 and BF16 stay 16-bit."""
    flat = raw.reshape(-1)
    if name == "F32":
        return flat.view("<f4")
    if name == "F16":
        values = flat.view("<f2")
        return widen_f16(values, np.empty(values.size, np.float32)) if widen else values
    if name == "BF16":
        values = flat.view("<u2")
        return (values.astype(np.uint32) << 16).view(np.float32) if widen else values
    raise ValueError(f"{name} is not a float type")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, NaN kept quiet (ggml's conversion)."""
    u = x.view(np.uint32)
    r = u >> 16  # one temporary, worked in place: a model's tensors are large
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= np.uint32(16)
    rounded = r.astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():  # weights have none, as a rule
        rounded[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return rounded


def float_rows(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 rows [n_rows, n] to raw bytes [n_rows, row_bytes] of one of FLOAT_TYPES."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    n_rows, n = x.shape
    if qtype == "F32":
        return x.view(np.uint8).reshape(n_rows, -1)
    if qtype == "F16":
        return x.astype("<f2").view(np.uint8).reshape(n_rows, -1)
    if qtype == "BF16":
        return bf16_bits(x).view(np.uint8).reshape(n_rows, -1)
    raise ValueError(f"{qtype} is not a float type")
