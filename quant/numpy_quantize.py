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
- the min and max of Q4_1/Q5_1 are the first values reaching them (argmin's and argmax's
  choice): that matters only for the sign of a zero.
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


def _at(xb: np.ndarray, first: np.ndarray) -> np.ndarray:
    """xb[i, first[i]] for every block i (first is modified)."""
    first += np.arange(0, xb.size, 32)
    return xb.reshape(-1)[first]


def _signed_absmax(xb: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Per block, the first value of largest magnitude; +0.0 where every value is zero."""
    bits = xb.view(np.uint32)  # the magnitude's bits order as |x| (no NaN in weights)
    magnitude = np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=scratch.view(np.uint32))
    mx = _at(xb, magnitude.argmax(axis=1))  # NumPy's argmax is far faster than max on rows of 32
    mx[mx == 0] = 0.0  # -0.0 never replaces C's starting 0.0
    return mx


def _first_min_max(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block, C's running min and max (`if (v < min) min = v`): the first values reaching
    them, which is argmin's and argmax's choice too (it matters for the sign of a zero)."""
    return _at(xb, xb.argmin(axis=1)), _at(xb, xb.argmax(axis=1))


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Levels [nb, 32] (uint8, < 16 after masking) -> 16 bytes per block: j | j+16 << 4."""
    lo = q[:, :16] & np.uint8(15)
    lo |= (q[:, 16:] & np.uint8(15)) << np.uint8(4)
    return lo


def _nibbles_of_levels(v: np.ndarray, out: np.ndarray) -> None:
    """Q4's levels from v = x*id + offset (float32 [nb, 32], >= 0): C's truncating cast and
    MIN(15, .), then j | j+16 << 4 into out [nb, 16], all in float32 (exact: small integers)
    and cast once, fewer passes than over bytes."""
    np.trunc(v, out=v)
    np.minimum(v, np.float32(15), out=v)
    packed = v[:, 16:]
    packed *= np.float32(16)
    packed += v[:, :16]
    out[...] = packed


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 levels as Q5's little-endian 32-bit qh: 4 bytes per block."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


def _q8_0(xb: np.ndarray, out: np.ndarray, v: np.ndarray, t: np.ndarray) -> None:
    magnitude = np.abs(xb, out=v)
    d = _at(magnitude, magnitude.view(np.uint32).argmax(axis=1)) / np.float32(127)
    # roundf(x * id) = sign(x) * roundf(|x| * id), id >= 0: round the magnitude, then put the
    # sign bit back (cheaper than copysign), and let the cast truncate toward zero as C's does
    v *= _inverse(d)
    v += HALF_BELOW
    sign = np.bitwise_and(xb.view(np.uint32), np.uint32(0x80000000), out=t.view(np.uint32))
    np.bitwise_or(v.view(np.uint32), sign, out=v.view(np.uint32))
    out[:, :2] = _half_bytes(d)
    out[:, 2:] = v.astype(np.int8).view(np.uint8)


def _symmetric(xb: np.ndarray, out: np.ndarray, half_levels: int, v: np.ndarray) -> None:
    """Q4_0 (8) and Q5_0 (16): d = signed max / -half_levels; q = min(top, (int8)(x*id + h+.5))."""
    d = _signed_absmax(xb, v) / np.float32(-half_levels)
    np.multiply(xb, _inverse(d), out=v)
    v += np.float32(half_levels + 0.5)
    out[:, :2] = _half_bytes(d)
    if half_levels == 8:
        _nibbles_of_levels(v, out[:, 2:])
        return
    q = v.astype(np.int8).view(np.uint8)  # in [0, 32]: the cast truncates
    np.minimum(q, np.uint8(31), out=q)
    out[:, 2:6] = _fifth_bits(q)
    out[:, 6:] = _nibbles(q)


def _affine(xb: np.ndarray, out: np.ndarray, levels: int, v: np.ndarray) -> None:
    """Q4_1 (15, levels clamped) and Q5_1 (31, cast straight to uint8, as C does):
    d = (max - min) / levels, m = min; q = (x - min) * id + 0.5, truncated."""
    lo, hi = _first_min_max(xb)
    d = (hi - lo) / np.float32(levels)
    np.subtract(xb, lo[:, None], out=v)
    v *= _inverse(d)
    v += np.float32(0.5)
    out[:, :2] = _half_bytes(d)
    out[:, 2:4] = _half_bytes(lo)
    if levels == 15:
        _nibbles_of_levels(v, out[:, 4:])
        return
    q = v.astype(np.int8).view(np.uint8)
    out[:, 4:8] = _fifth_bits(q)
    out[:, 8:] = _nibbles(q)


def quantize_blocks32(x: np.ndarray, name: str) -> np.ndarray:
    """float rows [n_rows, n] (float32, or float16 widened here; n a multiple of 32) -> raw
    bytes [n_rows, row_bytes] of Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1."""
    n_rows = x.shape[0]
    blocks = np.ascontiguousarray(x).reshape(-1, 32)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[name]), np.uint8)
    # A few thousand blocks at a time, in three scratch buffers reused by every chunk: they stay
    # in the core's L2 cache, and no pass allocates a large temporary (fresh pages, whose
    # faults cost more than the arithmetic, measured several times the whole pass).
    scratch = np.empty((3, min(CHUNK_BLOCKS, blocks.shape[0]), 32), np.float32)
    for b0 in range(0, blocks.shape[0], CHUNK_BLOCKS):
        chunk = blocks[b0 : b0 + CHUNK_BLOCKS]
        xb, v, t = scratch[:, : chunk.shape[0]]
        np.copyto(xb, chunk)  # float16 widened exactly
        chunk_out = out[b0 : b0 + CHUNK_BLOCKS]
        if name == "Q8_0":
            _q8_0(xb, chunk_out, v, t)
        elif name == "Q4_0":
            _symmetric(xb, chunk_out, 8, v)
        elif name == "Q5_0":
            _symmetric(xb, chunk_out, 16, v)
        elif name == "Q4_1":
            _affine(xb, chunk_out, 15, v)
        else:
            _affine(xb, chunk_out, 31, v)
    return out.reshape(n_rows, -1)
