"""Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 from float rows in vectorized NumPy, byte for byte as
llama.cpp's `quantize_row_*_ref` writes them.

Why not the Numba kernels: on a small model, importing Numba and loading its cached kernels
(about a second) costs more than quantizing every weight. These formats need no search, so a
few whole-slab NumPy passes do the same float32 arithmetic in the same order as the C code
(NumPy's float32 ops round each result as C's non-fused ones do), and NumPy releases the GIL
inside them, so the pipeline's threads run slabs side by side.

The places where C's semantics are subtle, kept exact here:
- roundf (Q8_0) rounds half away from zero: `trunc(v + copysign(HALF_BELOW, v))`, with the
  float just below 0.5, is that for every |v| < 2**22 (checked for every float32 of that range
  by scripts/check_roundf.py); adding 0.5 itself would round 0.49999997 up.
- the signed maximum of Q4_0/Q5_0 is the *first* value of largest magnitude, and +0.0 when all
  are zero (C only replaces on a strictly larger magnitude, starting from 0);
- the min and max of Q4_1/Q5_1 are the first values reaching them: that matters only for the
  sign of a zero, fixed up in the (rare) blocks whose min or max is zero.
"""

from __future__ import annotations

import numpy as np

# The largest float32 below 0.5: v + this, truncated, is roundf(v) (see the module doc).
HALF_BELOW = np.nextafter(np.float32(0.5), np.float32(0))

CHUNK_BLOCKS = 2048  # blocks per pass: 256 KiB of float32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}


def _inverse(d: np.ndarray) -> np.ndarray:
    """C's `d ? 1.0f/d : 0.0f`, per block, as a column to broadcast over the block."""
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    return inv[:, None]


def _half_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [n] -> IEEE half bytes [n, 2] (round to nearest even, as GGML_FP32_TO_FP16)."""
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _signed_absmax(xb: np.ndarray) -> np.ndarray:
    """Per block, the first value of largest magnitude; +0.0 where every value is zero."""
    magnitude = xb.view(np.uint32) & np.uint32(0x7FFFFFFF)  # orders as |x| (no NaN in weights)
    first = magnitude.argmax(axis=1)
    mx = np.take_along_axis(xb, first[:, None], axis=1)[:, 0]
    mx[mx == 0] = 0.0  # -0.0 never replaces C's starting 0.0
    return mx


def _first_extreme(xb: np.ndarray, reduce) -> np.ndarray:
    """Per block, C's running min (np.minimum) or max: the value, with a zero's sign taken
    from the first zero, as `if (v < min) min = v` keeps it."""
    ext = reduce.reduce(xb, axis=1)
    zero = np.flatnonzero(ext == 0)
    if zero.size:
        rows = xb[zero]
        ext[zero] = np.take_along_axis(rows, (rows == 0).argmax(axis=1)[:, None], axis=1)[:, 0]
    return ext


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Levels [nb, 32] (uint8, < 16 after masking) -> 16 bytes per block: j | j+16 << 4."""
    lo = q[:, :16] & np.uint8(15)
    lo |= (q[:, 16:] & np.uint8(15)) << np.uint8(4)
    return lo


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 levels as Q5's little-endian 32-bit qh: 4 bytes per block."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


def _q8_0(xb: np.ndarray, out: np.ndarray) -> None:
    magnitude = np.abs(xb)
    d = magnitude.max(axis=1) / np.float32(127)
    # roundf(x * id) = sign(x) * roundf(|x| * id), id >= 0: round the magnitude, then put the
    # sign bit back (cheaper than copysign), and let the cast truncate toward zero as C's does
    v = magnitude
    v *= _inverse(d)
    v += HALF_BELOW
    bits = v.view(np.uint32)
    bits |= xb.view(np.uint32) & np.uint32(0x80000000)
    out[:, :2] = _half_bytes(d)
    out[:, 2:] = v.astype(np.int8).view(np.uint8)


def _symmetric(xb: np.ndarray, out: np.ndarray, half_levels: int) -> None:
    """Q4_0 (8) and Q5_0 (16): d = signed max / -half_levels; q = min(top, (int8)(x*id + h+.5))."""
    d = _signed_absmax(xb) / np.float32(-half_levels)
    v = xb * _inverse(d)
    v += np.float32(half_levels + 0.5)
    q = v.astype(np.int8).view(np.uint8)  # in [0, 2 * half_levels]: the cast truncates
    np.minimum(q, np.uint8(2 * half_levels - 1), out=q)
    out[:, :2] = _half_bytes(d)
    if half_levels == 8:
        out[:, 2:] = _nibbles(q)
    else:
        out[:, 2:6] = _fifth_bits(q)
        out[:, 6:] = _nibbles(q)


def _affine(xb: np.ndarray, out: np.ndarray, levels: int) -> None:
    """Q4_1 (15, levels clamped) and Q5_1 (31, cast straight to uint8, as C does):
    d = (max - min) / levels, m = min; q = (x - min) * id + 0.5, truncated."""
    lo = _first_extreme(xb, np.minimum)
    hi = _first_extreme(xb, np.maximum)
    d = (hi - lo) / np.float32(levels)
    v = xb - lo[:, None]
    v *= _inverse(d)
    v += np.float32(0.5)
    q = v.astype(np.int8).view(np.uint8)
    out[:, :2] = _half_bytes(d)
    out[:, 2:4] = _half_bytes(lo)
    if levels == 15:
        np.minimum(q, np.uint8(15), out=q)
        out[:, 4:] = _nibbles(q)
    else:
        out[:, 4:8] = _fifth_bits(q)
        out[:, 8:] = _nibbles(q)


def quantize_blocks32(x: np.ndarray, name: str) -> np.ndarray:
    """float rows [n_rows, n] (float32, or float16 widened here; n a multiple of 32) -> raw
    bytes [n_rows, row_bytes] of Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1."""
    n_rows = x.shape[0]
    blocks = np.ascontiguousarray(x).reshape(-1, 32)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[name]), np.uint8)
    # A few thousand blocks at a time: the temporaries stay in the core's L2 cache and are
    # reused by the allocator, where whole-slab temporaries would be fresh pages each pass.
    for b0 in range(0, blocks.shape[0], CHUNK_BLOCKS):
        xb = blocks[b0 : b0 + CHUNK_BLOCKS].astype(np.float32, copy=False)
        chunk_out = out[b0 : b0 + CHUNK_BLOCKS]
        if name == "Q8_0":
            _q8_0(xb, chunk_out)
        elif name == "Q4_0":
            _symmetric(xb, chunk_out, 8)
        elif name == "Q5_0":
            _symmetric(xb, chunk_out, 16)
        elif name == "Q4_1":
            _affine(xb, chunk_out, 15)
        else:
            _affine(xb, chunk_out, 31)
    return out.reshape(n_rows, -1)
