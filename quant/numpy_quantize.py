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

Why the passes look as they do: a NumPy call on a row of 32 costs far more than its 32 values
(argmax along the rows of blocks is a third of a naive quantizer's time), so per-block
reductions run as one `reduceat` over the chunk (for F16 input, the position of the first
largest magnitude rides in the low bits of the key reduced), and bytes are packed as uint64
words, eight levels at a time, in passes over the whole chunk.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial

import numpy as np

from fastrun.quant.float_types import widen_f16

# The largest float32 below 0.5: v + this, truncated, is roundf(v) (see the module doc).
HALF_BELOW = np.nextafter(np.float32(0.5), np.float32(0))

CHUNK_BLOCKS = 4096  # blocks per pass: 512 KiB of float32 (fewer calls; L2 and L3 hold it)

# Each format's block as a NumPy record: a whole field is written in one pass over the chunk
# (the levels as raw 16- or 32-byte items), where a slice of the rows would cost a NumPy loop
# per block.
BLOCK_DTYPES = {
    "Q4_0": np.dtype([("d", "<u2"), ("qs", "V16")]),
    "Q4_1": np.dtype([("d", "<u2"), ("m", "<u2"), ("qs", "V16")]),
    "Q5_0": np.dtype([("d", "<u2"), ("qh", "V4"), ("qs", "V16")]),
    "Q5_1": np.dtype([("d", "<u2"), ("m", "<u2"), ("qh", "V4"), ("qs", "V16")]),
    "Q8_0": np.dtype([("d", "<u2"), ("qs", "V32")]),
}
BLOCK_BYTES = {name: dtype.itemsize for name, dtype in BLOCK_DTYPES.items()}

_MAGNITUDE = np.uint32(0x7FFFFFFF)
_SIGN = np.uint32(0x80000000)
# 31 - a value's position in its block: or'ed into the low bits of a magnitude that has
# none set (a widened F16), the largest key is the block's first largest magnitude
_POSITION_KEYS = np.arange(31, -1, -1, dtype=np.uint32)
# Eight levels in the bytes of a uint64: each byte's bit 4, then the multiplication that
# gathers the eight bits (byte i's bit lands on bit 56 + i; no two partial products overlap)
_BYTE_BIT4 = np.uint64(0x1010101010101010)
_GATHER_BITS = np.uint64(0x0102040810204080)
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


@dataclass
class _Chunk:
    """One chunk of blocks and the scratch its passes reuse (all [nb, 32] unless noted)."""

    x: np.ndarray  # the values, float32
    v: np.ndarray  # float32 scratch
    t: np.ndarray  # float32 scratch
    q: np.ndarray  # levels, uint8
    top: np.ndarray  # uint8, the largest level everywhere: np.minimum with a scalar is slow
    positions: np.ndarray  # uint32, _POSITION_KEYS for every block
    words: np.ndarray  # uint64 [4 nb]: the levels' packing
    starts: np.ndarray  # each block's first index in the flat chunk, for reduceat
    keyed: bool  # widened from F16: the low 13 bits are zero, room for a position


def _inverse(d: np.ndarray) -> np.ndarray:
    """C's `d ? 1.0f/d : 0.0f`, per block, as a column to broadcast over the block."""
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    return inv[:, None]


def _half_bits(v: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half bits (round to nearest even, as GGML_FP32_TO_FP16)."""
    return v.astype("<f2").view(np.uint16)


def _at(xb: np.ndarray, first: np.ndarray) -> np.ndarray:
    """xb[i, first[i]] for every block i (first is modified)."""
    first += np.arange(0, xb.size, 32)
    return xb.reshape(-1)[first]


def _absmax(c: _Chunk) -> np.ndarray:
    """Per block, the largest magnitude."""
    magnitude = np.bitwise_and(c.x.view(np.uint32), _MAGNITUDE, out=c.v.view(np.uint32))
    return np.maximum.reduceat(magnitude.reshape(-1), c.starts).view(np.float32)


def _signed_absmax(c: _Chunk) -> np.ndarray:
    """Per block, the first value of largest magnitude; +0.0 where every value is zero."""
    magnitude = np.bitwise_and(c.x.view(np.uint32), _MAGNITUDE, out=c.v.view(np.uint32))
    if c.keyed:  # magnitude, then position: the largest key is the first largest magnitude
        magnitude |= c.positions
        keys = np.maximum.reduceat(magnitude.reshape(-1), c.starts)
        first = (np.uint32(31) - (keys & np.uint32(31))).astype(np.intp)
    else:  # the magnitude's bits order as |x| (no NaN in weights)
        first = magnitude.argmax(axis=1)
    mx = _at(c.x, first)
    mx[mx == 0] = 0.0  # -0.0 never replaces C's starting 0.0
    return mx


def _first_min_max(c: _Chunk) -> tuple[np.ndarray, np.ndarray]:
    """Per block, C's running min and max (`if (v < min) min = v`): the first values reaching
    them. Only the sign of a zero depends on which: blocks whose min or max is a zero are
    redone with argmin and argmax, whose choice is the first."""
    flat = c.x.reshape(-1)
    lo = np.minimum.reduceat(flat, c.starts)
    hi = np.maximum.reduceat(flat, c.starts)
    zero = np.flatnonzero((lo == 0) | (hi == 0))
    if zero.size:
        blocks = c.x[zero]
        rows = np.arange(zero.size)
        lo[zero] = blocks[rows, blocks.argmin(axis=1)]
        hi[zero] = blocks[rows, blocks.argmax(axis=1)]
    return lo, hi


def _levels(c: _Chunk, clamp: bool) -> np.ndarray:
    """C's truncating cast of v = x*id + offset (>= 0, so truncation is the cast to uint8),
    then MIN(top, .) when `clamp` (Q5_1 casts straight to uint8)."""
    np.copyto(c.q, c.v, casting="unsafe")
    if clamp:
        np.minimum(c.q, c.top, out=c.q)
    return c.q


def _put_levels(c: _Chunk, out: np.ndarray, five_bits: bool) -> None:
    """The levels [nb, 32] into out's qs: level j | level j+16 << 4 in byte j; for Q5, bit 4
    of every level into qh, the little-endian 32-bit mask. Passes over the levels as uint64
    words, four a block: word k of a block, or'ed with word k+2 shifted by a nibble, is the
    block's packed word k."""
    w = c.q.view(np.uint64).reshape(-1)
    if five_bits:
        bits = np.bitwise_and(w, _BYTE_BIT4, out=c.words)
        bits >>= np.uint64(4)
        bits *= _GATHER_BITS
        bits >>= np.uint64(56)
        out["qh"] = bits.astype(np.uint8).view("V4")
        w &= _LOW_NIBBLES
    packed = np.left_shift(w[2:], np.uint64(4), out=c.words[:-2])
    packed |= w[:-2]
    out["qs"] = c.words.view("V16")[::2]


def _q8_0(c: _Chunk, out: np.ndarray) -> None:
    d = _absmax(c) / np.float32(127)
    # roundf(x * id) = sign(x) * roundf(|x| * id), id >= 0: round the magnitude, then put the
    # sign bit back (cheaper than copysign), and let the cast truncate toward zero as C's does
    v = np.multiply(c.v, _inverse(d), out=c.v)  # c.v holds the magnitudes (_absmax)
    v += HALF_BELOW
    sign = np.bitwise_and(c.x.view(np.uint32), _SIGN, out=c.t.view(np.uint32))
    np.bitwise_or(v.view(np.uint32), sign, out=v.view(np.uint32))
    out["d"] = _half_bits(d)
    qs = out.view(np.uint8).reshape(-1, BLOCK_BYTES["Q8_0"])[:, 2:]
    np.copyto(qs.view(np.int8), v, casting="unsafe")


def _symmetric(c: _Chunk, out: np.ndarray, half_levels: int) -> None:
    """Q4_0 (8) and Q5_0 (16): d = signed max / -half_levels; q = min(top, (int8)(x*id + h+.5))."""
    d = _signed_absmax(c) / np.float32(-half_levels)
    np.multiply(c.x, _inverse(d), out=c.v)
    c.v += np.float32(half_levels + 0.5)  # in [0, 2 * half_levels + 1): never negative
    _levels(c, clamp=True)
    out["d"] = _half_bits(d)
    _put_levels(c, out, five_bits=half_levels == 16)


def _affine(c: _Chunk, out: np.ndarray, levels: int) -> None:
    """Q4_1 (15, levels clamped) and Q5_1 (31, cast straight to uint8, as C does):
    d = (max - min) / levels, m = min; q = (x - min) * id + 0.5, truncated."""
    lo, hi = _first_min_max(c)
    d = (hi - lo) / np.float32(levels)
    np.subtract(c.x, lo[:, None], out=c.v)
    c.v *= _inverse(d)
    c.v += np.float32(0.5)
    _levels(c, clamp=levels == 15)
    out["d"] = _half_bits(d)
    out["m"] = _half_bits(lo)
    _put_levels(c, out, five_bits=levels == 31)


_QUANTIZERS = {
    "Q8_0": _q8_0,
    "Q4_0": partial(_symmetric, half_levels=8),
    "Q5_0": partial(_symmetric, half_levels=16),
    "Q4_1": partial(_affine, levels=15),
    "Q5_1": partial(_affine, levels=31),
}
_LARGEST_LEVEL = {"Q8_0": 127, "Q4_0": 15, "Q5_0": 31, "Q4_1": 15, "Q5_1": 31}


class _Scratch(threading.local):
    """Each thread's buffers for chunks of up to CHUNK_BLOCKS blocks, made on its first slab and
    reused by all the others: fresh buffers per slab cost their page faults and fills."""

    def __init__(self):
        nb = CHUNK_BLOCKS
        self.floats = np.empty((3, nb, 32), np.float32)
        self.levels = np.empty((nb, 32), np.uint8)
        self.tops = {top: np.full((nb, 32), top, np.uint8) for top in set(_LARGEST_LEVEL.values())}
        self.positions = np.tile(_POSITION_KEYS, nb).reshape(nb, 32)
        self.words = np.empty(4 * nb, np.uint64)
        self.starts = np.arange(0, 32 * nb, 32)


_scratch = _Scratch()


def quantize_blocks32(x: np.ndarray, name: str) -> np.ndarray:
    """float rows [n_rows, n] (float32, or float16 widened here; n a multiple of 32) -> raw
    bytes [n_rows, row_bytes] of Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1."""
    n_rows = x.shape[0]
    blocks = np.ascontiguousarray(x).reshape(-1, 32)
    out = np.empty(blocks.shape[0], BLOCK_DTYPES[name])
    quantize = _QUANTIZERS[name]
    # A few thousand blocks at a time, in scratch buffers reused by every chunk: they stay in
    # the core's caches, and no pass allocates a large temporary (fresh pages, whose faults
    # cost more than the arithmetic, measured several times the whole pass).
    s = _scratch
    top = s.tops[_LARGEST_LEVEL[name]]
    widened = blocks.dtype == np.float16
    for b0 in range(0, blocks.shape[0], CHUNK_BLOCKS):
        chunk = blocks[b0 : b0 + CHUNK_BLOCKS]
        k = chunk.shape[0]
        xb, v, t = s.floats[:, :k]
        if widened:
            widen_f16(chunk, xb)
        else:
            np.copyto(xb, chunk)
        levels, positions, words = s.levels[:k], s.positions[:k], s.words[: 4 * k]
        c = _Chunk(xb, v, t, levels, top[:k], positions, words, s.starts[:k], widened)
        quantize(c, out[b0 : b0 + k])
    return out.view(np.uint8).reshape(n_rows, -1)
